//! Autoregressive sampling from a language model: temperature, top-k, nucleus (top-p) and
//! greedy decoding, written once for every backend.

use crate::kernels::LabBackend;
use crate::models::LanguageModel;
use crate::nn::PositionKind;
use anyhow::{bail, Result};
use burn::prelude::*;
use burn::tensor::activation::softmax;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

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
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: None,
            top_p: None,
            greedy: false,
        }
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

    /// Draws the next token.
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

/// Extends `prompt` by `max_new_tokens` tokens, calling `emit` with each as it is chosen.
///
/// The model sees at most its last `context` tokens (a sliding window, as in nanoGPT).
pub fn generate<B: LabBackend>(
    model: &LanguageModel<B>,
    prompt: &[usize],
    max_new_tokens: usize,
    sampling: &Sampling,
    seed: u64,
    device: &B::Device,
    mut emit: impl FnMut(usize) -> Result<()>,
) -> Result<Vec<usize>> {
    let context = model.context();
    let vocab = model.vocab_size();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tokens = prompt.to_vec();
    for _ in 0..max_new_tokens {
        let window = &tokens[tokens.len().saturating_sub(context)..];
        let t = window.len();
        let ids: Vec<i64> = window.iter().map(|&id| id as i64).collect();
        let input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, t]), device);
        let logits = model
            .forward(input)
            .logits
            .slice([0..1, t - 1..t])
            .reshape([vocab]); // [v]
        let logits: Vec<f32> = logits
            .into_data()
            .convert::<f32>()
            .to_vec()
            .expect("f32 logits");
        let next = sampling.sample(&logits, &mut rng);
        tokens.push(next);
        emit(next)?;
    }
    Ok(tokens)
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
