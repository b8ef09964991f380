//! Masked-language-model data: the English sentences of one or more declared datasets
//! (`"multi30k+tatoeba-fra-eng+sst2+uci-sentiment"`), each only from its training split, pooled,
//! deduplicated and split; tokenized as `<s> … </s>`; and BERT's masking, drawn from a seed so
//! the same batch is masked the same way whenever it is made (a resumed run sees what the run
//! it replaced saw).

use super::translation::pad_rows;
use super::{DataConfig, DatasetSpec, Special, Task, Tokenizer, TranslationCorpus};
use crate::data::SentimentCorpus;
use anyhow::{bail, Context, Result};
use burn::data::dataset::Dataset;
use burn::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use std::collections::HashSet;
use std::path::Path;

/// The datasets a `+`-joined name lists, each checked to hold English text.
pub fn english_parts(dataset: &str) -> Result<Vec<String>> {
    let mut parts = Vec::new();
    for name in dataset.split('+').map(str::trim) {
        let spec = DatasetSpec::find(name)?;
        match spec.task {
            Task::Images => {
                bail!("data: {name} is an image dataset; a masked language model reads text")
            }
            Task::Translation if !spec.languages.iter().any(|l| l == "en") => {
                bail!("data: {name} has no English side")
            }
            _ => parts.push(name.to_string()),
        }
    }
    Ok(parts)
}

/// The training sentences of every part of `data.dataset` (or the lines of `data.text_file`),
/// in order, duplicates and blank lines dropped: Multi30k's and Tatoeba's English sides, SST-2's
/// and UCI's training sentences, a text's non-blank lines. Validation and test splits are left
/// out, so a model fine-tuned on one of these datasets is never tested on a sentence it was
/// pretrained on (the splits are the ones a classifier or translator with the same `seed`
/// makes).
pub fn english_sentences(data: &DataConfig, data_dir: &Path, seed: u64) -> Result<Vec<String>> {
    let mut all = Vec::new();
    if let Some(path) = &data.text_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?;
        all.extend(text.lines().map(str::to_owned));
    } else {
        for name in english_parts(&data.dataset)? {
            all.extend(training_sentences(&name, data, data_dir, seed)?);
        }
    }
    let mut seen = HashSet::new();
    Ok(all
        .into_iter()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty() && seen.insert(s.clone()))
        .collect())
}

fn training_sentences(
    name: &str,
    data: &DataConfig,
    data_dir: &Path,
    seed: u64,
) -> Result<Vec<String>> {
    let spec = DatasetSpec::find(name)?;
    Ok(match spec.task {
        Task::Text => {
            let path = spec.ensure(data_dir)?.remove(0);
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?;
            text.lines().map(str::to_owned).collect()
        }
        Task::Translation => {
            let other = spec.languages.iter().find(|l| *l != "en").cloned();
            let config = DataConfig {
                dataset: name.to_string(),
                source: "en".into(),
                target: other.unwrap_or_default(),
                ..data.clone()
            };
            let corpus = TranslationCorpus::load(&config, data_dir, seed)?;
            corpus.train.into_iter().map(|pair| pair.source).collect()
        }
        Task::SentenceClassification => {
            let corpus = SentimentCorpus::load(
                name,
                data_dir,
                data.valid_fraction,
                data.test_fraction,
                seed,
            )?;
            corpus.train.into_iter().map(|row| row.text).collect()
        }
        Task::Images => bail!("data: {name} is an image dataset"),
    })
}

/// Splits `sentences` with `seed`: a `valid_fraction` share (at least one) for validation.
pub fn split_sentences(
    mut sentences: Vec<String>,
    valid_fraction: f64,
    seed: u64,
) -> Result<(Vec<String>, Vec<String>)> {
    if sentences.len() < 2 {
        bail!(
            "data: {} sentence(s); a masked language model needs at least two (one to train on, \
             one to validate on)",
            sentences.len()
        );
    }
    sentences.shuffle(&mut StdRng::seed_from_u64(seed));
    let held = ((sentences.len() as f64 * valid_fraction).round() as usize).max(1);
    let valid = sentences.split_off(sentences.len() - held);
    Ok((sentences, valid))
}

/// A batch of masked sentences.
#[derive(Clone, Debug)]
pub struct MlmBatch<B: Backend> {
    /// `[b, n]` the sentences as the model reads them (some tokens replaced), `<pad>` on the
    /// right.
    pub tokens: Tensor<B, 2, Int>,
    /// `[m]` the predicted positions, as indices into the flattened `[b·n]` tokens.
    pub positions: Tensor<B, 1, Int>,
    /// `[m]` the original token at each.
    pub targets: Tensor<B, 1, Int>,
}

/// Tokenized sentences: `<s>`, at most `max_tokens − 2` tokens of the text, `</s>`.
#[derive(Clone, Debug)]
pub struct MaskedSentences {
    rows: Vec<Vec<u32>>,
}

/// One tokenized sentence and its index in its split (held-out masks follow the index).
#[derive(Clone, Debug)]
pub struct MaskedItem {
    /// `<s> … </s>` (BERT's `[CLS] … [SEP]`).
    pub ids: Vec<u32>,
    /// Its index in the split.
    pub index: usize,
}

