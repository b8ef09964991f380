//! Training through burn-train's `Learner`: each model's train/validation steps (in `lm` and
//! `seq2seq`) and one wiring function, [`launch`], that every model trains through.

/// Implements burn-train's `TrainStep` and `InferenceStep` for a model from one function that
/// maps a batch to a `ClassificationOutput` (loss, logits, targets): training backpropagates
/// its loss, validation only reports it.
macro_rules! supervised_steps {
    ($model:ident, $batch:ident, |$m:ident, $b:ident| $output:expr) => {
        impl<B: LabAutodiff> burn::train::TrainStep for $model<B> {
            type Input = $batch<B>;
            type Output = burn::train::ClassificationOutput<B>;

            fn step(&self, $b: $batch<B>) -> burn::train::TrainOutput<Self::Output> {
                let $m = self;
                let output: Self::Output = $output;
                let grads = output.loss.backward();
                burn::train::TrainOutput::new(self, grads, output)
            }
        }

        impl<B: LabBackend> burn::train::InferenceStep for $model<B> {
            type Input = $batch<B>;
            type Output = burn::train::ClassificationOutput<B>;

            fn step(&self, $b: $batch<B>) -> Self::Output {
                let $m = self;
                $output
            }
        }
    };
}

mod checkpoint;
mod classify;
mod lm;
mod loader;
mod optim;
mod preflight;
mod renderer;
mod run;
mod schedule;
mod seq2seq;

pub use checkpoint::{prune, KeepCheckpoints, Patience, ValidLossLogger, ValidLosses};
pub use classify::{TrainedClassifier, TrainedVit};
pub use lm::{evaluate, Corpus, Trained};
pub use loader::{mix, unseeded, BatchFn, Draw, EpochLoader};
pub use optim::{clip_global_norm, reference_adamw, LabAdamW, ReferenceOptimizer};
pub use renderer::{PlainRenderer, Throughput};
use run::{launch, Session};
pub use schedule::WarmupSchedule;
pub use seq2seq::{TrainedTranslator, TranslationData};

use crate::artifact::ArtifactDir;
use crate::config::{ExperimentConfig, ModelConfig};
use crate::data::Tokenizer;
use crate::kernels::{LabAutodiff, LabBackend};
use anyhow::{bail, Result};
use burn::module::Module;
use std::path::PathBuf;

/// Opens what `train` wrote in `artifact`: its config, its tokenizers (checked against the
/// config; none for an image model) and the model `init` builds from the config, with the
/// trained weights loaded.
pub(crate) fn open_artifact<B: LabBackend, M: Module<B>>(
    artifact: &ArtifactDir,
    device: &B::Device,
    init: impl FnOnce(&ExperimentConfig) -> Result<M>,
) -> Result<(M, Option<Tokenizers>, ExperimentConfig)> {
    let weights = artifact.weights()?;
    let config = ExperimentConfig::load(&artifact.config())?;
    artifact.check_config_unchanged(false)?;
    let model = init(&config)?;
    let tokenizers = if config.model.reads_text() {
        Some(Tokenizers::open(artifact, &config)?)
    } else {
        None
    };
    let model = crate::artifact::load_weights(model, &weights, device)?;
    Ok((model, tokenizers, config))
}

/// What `train` was asked to do.
#[derive(Clone, Debug)]
pub struct TrainRequest {
    /// The experiment (ignored on `resume`, where the artifact's own config is used; a
    /// different one given explicitly is an error).
    pub config: Option<ExperimentConfig>,
    /// Where checkpoints, config, tokenizer and the final model go.
    pub artifact: ArtifactDir,
    /// Where datasets are found (and downloaded to).
    pub data_dir: PathBuf,
    /// Continue the run in `artifact` from its latest complete checkpoint.
    pub resume: bool,
    /// Replace a previous run in `artifact`.
    pub force: bool,
    /// Plain log lines even in a terminal (no dashboard).
    pub plain: bool,
}

