//! The training loop: burn-train's single-device loop (train an epoch, validate, checkpoint,
//! maybe stop early) with what that loop cannot do — stop after any step with a checkpoint of
//! that step, resume in the middle of an epoch, and write mid-epoch checkpoints by time or
//! steps.
//!
//! A mid-epoch checkpoint of global step `S` is burn's three records under their own names
//! (`checkpoint/{model,optim,scheduler}-step-S.mpk`, written and synchronised before training
//! goes on) and then `checkpoint/step-S.json`: the epoch, the batches of it done, and the
//! epoch's running perplexity sums. The marker comes last, so a checkpoint without it is
//! incomplete and ignored; only the newest complete one is kept, and it goes once an epoch
//! checkpoint at or after its step is complete. Resuming from it loads the three records, has
//! the loader skip the batches done (each batch's data and dropout masks depend only on
//! `(seed, epoch, batch)`) and the metrics continue from the same step, so the run ends as the
//! uninterrupted one would have, to the bit.

use super::config::CheckpointEvery;
use super::metrics::{Divergence, Logged};
use super::parallel::{mean_across_peers, PeerThreads};
use super::perplexity::NllSums;
use super::stop::StopRequest;
use crate::artifact::{write_atomic, ArtifactDir, ArtifactRecorder, CheckpointWatch};
use anyhow::{Context, Result};
use burn::data::dataloader::Progress;
use burn::module::{AutodiffModule, Module};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::record::FileRecorder;
use burn::tensor::Tensor;
use burn::train::checkpoint::{
    AsyncCheckpointer, CheckpointingAction, CheckpointingStrategy, FileCheckpointer,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::ClassificationOutput;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent,
    LearningCheckpointer, LearningComponentsTypes, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainStep, TrainingComponents, TrainingItem,
    TrainingModel, ValidLoader,
};
use serde::{Deserialize, Serialize};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where a run stands: `step` optimizer steps done in all, in `epoch` (1-based, the epoch in
/// progress) of which `batch` are done. After epoch `E`'s checkpoint: step `E · steps_per_epoch`,
/// epoch `E + 1`, batch 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepPoint {
    /// Steps done.
    pub step: usize,
    /// The epoch in progress.
    pub epoch: usize,
    /// Its batches done.
    pub batch: usize,
}

impl StepPoint {
    /// Right after epoch `epoch`'s checkpoint.
    pub fn after_epoch(epoch: usize, steps_per_epoch: usize) -> Self {
        Self {
            step: epoch * steps_per_epoch,
            epoch: epoch + 1,
            batch: 0,
        }
    }
}

/// What `checkpoint/step-S.json` holds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepMarker {
    /// Where the run stood.
    #[serde(flatten)]
    pub point: StepPoint,
    /// The epoch's training perplexity sums so far (language models and translators).
    pub perplexity: Option<NllSums>,
}

impl StepMarker {
    /// The marker of `step` in `artifact`, if it reads.
    pub fn load(artifact: &ArtifactDir, step: usize) -> Result<Self> {
        let path = artifact.step_marker(step);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("malformed {}", path.display()))
    }
}

/// How long a checkpoint waits for its step's metrics to be logged (they trail the training on
/// burn's processor thread by a step or two).
const LOGGED_WAIT: Duration = Duration::from_secs(60);

/// A step longer than this cannot be stopped within the 10–30 s a scheduler (SLURM, Kubernetes,
/// `docker stop`) waits between SIGTERM and SIGKILL.
const GRACE: Duration = Duration::from_secs(10);

/// The environment variable that pauses a mid-epoch checkpoint for that many milliseconds
/// between its records and its marker (for testing a second signal in the middle of a save).
pub const PAUSE_STEP_SAVE_ENV: &str = "TRANSFORMER_LAB_PAUSE_STEP_SAVE";

