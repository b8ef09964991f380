//! The model kinds: one module per kind, each implementing [`ModelKind`] — everything the
//! application needs from a kind (build, train, load, evaluate, show its attention, read its
//! text states) — for that kind's config section.
//!
//! Commands never match on the kind. `train`, `eval`, `attention`, `explain` and `embed` ask
//! [`ModelConfig::visit`](crate::config::ModelConfig::visit) (the one place a kind is matched)
//! through the visitors here; commands made for one kind (`generate`, `translate`, `predict`,
//! `classify`) load it with [`load_as`], which names the kind an artifact holds instead.

mod classifier;
mod lm;
mod seq2seq;
mod vit;

pub use lm::{evaluate_lm, Corpus};
pub use seq2seq::TranslationData;

use crate::artifact::{ArtifactDir, Tokenizers, Trained};
use crate::config::{DataConfig, ExperimentConfig, ModelSection, Visit};
use crate::inspect::{AttentionMaps, GroupStats, TextModel};
use crate::kernels::{LabAutodiff, LabBackend};
use crate::train::speed::{BenchPlan, BenchReport};
use crate::train::{Session, TrainReport, TrainRequest};
use anyhow::{bail, Result};
use burn::module::Module;
use std::path::{Path, PathBuf};

/// Everything the application needs from one model kind, implemented for the kind's config
/// section (`LmConfig`, `Seq2SeqConfig`, …).
pub trait ModelKind: ModelSection {
    /// The trained model on backend `B`.
    type Model<B: LabBackend>: Module<B>;

    /// A fresh model (vocabulary sizes resolved, config validated).
    fn build<B: LabBackend>(&self, device: &B::Device) -> Self::Model<B>;

    /// Reads the data (fitting tokenizers unless `tokenizers` come from a resumed run),
    /// begins `session` with the resolved config, and trains.
    fn train<B: LabAutodiff>(
        &self,
        config: ExperimentConfig,
        tokenizers: Option<Tokenizers>,
        session: &Session,
        data_dir: &Path,
        device: B::Device,
    ) -> Result<TrainReport>;

    /// Floats one training example keeps for the backward pass, vocabulary sizes resolved (a
    /// lower bound, for the memory check before training).
    fn activation_floats(&self, data: &DataConfig) -> f64;

    /// Evaluates on held-out data and prints the result (loss and perplexity, BLEU, accuracy).
    fn eval<B: LabBackend>(
        trained: &Trained<Self::Model<B>>,
        request: &EvalRequest,
        device: &B::Device,
    ) -> Result<()>;

