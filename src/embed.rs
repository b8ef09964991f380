//! Contextual embeddings: the vector a trained text model gives one word in different
//! sentences, compared with the word's static (input) embedding, which never changes.

use crate::artifact::ArtifactDir;
use crate::config::ModelConfig;
use crate::data::{Special, Tokenizer};
use crate::kernels::LabBackend;
use crate::train::{Trained, TrainedClassifier};
use anyhow::{bail, Result};
use burn::prelude::*;

/// A trained text model whose states can be read: a language model or a classifier.
pub enum TextEncoder<B: LabBackend> {
    /// Decoder-only language model (each state sees only the words before it).
    Lm(Trained<B>),
    /// Encoder classifier (each state sees the whole sentence).
    Classifier(TrainedClassifier<B>),
}

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

impl<B: LabBackend> TextEncoder<B> {
    /// Loads any text model's artifact; image models are an error.
    pub fn load(artifact: &ArtifactDir, device: &B::Device) -> Result<Self> {
        let config = crate::config::ExperimentConfig::load(&artifact.config())?;
        Ok(match config.model {
            ModelConfig::Lm(_) => Self::Lm(Trained::load(artifact, device)?),
            ModelConfig::Classifier(_) => {
                Self::Classifier(TrainedClassifier::load(artifact, device)?)
            }
            other => bail!(
                "{} holds a {} model; embed needs a text model that encodes one sentence (lm or classifier)",
                artifact.root().display(),
                other.kind()
            ),
        })
    }

    fn tokenizer(&self) -> &Tokenizer {
        match self {
            Self::Lm(t) => &t.tokenizer,
            Self::Classifier(t) => &t.tokenizer,
        }
    }

    /// The longest input the model takes.
    fn max_len(&self) -> usize {
        match self {
            Self::Lm(t) => t.model.context(),
            Self::Classifier(t) => t.model.max_len(),
        }
    }

    /// The vectors of the first whole-word, case-insensitive occurrence of `word` in
    /// `sentence`, or `None` if the sentence lacks it.
    pub fn word_vectors(
        &self,
        sentence: &str,
        word: &str,
        device: &B::Device,
    ) -> Result<Option<WordVectors>> {
        let Some((start, end)) = find_word(sentence, word) else {
            return Ok(None);
        };
        let mut tokens = self.tokenizer().encode_with_offsets(sentence)?;
        if let Self::Classifier(_) = self {
            tokens.insert(0, (Special::Bos.id(), (0, 0))); // the classification token
        }
        if tokens.len() > self.max_len() {
            bail!(
                "{sentence:?} has {} tokens; the model takes at most {}",
                tokens.len(),
                self.max_len()
            );
        }
        let positions: Vec<usize> = (0..tokens.len())
            .filter(|&i| {
                let (s, e) = tokens[i].1;
                e > s && s < end && e > start
            })
            .collect();
        let ids: Vec<i64> = tokens.iter().map(|(id, _)| *id as i64).collect();
        let n = ids.len();
        let input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, n]), device);
        let (states, table) = match self {
            Self::Lm(t) => (
                t.model.states(input.clone()).x,
                t.model.token_embedding.weight.val(),
            ),
            Self::Classifier(t) => (
                t.model.forward(input.clone()).states,
                t.model.token_embedding.weight.val(),
            ),
        };
        let d = states.dims()[2];
        let index = Tensor::<B, 1, Int>::from_data(
            TensorData::new(
                positions.iter().map(|&p| p as i64).collect(),
                [positions.len()],
            ),
            device,
        );
        let contextual = states.reshape([n, d]).select(0, index.clone()).mean_dim(0);
        let word_ids = input.reshape([n]).select(0, index);
        let static_ = table.select(0, word_ids).mean_dim(0);
        let to_vec = |t: Tensor<B, 2>| t.into_data().convert::<f32>().into_vec::<f32>();
        Ok(Some(WordVectors {
            tokens: positions.len(),
            contextual: to_vec(contextual).map_err(|e| anyhow::anyhow!("{e:?}"))?,
            static_: to_vec(static_).map_err(|e| anyhow::anyhow!("{e:?}"))?,
        }))
    }
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
