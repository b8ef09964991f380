//! The translator's training: teacher-forced steps with label smoothing over padded pairs.

use super::{launch, open_artifact, unseeded, Session, Throughput, Tokenizers, TrainReport};
use crate::artifact::ArtifactDir;
use crate::config::ExperimentConfig;
use crate::data::{EncodedPairs, Seq2SeqBatcher, Special, Tokenizer, TranslationCorpus};
use crate::kernels::{LabAutodiff, LabBackend};
use crate::models::{Seq2Seq, Seq2SeqBatch};
use anyhow::{bail, Context, Result};
use burn::data::dataset::Dataset;
use burn::train::ClassificationOutput;
use std::path::Path;

supervised_steps!(Seq2Seq, Seq2SeqBatch, |model, batch| {
    let (loss, output, targets) = model.loss(&batch, model.label_smoothing());
    ClassificationOutput {
        loss,
        output,
        targets,
    }
});

/// A translation dataset read, split and tokenized.
pub struct TranslationData {
    /// The raw splits (the test split is for BLEU).
    pub corpus: TranslationCorpus,
    /// The tokenizers (trained on the training split, or the artifact's).
    pub tokenizers: Tokenizers,
    /// Tokenized training pairs within `max_tokens`.
    pub train: EncodedPairs,
    /// Tokenized validation pairs within `max_tokens`.
    pub valid: EncodedPairs,
    /// Training pairs skipped for length.
    pub skipped: usize,
}

impl TranslationData {
    /// Loads the experiment's dataset, fitting tokenizers on its training split unless given.
    pub fn load(
        config: &ExperimentConfig,
        data_dir: &Path,
        tokenizers: Option<Tokenizers>,
    ) -> Result<Self> {
        let data = &config.data;
        let corpus = TranslationCorpus::load(data, data_dir, config.seed)?;
        let tokenizers = match tokenizers {
            Some(tokenizers) => tokenizers,
            None => {
                let sources = corpus.train.iter().map(|p| p.source.as_str());
                let targets = corpus.train.iter().map(|p| p.target.as_str());
                let fit = |texts: Vec<&str>| {
                    Tokenizer::fit(data.tokenizer, texts.into_iter(), data.bpe_vocab_size)
                };
                if data.shared_vocab {
                    Tokenizers::shared(fit(sources.chain(targets).collect())?)
                } else {
                    Tokenizers {
                        source: fit(sources.collect())?,
                        target: fit(targets.collect())?,
                        shared: false,
                    }
                }
            }
        };
        let encode = |pairs: &[crate::data::Pair]| {
            EncodedPairs::encode(
                pairs,
                &tokenizers.source,
                &tokenizers.target,
                data.max_tokens,
            )
        };
        let (train, skipped) = encode(&corpus.train)?;
        let (valid, _) = encode(&corpus.valid)?;
        if train.is_empty() || valid.is_empty() {
            bail!(
                "{}: no training or validation pair fits in max_tokens {}",
                data.dataset,
                data.max_tokens
            );
        }
        Ok(Self {
            corpus,
            tokenizers,
            train,
            valid,
            skipped,
        })
    }
}

/// Trains the translator of `config`.
pub(super) fn train<B: LabAutodiff>(
    mut config: ExperimentConfig,
    tokenizers: Option<Tokenizers>,
    session: &Session,
    data_dir: &Path,
    device: B::Device,
) -> Result<TrainReport> {
    let data = TranslationData::load(&config, data_dir, tokenizers)?;
    config.model.set_vocab_sizes(
        data.tokenizers.source.vocab_size(),
        data.tokenizers.target.vocab_size(),
    );
    session.begin(&config, Some(&data.tokenizers))?;
    let train = &config.train;
    println!(
        "{}: {} training pairs ({} longer than {} tokens skipped), {} validation pairs, {} test sentences; vocabulary {} → {}",
        config.data.dataset,
        data.train.len(),
        data.skipped,
        config.data.max_tokens,
        data.valid.len(),
        data.corpus.test.len(),
        data.tokenizers.source.vocab_size(),
        data.tokenizers.target.vocab_size(),
    );

    B::seed(&device, config.seed);
    let mean_target = data.train.target_tokens() as f64 / data.train.len() as f64;
    let (loader_train, loader_valid) = session.loaders(
        &config,
        &device,
        data.train,
        unseeded(Seq2SeqBatcher),
        data.valid,
        unseeded(Seq2SeqBatcher),
    );
    let model: Seq2Seq<B> = config
        .seq2seq()?
        .init(&device)
        .with_label_smoothing(train.label_smoothing);
    launch(
        &config,
        session,
        model,
        (loader_train, loader_valid),
        Some(Special::Pad.id()),
        true,
        Throughput {
            per_step: (train.batch_size as f64 * mean_target).round() as usize,
            unit: "tok",
        },
    )
}

/// A translator in inference mode with its tokenizers and config.
pub struct TrainedTranslator<B: LabBackend> {
    /// The model.
    pub model: Seq2Seq<B>,
    /// Its tokenizers.
    pub tokenizers: Tokenizers,
    /// Its resolved config.
    pub config: ExperimentConfig,
}

impl<B: LabBackend> TrainedTranslator<B> {
    /// Loads what `train` wrote in `artifact`.
    pub fn load(artifact: &ArtifactDir, device: &B::Device) -> Result<Self> {
        let (model, tokenizers, config) = open_artifact(artifact, device, |config| {
            Ok(config.seq2seq()?.init::<B>(device))
        })?;
        Ok(Self {
            model,
            tokenizers: tokenizers.context("a translator artifact has tokenizers")?,
            config,
        })
    }
}
