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

/// Builds the training loader (a seeded, with-replacement draw of `steps_per_epoch` batches
/// per epoch, reseeded past the epochs a resumed run skips) and the validation loader (a fixed
/// seeded sample of `eval_batches` batches).
macro_rules! loaders {
    ($config:expr, $session:expr, $device:expr, $batcher:expr, $train:expr, $valid:expr) => {
        loaders!(
            $config,
            $session,
            $device,
            $batcher.clone(),
            $train,
            $batcher,
            $valid
        )
    };
    ($config:expr, $session:expr, $device:expr,
     $train_batcher:expr, $train:expr, $valid_batcher:expr, $valid:expr) => {{
        let train = &$config.train;
        let valid_size =
            (train.eval_batches * train.batch_size).min(burn::data::dataset::Dataset::len(&$valid));
        let loader_train = burn::data::dataloader::DataLoaderBuilder::new($train_batcher)
            .batch_size(train.batch_size)
            .num_workers(train.num_workers)
            .set_device($device.clone())
            .build(burn::data::dataset::transform::SamplerDataset::new(
                $train,
                burn::data::dataset::transform::SamplerDatasetOptions::default()
                    .with_replacement()
                    .with_fixed_size(train.steps_per_epoch * train.batch_size)
                    .with_seed($config.seed + $session.start as u64),
            ));
        let loader_valid = burn::data::dataloader::DataLoaderBuilder::new($valid_batcher)
            .batch_size(train.batch_size)
            .num_workers(train.num_workers)
            .set_device($device.clone())
            .build(burn::data::dataset::transform::SamplerDataset::new(
                $valid,
                burn::data::dataset::transform::SamplerDatasetOptions::default()
                    .with_fixed_size(valid_size)
                    .with_seed($config.seed ^ 0x5eed),
            ));
        (loader_train, loader_valid)
    }};
}

mod classify;
mod lm;
mod optim;
mod renderer;
mod schedule;
mod seq2seq;

pub use classify::{TrainedClassifier, TrainedVit};
pub use lm::{evaluate, Corpus, Trained};
pub use optim::{clip_global_norm, reference_adamw, LabAdamW, ReferenceOptimizer};
pub use renderer::{PlainRenderer, Throughput};
pub use schedule::WarmupSchedule;
pub use seq2seq::{TrainedTranslator, TranslationData};

use crate::artifact::{ArtifactDir, ArtifactRecorder};
use crate::config::{ExperimentConfig, ModelConfig};
use crate::data::Tokenizer;
use crate::kernels::{LabAutodiff, LabBackend};
use anyhow::{bail, Context, Result};
use burn::data::dataloader::DataLoader;
use burn::module::{AutodiffModule, Module};
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::{AccuracyMetric, LearningRateMetric, LossMetric, PerplexityMetric};
use burn::train::{ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainStep};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

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

/// Runs (or resumes) a training and writes its artifacts.
pub fn train<B: LabAutodiff>(request: TrainRequest, device: B::Device) -> Result<TrainReport> {
    let (config, tokenizers, start) = prepare_artifact(&request)?;
    let session = Session {
        artifact: request.artifact.clone(),
        start: start.unwrap_or(0),
        plain: request.plain,
    };
    let data_dir = &request.data_dir;
    match &config.model {
        ModelConfig::Lm(_) => lm::train::<B>(config, tokenizers, &session, data_dir, device),
        ModelConfig::Seq2seq(_) => {
            seq2seq::train::<B>(config, tokenizers, &session, data_dir, device)
        }
        ModelConfig::Classifier(_) => {
            classify::train_text::<B>(config, tokenizers, &session, data_dir, device)
        }
        ModelConfig::Vit(_) => classify::train_vit::<B>(config, &session, data_dir, device),
    }
}

/// Where a training writes and where it starts.
pub(crate) struct Session {
    artifact: ArtifactDir,
    /// Epochs already done (0 for a fresh run).
    start: usize,
    plain: bool,
}

impl Session {
    /// Saves the resolved config and the tokenizers of a fresh run, and refuses to resume a
    /// run that already finished.
    fn begin(&self, config: &ExperimentConfig, tokenizers: Option<&Tokenizers>) -> Result<()> {
        if self.start == 0 {
            config.save(&self.artifact.config())?;
            if let Some(tokenizers) = tokenizers {
                tokenizers.save(&self.artifact)?;
            }
        }
        if self.start >= config.train.epochs() {
            bail!(
                "{} already finished all {} steps; use --force to start over",
                self.artifact.root().display(),
                config.train.steps
            );
        }
        Ok(())
    }
}

/// The training and validation loaders of a model trained through [`launch`].
pub(crate) type Loaders<B, M> = (
    Arc<dyn DataLoader<B, <M as TrainStep>::Input>>,
    Arc<
        dyn DataLoader<
            <B as AutodiffBackend>::InnerBackend,
            <<M as AutodiffModule<B>>::InnerModule as InferenceStep>::Input,
        >,
    >,
);

