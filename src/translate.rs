//! Decoding a translator: batched greedy search and batched beam search with a length
//! penalty, written once over [`Seq2Seq::encode`] / [`Seq2Seq::decode`].
//!
//! Each step runs the decoder on the rows' newest tokens only: the decoder layers keep the
//! keys and values of the prefix and of the encoder memory ([`crate::nn::KvCache`]), and
//! beam search reorders that cache as beams survive. `cached: false` re-runs the whole prefix
//! instead (the same translations; kept to compare). The step's only host round trip is the
//! few ids per row that steer the search.

use crate::data::Special;
use crate::kernels::LabBackend;
use crate::models::{Memory, Seq2Seq};
use crate::nn::{AttentionMask, KvCache};
use anyhow::{bail, Result};
use burn::prelude::*;
use burn::tensor::activation::log_softmax;

/// How to search.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SearchConfig {
    /// Hypotheses kept per sentence; 1 is greedy.
    pub beam_size: usize,
    /// GNMT length penalty α: scores are `log p / ((5 + len)/6)^α`; 0 = raw log-probability.
    pub length_penalty: f64,
    /// Most tokens generated per sentence (`</s>` included).
    pub max_len: usize,
    /// Decode from the key–value cache (the default) or re-run the whole prefix every step.
    pub cached: bool,
}

impl SearchConfig {
    /// The search asked for, `max_len` defaulting to what a model of `model_max_len` positions
    /// can produce after `<s>`; checked.
    pub fn resolve(
        beam_size: usize,
        length_penalty: f64,
        max_len: Option<usize>,
        model_max_len: usize,
    ) -> Result<Self> {
        let search = Self {
            beam_size,
            length_penalty,
            max_len: max_len.unwrap_or(model_max_len - 1),
            cached: true,
        };
        search.validate()?;
        Ok(search)
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        if self.beam_size == 0 || self.max_len == 0 {
            bail!("--beam and --max-len must be at least 1");
        }
        if !(0.0..=5.0).contains(&self.length_penalty) {
            bail!("--length-penalty must be in [0, 5]");
        }
        Ok(())
    }

    fn penalty(&self, len: usize) -> f64 {
        ((5.0 + len as f64) / 6.0).powf(self.length_penalty)
    }
}

/// One decoded sentence.
#[derive(Clone, Debug, PartialEq)]
pub struct Hypothesis {
    /// Target ids, without `<s>` and `</s>`.
    pub tokens: Vec<usize>,
    /// Sum of the log-probabilities of the tokens and the final `</s>` (if produced).
    pub log_prob: f64,
    /// `log_prob` divided by the length penalty: what the search maximises.
    pub score: f64,
}

/// Greedy decoding of a batch: at every step each unfinished row takes its most likely token.
///
/// # Shapes
/// `source`: `[b, s]` ids (each row `… </s>`, padded with `<pad>`) → `b` hypotheses.
pub fn greedy<B: LabBackend>(
    model: &Seq2Seq<B>,
    source: Tensor<B, 2, Int>,
    search: &SearchConfig,
) -> Vec<Hypothesis> {
    let memory = model.encode(source);
    let b = memory.states.dims()[0];
    let device = memory.states.device();
    let mut cache = (search.cached && model.caches()).then(|| model.new_cache(&memory));
    let mut rows: Vec<Vec<usize>> = vec![vec![Special::Bos.id()]; b];
    let mut log_probs = vec![0.0f64; b];
    let mut done = vec![false; b];
    let max_len = search.max_len.min(model.max_len() - 1);
    for _ in 0..max_len {
        let last = last_log_probs(model, &memory, cache.as_mut(), &rows, &device); // [b, v]
        let (best, ids) = last.max_dim_with_indices(1); // [b, 1]
        let best: Vec<f32> = best.into_data().to_vec().expect("f32 log-probs");
        let ids: Vec<i64> = ids.into_data().convert::<i64>().to_vec().expect("ids");
        for row in 0..b {
            if done[row] {
                rows[row].push(Special::Pad.id()); // keeps the batch rectangular
                continue;
            }
            log_probs[row] += best[row] as f64;
            rows[row].push(ids[row] as usize);
            done[row] = ids[row] as usize == Special::Eos.id();
        }
        if done.iter().all(|&d| d) {
            break;
        }
    }
    rows.into_iter()
        .zip(log_probs)
        .map(|(row, log_prob)| finish(row, log_prob, search))
        .collect()
}