    /// The attention weights of every layer and head on `input` (a text, or an image path); a
    /// translator attends over `target` when given, else over its own translation.
    fn attention<B: LabBackend>(
        trained: &Trained<Self::Model<B>>,
        input: &str,
        target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps>;

    /// Head statistics of `maps`, compared with the same input shuffled by `seed`.
    fn statistics<B: LabBackend>(
        trained: &Trained<Self::Model<B>>,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>>;

    /// The model as a reader of one text (for `explain` and `embed`), or why it is not one.
    fn text_model<B: LabBackend>(trained: &Trained<Self::Model<B>>) -> Result<TextModel<'_, B>>;

    /// `bench train`: `plan`'s training steps of a fresh model on batches of the real training
    /// data, drawn as `train` draws them, timed phase by phase.
    fn bench<B: LabAutodiff>(
        &self,
        config: ExperimentConfig,
        data_dir: &Path,
        plan: BenchPlan,
        device: &B::Device,
    ) -> Result<BenchReport>;
}

/// What `eval` was asked.
#[derive(Clone, Debug)]
pub struct EvalRequest {
    /// The artifact evaluated.
    pub artifact_dir: PathBuf,
    /// Where datasets are found.
    pub data_dir: PathBuf,
    /// Examples per batch.
    pub batch_size: usize,
    /// Evaluate only the first N test examples (translators, classifiers).
    pub limit: Option<usize>,
    /// Translators: the tab-separated translations; classifiers: the confusion PNG.
    pub output: Option<PathBuf>,
    /// Translators: beam size (1 = greedy).
    pub beam: usize,
    /// Translators: GNMT length penalty α.
    pub length_penalty: f64,
    /// Translators: most tokens per output (default: the model's maximum length).
    pub max_len: Option<usize>,
    /// Translators: decode from the key–value cache (else re-run each prefix).
    pub cached: bool,
    /// Language models: tokens per evaluation window (default: the model's context).
    pub context: Option<usize>,
}

/// A trained model of whichever kind an artifact holds.
pub trait AnyTrained<B: LabBackend> {
    /// Its resolved config.
    fn config(&self) -> &ExperimentConfig;
    /// See [`ModelKind::eval`].
    fn eval(&self, request: &EvalRequest, device: &B::Device) -> Result<()>;
    /// See [`ModelKind::attention`].
    fn attention(
        &self,
        input: &str,
        target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps>;
    /// See [`ModelKind::statistics`].
    fn statistics(
        &self,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>>;
    /// See [`ModelKind::text_model`].
    fn text_model(&self) -> Result<TextModel<'_, B>>;
}

struct Loaded<K: ModelKind, B: LabBackend>(Trained<K::Model<B>>);

impl<K: ModelKind, B: LabBackend> AnyTrained<B> for Loaded<K, B> {
    fn config(&self) -> &ExperimentConfig {
        &self.0.config
    }
    fn eval(&self, request: &EvalRequest, device: &B::Device) -> Result<()> {
        K::eval(&self.0, request, device)
    }
    fn attention(
        &self,
        input: &str,
        target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps> {
        K::attention(&self.0, input, target, device)
    }
    fn statistics(
        &self,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>> {
        K::statistics(&self.0, maps, seed, device)
    }
    fn text_model(&self) -> Result<TextModel<'_, B>> {
        K::text_model(&self.0)
    }
}

/// Loads the model `artifact` holds, whatever its kind.
pub fn load<B: LabBackend>(
    artifact: &ArtifactDir,
    device: &B::Device,
) -> Result<Box<dyn AnyTrained<B>>> {
    let config = ExperimentConfig::load(&artifact.config())?;
    config.model.visit(Load { artifact, device })
}

struct Load<'x, B: LabBackend> {
    artifact: &'x ArtifactDir,
    device: &'x B::Device,
}

impl<K: ModelKind, B: LabBackend> Visit<'_, K> for Load<'_, B> {
    type Output = Result<Box<dyn AnyTrained<B>>>;
    fn visit(self, _: &K) -> Self::Output {
        let trained = load_as::<K, B>(self.artifact, self.device)?;
        Ok(Box::new(Loaded::<K, B>(trained)))
    }
}

/// Loads the model of kind `K` that `artifact` holds; another kind is an error naming it.
pub fn load_as<K: ModelKind, B: LabBackend>(
    artifact: &ArtifactDir,
    device: &B::Device,
) -> Result<Trained<K::Model<B>>> {
    Trained::open(artifact, device, |config| {
        if config.model.kind() != K::KIND {
            bail!(
                "{} holds a {} model, not a {} ({}); use it with `transformer-lab {}`",
                artifact.root().display(),
                config.model.kind(),
                K::DESCRIPTION,
                K::KIND,
                config.model.command()
            );
        }
        Ok(config.model_as::<K>()?.build::<B>(device))
    })
}

/// Runs (or resumes) the training `request` asks for, with the kind its config names.
pub fn train<B: LabAutodiff>(request: TrainRequest, device: B::Device) -> Result<TrainReport> {
    crate::train::run(request, |config, tokenizers, session, data_dir| {
        let model = config.model.clone();
        model.visit(Train::<B> {
            config,
            tokenizers,
            session,
            data_dir,
            device,
        })
    })
}

struct Train<'x, B: LabAutodiff> {
    config: ExperimentConfig,
    tokenizers: Option<Tokenizers>,
    session: &'x Session,
    data_dir: &'x Path,
    device: B::Device,
}

impl<K: ModelKind, B: LabAutodiff> Visit<'_, K> for Train<'_, B> {
    type Output = Result<TrainReport>;
    fn visit(self, section: &K) -> Self::Output {
        section.train::<B>(
            self.config,
            self.tokenizers,
            self.session,
            self.data_dir,
            self.device,
        )
    }
}

/// `bench train` of `config`, whatever its kind (see [`ModelKind::bench`]).
pub fn bench<B: LabAutodiff>(
    config: ExperimentConfig,
    data_dir: &Path,
    plan: BenchPlan,
    device: &B::Device,
) -> Result<BenchReport> {
    let model = config.model.clone();
    model.visit(Bench::<B> {
        config,
        data_dir,
        plan,
        device,
    })
}

struct Bench<'x, B: LabAutodiff> {
    config: ExperimentConfig,
    data_dir: &'x Path,
    plan: BenchPlan,
    device: &'x B::Device,
}

impl<K: ModelKind, B: LabAutodiff> Visit<'_, K> for Bench<'_, B> {
    type Output = Result<BenchReport>;
    fn visit(self, section: &K) -> Self::Output {
        section.bench::<B>(self.config, self.data_dir, self.plan, self.device)
    }
}
