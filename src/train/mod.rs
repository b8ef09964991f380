//! Training through burn-train's `Learner`, generic over the model: one wiring function,
//! [`launch`], that every model kind trains through, with the deterministic loaders, checkpoints,
//! schedule and optimizer it uses. Each kind's steps are `supervised_steps!` of its
//! `ModelKind::loss` in `kinds/`.

mod checkpoint;
pub mod config;
mod loader;
mod metrics;
mod optim;
pub mod parallel;
mod perplexity;
mod preflight;
pub use preflight::AlreadyFinished;
mod renderer;
mod run;
mod schedule;
pub mod speed;
pub mod stop;
mod strategy;

pub use checkpoint::{prune, KeepCheckpoints, Patience, ValidLosses};
pub use loader::{
    mix, padding_fraction, replacement_batches, replacement_batches_in_groups, unseeded, BatchFn,
    Draw, EpochIter, EpochLoader,
};
pub use optim::{
    clip_global_norm, reference_adamw, AllAtOnce, LabAdamW, ReferenceOptimizer, NAN_ENV,
};
pub use perplexity::{batch_nll, EpochPerplexity, NllSums};
pub use renderer::{PlainRenderer, Throughput};
pub use run::{launch, train_loader, LaunchOptions, Session};
pub use schedule::WarmupSchedule;
pub use strategy::{StepMarker, StepPoint, PAUSE_STEP_SAVE_ENV};

use crate::artifact::{ArtifactDir, Tokenizers};
use crate::config::ExperimentConfig;
use anyhow::Result;
use std::path::{Path, PathBuf};

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
    /// The precision of the products, replacing the experiment's (a resumed run keeps its
    /// own: a different one is an error).
    pub precision: Option<crate::kernels::Precision>,
    /// The peak learning rate, replacing the experiment's for this invocation (also on
    /// resume); `min_lr` is scaled with it.
    pub lr: Option<f64>,
    /// The devices to train on, replacing the experiment's `train.devices` (also on resume).
    pub devices: Option<Vec<usize>>,
    /// The machines, when the run spans several (this process is one node).
    pub nodes: Option<parallel::NodeGroup>,
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
    /// What the validation figures are computed over ("1280 of 111284 validation examples").
    pub valid_over: String,
    /// Why `metrics.csv` stopped being written, if it did (a full disk).
    pub metrics_failure: Option<String>,
    /// The step whose checkpoint a stopped run saved (`Outcome::Interrupted`).
    pub saved_step: Option<usize>,
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
    /// Stopped on request (SIGTERM, SIGINT, the dashboard's `q`) after a step whose checkpoint
    /// was saved (`saved_step`); no `model.mpk`, `--resume` continues from that step.
    Interrupted,
}

/// Runs (or resumes) a training and writes its artifacts: checks the request before anything
/// is touched, then `train_kind` (the kind's own training, which begins the [`Session`] once its
/// data and tokenizers are ready) with the config to train and the tokenizers to reuse.
pub fn run(
    request: TrainRequest,
    train_kind: impl FnOnce(
        ExperimentConfig,
        Option<Tokenizers>,
        &Session,
        &Path,
    ) -> Result<TrainReport>,
) -> Result<TrainReport> {
    preflight::recover_replaced_run(&request.artifact)?;
    let (config, tokenizers) = preflight::prepare_artifact(&request)?;
    let session = Session::new(&request);
    let result = train_kind(config, tokenizers, &session, &request.data_dir);
    session.end(result)
}
