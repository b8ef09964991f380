//! Training through burn-train's `Learner`: the model's train/validation steps and one wiring
//! function that builds data, model, optimizer and schedule from an [`ExperimentConfig`].

mod optim;
mod renderer;
mod schedule;

pub use optim::{clip_global_norm, ReferenceOptimizer};
pub use renderer::PlainRenderer;
pub use schedule::WarmupCosine;

use crate::artifact::{ArtifactDir, ArtifactRecorder};
use crate::config::ExperimentConfig;
use crate::data::{CharTokenizer, DatasetSpec, LmBatcher, TokenWindows};
use crate::models::{LanguageModel, LmBatch};
use anyhow::{bail, Context, Result};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::transform::{SamplerDataset, SamplerDatasetOptions};
use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::{AccuracyMetric, LearningRateMetric, LossMetric, PerplexityMetric};
use burn::train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

impl<B: AutodiffBackend> TrainStep for LanguageModel<B> {
    type Input = LmBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let (loss, output, targets) = self.loss(batch);
        let grads = loss.backward();
        TrainOutput::new(
            self,
            grads,
            ClassificationOutput {
                loss,
                output,
                targets,
            },
        )
    }
}

impl<B: Backend> InferenceStep for LanguageModel<B> {
    type Input = LmBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> ClassificationOutput<B> {
        let (loss, output, targets) = self.loss(batch);
        ClassificationOutput {
            loss,
            output,
            targets,
        }
    }
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
    /// Training tokens per second over that wall time.
    pub tokens_per_second: f64,
}

