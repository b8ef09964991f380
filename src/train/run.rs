//! One training invocation from start to end: what is checked before anything is touched, how
//! a previous run is replaced (moved aside, never deleted before the new run has a complete
//! checkpoint), which checkpoint a resumed run starts from, and the Learner wiring.

use super::checkpoint::{prune, KeepCheckpoints, Patience, ValidLosses};
use super::loader::{BatchFn, Draw, EpochLoader};
use super::metrics::{CsvLogger, Divergence, EpochCorrected, Logged};
use super::parallel::{peer_numbers, AnyPeers, NodeGroup, PeerThreads, Peers, ShardFn, ShardIter};
use super::perplexity::{EpochPerplexity, NllSums};
use super::stop::StopRequest;
use super::strategy::{
    remove_step_checkpoints, remove_superseded_steps, StepMarker, StepPoint, StepStrategy,
};
use super::{
    reference_adamw, Outcome, PlainRenderer, Throughput, Tokenizers, TrainReport, TrainRequest,
    WarmupSchedule,
};
use crate::artifact::{
    catch_silently, load_weights, ArtifactDir, ArtifactRecorder, CheckpointWatch,
};
use crate::config::ExperimentConfig;
use crate::kernels::LabAutodiff;
use anyhow::{bail, Result};
use burn::data::dataloader::DataLoader;
use burn::data::dataset::Dataset;
use burn::lr_scheduler::LrScheduler;
use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::record::Recorder;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::train::logger::FileMetricLogger;
use burn::train::metric::{AccuracyMetric, LearningRateMetric, LossMetric};
use burn::train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainStep, TrainingStrategy,
};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// The training and validation loaders of a model trained through [`launch`].
pub type Loaders<B, M> = (
    Arc<dyn DataLoader<B, <M as TrainStep>::Input>>,
    Arc<
        dyn DataLoader<
            <B as AutodiffBackend>::InnerBackend,
            <<M as AutodiffModule<B>>::InnerModule as InferenceStep>::Input,
        >,
    >,
    Option<AnyPeers>,
);

/// A training loader and a validation loader (on the inner backend).
type LoaderPair<B, O, OV> = (
    Arc<dyn DataLoader<B, O>>,
    Arc<dyn DataLoader<<B as AutodiffBackend>::InnerBackend, OV>>,
    Option<AnyPeers>,
);

/// Where a training writes, and what its parts share while it runs.
pub struct Session {
    pub(super) artifact: ArtifactDir,
    resume: bool,
    plain: bool,
    /// Epochs done: the epoch a resumed run starts after, then counted up by the training
    /// loader as epochs begin.
    epoch: Arc<AtomicUsize>,
    /// Batches the training loader skips at the next epoch's start (a run resumed mid-epoch).
    skip: Arc<AtomicUsize>,
    watch: Arc<CheckpointWatch>,
    /// The validation examples each epoch is judged on, of how many (set by `loaders`).
    valid_sample: OnceLock<(usize, usize)>,
    /// The machines of a run across several.
    nodes: Option<NodeGroup>,
}

impl Session {
    pub(super) fn new(request: &TrainRequest) -> Self {
        Self {
            artifact: request.artifact.clone(),
            resume: request.resume,
            plain: request.plain,
            epoch: Arc::new(AtomicUsize::new(0)),
            skip: Arc::new(AtomicUsize::new(0)),
            watch: Arc::new(CheckpointWatch::new()),
            valid_sample: OnceLock::new(),
            nodes: request.nodes.clone(),
        }
    }

    /// The machines of a run across several.
    pub fn nodes(&self) -> Option<&NodeGroup> {
        self.nodes.as_ref()
    }

    /// What the validation figures of a training run are computed over, for the lines that
    /// print them: "1280 of 111284 validation examples" (the same ones every epoch).
    pub fn valid_over(&self) -> String {
        match self.valid_sample.get() {
            Some(&(items, total)) if items == total => {
                format!("all {}", crate::stdio::count(total, "validation example"))
            }
            Some(&(items, total)) => format!("{items} of {total} validation examples"),
            None => "the validation examples".to_string(),
        }
    }