/// The loop; see the module docs. Shared with the run that launches it.
pub struct StepStrategy {
    pub(super) artifact: ArtifactDir,
    pub(super) steps_per_epoch: usize,
    /// Batches a step (`train.grad_accumulation`): their gradients are summed and the
    /// optimizer takes their mean ([`super::optim::ReferenceOptimizer`] scales by `1/n`).
    pub(super) accumulation: usize,
    /// A mid-epoch checkpoint to start from (its records are loaded here); `None` starts where
    /// burn's learner starts (a fresh run, or after the epoch checkpoint it loaded).
    pub(super) resume: Option<StepPoint>,
    pub(super) every: Option<CheckpointEvery>,
    pub(super) request: StopRequest,
    /// The training loader's batches to skip at the next epoch's start.
    pub(super) skip: Arc<AtomicUsize>,
    pub(super) logged: Logged,
    pub(super) perplexity: Option<Arc<Mutex<NllSums>>>,
    pub(super) divergence: Divergence,
    pub(super) watch: Arc<CheckpointWatch>,
    /// The step a stop saved, once it has.
    pub(super) saved: Arc<Mutex<Option<usize>>>,
    /// The other peers of a data-parallel run, started ([`PeerThreads`] of the run's model);
    /// `None` trains on one device.
    pub(super) peers: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// Why a data-parallel step failed, if one did (the run stops there).
    pub(super) failure: Arc<Mutex<Option<String>>>,
}

/// Saves every time it is asked: a mid-epoch checkpoint replaces the previous one itself.
struct SaveAlways;

impl CheckpointingStrategy for SaveAlways {
    fn checkpointing(&mut self, _: usize, _: &EventStoreClient) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

impl StepStrategy {
    /// The checkpointer of mid-epoch checkpoints: burn's three records, named by step.
    fn checkpointer<LC>(&self, interrupter: &Interrupter) -> LearningCheckpointer<LC>
    where
        LC: LearningComponentsTypes,
        ArtifactRecorder: FileRecorder<LC::Backend>,
    {
        let dir = self.artifact.checkpoints();
        let recorder = ArtifactRecorder::watched(self.watch.clone());
        LearningCheckpointer::new(
            AsyncCheckpointer::new(FileCheckpointer::new(recorder.clone(), &dir, "model-step"))
                .with_interrupter(interrupter.clone()),
            AsyncCheckpointer::new(FileCheckpointer::new(recorder.clone(), &dir, "optim-step"))
                .with_interrupter(interrupter.clone()),
            AsyncCheckpointer::new(FileCheckpointer::new(recorder, &dir, "scheduler-step"))
                .with_interrupter(interrupter.clone()),
            Box::new(SaveAlways),
        )
    }