/// What a finished (or stopped) training reports.
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// How the run ended.
    pub outcome: Outcome,
    /// The epoch (checkpoint) whose weights are in `model.mpk`, and the run's epochs.
    pub epoch: usize,
    /// The run's epochs.
    pub epochs: usize,
    /// Optimizer steps per epoch.
    pub steps_per_epoch: usize,
    /// Validation loss of `epoch`, if known.
    pub valid_loss: Option<f64>,
    /// The kept checkpoint with the lowest validation loss.
    pub best: Option<(usize, f64)>,
    /// Optimizer steps run in this invocation.
    pub steps: usize,
    /// Wall time of the Learner, validation and checkpoints included.
    pub seconds: f64,
    /// Training items (target tokens, images, sentences) per second over that wall time.
    pub per_second: f64,
    /// What an item is ("tok", "img", "sent").
    pub unit: &'static str,
    /// The command that uses the trained model ("generate", "translate", …).
    pub use_with: &'static str,
}

/// The tokenizers of a run: a language model has one (`source` and `target` are the same);
/// a translator has one per side, or one shared.
#[derive(Clone, Debug)]
pub struct Tokenizers {
    /// Tokenizes the translator's input.
    pub source: Tokenizer,
    /// Tokenizes the language model's text, or the translator's output.
    pub target: Tokenizer,
    /// Whether both sides use the same tokenizer.
    pub shared: bool,
}

impl Tokenizers {
    /// One tokenizer for everything.
    pub fn shared(tokenizer: Tokenizer) -> Self {
        Self {
            source: tokenizer.clone(),
            target: tokenizer,
            shared: true,
        }
    }

    /// Writes `tokenizer.json` (and `tokenizer-source.json` when the sides differ).
    pub fn save(&self, artifact: &ArtifactDir) -> Result<()> {
        self.target.save(&artifact.tokenizer())?;
        if !self.shared {
            self.source.save(&artifact.source_tokenizer())?;
        }
        Ok(())
    }

    /// Reads what [`Tokenizers::save`] wrote.
    pub fn load(artifact: &ArtifactDir) -> Result<Self> {
        let target = Tokenizer::load(&artifact.tokenizer())?;
        if artifact.source_tokenizer().exists() {
            let source = Tokenizer::load(&artifact.source_tokenizer())?;
            return Ok(Self {
                source,
                target,
                shared: false,
            });
        }
        Ok(Self::shared(target))
    }

    /// Reads the tokenizers of `artifact` and checks them against its config.
    pub fn open(artifact: &ArtifactDir, config: &ExperimentConfig) -> Result<Self> {
        let tokenizers = Self::load(artifact)?;
        tokenizers.check(config, artifact)?;
        Ok(tokenizers)
    }

    /// Checks the config's vocabulary sizes against the tokenizers'.
    pub fn check(&self, config: &ExperimentConfig, artifact: &ArtifactDir) -> Result<()> {
        let expected = (self.source.vocab_size(), self.target.vocab_size());
        if config.model.vocab_sizes() != expected {
            bail!(
                "{}: config.json has vocabulary sizes {:?} but the tokenizers have {:?}",
                artifact.root().display(),
                config.model.vocab_sizes(),
                expected
            );
        }
        Ok(())
    }
}

/// How a training invocation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// All steps trained; `model.mpk` written.
    Finished,
    /// Stopped by early stopping; `model.mpk` written.
    StoppedEarly,
    /// Every step was already trained (a run killed before writing `model.mpk`); `model.mpk`
    /// written from the last checkpoint.
    WrittenFromCheckpoint,
    /// Stopped by the user (the dashboard's `q`); no `model.mpk`, `--resume` continues.
    Interrupted,
}

/// Runs (or resumes) a training and writes its artifacts.
pub fn train<B: LabAutodiff>(request: TrainRequest, device: B::Device) -> Result<TrainReport> {
    preflight::recover_replaced_run(&request.artifact)?;
    let (config, tokenizers) = preflight::prepare_artifact(&request)?;
    let session = Session::new(&request);
    let data_dir = &request.data_dir;
    let result = match &config.model {
        ModelConfig::Lm(_) => lm::train::<B>(config, tokenizers, &session, data_dir, device),
        ModelConfig::Seq2seq(_) => {
            seq2seq::train::<B>(config, tokenizers, &session, data_dir, device)
        }
        ModelConfig::Classifier(_) => {
            classify::train_text::<B>(config, tokenizers, &session, data_dir, device)
        }
        ModelConfig::Vit(_) => classify::train_vit::<B>(config, &session, data_dir, device),
    };
    session.end(result)
}