    /// Called once the data and tokenizers are ready, before the first write: checks what is
    /// left to check (memory, a writable directory), moves a replaced run aside, and saves the
    /// resolved config and tokenizers of a fresh run.
    ///
    /// `activation_floats` is what one example keeps for the backward pass (the memory check's
    /// lower bound, from the model kind).
    pub fn begin(
        &self,
        config: &ExperimentConfig,
        tokenizers: Option<&Tokenizers>,
        activation_floats: f64,
    ) -> Result<()> {
        super::preflight::check_memory(config, activation_floats)?;
        let artifact = &self.artifact;
        let previous = !self.resume && artifact.holds_run();
        artifact.check_writable()?;
        let partial = artifact.remove_partial_files();
        if partial > 0 {
            println!("removed {partial} half-written file(s) an interrupted run left behind");
        }
        if self.resume {
            return Ok(());
        }
        if previous {
            // Only with --force (checked before): kept until this run has a checkpoint.
            let aside = artifact.move_run_aside()?;
            println!(
                "the previous run in {} is kept in {} until this run's first checkpoint is complete",
                artifact.root().display(),
                aside.display()
            );
            self.watch.set_replaced(artifact.clone(), aside);
            artifact.check_writable()?;
        }
        config.save(&artifact.config())?;
        config.save(&artifact.trained_config())?;
        if let Some(tokenizers) = tokenizers {
            tokenizers.save(artifact)?;
        }
        Ok(())
    }

    /// The training loader (`steps_per_epoch · grad_accumulation` batches drawn with
    /// replacement, fresh every epoch) and the validation loader (the same `eval_batches`
    /// batches every epoch), both reproducible from the seed and the epoch alone.
    #[allow(clippy::too_many_arguments)]
    pub fn loaders<B, I, O, IV, OV>(
        &self,
        config: &ExperimentConfig,
        devices: &[B::Device],
        train_set: impl Dataset<I> + 'static,
        train_batch: BatchFn<B, I, O>,
        valid_set: impl Dataset<IV> + 'static,
        valid_batch: BatchFn<B::InnerBackend, IV, OV>,
        lengths: Option<Vec<usize>>,
    ) -> LoaderPair<B, O, OV>
    where
        B: AutodiffBackend,
        I: Send + Sync + 'static,
        O: Send + 'static,
        IV: Send + Sync + 'static,
        OV: Send + 'static,
    {
        let train = &config.train;
        let valid_items = (train.eval_batches * train.batch_size).min(valid_set.len());
        let _ = self.valid_sample.set((valid_items, valid_set.len()));
        let device = &devices[0];
        let loader_train = train_loader(
            config,
            device,
            train_set,
            train_batch,
            self.epoch.clone(),
            lengths,
        )
        .skipping(self.skip.clone())
        .after_checkpoints(self.watch.clone());
        // Data-parallel: every peer (of every node) reads its own share of each batch.
        let local = devices.len();
        let (first, count) = peer_numbers(self.nodes.as_ref(), local);
        let peers = (count > 1).then(|| {
            let shards = (1..local)
                .map(|peer| {
                    let shard =
                        loader_train
                            .clone()
                            .shard(first + peer, count, devices[peer].clone());
                    Arc::new(move |epoch, skip| {
                        Box::new(shard.epoch_iter(epoch, skip)) as ShardIter<O>
                    }) as ShardFn<O>
                })
                .collect();
            Arc::new(Peers::<B, O> {
                devices: devices.to_vec(),
                shards,
                group: self.nodes.clone(),
                identity: identity(config),
            }) as AnyPeers
        });
        let loader_train = loader_train.shard(first, count, device.clone());
        let loader_valid = EpochLoader::new(
            valid_set,
            valid_batch,
            device.clone(),
            Draw::Fixed { items: valid_items },
            train.batch_size,
            train.num_workers,
            config.seed ^ 0x5eed,
            Arc::new(AtomicUsize::new(0)),
        )
        .after_checkpoints(self.watch.clone());
        (Arc::new(loader_train), Arc::new(loader_valid), peers)
    }

    /// After training (or its failure): a run moved aside by `--force` comes back if the new
    /// run never completed a checkpoint.
    pub(super) fn end(&self, result: Result<TrainReport>) -> Result<TrainReport> {
        if self.watch.take_replaced().is_some() {
            match self.artifact.settle_replaced_run() {
                Ok(true) => eprintln!(
                    "the previous run in {} was put back",
                    self.artifact.root().display()
                ),
                Ok(false) => {}
                Err(err) => eprintln!("warning: {err:#}"),
            }
        }
        result
    }
}

