//! Autoregressive sampling from a language model: temperature, top-k, nucleus (top-p) and
//! greedy decoding, with repetition, frequency and presence penalties and per-token biases,
//! written once for every backend.

use crate::kernels::LabBackend;
use crate::models::LanguageModel;
use crate::nn::{KvCache, PositionKind};
use anyhow::{bail, Result};
use burn::prelude::*;
use burn::tensor::activation::softmax;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::collections::HashMap;

/// How the next token is chosen from the model's logits.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// Divide the logits by this before the softmax (`0` = greedy).
    pub temperature: f64,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `p`.
    pub top_p: Option<f64>,
    /// Always take the most likely token.
    pub greedy: bool,
    /// What the tokens already seen do to the logits before any of the above.
    pub penalties: Penalties,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: None,
            top_p: None,
            greedy: false,
            penalties: Penalties::default(),
        }
    }
}

/// Changes to the logits from the tokens seen so far, applied in this order before
/// temperature, top-k and top-p (a [`Sampler`] applies them; [`Sampling::sample`] does not).
#[derive(Clone, Debug, PartialEq)]
pub struct Penalties {
    /// The CTRL paper's (Keskar et al. 2019) and Hugging Face's `repetition_penalty`: the logit
    /// `l` of every token in the prompt or generated so far becomes `l / r` where positive and
    /// `l · r` where not (`1` = off; above 1 discourages repeats).
    pub repetition: f32,
    /// OpenAI's `frequency_penalty`: `α` times the number of times a token was generated is
    /// subtracted from its logit (`0` = off; the prompt does not count).
    pub frequency: f32,
    /// OpenAI's `presence_penalty`: `α` is subtracted from the logit of every token generated
    /// at least once (`0` = off).
    pub presence: f32,
    /// OpenAI's `logit_bias`: `(token, b)` adds `b` to that token's logit, last (−100 bans it,
    /// +100 all but forces it).
    pub bias: Vec<(usize, f32)>,
}

impl Default for Penalties {
    fn default() -> Self {
        Self {
            repetition: 1.0,
            frequency: 0.0,
            presence: 0.0,
            bias: Vec::new(),
        }
    }
}

impl Penalties {
    /// The first penalty outside its range — OpenAI's for the frequency and presence penalties,
    /// vLLM's for the repetition penalty — as `(name, range in words, value)`, with `name` one
    /// of `repetition`, `frequency` and `presence` (the command line and the server spell the
    /// parameter each their own way around it).
    pub fn out_of_range(&self) -> Option<(&'static str, &'static str, f32)> {
        if !(self.repetition > 0.0 && self.repetition.is_finite()) {
            return Some((
                "repetition",
                "a finite number above 0 (1 = off)",
                self.repetition,
            ));
        }
        [("frequency", self.frequency), ("presence", self.presence)]
            .into_iter()
            .find(|(_, value)| !(-2.0..=2.0).contains(value))
            .map(|(name, value)| (name, "between -2 and 2", value))
    }

    /// Whether they change nothing.
    pub fn are_off(&self) -> bool {
        self.repetition == 1.0
            && self.frequency == 0.0
            && self.presence == 0.0
            && self.bias.is_empty()
    }

    /// Applies them to `logits` after the tokens `seen`.
    pub fn apply(&self, logits: &mut [f32], seen: &Seen) {
        for (&token, &generated) in &seen.generated {
            let l = &mut logits[token];
            if self.repetition != 1.0 {
                *l = if *l > 0.0 {
                    *l / self.repetition
                } else {
                    *l * self.repetition
                };
            }
            if generated > 0 {
                *l -= generated as f32 * self.frequency + self.presence;
            }
        }
        for &(token, b) in &self.bias {
            logits[token] += b;
        }
    }
}

/// The tokens a sequence holds so far, for [`Penalties`]: every token of the prompt or
/// generated, with the times it was generated (0: only in the prompt).
#[derive(Clone, Debug, Default)]
pub struct Seen {
    generated: HashMap<usize, u32>,
}

impl Seen {
    /// After `prompt`, nothing generated.
    pub fn new(prompt: &[usize]) -> Self {
        Self {
            generated: prompt.iter().map(|&token| (token, 0)).collect(),
        }
    }

    /// Records a generated token.
    pub fn push(&mut self, token: usize) {
        *self.generated.entry(token).or_insert(0) += 1;
    }
}

/// Draws a sequence's tokens one after another: [`Sampling`] with its own seeded generator and
/// what the sequence has seen, for the penalties.
pub struct Sampler {
    sampling: Sampling,
    rng: StdRng,
    seen: Seen,
}

