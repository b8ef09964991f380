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