/// Tokenized train and validation splits of the experiment's text.
pub struct Corpus {
    /// The tokenizer (fit on the training split, or the artifact's on resume).
    pub tokenizer: CharTokenizer,
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
        data_dir: &std::path::Path,
        tokenizer: Option<CharTokenizer>,
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
        let tokenizer = tokenizer.unwrap_or_else(|| CharTokenizer::fit(&train_text));
        let encode = |text: &str, part: &str| -> Result<Arc<Vec<u32>>> {
            let ids = tokenizer.encode(text).with_context(|| {
                format!("cannot tokenize the {part} split of {}", path.display())
            })?;
            Ok(Arc::new(ids.into_iter().map(|id| id as u32).collect()))
        };
        let train = encode(&train_text, "training")?;
        let valid = encode(&valid_text, "validation")?;
        let context = config.model.context;
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

/// Runs (or resumes) a training and writes its artifacts.
pub fn train<B: AutodiffBackend>(request: TrainRequest, device: B::Device) -> Result<TrainReport> {
    let artifact = &request.artifact;
    let (mut config, tokenizer, start_epoch) = prepare_artifact(&request)?;
    let corpus = Corpus::load(&config, &request.data_dir, tokenizer)?;
    config.model.vocab_size = corpus.tokenizer.vocab_size();
    if start_epoch.is_none() {
        config.save(&artifact.config())?;
        corpus.tokenizer.save(&artifact.tokenizer())?;
    }
    let start = start_epoch.unwrap_or(0);
    let train = &config.train;
    if start >= train.epochs() {
        bail!(
            "{} already finished all {} steps; use --force to start over",
            artifact.root().display(),
            train.steps
        );
    }

    B::seed(&device, config.seed);
    // Each epoch draws fresh random windows; a resumed run reseeds past the epochs it skips.
    let sampler = |tokens: &Arc<Vec<u32>>, batches: usize, seed: u64| {
        SamplerDataset::new(
            TokenWindows::new(tokens.clone(), config.model.context),
            SamplerDatasetOptions::default()
                .with_replacement()
                .with_fixed_size(batches * train.batch_size)
                .with_seed(seed),
        )
    };
    let loader_train = DataLoaderBuilder::new(LmBatcher)
        .batch_size(train.batch_size)
        .num_workers(train.num_workers)
        .set_device(device.clone())
        .build(sampler(
            &corpus.train,
            train.steps_per_epoch,
            config.seed + start as u64,
        ));
    let loader_valid = DataLoaderBuilder::new(LmBatcher)
        .batch_size(train.batch_size)
        .num_workers(train.num_workers)
        .set_device(device.clone())
        .build(sampler(
            &corpus.valid,
            train.eval_batches,
            config.seed ^ 0x5eed,
        ));

    let model: LanguageModel<B> = config.model.init(&device);
    // AdamW as in PyTorch/nanoGPT: decay on matrices only, clipping by the global norm.
    let adamw = AdamWConfig::new()
        .with_beta_1(train.beta1)
        .with_beta_2(train.beta2)
        .with_epsilon(train.epsilon)
        .with_weight_decay(0.0)
        .init();
    let optimizer = ReferenceOptimizer::new(adamw, train.weight_decay as f64, train.grad_clip);
    let schedule = WarmupCosine::new(
        train.lr,
        train.min_lr,
        train.warmup_steps,
        train.decay_steps(),
    );

    let mut training = SupervisedTraining::new(artifact.root(), loader_train, loader_valid)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_train_numeric(AccuracyMetric::new())
        .metric_valid_numeric(AccuracyMetric::new())
        .metric_train_numeric(PerplexityMetric::new())
        .metric_valid_numeric(PerplexityMetric::new())
        .metric_train_numeric(LearningRateMetric::new())
        .with_file_checkpointer(ArtifactRecorder::default())
        .num_epochs(train.epochs())
        .summary();
    if start > 0 {
        training = training.checkpoint(start);
    }
    let tokens_per_step = train.batch_size * config.model.context;
    if request.plain || !std::io::stdout().is_terminal() {
        training = training.renderer(PlainRenderer::new(
            train.steps_per_epoch,
            train.steps,
            tokens_per_step,
        ));
    }
    println!(
        "training {} ({} parameters) for {} steps on {:?}{}; artifacts in {}",
        config.name,
        model.num_params(),
        train.steps,
        device,
        if start > 0 {
            format!(", resuming after step {}", start * train.steps_per_epoch)
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

    let finished = artifact.latest_checkpoint().unwrap_or(start);
    let steps = finished.saturating_sub(start) * train.steps_per_epoch;
    Ok(TrainReport {
        steps,
        seconds,
        tokens_per_second: (steps * tokens_per_step) as f64 / seconds,
    })
}

/// Checks the artifact directory against the request and returns the config to train, the
/// tokenizer to reuse and the epoch to resume after (`None` for a fresh run).
fn prepare_artifact(
    request: &TrainRequest,
) -> Result<(ExperimentConfig, Option<CharTokenizer>, Option<usize>)> {
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
            asked.model.vocab_size = saved.model.vocab_size;
            if asked != saved {
                bail!(
                    "--resume: the experiment given differs from the one {} was trained with; \
                     resume without --experiment, or start a new run elsewhere",
                    artifact.root().display()
                );
            }
        }
        let tokenizer = CharTokenizer::load(&artifact.tokenizer())?;
        let epoch = artifact.latest_checkpoint().unwrap_or(0);
        return Ok((saved, Some(tokenizer), Some(epoch)));
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
    let config = request.config.clone().unwrap_or_else(|| {
        serde_json::from_str(crate::cli::DEFAULT_EXPERIMENT)
            .expect("the default experiment parses (tested)")
    });
    config.validate()?;
    Ok((config, None, None))
}

/// A model in inference mode with the tokenizer and config it was trained with.
pub struct Trained<B: Backend> {
    /// The model.
    pub model: LanguageModel<B>,
    /// Its tokenizer.
    pub tokenizer: CharTokenizer,
    /// Its resolved config.
    pub config: ExperimentConfig,
}

impl<B: Backend> Trained<B> {
    /// Loads what `train` wrote in `artifact`.
    pub fn load(artifact: &ArtifactDir, device: &B::Device) -> Result<Self> {
        let weights = artifact.weights()?;
        let config = ExperimentConfig::load(&artifact.config())?;
        let tokenizer = CharTokenizer::load(&artifact.tokenizer())?;
        if config.model.vocab_size != tokenizer.vocab_size() {
            bail!(
                "{}: config.json has vocab_size {} but tokenizer.json has {} tokens",
                artifact.root().display(),
                config.model.vocab_size,
                tokenizer.vocab_size()
            );
        }
        let model =
            crate::artifact::load_weights(config.model.init::<B>(device), &weights, device)?;
        Ok(Self {
            model,
            tokenizer,
            config,
        })
    }
}

/// Validation loss and perplexity over every non-overlapping window of the validation split.
pub fn evaluate<B: Backend>(
    trained: &Trained<B>,
    data_dir: &std::path::Path,
    batch_size: usize,
    device: &B::Device,
) -> Result<(f64, f64, usize)> {
    let corpus = Corpus::load(&trained.config, data_dir, Some(trained.tokenizer.clone()))?;
    let windows = TokenWindows::non_overlapping(corpus.valid, trained.config.model.context);
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