/// Where a run starts.
#[derive(Clone, Copy, Debug)]
enum Start {
    /// From the initial weights.
    Fresh,
    /// After epoch `E`'s checkpoint.
    Epoch(usize),
    /// From a mid-epoch checkpoint.
    Step(StepMarker),
}

impl Start {
    fn point(&self, steps_per_epoch: usize) -> StepPoint {
        match self {
            Start::Fresh => StepPoint::after_epoch(0, steps_per_epoch),
            Start::Epoch(epoch) => StepPoint::after_epoch(*epoch, steps_per_epoch),
            Start::Step(marker) => marker.point,
        }
    }
}

/// The newest checkpoint — an epoch's, or a mid-epoch one — whose model, optimizer and
/// scheduler files all load, saying which newer ones were skipped and why.
#[allow(clippy::too_many_arguments)]
fn newest_loadable<B, M, O, S>(
    artifact: &ArtifactDir,
    model: &M,
    _optimizer: &O,
    _schedule: &S,
    steps_per_epoch: usize,
    device: &B::Device,
    at_most: Option<usize>,
) -> Result<Start>
where
    B: LabAutodiff,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
    S: LrScheduler,
{
    let epochs = artifact.complete_checkpoints();
    // Newest first; of an epoch's checkpoint and a mid-epoch one at the same step (stopped
    // after the epoch's last step, before its validation), the epoch's has done more.
    let mut candidates: Vec<(usize, bool, String)> = epochs
        .iter()
        .map(|&e| (e * steps_per_epoch, true, e.to_string()))
        .chain(
            artifact
                .step_checkpoints()
                .into_iter()
                .map(|s| (s, false, format!("step-{s}"))),
        )
        .filter(|c| at_most.is_none_or(|limit| c.0 <= limit))
        .collect();
    candidates.sort_by_key(|c| std::cmp::Reverse((c.0, c.1)));
    let mut reasons = Vec::new();
    for (step, is_epoch, suffix) in &candidates {
        let file = |kind: &str| artifact.checkpoints().join(format!("{kind}-{suffix}"));
        let first_line = |e: &dyn std::fmt::Display| {
            e.to_string().lines().next().unwrap_or_default().to_string()
        };
        let check = || -> std::result::Result<(), String> {
            load_weights(model.clone(), &file("model"), device).map_err(|e| first_line(&e))?;
            let recorder = ArtifactRecorder::default();
            quietly(|| {
                recorder
                    .load::<O::Record>(file("optim"), device)
                    .map(|_| ())
            })
            .map_err(|e| format!("{}.mpk: {}", file("optim").display(), first_line(&e)))?;
            quietly(|| {
                recorder
                    .load::<S::Record<B>>(file("scheduler"), device)
                    .map(|_| ())
            })
            .map_err(|e| format!("{}.mpk: {}", file("scheduler").display(), first_line(&e)))
        };
        let start = check().and_then(|()| match is_epoch {
            true => Ok(Start::Epoch(step / steps_per_epoch)),
            false => StepMarker::load(artifact, *step)
                .map(Start::Step)
                .map_err(|e| format!("{e:#}")),
        });
        match start {
            Ok(start) => {
                for reason in &reasons {
                    eprintln!("warning: {reason}");
                }
                return Ok(start);
            }
            Err(why) if *is_epoch => reasons.push(format!(
                "skipped the checkpoint of epoch {} (step {step}): {why}",
                step / steps_per_epoch
            )),
            Err(why) => reasons.push(format!("skipped the checkpoint of step {step}: {why}")),
        }
    }
    if candidates.is_empty() {
        return Ok(Start::Fresh);
    }
    bail!(
        "none of the {} checkpoints in {} can be loaded; {}",
        candidates.len(),
        artifact.checkpoints().display(),
        reasons.join("; ")
    )
}