/// Beam search over a batch: all `b·k` live hypotheses go through the decoder together, and
/// the `2k` best continuations of each sentence are chosen on the device.
///
/// A hypothesis ends when it emits `</s>` (or reaches `max_len`); a sentence is done when it
/// has `k` finished hypotheses and no live one can still beat the worst of them at the
/// current length. Returns the best-scoring finished hypothesis per sentence. With `k = 1`
/// this is exactly greedy decoding.
pub fn beam_search<B: LabBackend>(
    model: &Seq2Seq<B>,
    source: Tensor<B, 2, Int>,
    search: &SearchConfig,
) -> Vec<Hypothesis> {
    let k = search.beam_size;
    let memory = model.encode(source);
    let [b, s, d] = memory.states.dims();
    let device = memory.states.device();
    // Each sentence's memory repeated k times, beams of one sentence adjacent: row = i·k + j.
    let memory = Memory {
        states: memory
            .states
            .unsqueeze_dim::<4>(1)
            .expand([b, k, s, d])
            .reshape([b * k, s, d]),
        mask: repeat_mask(&memory.mask, k),
        attention: Vec::new(),
    };
    let mut cache = (search.cached && model.caches()).then(|| model.new_cache(&memory));
    // Only the first beam of each sentence is live at the start, so the k beams do not all
    // extend the same prefix.
    let mut beams: Vec<Vec<(Vec<usize>, f64)>> = vec![vec![(vec![Special::Bos.id()], 0.0)]; b];
    // The row of the previous step each beam extends (where its cache is).
    let mut parents: Vec<Vec<usize>> = (0..b).map(|i| vec![i * k]).collect();
    let mut finished: Vec<Vec<Hypothesis>> = vec![Vec::new(); b];
    let mut done = vec![false; b];
    let max_len = search.max_len.min(model.max_len() - 1);
    for step in 1..=max_len {
        // Every live prefix has `step` tokens; finished sentences and missing beams fill
        // their rows with a placeholder of that length scored −∞, which no top-k keeps.
        let mut rows = Vec::with_capacity(b * k);
        let mut scores = Vec::with_capacity(b * k);
        for (i, sentence) in beams.iter().enumerate() {
            for j in 0..k {
                match sentence.get(j).filter(|_| !done[i]) {
                    Some((prefix, score)) => {
                        rows.push(prefix.clone());
                        scores.push(*score as f32);
                    }
                    None => {
                        rows.push(vec![Special::Bos.id(); step]);
                        scores.push(f32::NEG_INFINITY);
                    }
                }
            }
        }
        let v = model.tgt_vocab_size();
        if let Some(cache) = cache.as_mut().filter(|_| step > 1) {
            // Row i·k + j continues beam j of sentence i; placeholders take any row.
            let order: Vec<usize> = (0..b * k)
                .map(|row| parents[row / k].get(row % k).copied().unwrap_or(row))
                .collect();
            cache.select(&order, &device);
        }
        let last = last_log_probs(model, &memory, cache.as_mut(), &rows, &device); // [b*k, v]
        let scores = Tensor::<B, 1>::from_floats(scores.as_slice(), &device).reshape([b * k, 1]);
        let total = (last + scores).reshape([b, k * v]); // [b, k*v]
        let (top, index) = total.topk_with_indices(2 * k, 1); // [b, 2k]
        let top: Vec<f32> = top.into_data().to_vec().expect("f32 scores");
        let index: Vec<i64> = index.into_data().convert::<i64>().to_vec().expect("ids");

        for i in 0..b {
            if done[i] {
                continue;
            }
            let mut next = Vec::with_capacity(k);
            parents[i].clear();
            for c in 0..2 * k {
                let log_prob = top[i * 2 * k + c] as f64;
                if log_prob == f64::NEG_INFINITY || next.len() == k {
                    break;
                }
                let flat = index[i * 2 * k + c] as usize;
                let (beam, token) = (flat / v, flat % v);
                let mut prefix = beams[i][beam].0.clone();
                prefix.push(token);
                if token == Special::Eos.id() {
                    finished[i].push(finish(prefix, log_prob, search));
                } else {
                    next.push((prefix, log_prob));
                    parents[i].push(i * k + beam);
                }
            }
            if step == max_len {
                finished[i].extend(next.drain(..).map(|(p, lp)| finish(p, lp, search)));
            }
            beams[i] = next;
            done[i] = beams[i].is_empty() || can_stop(&finished[i], &beams[i], step, search);
        }
        if done.iter().all(|&d| d) {
            break;
        }
    }
    finished
        .into_iter()
        .map(|hyps| {
            hyps.into_iter()
                .max_by(|a, b| a.score.total_cmp(&b.score))
                .expect("every sentence finishes at max_len at the latest")
        })
        .collect()
}

/// A sentence may stop once it has `k` finished hypotheses and its best live one, scored at
/// the current length, is no better than the worst finished one.
fn can_stop(
    finished: &[Hypothesis],
    live: &[(Vec<usize>, f64)],
    step: usize,
    search: &SearchConfig,
) -> bool {
    if finished.len() < search.beam_size {
        return false;
    }
    let worst = finished
        .iter()
        .map(|h| h.score)
        .fold(f64::INFINITY, f64::min);
    let best_live = live
        .iter()
        .map(|(_, lp)| *lp)
        .fold(f64::NEG_INFINITY, f64::max);
    best_live / search.penalty(step) <= worst
}