impl Sampler {
    /// For a sequence that starts with `prompt`.
    pub fn new(sampling: Sampling, seed: u64, prompt: &[usize]) -> Self {
        let seen = match sampling.penalties.are_off() {
            true => Seen::default(),
            false => Seen::new(prompt),
        };
        Self {
            sampling,
            rng: StdRng::seed_from_u64(seed),
            seen,
        }
    }

    /// Draws the next token from the model's `logits` for it, and records it.
    pub fn next(&mut self, logits: &[f32]) -> usize {
        let penalties = &self.sampling.penalties;
        if penalties.are_off() {
            return self.sampling.sample(logits, &mut self.rng);
        }
        let mut logits = logits.to_vec();
        penalties.apply(&mut logits, &self.seen);
        let token = self.sampling.sample(&logits, &mut self.rng);
        self.seen.push(token);
        token
    }
}

impl Sampling {
    /// Checks the ranges of the settings.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!(
                "--temperature must be a finite number >= 0, got {}",
                self.temperature
            );
        }
        if self.top_k == Some(0) {
            bail!("--top-k must be at least 1");
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                bail!("--top-p must be in (0, 1], got {p}");
            }
        }
        if let Some((name, range, value)) = self.penalties.out_of_range() {
            bail!("--{name}-penalty must be {range}, got {value}");
        }
        Ok(())
    }

    /// The distribution the next token is drawn from: `(token, probability)` pairs, most likely
    /// first, after temperature, top-k and top-p, renormalised. Greedy keeps the argmax alone.
    pub fn candidates(&self, logits: &[f32]) -> Vec<(usize, f64)> {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        // Most likely first; ties by lower id, so greedy, top-k 1 and tiny top-p agree.
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if self.greedy || self.temperature == 0.0 {
            return vec![(order[0], 1.0)];
        }
        let max = logits[order[0]] as f64;
        let mut kept: Vec<(usize, f64)> = order
            .iter()
            .map(|&i| (i, ((logits[i] as f64 - max) / self.temperature).exp()))
            .collect();
        if let Some(k) = self.top_k {
            kept.truncate(k);
        }
        normalise(&mut kept);
        if let Some(p) = self.top_p {
            let mut mass = 0.0;
            let keep = kept
                .iter()
                .position(|&(_, q)| {
                    mass += q;
                    mass >= p
                })
                .map_or(kept.len(), |i| i + 1);
            kept.truncate(keep);
            normalise(&mut kept);
        }
        kept
    }

    /// Draws the next token from `logits` as given (no [`Penalties`]: a [`Sampler`] applies
    /// them first).
    pub fn sample(&self, logits: &[f32], rng: &mut StdRng) -> usize {
        let candidates = self.candidates(logits);
        let mut u: f64 = rng.random();
        for &(token, p) in &candidates {
            if u < p {
                return token;
            }
            u -= p;
        }
        candidates.last().map_or(0, |c| c.0)
    }
}

fn normalise(dist: &mut [(usize, f64)]) {
    let total: f64 = dist.iter().map(|d| d.1).sum();
    dist.iter_mut().for_each(|d| d.1 /= total);
}

/// Checks that a prompt fits the model's context.
///
/// Learned positions exist only for `0..context`: a longer prompt would be cut silently, so it
/// is refused. Sinusoidal models condition on the prompt's last `context` tokens.
pub fn check_prompt(len: usize, context: usize, position: PositionKind) -> Result<()> {
    if len == 0 {
        bail!("the prompt is empty; give at least one character");
    }
    if len > context && position == PositionKind::Learned {
        bail!(
            "the prompt has {len} tokens but the model's context is {context} (learned positions \
             end there); shorten the prompt"
        );
    }
    Ok(())
}

/// How `generate` runs the model for each new token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoding {
    /// Each layer keeps what it needs of the tokens it has seen (keys and values, or linear
    /// attention's running sums), so a new token costs one row of attention. Past the context:
    /// with relative positions (RoPE, ALiBi) and full or local attention the cache rolls —
    /// every layer attends over its last `context` positions (sliding-window attention: the
    /// recomputing path's window in the first layer; deeper layers also see further back
    /// through the layers below, see [`KvCache::rolling`]); with absolute
    /// positions (learned, sinusoidal) it is refilled from the last `context/2` tokens
    /// whenever it is full, so the model sees between `context/2` and `context` tokens at
    /// their positions from the refill. (Hyena has no incremental form and recomputes.)
    Cached,
    /// The whole window is run again for every token: the model always sees exactly the last
    /// `context` tokens at positions `0..context` (nanoGPT's sliding window).
    Recompute,
}