/// Runs `load`, turning a panic (a record burn cannot map) into an error without printing it.
fn quietly<T>(
    load: impl FnOnce() -> std::result::Result<T, burn::record::RecorderError>,
) -> std::result::Result<T, String> {
    match catch_silently(load) {
        Some(Ok(value)) => Ok(value),
        Some(Err(err)) => Err(err.to_string()),
        None => Err("its content does not match this model".into()),
    }
}

/// What a training reports beside its loss, and what a step consumes.
#[derive(Clone, Copy, Debug)]
pub struct LaunchOptions {
    /// The padding id that accuracy and perplexity skip (targets of varying length).
    pub pad: Option<usize>,
    /// Whether perplexity is reported (token predictors; not sentence or image classifiers).
    pub perplexity: bool,
    /// What a step consumes, for the speed reports.
    pub throughput: Throughput,
}

impl LaunchOptions {
    /// A model that scores whole items (sentences, images, pairs), `per_step` a step, `unit` /
    /// `units` in the speed reports (`"img"`, `"images"`): no perplexity, nothing padded.
    pub fn items(per_step: usize, unit: &'static str, units: &'static str) -> Self {
        Self {
            pad: None,
            perplexity: false,
            throughput: Throughput {
                per_step,
                unit,
                units,
            },
        }
    }

    /// A model that predicts tokens, about `per_step` a step (`units` in `bench train`'s
    /// report): perplexity reported.
    pub fn tokens(per_step: usize, units: &'static str) -> Self {
        Self {
            perplexity: true,
            ..Self::items(per_step, "tok", units)
        }
    }

    /// The same, accuracy and perplexity skipping the targets' padding `pad`.
    pub fn padded(self, pad: usize) -> Self {
        Self {
            pad: Some(pad),
            ..self
        }
    }
}

