//! The language model's training: next-token steps, the corpus, and whole-split evaluation.

use super::{launch, open_artifact, unseeded, Session, Throughput, Tokenizers, TrainReport};
use crate::artifact::ArtifactDir;
use crate::config::ExperimentConfig;
use crate::data::{DatasetSpec, LmBatcher, TokenWindows, Tokenizer};
use crate::kernels::{LabAutodiff, LabBackend};
use crate::models::{LanguageModel, LmBatch};
use anyhow::{bail, Context, Result};
use burn::data::dataloader::DataLoaderBuilder;
use burn::prelude::*;
use burn::train::ClassificationOutput;
use std::path::Path;
use std::sync::Arc;

supervised_steps!(LanguageModel, LmBatch, |model, batch| {
    let (loss, output, targets) = model.loss(batch);
    ClassificationOutput {
        loss,
        output,
        targets,
    }
});

/// Tokenized train and validation splits of the experiment's text.
pub struct Corpus {
    /// The tokenizer (fit on the training split, or the artifact's on resume).
    pub tokenizer: Tokenizer,
    /// Training token ids.
    pub train: Arc<Vec<u32>>,
    /// Validation token ids.
    pub valid: Arc<Vec<u32>>,
}

impl Corpus {
    /// Reads the dataset, splits it (the first `1 − valid_fraction` of characters for training)
    /// and tokenizes both parts, fitting a tokenizer on the training part unless one is given.
    pub fn load(
        config: &ExperimentConfig,
        data_dir: &Path,
        tokenizer: Option<Tokenizer>,
    ) -> Result<Self> {
        let path = match &config.data.text_file {
            Some(path) => path.clone(),
            None => DatasetSpec::find(&config.data.dataset)?
                .ensure(data_dir)?
                .remove(0),
        };
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?;
        let chars: Vec<char> = text.chars().collect();
        let split = ((chars.len() as f64) * (1.0 - config.data.valid_fraction)) as usize;
        let train_text: String = chars[..split].iter().collect();
        let valid_text: String = chars[split..].iter().collect();
        let tokenizer = match tokenizer {
            Some(tokenizer) => tokenizer,
            None => Tokenizer::fit(
                config.data.tokenizer,
                train_text.split_inclusive('\n'),
                config.data.bpe_vocab_size,
            )?,
        };
        let encode = |text: &str, part: &str| -> Result<Arc<Vec<u32>>> {
            let ids = tokenizer.encode(text).with_context(|| {
                format!("cannot tokenize the {part} split of {}", path.display())
            })?;
            Ok(Arc::new(ids.into_iter().map(|id| id as u32).collect()))
        };
        let train = encode(&train_text, "training")?;
        let valid = encode(&valid_text, "validation")?;
        let context = config.lm()?.context;
        if train.len() <= context || valid.len() <= context {
            bail!("the text is too short for context {context}: each split needs more tokens");
        }
        Ok(Self {
            tokenizer,
            train,
            valid,
        })
    }
}

/// Trains the language model of `config`.
pub(super) fn train<B: LabAutodiff>(
    mut config: ExperimentConfig,
    tokenizers: Option<Tokenizers>,
    session: &Session,
    data_dir: &Path,
    device: B::Device,
) -> Result<TrainReport> {
    let corpus = Corpus::load(&config, data_dir, tokenizers.map(|t| t.target))?;
    let vocab = corpus.tokenizer.vocab_size();
    config.model.set_vocab_sizes(vocab, vocab);
    session.begin(&config, Some(&Tokenizers::shared(corpus.tokenizer.clone())))?;
    let lm = config.lm()?.clone();
    let train = &config.train;

    B::seed(&device, config.seed);
    let (loader_train, loader_valid) = session.loaders(
        &config,
        &device,
        TokenWindows::new(corpus.train.clone(), lm.context),
        unseeded(LmBatcher),
        TokenWindows::new(corpus.valid.clone(), lm.context),
        unseeded(LmBatcher),
    );
    let model: LanguageModel<B> = lm.init(&device);
    launch(
        &config,
        session,
        model,
        (loader_train, loader_valid),
        None,
        true,
        Throughput {
            per_step: train.batch_size * lm.context,
            unit: "tok",
        },
    )
}

/// A language model in inference mode with the tokenizer and config it was trained with.
pub struct Trained<B: LabBackend> {
    /// The model.
    pub model: LanguageModel<B>,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Its resolved config.
    pub config: ExperimentConfig,
}

impl<B: LabBackend> Trained<B> {
    /// Loads what `train` wrote in `artifact`.
    pub fn load(artifact: &ArtifactDir, device: &B::Device) -> Result<Self> {
        let (model, tokenizers, config) = open_artifact(artifact, device, |config| {
            Ok(config.lm()?.init::<B>(device))
        })?;
        Ok(Self {
            model,
            tokenizer: tokenizers
                .context("a language model artifact has a tokenizer")?
                .target,
            config,
        })
    }
}

/// Validation loss and perplexity over every non-overlapping window of the validation split.
pub fn evaluate<B: LabBackend>(
    trained: &Trained<B>,
    data_dir: &Path,
    batch_size: usize,
    device: &B::Device,
) -> Result<(f64, f64, usize)> {
    let corpus = Corpus::load(&trained.config, data_dir, Some(trained.tokenizer.clone()))?;
    let windows = TokenWindows::non_overlapping(corpus.valid, trained.config.lm()?.context);
    let loader = DataLoaderBuilder::<B, _, _>::new(LmBatcher)
        .batch_size(batch_size)
        .set_device(device.clone())
        .build(windows);
    let (mut sum, mut count) = (0.0f64, 0usize);
    for batch in loader.iter() {
        let n = batch.targets.dims().iter().product::<usize>();
        let (loss, _, _) = trained.model.loss(batch);
        sum += loss.into_scalar().elem::<f64>() * n as f64;
        count += n;
    }
    let loss = sum / count as f64;
    Ok((loss, loss.exp(), count))
}