/// Trains `model` through burn-train's Learner — AdamW with decay on matrices only, global-norm
/// clipping, the configured warmup schedule, loss/accuracy/perplexity/LR metrics, a checkpoint
/// per epoch (restored on resume) — and writes the final weights to `model.mpk`.
///
/// `pad` is the padding id that accuracy (and perplexity) skip; `perplexity` is for token
/// predictors, not sentence or image classifiers; `throughput` feeds the speed reports.
pub(crate) fn launch<B, M>(
    config: &ExperimentConfig,
    session: &Session,
    model: M,
    loaders: Loaders<B, M>,
    pad: Option<usize>,
    perplexity: bool,
    throughput: Throughput,
) -> Result<TrainReport>
where
    B: LabAutodiff,
    M: TrainStep<Output = ClassificationOutput<B>>
        + AutodiffModule<B>
        + core::fmt::Display
        + 'static,
    M::InnerModule: InferenceStep<Output = ClassificationOutput<B::InnerBackend>>,
{
    let train = &config.train;
    let artifact = &session.artifact;
    let optimizer = reference_adamw::<B, M>(train);
    let schedule = WarmupSchedule::from_config(train);

    let accuracy = || match pad {
        Some(pad) => AccuracyMetric::new().with_pad_token(pad),
        None => AccuracyMetric::new(),
    };
    let perplexity_metric = || match pad {
        Some(pad) => PerplexityMetric::new().with_pad_token(pad),
        None => PerplexityMetric::new(),
    };
    let mut training = SupervisedTraining::new(artifact.root(), loaders.0, loaders.1)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_train_numeric(accuracy())
        .metric_valid_numeric(accuracy());
    if perplexity {
        training = training
            .metric_train_numeric(perplexity_metric())
            .metric_valid_numeric(perplexity_metric());
    }
    let mut training = training
        .metric_train_numeric(LearningRateMetric::new())
        .with_file_checkpointer(ArtifactRecorder::default())
        .num_epochs(train.epochs())
        .summary();
    if session.start > 0 {
        training = training.checkpoint(session.start);
    }
    if session.plain || !std::io::stdout().is_terminal() {
        training = training.renderer(PlainRenderer::new(
            train.steps_per_epoch,
            train.steps,
            throughput,
        ));
    }
    println!(
        "training {} ({} parameters) for {} steps{}; artifacts in {}",
        config.name,
        model.num_params(),
        train.steps,
        if session.start > 0 {
            format!(
                ", resuming after step {}",
                session.start * train.steps_per_epoch
            )
        } else {
            String::new()
        },
        artifact.root().display()
    );

    let began = Instant::now();
    let result = training.launch(Learner::new(model, optimizer, schedule));
    let seconds = began.elapsed().as_secs_f64();
    result
        .model
        .save_file(artifact.model(), &ArtifactRecorder::default())
        .with_context(|| format!("cannot write {}", artifact.model().display()))?;

    let finished = artifact.latest_checkpoint().unwrap_or(session.start);
    let steps = finished.saturating_sub(session.start) * train.steps_per_epoch;
    Ok(TrainReport {
        steps,
        seconds,
        per_second: (steps * throughput.per_step) as f64 / seconds,
        unit: throughput.unit,
        use_with: config.model.command(),
    })
}

/// Checks the artifact directory against the request and returns the config to train, the
/// tokenizers to reuse and the epoch to resume after (`None` for a fresh run).
fn prepare_artifact(
    request: &TrainRequest,
) -> Result<(ExperimentConfig, Option<Tokenizers>, Option<usize>)> {
    let artifact = &request.artifact;
    if request.resume {
        if !artifact.config().exists() {
            bail!(
                "--resume: {} holds no run to resume (no config.json)",
                artifact.root().display()
            );
        }
        let saved = ExperimentConfig::load(&artifact.config())?;
        if let Some(asked) = &request.config {
            let mut asked = asked.clone();
            let (source, target) = saved.model.vocab_sizes();
            asked.model.set_vocab_sizes(source, target);
            if asked != saved {
                bail!(
                    "--resume: the experiment given differs from the one {} was trained with; \
                     resume without --experiment, or start a new run elsewhere",
                    artifact.root().display()
                );
            }
        }
        let tokenizers = if saved.model.reads_text() {
            Some(Tokenizers::open(artifact, &saved)?)
        } else {
            None
        };
        let epoch = artifact.latest_checkpoint().unwrap_or(0);
        return Ok((saved, tokenizers, Some(epoch)));
    }
    if artifact.holds_run() {
        if !request.force {
            bail!(
                "{} already holds a run; pass --resume to continue it or --force to replace it",
                artifact.root().display()
            );
        }
        artifact.clear()?;
    }
    let config = match &request.config {
        Some(config) => config.clone(),
        None => ExperimentConfig::parse(crate::cli::DEFAULT_EXPERIMENT)
            .expect("the default experiment parses (tested)"),
    };
    config.validate()?;
    Ok((config, None, None))
}