    /// Writes the mid-epoch checkpoint of `point` and removes the older ones; whether it is
    /// complete. Waits for the step's metrics first: they are part of what resumes, and a
    /// loss that was not finite there means these weights must not be kept.
    fn save<LC>(
        &self,
        learner: &Learner<LC>,
        point: StepPoint,
        interrupter: &Interrupter,
        store: &EventStoreClient,
    ) -> bool
    where
        LC: LearningComponentsTypes,
        ArtifactRecorder: FileRecorder<LC::Backend>,
    {
        if !self.logged.wait_for(point.step, LOGGED_WAIT) || self.divergence.step().is_some() {
            return false;
        }
        let perplexity = self
            .perplexity
            .as_ref()
            .map(|sums| *sums.lock().unwrap_or_else(|e| e.into_inner()));
        {
            // Dropped at the end of the block: its threads finish writing first.
            let mut checkpointer = self.checkpointer::<LC>(interrupter);
            self.watch.reading(3);
            checkpointer.checkpoint(learner, point.step, store);
        }
        if self.watch.failure().is_some() {
            return false;
        }
        if let Some(ms) = std::env::var(PAUSE_STEP_SAVE_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
        {
            std::thread::sleep(Duration::from_millis(ms));
        }
        let marker = StepMarker { point, perplexity };
        let written = serde_json::to_string_pretty(&marker)
            .map_err(anyhow::Error::from)
            .and_then(|text| write_atomic(&self.artifact.step_marker(point.step), text.as_bytes()));
        if let Err(err) = written {
            eprintln!(
                "warning: the checkpoint of step {} is incomplete: {err:#}",
                point.step
            );
            return false;
        }
        if let Err(err) = remove_step_checkpoints(&self.artifact, |s| s != point.step) {
            eprintln!("warning: {err:#}");
        }
        true
    }
}

/// Removes every mid-epoch checkpoint (complete or not) whose step `stale` says.
pub fn remove_step_checkpoints(
    artifact: &ArtifactDir,
    stale: impl Fn(usize) -> bool,
) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(artifact.checkpoints()) else {
        return Ok(());
    };
    let mut steps: Vec<usize> = entries
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            let stem = name
                .strip_suffix(".mpk")
                .or_else(|| name.strip_suffix(".json"))?;
            stem.rsplit_once("step-")?.1.parse().ok()
        })
        .filter(|&s| stale(s))
        .collect();
    steps.sort_unstable();
    steps.dedup();
    for step in steps {
        artifact.remove_step_checkpoint(step)?;
    }
    Ok(())
}

/// Removes the mid-epoch checkpoints that the newest complete epoch checkpoint supersedes, and
/// the files of any that never got its marker.
pub fn remove_superseded_steps(artifact: &ArtifactDir, steps_per_epoch: usize) -> Result<()> {
    let complete = artifact.step_checkpoints();
    let epoch_step = artifact.latest_checkpoint().unwrap_or(0) * steps_per_epoch;
    remove_step_checkpoints(artifact, |s| s <= epoch_step || !complete.contains(&s))
}