/// Trains `model` through burn-train's Learner — AdamW with decay on matrices only, global-norm
/// clipping, the configured warmup schedule, loss/accuracy/perplexity/LR metrics, a checkpoint
/// per epoch (the newest loadable one restored on resume; the last `keep_checkpoints` and the
/// best kept), optional early stopping — and writes the final weights to `model.mpk` once
/// every step is trained.
pub fn launch<B, M>(
    config: &ExperimentConfig,
    session: &Session,
    model: M,
    loaders: Loaders<B, M>,
    options: LaunchOptions,
) -> Result<TrainReport>
where
    B: LabAutodiff,
    M: TrainStep<Output = ClassificationOutput<B>>
        + AutodiffModule<B>
        + core::fmt::Display
        + 'static,
    M::InnerModule: InferenceStep<Output = ClassificationOutput<B::InnerBackend>>,
{
    let LaunchOptions {
        pad,
        perplexity,
        mut throughput,
    } = options;
    let train = &config.train;
    // A kind counts one batch's items; an optimizer step learns from several batches.
    throughput.per_step *= train.grad_accumulation;
    let artifact = &session.artifact;
    let optimizer = reference_adamw::<B, M>(train);
    let schedule = WarmupSchedule::from_config(train);
    let epochs = train.epochs();
    let device = model.devices()[0].clone();
    let spe = train.steps_per_epoch;
    let newest = |at_most| {
        newest_loadable(
            artifact, &model, &optimizer, &schedule, spe, &device, at_most,
        )
    };
    let mut resumed = if session.resume {
        newest(None)?
    } else {
        Start::Fresh
    };
    // Data-parallel: the other peers start, and across machines the nodes agree on what they
    // run and where they start: the newest checkpoint every node has (a node killed while
    // writing one may lack the newest).
    let peers = match &loaders.2 {
        Some(peers) => {
            let peers = peers
                .downcast_ref::<Peers<B, M::Input>>()
                .expect("the peers of a run are made for its model and batches");
            let (threads, start) = PeerThreads::<M>::start(peers, resumed.point(spe).step)
                .map_err(|err| anyhow::anyhow!(err))?;
            if start < resumed.point(spe).step {
                resumed = if start == 0 {
                    Start::Fresh
                } else {
                    newest(Some(start))?
                };
                if resumed.point(spe).step != start {
                    bail!(
                        "this node has no checkpoint of step {start}, the newest another node has: \
                         every node must resume from the same one"
                    );
                }
                println!("resuming after step {start}: the newest checkpoint every node has");
            }
            Some(Box::new(threads) as Box<dyn std::any::Any + Send>)
        }
        None => None,
    };
    let point = resumed.point(spe);
    // The epoch checkpoint the run starts after (or stands at).
    let start = point.epoch - 1;
    let losses = ValidLosses::load(artifact, start);
    let patience = train.early_stopping.as_ref().map(|e| e.patience);
    let stops_early = |epoch: usize| patience.is_some_and(|p| losses.no_improvement(epoch, p));
    let mut report = TrainReport {
        outcome: Outcome::Finished,
        epoch: start,
        epochs,
        steps_per_epoch: spe,
        valid_loss: None,
        best: None,
        steps: 0,
        seconds: 0.0,
        per_second: 0.0,
        unit: throughput.unit,
        use_with: config.model.command(),
        valid_over: session.valid_over(),
        metrics_failure: None,
        saved_step: None,
    };
    if let Start::Epoch(start) = resumed {
        if start >= epochs || stops_early(start) {
            // Killed between the last checkpoint and model.mpk: finish the job.
            let checkpoint = artifact.checkpoints().join(format!("model-{start}"));
            let model = load_weights(model, &checkpoint, &device)?;
            report.outcome = Outcome::WrittenFromCheckpoint;
            return finish(artifact, train, &losses, model, start, report);
        }
    }
    remove_superseded_steps(artifact, spe)?;
    session.epoch.store(start, Ordering::SeqCst);
    let interrupter = burn::train::Interrupter::new();
    let divergence = Divergence::new(interrupter.clone());
    let logged = Logged::default();
    let (csv, csv_failure) = CsvLogger::open(
        artifact,
        spe,
        point,
        losses.clone(),
        divergence.clone(),
        logged.clone(),
    )?;

    let accuracy = || match pad {
        Some(pad) => AccuracyMetric::new().with_pad_token(pad),
        None => AccuracyMetric::new(),
    };
    let train_perplexity = EpochPerplexity::new(
        pad,
        match resumed {
            Start::Step(marker) => marker.perplexity.unwrap_or_default(),
            _ => NllSums::default(),
        },
    );
    let strategy = StepStrategy {
        artifact: artifact.clone(),
        steps_per_epoch: spe,
        accumulation: train.grad_accumulation,
        resume: match resumed {
            Start::Step(marker) => Some(marker.point),
            _ => None,
        },
        every: train.checkpoint_every,
        request: StopRequest::installed().unwrap_or_default(),
        skip: session.skip.clone(),
        logged,
        perplexity: perplexity.then(|| train_perplexity.sums()),
        divergence: divergence.clone(),
        watch: session.watch.clone(),
        saved: Arc::default(),
        peers: Mutex::new(peers),
        failure: Arc::default(),
    };
    let failure = strategy.failure.clone();
    let saved = strategy.saved.clone();
    let mut training = SupervisedTraining::new(artifact.root(), loaders.0, loaders.1)
        .with_interrupter(interrupter)
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
        .with_metric_logger(EpochCorrected::new(
            FileMetricLogger::new(artifact.root()),
            spe,
            point.step,
        ))
        .with_metric_logger(csv)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_train_numeric(accuracy())
        .metric_valid_numeric(accuracy());
    if perplexity {
        training = training
            .metric_train_numeric(train_perplexity)
            .metric_valid_numeric(EpochPerplexity::new(pad, NllSums::default()));
    }
    let mut training = training
        .metric_train_numeric(LearningRateMetric::new())
        .with_file_checkpointer(ArtifactRecorder::watched(session.watch.clone()))
        .with_checkpointing_strategy(KeepCheckpoints::new(
            artifact.clone(),
            train.keep_checkpoints,
            losses.clone(),
            session.watch.clone(),
        ))
        .num_epochs(epochs)
        .summary();
    if let Some(patience) = patience {
        training = training.early_stopping(Patience::new(patience, losses.clone()));
    }
    if let Start::Epoch(start) = resumed {
        training = training.checkpoint(start);
    }
    if session.plain || !std::io::stdout().is_terminal() {
        training = training.renderer(PlainRenderer::new(
            spe,
            train.steps,
            throughput,
            session.valid_over(),
        ));
    }
    println!(
        "training {} ({} parameters) for {} steps{}{}; artifacts in {}",
        config.name,
        model.num_params(),
        train.steps,
        match train.grad_accumulation {
            1 => String::new(),
            n => format!(
                " of {n} batches of {} each (gradients accumulated)",
                train.batch_size
            ),
        },
        if point.step > 0 {
            format!(", resuming after step {}", point.step)
        } else {
            String::new()
        },
        artifact.root().display()
    );

    let began = Instant::now();
    let result = training.launch(Learner::new(model, optimizer, schedule));
    report.seconds = began.elapsed().as_secs_f64();
    let ended = Ended {
        failure: failure.lock().unwrap_or_else(|e| e.into_inner()).take(),
        saved: *saved.lock().unwrap_or_else(|e| e.into_inner()),
        metrics_failure: csv_failure.lock().unwrap_or_else(|e| e.into_inner()).take(),
        diverged_at: divergence.step(),
        model: result.model,
    };
    conclude(
        session,
        train,
        point,
        &losses,
        ended,
        throughput.per_step,
        report,
    )
}