impl MaskedSentences {
    /// Tokenizes `sentences`.
    pub fn encode(sentences: &[String], tokenizer: &Tokenizer, max_tokens: usize) -> Result<Self> {
        let (first, last) = tokenizer.frame()?;
        let rows = sentences
            .iter()
            .map(|text| {
                let ids = tokenizer.encode(text)?;
                let keep = ids.len().min(max_tokens.saturating_sub(2));
                Ok(std::iter::once(first)
                    .chain(ids.into_iter().take(keep))
                    .chain(std::iter::once(last))
                    .map(|id| id as u32)
                    .collect())
            })
            .collect::<Result<_>>()?;
        Ok(Self { rows })
    }

    /// Each sentence's length in tokens, for grouping batches by length.
    pub fn lengths(&self) -> Vec<usize> {
        self.rows.iter().map(Vec::len).collect()
    }

    /// Tokens in all sentences.
    pub fn tokens(&self) -> usize {
        self.rows.iter().map(Vec::len).sum()
    }
}

impl Dataset<MaskedItem> for MaskedSentences {
    fn get(&self, index: usize) -> Option<MaskedItem> {
        self.rows.get(index).map(|ids| MaskedItem {
            ids: ids.clone(),
            index,
        })
    }

    fn len(&self) -> usize {
        self.rows.len()
    }
}

/// BERT's masking. Of each sentence's tokens between `<s>` and `</s>`, `max(1, round(fraction ·
/// n))` are chosen uniformly; each chosen one reads `[MASK]` with probability 0.8, a random
/// ordinary token (never a special one) with 0.1, and itself with 0.1; the loss predicts the
/// original at every chosen position.
#[derive(Clone, Debug)]
pub struct Masking {
    /// The `[MASK]` id.
    pub mask: usize,
    /// Ordinary tokens are `first_ordinary..vocab`, `mask` excepted.
    pub vocab: usize,
    /// The share of tokens chosen.
    pub fraction: f64,
    /// The run's seed: held-out masks depend on it and the sentence alone.
    pub seed: u64,
}

/// What [`Masking::apply`] made of one sentence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Masked {
    /// The sentence as the model reads it.
    pub ids: Vec<u32>,
    /// The chosen positions, ascending.
    pub positions: Vec<usize>,
    /// The original token at each.
    pub targets: Vec<u32>,
}

/// The first id that is not a special token (`<pad> <s> </s> <unk>`).
pub const FIRST_ORDINARY: usize = Special::ALL.len();

impl Masking {
    /// Masks one sentence (`<s> … </s>`) with `rng`.
    pub fn apply(&self, ids: &[u32], rng: &mut StdRng) -> Masked {
        let mut out = ids.to_vec();
        let inner = ids.len().saturating_sub(2);
        if inner == 0 {
            return Masked {
                ids: out,
                positions: Vec::new(),
                targets: Vec::new(),
            };
        }
        let count = ((self.fraction * inner as f64).round() as usize).clamp(1, inner);
        let mut positions: Vec<usize> = rand::seq::index::sample(rng, inner, count)
            .into_iter()
            .map(|i| i + 1)
            .collect();
        positions.sort_unstable();
        let targets = positions.iter().map(|&p| ids[p]).collect();
        for &p in &positions {
            let r: f64 = rng.random();
            if r < 0.8 {
                out[p] = self.mask as u32;
            } else if r < 0.9 {
                out[p] = self.random_token(rng) as u32;
            }
        }
        Masked {
            ids: out,
            positions,
            targets,
        }
    }

    fn random_token(&self, rng: &mut StdRng) -> usize {
        // Ordinary ids, the mask's left out.
        let ordinary = self.vocab - FIRST_ORDINARY - 1;
        let pick = FIRST_ORDINARY + rng.random_range(0..ordinary);
        if pick >= self.mask {
            pick + 1
        } else {
            pick
        }
    }

    /// The generator of item `slot` of a batch drawn with `draw` (training), or of the
    /// held-out sentence `index` (`draw` none: the same masks every epoch).
    pub fn rng(&self, draw: Option<u64>, slot: usize, index: usize) -> StdRng {
        let (a, b) = match draw {
            Some(draw) => (draw, slot as u64 + 1),
            None => (self.seed ^ 0x6d61_736b, index as u64),
        };
        // seed_from_u64 scrambles its key, so nearby keys give unrelated streams.
        StdRng::seed_from_u64(
            a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.wrapping_mul(0xbf58_476d_1ce4_e5b9),
        )
    }

    /// A batch of `items`, masked (see [`Masking::rng`] for `draw`).
    pub fn batch<B: Backend>(
        &self,
        items: Vec<MaskedItem>,
        draw: Option<u64>,
        device: &B::Device,
    ) -> MlmBatch<B> {
        let masked: Vec<Masked> = items
            .iter()
            .enumerate()
            .map(|(slot, item)| self.apply(&item.ids, &mut self.rng(draw, slot, item.index)))
            .collect();
        let width = masked.iter().map(|m| m.ids.len()).max().unwrap_or(0);
        let rows: Vec<&[u32]> = masked.iter().map(|m| m.ids.as_slice()).collect();
        let (mut positions, mut targets) = (Vec::new(), Vec::new());
        for (row, m) in masked.iter().enumerate() {
            positions.extend(m.positions.iter().map(|&p| (row * width + p) as i64));
            targets.extend(m.targets.iter().map(|&t| t as i64));
        }
        let m = positions.len();
        MlmBatch {
            tokens: pad_rows(&rows, device),
            positions: Tensor::from_data(TensorData::new(positions, [m]), device),
            targets: Tensor::from_data(TensorData::new(targets, [m]), device),
        }
    }
}