/// Log-probabilities of the next token after each row's last token, `[rows, v]`.
///
/// With a cache (which holds every row's prefix but its last token) only the last tokens run.
fn last_log_probs<B: LabBackend>(
    model: &Seq2Seq<B>,
    memory: &Memory<B>,
    cache: Option<&mut KvCache<B>>,
    rows: &[Vec<usize>],
    device: &B::Device,
) -> Tensor<B, 2> {
    let t = rows[0].len();
    let new = cache.as_ref().map_or(0, |cache| cache.len())..t;
    let target = crate::generate::ids::<B>(rows, new, device);
    let logits = match cache {
        Some(cache) => model.decode_cached(target, cache), // [n, new, v]
        None => model.decode(memory, target).logits,       // [n, t, v]
    };
    let [n, t, v] = logits.dims();
    let last = logits.slice([0..n, t - 1..t, 0..v]).reshape([n, v]);
    // <pad>, <s> and <unk> are never a next token: only words and </s> compete.
    let mut never = vec![false; v];
    for special in [Special::Pad, Special::Bos, Special::Unk] {
        never[special.id()] = true;
    }
    let never = Tensor::<B, 2, Bool>::from_data(TensorData::new(never, [1, v]), device);
    let last = last.mask_fill(never.expand([n, v]), f32::NEG_INFINITY);
    log_softmax(last, 1)
}

/// Repeats each sentence's key-padding mask `k` times (beams adjacent).
fn repeat_mask<B: LabBackend>(mask: &AttentionMask<B>, k: usize) -> AttentionMask<B> {
    let tensor = mask.tensor(); // [b, 1, 1, s]
    let [b, _, _, s] = tensor.dims();
    let pad = tensor
        .reshape([b, 1, s])
        .expand([b, k, s])
        .reshape([b * k, s]);
    AttentionMask::padding(pad)
}

/// Turns `<s> y₁ … yₙ [</s> <pad>…]` into a hypothesis scored over the `n` tokens and `</s>`.
fn finish(row: Vec<usize>, log_prob: f64, search: &SearchConfig) -> Hypothesis {
    let tokens: Vec<usize> = row
        .iter()
        .skip(1)
        .copied()
        .take_while(|&id| id != Special::Eos.id())
        .collect();
    let generated = tokens.len() + usize::from(row.contains(&Special::Eos.id()));
    Hypothesis {
        tokens,
        log_prob,
        score: log_prob / search.penalty(generated),
    }
}

/// A source text that had to be shortened to fit the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Truncated {
    /// Index of the text in the input.
    pub index: usize,
    /// Its length in tokens (with `</s>`).
    pub tokens: usize,
}

/// Translates `texts` in batches of similar length, returning the translations in input order
/// and the inputs that were cut to `max_tokens` (with `</s>`). An empty (or all-blank) text
/// translates to an empty string without running the model.
pub fn translate_texts<B: LabBackend>(
    model: &Seq2Seq<B>,
    tokenizers: &crate::artifact::Tokenizers,
    texts: &[String],
    search: &SearchConfig,
    batch_size: usize,
    max_tokens: usize,
    device: &B::Device,
) -> Result<(Vec<String>, Vec<Truncated>)> {
    let eos = Special::Eos.id() as u32;
    let mut truncated = Vec::new();
    let mut encoded: Vec<(usize, Vec<u32>)> = Vec::new();
    for (index, text) in texts.iter().enumerate() {
        if text.trim().is_empty() {
            continue;
        }
        let mut ids: Vec<u32> = tokenizers
            .source
            .encode(text.trim())?
            .into_iter()
            .map(|id| id as u32)
            .collect();
        if ids.len() + 1 > max_tokens {
            truncated.push(Truncated {
                index,
                tokens: ids.len() + 1,
            });
            ids.truncate(max_tokens - 1);
        }
        ids.push(eos);
        encoded.push((index, ids));
    }
    // Similar lengths together: less padding, and each batch stops with its longest output.
    encoded.sort_by_key(|(_, ids)| ids.len());
    let mut out = vec![String::new(); texts.len()];
    for chunk in encoded.chunks(batch_size.max(1)) {
        let rows: Vec<Vec<u32>> = chunk.iter().map(|(_, ids)| ids.clone()).collect();
        let source = crate::data::translation::pad_rows::<B, _>(&rows, device);
        let hypotheses = if search.beam_size == 1 {
            greedy(model, source, search)
        } else {
            beam_search(model, source, search)
        };
        for ((index, _), hypothesis) in chunk.iter().zip(hypotheses) {
            out[*index] = tokenizers.target.decode(&hypothesis.tokens);
        }
    }
    Ok((out, truncated))
}

/// Warns (on stderr) about each input [`translate_texts`] cut to the model's `max_tokens`.
pub fn warn_truncated(truncated: &[Truncated], max_tokens: usize) {
    for cut in truncated {
        eprintln!(
            "warning: input {} has {} tokens; translated its first {} (the model's maximum is {max_tokens} with </s>)",
            cut.index + 1,
            cut.tokens,
            max_tokens - 1
        );
    }
}
