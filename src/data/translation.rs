//! Translation data: Tatoeba English–French (seeded split by source sentence), Multi30k
//! German–English (official splits), and the synthetic copy task; tokenized pairs and the
//! batcher that pads them.

use super::bpe::Special;
use super::config::{CopyTaskConfig, DataConfig};
use super::registry::DatasetSpec;
use super::tokenizer::Tokenizer;
use crate::kernels::LabBackend;
use anyhow::{bail, Context, Result};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

/// The synthetic copy task's name in configs.
pub const COPY_TASK: &str = "copy";

/// Checks that `source → target` is a direction the dataset offers (its declaration's
/// `languages`).
pub fn check_languages(data: &DataConfig) -> Result<()> {
    if data.dataset == COPY_TASK {
        return Ok(());
    }
    let languages = DatasetSpec::find(&data.dataset)?.languages;
    if languages.len() != 2 {
        bail!("data: {} declares no language pair", data.dataset);
    }
    let offered = |code: &str| languages.iter().any(|l| l == code);
    if !offered(&data.source) || !offered(&data.target) || data.source == data.target {
        bail!(
            "data: {} offers {} and {}; source {:?} → target {:?} is not one of its directions",
            data.dataset,
            languages[0],
            languages[1],
            data.source,
            data.target
        );
    }
    Ok(())
}

/// A batch of translation pairs, padded with `<pad>` (id 0) on the right.
#[derive(Clone, Debug)]
pub struct Seq2SeqBatch<B: LabBackend> {
    /// `[b, s]` source ids.
    pub source: Tensor<B, 2, Int>,
    /// `[b, t]` decoder inputs: `<s> y₁ … y_{n}`.
    pub target_in: Tensor<B, 2, Int>,
    /// `[b, t]` what each decoder position must predict: `y₁ … y_n </s>`.
    pub target_out: Tensor<B, 2, Int>,
}

/// One sentence and its translation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pair {
    /// Source sentence.
    pub source: String,
    /// Target sentence.
    pub target: String,
}

/// A test sentence with every reference translation the data has for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestItem {
    /// Source sentence.
    pub source: String,
    /// Reference translations (Tatoeba often has several).
    pub references: Vec<String>,
}

/// Train, validation and test splits of a translation dataset.
#[derive(Clone, Debug)]
pub struct TranslationCorpus {
    /// Training pairs.
    pub train: Vec<Pair>,
    /// Validation pairs (loss and accuracy during training).
    pub valid: Vec<Pair>,
    /// Test sentences (BLEU).
    pub test: Vec<TestItem>,
}

impl TranslationCorpus {
    /// Reads (downloading if needed) and splits the configured dataset.
    pub fn load(data: &DataConfig, data_dir: &Path, seed: u64) -> Result<Self> {
        match data.dataset.as_str() {
            COPY_TASK => Ok(copy_task(&data.copy, seed)),
            "tatoeba-fra-eng" => {
                let files = DatasetSpec::find(&data.dataset)?.ensure(data_dir)?;
                let pairs = read_tatoeba(&files[0], data.source == "fr")?;
                Ok(split_by_source(
                    pairs,
                    data.valid_fraction,
                    data.test_fraction,
                    seed,
                ))
            }
            "multi30k" => read_multi30k(data, data_dir),
            other => bail!("{other} is not a translation dataset"),
        }
    }
}

/// Reads `fra.txt` from the Tatoeba zip: `English<TAB>French` per line.
fn read_tatoeba(zip_path: &Path, french_source: bool) -> Result<Vec<Pair>> {
    let file = std::fs::File::open(zip_path)
        .with_context(|| format!("cannot open {}", zip_path.display()))?;
    let mut archive = zip::ZipArchive::new(file)
        .with_context(|| format!("{} is not a readable zip file", zip_path.display()))?;
    let mut text = String::new();
    archive
        .by_name("fra.txt")
        .with_context(|| format!("{} has no fra.txt", zip_path.display()))?
        .read_to_string(&mut text)
        .with_context(|| format!("fra.txt in {} is not UTF-8 text", zip_path.display()))?;
    let mut pairs = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let mut columns = line.split('\t');
        let (Some(en), Some(fr)) = (columns.next(), columns.next()) else {
            bail!(
                "{}: fra.txt line {} is not English<TAB>French",
                zip_path.display(),
                number + 1
            );
        };
        let (source, target) = if french_source { (fr, en) } else { (en, fr) };
        pairs.push(Pair {
            source: source.trim().to_owned(),
            target: target.trim().to_owned(),
        });
    }
    Ok(pairs)
}

