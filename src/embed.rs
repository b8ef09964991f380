//! Contextual embeddings: the vector a trained text model gives one word in different
//! sentences, compared with the word's static (input) embedding, which never changes.

use crate::inspect::TextModel;
use crate::kernels::LabBackend;
use anyhow::Result;
use burn::prelude::*;

/// A word's vectors in one sentence.
#[derive(Clone, Debug)]
pub struct WordVectors {
    /// The tokens the word was split into.
    pub tokens: usize,
    /// Mean of the last layer's states over the word's tokens, `d` values.
    pub contextual: Vec<f32>,
    /// Mean of the input (token) embeddings of the word's tokens, `d` values.
    pub static_: Vec<f32>,
}

/// The vectors of the first whole-word, case-insensitive occurrence of `word` in `sentence`
/// as `model` reads it, or `None` if the sentence lacks it.
pub fn word_vectors<B: LabBackend>(
    model: &TextModel<'_, B>,
    sentence: &str,
    word: &str,
    device: &B::Device,
) -> Result<Option<WordVectors>> {
    let Some((start, end)) = find_word(sentence, word) else {
        return Ok(None);
    };
    let tokens = model.encode_with_offsets(sentence)?;
    let positions: Vec<usize> = (0..tokens.len())
        .filter(|&i| {
            let (s, e) = tokens[i].1;
            e > s && s < end && e > start
        })
        .collect();
    let ids: Vec<usize> = tokens.iter().map(|(id, _)| *id).collect();
    let n = ids.len();
    let states = model.states(&ids, device); // [1, n, d]
    let d = states.dims()[2];
    let index = Tensor::<B, 1, Int>::from_data(
        TensorData::new(
            positions.iter().map(|&p| p as i64).collect(),
            [positions.len()],
        ),
        device,
    );
    let contextual = states.reshape([n, d]).select(0, index.clone()).mean_dim(0);
    let word_ids = model.tokens(&ids, device).reshape([n]).select(0, index);
    let static_ = model.table.clone().select(0, word_ids).mean_dim(0);
    let to_vec = |t: Tensor<B, 2>| t.into_data().convert::<f32>().into_vec::<f32>();
    Ok(Some(WordVectors {
        tokens: positions.len(),
        contextual: to_vec(contextual).map_err(|e| anyhow::anyhow!("{e:?}"))?,
        static_: to_vec(static_).map_err(|e| anyhow::anyhow!("{e:?}"))?,
    }))
}

/// Byte span of the first whole-word, case-insensitive occurrence of `word` in `text`.
pub fn find_word(text: &str, word: &str) -> Option<(usize, usize)> {
    let pattern = format!(r"(?i)(^|\W)({})($|\W)", regex::escape(word.trim()));
    let found = regex::Regex::new(&pattern).ok()?.captures(text)?;
    let m = found.get(2)?;
    Some((m.start(), m.end()))
}

/// Cosine similarity of two vectors (0 when either is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let denominator = norm(a) * norm(b);
    if denominator == 0.0 {
        0.0
    } else {
        dot / denominator
    }
}

/// One pair of a word-in-context set: `word` in sentence `a` and in sentence `b`, and whether
/// it has the same sense in both.
#[derive(Clone, Debug, PartialEq)]
pub struct SensePair {
    /// The word.
    pub word: String,
    /// The first sentence.
    pub a: String,
    /// The second sentence.
    pub b: String,
    /// Whether the word means the same in both.
    pub same: bool,
}

/// Reads a word-in-context TSV: `word <TAB> sentence A <TAB> sentence B <TAB> same|different`
/// per line; blank lines and lines starting with `#` are skipped. Each error names its line.
pub fn read_pairs(path: &std::path::Path) -> Result<Vec<SensePair>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    let mut pairs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let at = || format!("{}:{}", path.display(), i + 1);
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split('\t').map(str::trim).collect();
        let [word, a, b, sense] = fields[..] else {
            anyhow::bail!(
                "{}: expected 4 tab-separated fields (word, sentence A, sentence B, same|different), found {}",
                at(),
                fields.len()
            );
        };
        let same = match sense {
            "same" => true,
            "different" => false,
            other => anyhow::bail!("{}: the sense is {other:?}; write same or different", at()),
        };
        for (name, sentence) in [("A", a), ("B", b)] {
            if find_word(sentence, word).is_none() {
                anyhow::bail!("{}: {word:?} is not a word of sentence {name}", at());
            }
        }
        pairs.push(SensePair {
            word: word.to_string(),
            a: a.to_string(),
            b: b.to_string(),
            same,
        });
    }
    if pairs.is_empty() {
        anyhow::bail!("{} holds no pairs", path.display());
    }
    Ok(pairs)
}

/// The WiC protocol's score: the threshold `t` for which "cosine ≥ t means the same sense" is
/// right most often, and how many pairs it gets right. Every cut between two neighbouring
/// cosines (and below and above them all) is tried; the threshold is the cut's midpoint.
pub fn best_threshold(cosines: &[f64], same: &[bool]) -> (f64, usize) {
    let mut order: Vec<usize> = (0..cosines.len()).collect();
    order.sort_by(|&i, &j| cosines[i].total_cmp(&cosines[j]));
    // Threshold below every cosine: everything is called "same".
    let mut right = same.iter().filter(|&&s| s).count();
    let (mut best, mut best_right) = (cosines[order[0]] - 1e-9, right);
    for (k, &i) in order.iter().enumerate() {
        // Moving the threshold past pair i calls it "different".
        right = if same[i] { right - 1 } else { right + 1 };
        let next = order.get(k + 1).map(|&j| cosines[j]);
        if next == Some(cosines[i]) {
            continue; // ties move together
        }
        if right > best_right {
            best_right = right;
            best = match next {
                Some(next) => (cosines[i] + next) / 2.0,
                None => cosines[i] + 1e-9,
            };
        }
    }
    (best, best_right)
}
