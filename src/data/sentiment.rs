//! Sentence classification data: SST-2 (GLUE) and the UCI sentiment-labelled sentences, split,
//! tokenized with `<s>` first (the classification token) and batched with padding.

use super::{DatasetSpec, Tokenizer};
use anyhow::{bail, Context, Result};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::path::Path;

/// A labelled sentence.
#[derive(Clone, Debug, PartialEq)]
pub struct Labelled {
    /// The text.
    pub text: String,
    /// Class index.
    pub label: usize,
}

/// The three splits of a sentence-classification set.
#[derive(Clone, Debug)]
pub struct SentimentCorpus {
    /// Training sentences.
    pub train: Vec<Labelled>,
    /// Validation sentences (seeded share of train, or of everything for UCI).
    pub valid: Vec<Labelled>,
    /// Test sentences (GLUE dev for SST-2).
    pub test: Vec<Labelled>,
}

impl SentimentCorpus {
    /// Reads `dataset` from `data_dir` and splits it with `seed`.
    pub fn load(
        dataset: &str,
        data_dir: &Path,
        valid_fraction: f64,
        test_fraction: f64,
        seed: u64,
    ) -> Result<Self> {
        let paths = DatasetSpec::find(dataset)?.ensure(data_dir)?;
        let mut rng = StdRng::seed_from_u64(seed);
        match dataset {
            "sst2" => {
                let mut train = read_tsv(&paths[0], true)?;
                let test = read_tsv(&paths[1], true)?;
                train.shuffle(&mut rng);
                let held = (train.len() as f64 * valid_fraction).round() as usize;
                let valid = train.split_off(train.len() - held);
                Ok(Self { train, valid, test })
            }
            "uci-sentiment" => {
                let mut all = Vec::new();
                for path in &paths {
                    all.extend(read_tsv(path, false)?);
                }
                all.shuffle(&mut rng);
                let n = all.len() as f64;
                let test = all.split_off(all.len() - (n * test_fraction).round() as usize);
                let valid = all.split_off(all.len() - (n * valid_fraction).round() as usize);
                Ok(Self {
                    train: all,
                    valid,
                    test,
                })
            }
            other => {
                bail!("{other} is not a sentence-classification dataset (sst2, uci-sentiment)")
            }
        }
    }
}

/// Reads `sentence<TAB>label` lines (split on `\n` only; text trimmed), skipping a header.
fn read_tsv(path: &Path, header: bool) -> Result<Vec<Labelled>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?;
    let mut rows = Vec::new();
    for (i, line) in text.split('\n').enumerate().skip(usize::from(header)) {
        if line.trim().is_empty() {
            continue;
        }
        let (sentence, label) = line
            .rsplit_once('\t')
            .with_context(|| format!("{}:{}: no tab before the label", path.display(), i + 1))?;
        let label = match label.trim() {
            "0" => 0,
            "1" => 1,
            other => bail!(
                "{}:{}: label {other:?} is not 0 or 1",
                path.display(),
                i + 1
            ),
        };
        rows.push(Labelled {
            text: sentence.trim().to_string(),
            label,
        });
    }
    Ok(rows)
}

/// Token ids of a sentence for the classifier: `<s>` (the classification token; BERT's `[CLS]`)
/// then at most
/// `max_tokens − 1` tokens of the text.
pub fn encode_sentence(tokenizer: &Tokenizer, text: &str, max_tokens: usize) -> Result<Vec<u32>> {
    let ids = tokenizer.encode(text)?;
    Ok(std::iter::once(tokenizer.frame()?.0)
        .chain(ids)
        .take(max_tokens)
        .map(|id| id as u32)
        .collect())
}

/// Tokenized sentences with their labels.
#[derive(Clone, Debug)]
pub struct EncodedSentences {
    items: Vec<SentenceItem>,
}

/// One tokenized sentence.
#[derive(Clone, Debug)]
pub struct SentenceItem {
    /// `<s>` then the text's tokens.
    pub tokens: Vec<u32>,
    /// Class index.
    pub label: usize,
}

impl EncodedSentences {
    /// Tokenizes `rows`, cutting each to `max_tokens`.
    pub fn encode(rows: &[Labelled], tokenizer: &Tokenizer, max_tokens: usize) -> Result<Self> {
        let items = rows
            .iter()
            .map(|row| {
                Ok(SentenceItem {
                    tokens: encode_sentence(tokenizer, &row.text, max_tokens)?,
                    label: row.label,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self { items })
    }
}

impl EncodedSentences {
    /// Each sentence's length in tokens (`<s>` included).
    pub fn lengths(&self) -> Vec<usize> {
        self.items.iter().map(|item| item.tokens.len()).collect()
    }
}

impl Dataset<SentenceItem> for EncodedSentences {
    fn get(&self, index: usize) -> Option<SentenceItem> {
        self.items.get(index).cloned()
    }

    fn len(&self) -> usize {
        self.items.len()
    }
}

/// A batch of sentences, padded with `<pad>` (id 0) on the right.
#[derive(Clone, Debug)]
pub struct SentenceBatch<B: Backend> {
    /// `[b, n]` token ids.
    pub tokens: Tensor<B, 2, Int>,
    /// `[b]` class indices.
    pub labels: Tensor<B, 1, Int>,
}

/// Pads [`SentenceItem`]s into a [`SentenceBatch`].
#[derive(Clone, Debug, Default)]
pub struct SentenceBatcher;

impl<B: Backend> Batcher<B, SentenceItem, SentenceBatch<B>> for SentenceBatcher {
    fn batch(&self, items: Vec<SentenceItem>, device: &B::Device) -> SentenceBatch<B> {
        let rows: Vec<Vec<u32>> = items.iter().map(|item| item.tokens.clone()).collect();
        let labels: Vec<i64> = items.iter().map(|item| item.label as i64).collect();
        SentenceBatch {
            tokens: super::translation::pad_rows(&rows, device),
            labels: Tensor::from_data(TensorData::new(labels, [items.len()]), device),
        }
    }
}