/// A seeded split that keeps every pair of one source sentence in the same split, so no
/// source sentence is both trained on and tested on. Test items carry all references.
pub fn split_by_source(
    pairs: Vec<Pair>,
    valid_fraction: f64,
    test_fraction: f64,
    seed: u64,
) -> TranslationCorpus {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for pair in pairs {
        let slot = *index.entry(pair.source.clone()).or_insert_with(|| {
            groups.push((pair.source.clone(), Vec::new()));
            groups.len() - 1
        });
        groups[slot].1.push(pair.target);
    }
    groups.shuffle(&mut StdRng::seed_from_u64(seed));
    let n_test = ((groups.len() as f64) * test_fraction).round() as usize;
    let n_valid = ((groups.len() as f64) * valid_fraction).round() as usize;
    let mut rest = groups.split_off(n_test);
    let train_groups = rest.split_off(n_valid.min(rest.len()));
    let flatten = |groups: Vec<(String, Vec<String>)>| -> Vec<Pair> {
        groups
            .into_iter()
            .flat_map(|(source, targets)| {
                targets.into_iter().map(move |target| Pair {
                    source: source.clone(),
                    target,
                })
            })
            .collect()
    };
    TranslationCorpus {
        train: flatten(train_groups),
        valid: flatten(rest),
        test: groups
            .into_iter()
            .map(|(source, references)| TestItem { source, references })
            .collect(),
    }
}

/// Multi30k's official train / val / test_2016_flickr splits.
fn read_multi30k(data: &DataConfig, data_dir: &Path) -> Result<TranslationCorpus> {
    let files = DatasetSpec::find(&data.dataset)?.ensure(data_dir)?;
    let read = |split: &str, lang: &str| -> Result<Vec<String>> {
        let name = format!("{split}.{lang}.gz");
        let path = files
            .iter()
            .find(|p| p.file_name().is_some_and(|f| f == name.as_str()))
            .with_context(|| format!("multi30k declares no {name}"))?;
        let file =
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let mut text = String::new();
        flate2::read::GzDecoder::new(file)
            .read_to_string(&mut text)
            .with_context(|| format!("{} is not gzip-compressed UTF-8 text", path.display()))?;
        Ok(text.lines().map(|l| l.trim().to_owned()).collect())
    };
    let pairs = |split: &str| -> Result<Vec<Pair>> {
        let sources = read(split, &data.source)?;
        let targets = read(split, &data.target)?;
        if sources.len() != targets.len() {
            bail!(
                "multi30k {split}: {} {} lines but {} {} lines",
                sources.len(),
                data.source,
                targets.len(),
                data.target
            );
        }
        Ok(sources
            .into_iter()
            .zip(targets)
            .map(|(source, target)| Pair { source, target })
            .collect())
    };
    Ok(TranslationCorpus {
        train: pairs("train")?,
        valid: pairs("val")?,
        test: pairs("test_2016_flickr")?
            .into_iter()
            .map(|p| TestItem {
                source: p.source,
                references: vec![p.target],
            })
            .collect(),
    })
}