impl<LC> SupervisedLearningStrategy<LC> for StepStrategy
where
    LC: LearningComponentsTypes,
    LC::TrainingModel: TrainStep<Output = ClassificationOutput<LC::Backend>>,
    ArtifactRecorder: FileRecorder<LC::Backend>,
{
    fn fit(
        &self,
        components: TrainingComponents<LC>,
        mut learner: Learner<LC>,
        loader_train: TrainLoader<LC>,
        loader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        // Ctrl-C stays a signal inside the dashboard for as long as the run goes on.
        let _signal_keys = super::stop::SignalKeys::watch();
        let mut processor = components.event_processor;
        let mut checkpointer = components.checkpointer;
        let mut early_stopping = components.early_stopping;
        let interrupter = components.interrupter;
        let store = components.event_store;
        let device = learner.model().devices()[0].clone();
        let (first_epoch, mut skip) = match self.resume {
            Some(point) => {
                learner = self
                    .checkpointer::<LC>(&interrupter)
                    .load_checkpoint(learner, &device, point.step);
                (point.epoch, point.batch)
            }
            None => (starting_epoch, 0),
        };
        let peers = self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .map(|peers| {
                *peers
                    .downcast::<PeerThreads<LC::TrainingModel>>()
                    .expect("the peers of a run are started for its model")
            });
        if peers.as_ref().is_some_and(|p| p.group().is_some()) {
            super::parallel::quiet_collective_panics();
        }
        let spe = self.steps_per_epoch;
        let n = self.accumulation;
        let mut accumulated = GradientsAccumulator::<LC::TrainingModel>::new();
        // The losses of the step's batches so far (`[1]` each).
        let mut losses = Vec::with_capacity(n);
        let mut last_save = Instant::now();
        let mut warned = false;
        let mut steps_run = 0usize;
        // The user's stop (a signal, or the dashboard's q through the interrupter) is told
        // apart from the other reasons the interrupter stops a run: a loss that is not finite
        // and a checkpoint that could not be written, which save nothing.
        let asked = |interrupter: &Interrupter| {
            if interrupter.should_stop()
                && self.divergence.step().is_none()
                && self.watch.failure().is_none()
            {
                self.request.ask(StopRequest::KEY);
            }
            self.request.asked().is_some()
        };
        // Data-parallel, a stop takes effect once every peer knows of it: each step's
        // all-reduce carries this node's wish (stop and save; stop for another reason), and
        // the agreed answer is what every node acts on, after the same step.
        let agreed = Cell::new((false, false));
        let user_stop = |interrupter: &Interrupter| match &peers {
            Some(_) => agreed.get().0,
            None => asked(interrupter),
        };
        let stopping = |interrupter: &Interrupter| match &peers {
            Some(_) => agreed.get().0 || agreed.get().1,
            None => interrupter.should_stop(),
        };
        'epochs: for epoch in first_epoch..=components.num_epochs {
            let global = Progress {
                items_processed: epoch,
                items_total: components.num_epochs,
            };
            // The loader counts batches: `n` a step.
            self.skip.store(skip * n, Ordering::SeqCst);
            let mut iterator = loader_train.iter();
            if let Err(err) = remove_superseded_steps(&self.artifact, spe) {
                eprintln!("warning: {err:#}");
            }
            if let Some(peers) = &peers {
                peers.begin_epoch(epoch, skip * n);
            }
            // `batch` counts this epoch's optimizer steps, `part` the batches of the step under
            // way; a stop, a checkpoint or a metric comes only between steps.
            let mut batch = std::mem::take(&mut skip);
            let mut part = 0usize;
            let mut began = Instant::now();
            while let Some(item) = iterator.next() {
                if part == 0 {
                    began = Instant::now();
                    learner.lr_step();
                }
                part += 1;
                let last = part == n;
                let step = (epoch - 1) * spe + batch + 1;
                let progress = iterator.progress();
                let (mut item, grads) = match &peers {
                    None => {
                        let output = learner.train_step(item);
                        (output.item, output.grads)
                    }
                    Some(peers) => {
                        let user = asked(&interrupter);
                        let wish = [
                            f32::from(user),
                            f32::from(interrupter.should_stop() && !user),
                        ];
                        let first = steps_run == 0 && part == 1;
                        match parallel_grads(&mut learner, peers, item, first, step, wish) {
                            Ok((item, grads, [user, other])) => {
                                agreed.set((user > 0.0, other > 0.0));
                                (item, grads)
                            }
                            Err(err) => {
                                self.fail(err, &interrupter);
                                break 'epochs;
                            }
                        }
                    }
                };
                if n > 1 {
                    accumulated.accumulate(&learner.model(), grads);
                    losses.push(item.loss.detach());
                    if !last {
                        continue;
                    }
                    learner.optimizer_step(accumulated.grads());
                    // The step's loss is its batches' mean (a batch that diverged makes it
                    // NaN); its other metrics are its last batch's.
                    item.loss = Tensor::cat(std::mem::take(&mut losses), 0).mean();
                } else {
                    learner.optimizer_step(grads);
                }
                part = 0;
                batch += 1;
                processor.process_train(LearnerEvent::ProcessedItem(TrainingItem::new(
                    item,
                    progress,
                    global.clone(),
                    Some(batch),
                    Some(learner.lr_current()),
                )));
                steps_run += 1;
                let point = StepPoint {
                    step: (epoch - 1) * spe + batch,
                    epoch,
                    batch,
                };
                if steps_run == 2 && !warned && began.elapsed() > GRACE {
                    warned = true;
                    eprintln!(
                        "warning: a step takes {:.0} s: a stop (SIGTERM, Ctrl-C) finishes its step \
                         and writes a checkpoint, longer than the 10-30 s a scheduler waits before \
                         SIGKILL; only the last complete checkpoint would be kept",
                        began.elapsed().as_secs_f64()
                    );
                }
                if user_stop(&interrupter) {
                    if self.save(&learner, point, &interrupter, &store) {
                        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some(point.step);
                    }
                    break 'epochs;
                }
                if stopping(&interrupter) {
                    break 'epochs;
                }
                let due = match self.every {
                    Some(CheckpointEvery::Steps(n)) => point.step.is_multiple_of(n),
                    Some(CheckpointEvery::Minutes(m)) => {
                        last_save.elapsed().as_secs_f64() >= m * 60.0
                    }
                    None => false,
                };
                if due && batch < spe {
                    self.save(&learner, point, &interrupter, &store);
                    last_save = Instant::now();
                }
            }
            processor.process_train(LearnerEvent::EndEpoch(epoch));
            // Validation runs to its end: its loss decides the checkpoints kept and early
            // stopping, and a stop asked meanwhile is served by this epoch's checkpoint.
            let model = learner.model().valid();
            let mut iterator = loader_valid.iter();
            let mut iteration = 0;
            while let Some(item) = iterator.next() {
                iteration += 1;
                let progress = iterator.progress();
                let item = model.step(item);
                processor.process_valid(LearnerEvent::ProcessedItem(TrainingItem::new(
                    item,
                    progress,
                    global.clone(),
                    Some(iteration),
                    None,
                )));
            }
            processor.process_valid(LearnerEvent::EndEpoch(epoch));
            if let Some(checkpointer) = &mut checkpointer {
                checkpointer.checkpoint(&learner, epoch, &store);
            }
            last_save = Instant::now();
            if let Some(early) = &mut early_stopping {
                if early.should_stop(epoch, &store) {
                    break;
                }
            }
            if stopping(&interrupter) && !user_stop(&interrupter) {
                break;
            }
            if user_stop(&interrupter) && epoch < components.num_epochs {
                *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some(epoch * spe);
                break;
            }
        }
        if let Some(peers) = peers {
            peers.stop::<LC::Backend>();
        }
        (learner.model(), processor)
    }
}