/// Extends `prompt` by `max_new_tokens` tokens, calling `emit` with each as it is chosen and
/// the logits it was drawn from.
///
/// Up to the context length both [`Decoding`]s give the same logits (tested); past it, see
/// [`Decoding`].
#[allow(clippy::too_many_arguments)]
pub fn generate<B: LabBackend>(
    model: &LanguageModel<B>,
    prompt: &[usize],
    max_new_tokens: usize,
    sampling: &Sampling,
    seed: u64,
    decoding: Decoding,
    device: &B::Device,
    mut emit: impl FnMut(usize, &[f32]) -> Result<()>,
) -> Result<Vec<usize>> {
    let mut sampler = Sampler::new(sampling.clone(), seed, prompt);
    let mut decoder = Decoder::new(model, vec![prompt.to_vec()], decoding, device);
    for _ in 0..max_new_tokens {
        let logits: Vec<f32> = decoder
            .next_logits()
            .into_data()
            .convert::<f32>()
            .to_vec()
            .expect("f32 logits");
        let next = sampler.next(&logits);
        decoder.push(&[next]);
        emit(next, &logits)?;
    }
    Ok(decoder.tokens.swap_remove(0))
}

/// Autoregressive decoding of a batch of sequences of one length: [`Decoder::next_logits`]
/// runs the model on what is new since the last call, [`Decoder::push`] appends one token to
/// every sequence.
pub struct Decoder<'a, B: LabBackend> {
    model: &'a LanguageModel<B>,
    /// The sequences so far, prompt included.
    pub tokens: Vec<Vec<usize>>,
    cache: Option<KvCache<B>>,
    /// The cache holds positions `start..start + cache.len()` of every sequence.
    start: usize,
    device: B::Device,
}

impl<'a, B: LabBackend> Decoder<'a, B> {
    /// A decoder that continues `prompts` (non-empty, all of one length). A model whose mixer
    /// has no incremental form (Hyena) recomputes whatever `decoding` asks.
    ///
    /// # Panics
    /// If the prompts are empty or of different lengths.
    pub fn new(
        model: &'a LanguageModel<B>,
        prompts: Vec<Vec<usize>>,
        decoding: Decoding,
        device: &B::Device,
    ) -> Self {
        let len = prompts[0].len();
        assert!(
            len > 0 && prompts.iter().all(|p| p.len() == len),
            "prompts must be non-empty and of one length"
        );
        let cached = decoding == Decoding::Cached && model.caches();
        Self {
            model,
            start: len.saturating_sub(model.context()),
            tokens: prompts,
            cache: cached.then(|| model.new_cache()),
            device: device.clone(),
        }
    }

    /// The logits of the next token of every sequence, `[b, v]`.
    pub fn next_logits(&mut self) -> Tensor<B, 2> {
        let (b, vocab, context) = (
            self.tokens.len(),
            self.model.vocab_size(),
            self.model.context(),
        );
        let len = self.tokens[0].len();
        let Some(cache) = self.cache.as_mut() else {
            let window = len.saturating_sub(context)..len;
            let t = window.len();
            let logits = self
                .model
                .forward(ids(&self.tokens, window, &self.device))
                .logits;
            return logits.slice([0..b, t - 1..t]).reshape([b, vocab]);
        };
        if len - self.start > context && !cache.rolls() {
            // Full: start again from the last context/2 tokens.
            *cache = self.model.new_cache();
            self.start = len - (context / 2).max(1);
        }
        let new = self.start + cache.len()..len;
        let n = new.len();
        self.model
            .forward_cached(ids(&self.tokens, new, &self.device), cache)
            .slice([0..b, n - 1..n])
            .reshape([b, vocab])
    }

    /// The cache (`None` when recomputing).
    pub fn cache(&self) -> Option<&KvCache<B>> {
        self.cache.as_ref()
    }

    /// Appends `next[i]` to sequence `i`.
    pub fn push(&mut self, next: &[usize]) {
        for (tokens, &token) in self.tokens.iter_mut().zip(next) {
            tokens.push(token);
        }
    }
}

/// Positions `range` of every sequence as a `[b, range.len()]` id tensor.
pub fn ids<B: LabBackend>(
    tokens: &[Vec<usize>],
    range: std::ops::Range<usize>,
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    let ids: Vec<i64> = tokens
        .iter()
        .flat_map(|row| row[range.clone()].iter().map(|&id| id as i64))
        .collect();
    Tensor::from_data(TensorData::new(ids, [tokens.len(), range.len()]), device)
}

/// The next-token distribution of the model after `tokens`, `[v]` probabilities (for tests
/// and inspection).
pub fn next_token_probs<B: LabBackend>(
    model: &LanguageModel<B>,
    tokens: &[usize],
    device: &B::Device,
) -> Vec<f32> {
    let t = tokens.len();
    let ids: Vec<i64> = tokens.iter().map(|&id| id as i64).collect();
    let input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, t]), device);
    let logits = model
        .forward(input)
        .logits
        .slice([0..1, t - 1..t])
        .reshape([model.vocab_size()]);
    softmax(logits, 0)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .expect("f32 probabilities")
}