/// Random symbol sequences whose target is the sequence itself.
pub fn copy_task(config: &CopyTaskConfig, seed: u64) -> TranslationCorpus {
    let mut rng = StdRng::seed_from_u64(seed);
    let symbol = |i: usize| -> String {
        if config.symbols <= 26 {
            char::from(b'a' + i as u8).to_string()
        } else {
            format!("s{i}")
        }
    };
    let sentence = |rng: &mut StdRng| -> String {
        let len = rng.random_range(config.min_len..=config.max_len);
        (0..len)
            .map(|_| symbol(rng.random_range(0..config.symbols)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut pairs = |n: usize| -> Vec<Pair> {
        (0..n)
            .map(|_| {
                let s = sentence(&mut rng);
                Pair {
                    source: s.clone(),
                    target: s,
                }
            })
            .collect()
    };
    let held_out = (config.train_pairs / 10).max(1);
    let train = pairs(config.train_pairs);
    let valid = pairs(held_out);
    let test = pairs(held_out)
        .into_iter()
        .map(|p| TestItem {
            source: p.source,
            references: vec![p.target],
        })
        .collect();
    TranslationCorpus { train, valid, test }
}

/// One tokenized pair: source ids ending with `</s>`, target ids without specials.
#[derive(Clone, Debug)]
pub struct PairItem {
    /// Source ids, `… </s>`.
    pub source: Vec<u32>,
    /// Target ids (the batcher adds `<s>` in front and `</s>` behind).
    pub target: Vec<u32>,
}

/// Tokenized pairs, shared between data-loading workers.
#[derive(Clone, Debug)]
pub struct EncodedPairs {
    items: Arc<Vec<PairItem>>,
}

impl EncodedPairs {
    /// Tokenizes `pairs`, skipping those longer than `max_tokens` on either side (specials
    /// included) or empty on either side. Returns the dataset and how many pairs were skipped.
    pub fn encode(
        pairs: &[Pair],
        source: &Tokenizer,
        target: &Tokenizer,
        max_tokens: usize,
    ) -> Result<(Self, usize)> {
        let eos = Special::Eos.id() as u32;
        let mut items = Vec::with_capacity(pairs.len());
        for pair in pairs {
            let src = source.encode(&pair.source)?;
            let tgt = target.encode(&pair.target)?;
            if src.is_empty()
                || tgt.is_empty()
                || src.len() + 1 > max_tokens
                || tgt.len() + 1 > max_tokens
            {
                continue;
            }
            let mut src: Vec<u32> = src.into_iter().map(|id| id as u32).collect();
            src.push(eos);
            items.push(PairItem {
                source: src,
                target: tgt.into_iter().map(|id| id as u32).collect(),
            });
        }
        let skipped = pairs.len() - items.len();
        Ok((
            Self {
                items: Arc::new(items),
            },
            skipped,
        ))
    }

    /// Each pair's `(source, target)` positions in a batch (target with `<s>`).
    pub fn lengths(&self) -> Vec<(usize, usize)> {
        self.items
            .iter()
            .map(|p| (p.source.len(), p.target.len() + 1))
            .collect()
    }

    /// The length batches are grouped and balanced by (`train.batch_by_length`): the longer
    /// side's, what a pair costs once padded.
    pub fn length_keys(&self) -> Vec<usize> {
        self.lengths().into_iter().map(|(s, t)| s.max(t)).collect()
    }

    /// Target tokens (with `</s>`) over all pairs: the tokens a pass of training predicts.
    pub fn target_tokens(&self) -> usize {
        self.items.iter().map(|p| p.target.len() + 1).sum()
    }
}

impl Dataset<PairItem> for EncodedPairs {
    fn get(&self, index: usize) -> Option<PairItem> {
        self.items.get(index).cloned()
    }

    fn len(&self) -> usize {
        self.items.len()
    }
}

/// Pads pairs into a [`Seq2SeqBatch`]: `<pad>` on the right of each side.
#[derive(Clone, Debug, Default)]
pub struct Seq2SeqBatcher;

/// Right-pads `rows` with `<pad>` into a `[b, n]` tensor, `n` the longest row.
pub fn pad_rows<B: Backend, R: AsRef<[u32]>>(rows: &[R], device: &B::Device) -> Tensor<B, 2, Int> {
    let n = rows
        .iter()
        .map(|r| r.as_ref().len())
        .max()
        .unwrap_or(0)
        .max(1);
    let mut ids = vec![Special::Pad.id() as i64; rows.len() * n];
    for (row, tokens) in rows.iter().enumerate() {
        for (j, &id) in tokens.as_ref().iter().enumerate() {
            ids[row * n + j] = id as i64;
        }
    }
    Tensor::from_data(TensorData::new(ids, [rows.len(), n]), device)
}

impl<B: LabBackend> Batcher<B, PairItem, Seq2SeqBatch<B>> for Seq2SeqBatcher {
    fn batch(&self, items: Vec<PairItem>, device: &B::Device) -> Seq2SeqBatch<B> {
        let (bos, eos) = (Special::Bos.id() as u32, Special::Eos.id() as u32);
        let sources: Vec<Vec<u32>> = items.iter().map(|p| p.source.clone()).collect();
        let inputs: Vec<Vec<u32>> = items
            .iter()
            .map(|p| {
                std::iter::once(bos)
                    .chain(p.target.iter().copied())
                    .collect()
            })
            .collect();
        let outputs: Vec<Vec<u32>> = items
            .iter()
            .map(|p| {
                p.target
                    .iter()
                    .copied()
                    .chain(std::iter::once(eos))
                    .collect()
            })
            .collect();
        Seq2SeqBatch {
            source: pad_rows(&sources, device),
            target_in: pad_rows(&inputs, device),
            target_out: pad_rows(&outputs, device),
        }
    }
}