impl StepStrategy {
    /// Records why a data-parallel run cannot go on and stops it.
    fn fail(&self, err: String, interrupter: &Interrupter) {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(err);
        interrupter.stop(None);
    }
}

/// One data-parallel batch: the other peers start from the learner's weights, every peer
/// computes the gradients of its share, and their mean comes back for the optimizer (which
/// steps after a step's last batch). The run's first batch hands the weights over only after
/// peer 0's forward pass, which initialises the parameters burn creates lazily (as a
/// one-device run's first step does, so both start from the same weights).
fn parallel_grads<LC: LearningComponentsTypes>(
    learner: &mut Learner<LC>,
    peers: &PeerThreads<LC::TrainingModel>,
    item: <LC::TrainingModel as TrainStep>::Input,
    first: bool,
    step: usize,
    wish: [f32; 2],
) -> Result<StepGrads<LC>, String> {
    let began = Instant::now();
    if !first {
        peers.step(&learner.model());
    }
    let output = learner.train_step(item);
    if first {
        peers.step(&learner.model());
    }
    let reducing = Instant::now();
    peers.reducing(Some(step));
    let mean =
        mean_across_peers::<LC::Backend, _>(peers.first(), &learner.model(), output.grads, wish);
    peers.reducing(None);
    let mean = mean.map_err(|err| match peers.group() {
        Some(group) => format!(
            "node {} at step {step}: {} left (stopped, killed or unreachable) — {err}",
            group.rank,
            group.others()
        ),
        None => err,
    })?;
    peers.finish_step()?;
    let reduce = reducing.elapsed();
    let (grads, agreed) = mean;
    peers.timed(began.elapsed(), reduce);
    Ok((output.item, grads, agreed))
}

/// A data-parallel batch's output on this peer, the mean of every peer's gradients of its
/// share, and what the peers agreed on stopping.
type StepGrads<LC> = (
    <<LC as LearningComponentsTypes>::TrainingModel as TrainStep>::Output,
    GradientsParams,
    [f32; 2],
);