/// How the Learner left a run.
struct Ended<M> {
    /// Why a data-parallel step failed, if one did.
    failure: Option<String>,
    /// The step whose checkpoint a stop request saved.
    saved: Option<usize>,
    /// Why `metrics.csv` stopped being written, if it did.
    metrics_failure: Option<String>,
    /// The step whose loss was not finite.
    diverged_at: Option<usize>,
    /// The weights it ended with.
    model: M,
}

/// After the Learner: the report of what the run did; an error naming how to continue when it
/// could not go on (a full disk, a diverged loss); `Interrupted` when stopped on request; and
/// for a run that trained every step (or stopped early), `model.mpk` written and the
/// checkpoints pruned.
fn conclude<B: crate::kernels::LabBackend, M: burn::module::Module<B>>(
    session: &Session,
    train: &crate::config::TrainConfig,
    point: StepPoint,
    losses: &ValidLosses,
    ended: Ended<M>,
    per_step: usize,
    mut report: TrainReport,
) -> Result<TrainReport> {
    let artifact = &session.artifact;
    let spe = train.steps_per_epoch;
    let start = point.epoch - 1;
    let done = artifact.latest_checkpoint().unwrap_or(start).max(start);
    report.epoch = done;
    report.steps = (ended.saved)
        .unwrap_or(done * spe)
        .saturating_sub(point.step);
    report.per_second = (report.steps * per_step) as f64 / report.seconds;
    report.valid_loss = losses.get(done);
    report.metrics_failure = ended.metrics_failure;
    if let Some(failure) = session.watch.failure() {
        let next = match artifact.latest_checkpoint() {
            Some(epoch) => format!(
                "the checkpoint of step {} is complete: free space (or fix the directory) and \
                 run `train --resume --artifact-dir {}`",
                epoch * spe,
                artifact.root().display()
            ),
            None => "no checkpoint was complete: free space (or fix the directory) and train \
                     again"
                .to_string(),
        };
        bail!("{failure}; training stopped, {next}");
    }
    if let Some(failure) = ended.failure {
        let next = match artifact.latest_checkpoint() {
            Some(epoch) => format!(
                "the checkpoint of step {} is complete: continue with `train --resume \
                 --artifact-dir {}`",
                epoch * spe,
                artifact.root().display()
            ),
            None => "no checkpoint was complete".to_string(),
        };
        bail!("data-parallel training failed on {failure}; {next}");
    }
    if let Some(step) = ended.diverged_at {
        bail!("{}", diverged(artifact, train, step)?);
    }
    if ended.saved.is_some() {
        report.outcome = Outcome::Interrupted;
        report.saved_step = ended.saved;
        return Ok(report);
    }
    let patience = train.early_stopping.as_ref().map(|e| e.patience);
    let stopped_early = patience.is_some_and(|p| losses.no_improvement(done, p));
    if done < train.epochs() && !stopped_early {
        // Stopped on request, but its step could not be saved (see the warning above).
        report.outcome = Outcome::Interrupted;
        return Ok(report);
    }
    if done < train.epochs() {
        report.outcome = Outcome::StoppedEarly;
    }
    finish(artifact, train, losses, ended.model, done, report)
}

