//! Training the classifiers: the Vision Transformer on IDX images and the encoder classifier on
//! labelled sentences. Both are one cross-entropy step over class scores.

use super::{launch, open_artifact, unseeded, Session, Throughput, Tokenizers, TrainReport};
use crate::artifact::ArtifactDir;
use crate::config::ExperimentConfig;
use crate::data::{
    EncodedSentences, ImageBatch, ImageBatcher, ImageSet, SentenceBatch, SentenceBatcher,
    SentimentCorpus, Tokenizer,
};
use crate::kernels::{LabAutodiff, LabBackend};
use crate::models::{TextClassifier, VisionTransformer};
use anyhow::{Context, Result};
use burn::data::dataset::Dataset;
use burn::train::ClassificationOutput;
use std::path::Path;
use std::sync::Arc;

supervised_steps!(VisionTransformer, ImageBatch, |model, batch| {
    let (loss, output, targets) = model.loss(batch.images, batch.labels);
    ClassificationOutput {
        loss,
        output,
        targets,
    }
});

supervised_steps!(TextClassifier, SentenceBatch, |model, batch| {
    let (loss, output, targets) = model.loss(batch.tokens, batch.labels);
    ClassificationOutput {
        loss,
        output,
        targets,
    }
});

/// Trains the Vision Transformer of `config`.
pub(super) fn train_vit<B: LabAutodiff>(
    config: ExperimentConfig,
    session: &Session,
    data_dir: &Path,
    device: B::Device,
) -> Result<TrainReport> {
    let vit = config.vit()?.clone();
    let (train_set, test) = ImageSet::load(&config.data.dataset, data_dir)?;
    let (train_set, valid) = train_set.split(config.data.valid_fraction, config.seed);
    println!(
        "{}: {} training, {} validation, {} test images of {}×{}; {} patches of {}×{} per image",
        config.data.dataset,
        train_set.len(),
        valid.len(),
        test.len(),
        train_set.rows,
        train_set.cols,
        vit.n_tokens() - 1,
        vit.patch_size,
        vit.patch_size
    );
    session.begin(&config, None)?;
    B::seed(&device, config.seed);
    let (rows, cols) = (train_set.rows, train_set.cols);
    let augmenting = ImageBatcher::new(rows, cols, config.data.augment_shift, config.seed);
    let plain = ImageBatcher::new(rows, cols, 0, config.seed);
    let (loader_train, loader_valid) = session.loaders(
        &config,
        &device,
        train_set,
        Arc::new(move |items, seed, device: &B::Device| {
            augmenting.batch_seeded(items, seed, device)
        }),
        valid,
        unseeded(plain),
    );
    launch(
        &config,
        session,
        vit.init::<B>(&device),
        (loader_train, loader_valid),
        None,
        false,
        Throughput {
            per_step: config.train.batch_size,
            unit: "img",
        },
    )
}

/// Trains the encoder classifier of `config`.
pub(super) fn train_text<B: LabAutodiff>(
    mut config: ExperimentConfig,
    tokenizers: Option<Tokenizers>,
    session: &Session,
    data_dir: &Path,
    device: B::Device,
) -> Result<TrainReport> {
    let data = &config.data;
    let corpus = SentimentCorpus::load(
        &data.dataset,
        data_dir,
        data.valid_fraction,
        data.test_fraction,
        config.seed,
    )?;
    let tokenizer = match tokenizers {
        Some(tokenizers) => tokenizers.target,
        None => Tokenizer::fit(
            data.tokenizer,
            corpus.train.iter().map(|row| row.text.as_str()),
            data.bpe_vocab_size,
        )?,
    };
    let train_set = EncodedSentences::encode(&corpus.train, &tokenizer, data.max_tokens)?;
    let valid = EncodedSentences::encode(&corpus.valid, &tokenizer, data.max_tokens)?;
    println!(
        "{}: {} training, {} validation, {} test sentences; vocabulary {}",
        data.dataset,
        train_set.len(),
        valid.len(),
        corpus.test.len(),
        tokenizer.vocab_size()
    );
    config
        .model
        .set_vocab_sizes(tokenizer.vocab_size(), tokenizer.vocab_size());
    session.begin(&config, Some(&Tokenizers::shared(tokenizer)))?;
    B::seed(&device, config.seed);
    let (loader_train, loader_valid) = session.loaders(
        &config,
        &device,
        train_set,
        unseeded(SentenceBatcher),
        valid,
        unseeded(SentenceBatcher),
    );
    let model = config.classifier()?.init::<B>(&device);
    launch(
        &config,
        session,
        model,
        (loader_train, loader_valid),
        None,
        false,
        Throughput {
            per_step: config.train.batch_size,
            unit: "sent",
        },
    )
}

/// A trained Vision Transformer with its config.
pub struct TrainedVit<B: LabBackend> {
    /// The model.
    pub model: VisionTransformer<B>,
    /// Its resolved config.
    pub config: ExperimentConfig,
}

impl<B: LabBackend> TrainedVit<B> {
    /// Loads what `train` wrote in `artifact`.
    pub fn load(artifact: &ArtifactDir, device: &B::Device) -> Result<Self> {
        let (model, _, config) = open_artifact(artifact, device, |config| {
            Ok(config.vit()?.init::<B>(device))
        })?;
        Ok(Self { model, config })
    }
}

/// A trained text classifier with its tokenizer and config.
pub struct TrainedClassifier<B: LabBackend> {
    /// The model.
    pub model: TextClassifier<B>,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Its resolved config.
    pub config: ExperimentConfig,
}

impl<B: LabBackend> TrainedClassifier<B> {
    /// Loads what `train` wrote in `artifact`.
    pub fn load(artifact: &ArtifactDir, device: &B::Device) -> Result<Self> {
        let (model, tokenizers, config) = open_artifact(artifact, device, |config| {
            Ok(config.classifier()?.init::<B>(device))
        })?;
        Ok(Self {
            model,
            tokenizer: tokenizers
                .context("a classifier artifact has a tokenizer")?
                .target,
            config,
        })
    }
}