/// Writes `model.mpk`, keeps the checkpoints `keep_checkpoints` and the best one ask for, and
/// removes the mid-epoch ones: the end of a run whose weights are those of epoch `epoch`.
fn finish<B: crate::kernels::LabBackend, M: burn::module::Module<B>>(
    artifact: &ArtifactDir,
    train: &crate::config::TrainConfig,
    losses: &ValidLosses,
    model: M,
    epoch: usize,
    mut report: TrainReport,
) -> Result<TrainReport> {
    write_model(artifact, model)?;
    report.valid_loss = losses.get(epoch);
    report.best = prune(artifact, train.keep_checkpoints, losses)?;
    remove_step_checkpoints(artifact, |_| true)?;
    Ok(report)
}

/// After a non-finite loss at `step`: removes the checkpoints written from that step's epoch on
/// (the metrics logger may see the loss after the epoch's checkpoint was written; those weights
/// are not finite) and says which checkpoint is kept and how to continue.
fn diverged(
    artifact: &ArtifactDir,
    train: &crate::config::TrainConfig,
    step: usize,
) -> Result<String> {
    let epoch = step.div_ceil(train.steps_per_epoch);
    // A mid-epoch checkpoint of the step before holds the weights that gave the bad loss.
    remove_step_checkpoints(artifact, |s| s + 1 >= step)?;
    for bad in artifact
        .complete_checkpoints()
        .into_iter()
        .filter(|&e| e >= epoch)
    {
        artifact.remove_checkpoint(bad)?;
    }
    let dir = artifact.root().display();
    let next = match artifact.latest_checkpoint() {
        Some(good) => format!(
            "the checkpoint of step {} is kept; continue it with a lower learning rate: \
             transformer-lab train --artifact-dir {dir} --resume --lr {:.1e}",
            good * train.steps_per_epoch,
            train.lr / 4.0
        ),
        None => format!(
            "no checkpoint came before it; train again with a lower learning rate (--lr {:.1e} \
             --force)",
            train.lr / 4.0
        ),
    };
    Ok(format!(
        "training diverged: the loss is not finite at step {step}; {next}"
    ))
}

fn write_model<B: crate::kernels::LabBackend, M: burn::module::Module<B>>(
    artifact: &ArtifactDir,
    model: M,
) -> Result<()> {
    use anyhow::Context;
    model
        .save_file(artifact.model(), &ArtifactRecorder::default())
        .with_context(|| format!("cannot write {}", artifact.model_file().display()))
}

/// The training loader of `config`: `steps_per_epoch · grad_accumulation` batches drawn with
/// replacement, fresh every epoch, grouped by length when the config asks and `lengths` are
/// given, the backend's generator and the dropout stream reseeded before each batch. `epoch`
/// counts the epochs begun.
pub fn train_loader<B, I, O>(
    config: &ExperimentConfig,
    device: &B::Device,
    train_set: impl Dataset<I> + 'static,
    train_batch: BatchFn<B, I, O>,
    epoch: Arc<AtomicUsize>,
    lengths: Option<Vec<usize>>,
) -> EpochLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + 'static,
    O: Send + 'static,
{
    let train = &config.train;
    let loader = EpochLoader::new(
        train_set,
        train_batch,
        device.clone(),
        Draw::Replacement {
            batches: train.batches_per_epoch(),
        },
        train.batch_size,
        train.num_workers,
        config.seed,
        epoch,
    )
    .reseeding_backend();
    match lengths {
        Some(lengths) if train.batch_by_length => loader.by_length(lengths),
        _ => loader,
    }
}

/// What every node of a run must run alike: the resolved experiment and the binary (its version
/// and size), hashed.
fn identity(config: &ExperimentConfig) -> u64 {
    use sha2::{Digest, Sha256};
    let mut config = config.clone();
    // Where each node runs is its own business.
    config.train.devices = None;
    let binary = std::env::current_exe()
        .and_then(std::fs::metadata)
        .map_or(0, |m| m.len());
    let text = format!(
        "{} | transformer-lab {} | {binary} bytes",
        serde_json::to_string(&config).unwrap_or_default(),
        env!("CARGO_PKG_VERSION")
    );
    let digest = Sha256::digest(text.as_bytes());
    u64::from_le_bytes(digest[..8].try_into().unwrap_or_default())
}
