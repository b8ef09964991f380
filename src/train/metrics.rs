//! `metrics.csv` written as training goes: every training step's loss, accuracy, perplexity
//! and learning rate, and each epoch's validation means at the epoch's last step.

use super::checkpoint::ValidLosses;
use super::strategy::StepPoint;
use crate::artifact::metrics::{self, metric_key, to_csv, Row};
use crate::artifact::ArtifactDir;
use crate::files::write_atomic;
use anyhow::{Context, Result};
use burn::train::logger::MetricLogger;
use burn::train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The first training step whose loss was not finite (NaN or ±∞), and the handle that stops
/// the run there: the Learner leaves the epoch without validating or checkpointing it.
#[derive(Clone)]
pub struct Divergence {
    step: Arc<AtomicUsize>,
    interrupter: burn::train::Interrupter,
}

impl Divergence {
    /// Stops training through `interrupter` (the one the Learner checks after every step).
    pub fn new(interrupter: burn::train::Interrupter) -> Self {
        Self {
            step: Arc::new(AtomicUsize::new(0)),
            interrupter,
        }
    }

    /// The first non-finite loss was at `step` (counted from 1): stop.
    fn trip(&self, step: usize) {
        let first = self
            .step
            .compare_exchange(0, step, Ordering::SeqCst, Ordering::SeqCst);
        if first.is_ok() {
            self.interrupter
                .stop(Some("the training loss is not finite"));
        }
    }

    /// The step whose loss was not finite, if one was.
    pub fn step(&self) -> Option<usize> {
        match self.step.load(Ordering::SeqCst) {
            0 => None,
            step => Some(step),
        }
    }
}

/// Counts training steps as their metrics are logged. burn 0.21 passes a resumed run's first
/// epoch to the loggers as epoch 1 (its event store restarts its count), so the step and epoch
/// of a training update are counted here from the checkpoint the run started after.
#[derive(Clone, Copy, Debug)]
pub struct StepCounter {
    steps_per_epoch: usize,
    done: usize,
}

impl StepCounter {
    /// A counter for a run resuming after `done` steps (0: a fresh run).
    pub fn new(steps_per_epoch: usize, done: usize) -> Self {
        Self {
            steps_per_epoch,
            done,
        }
    }

    /// `(step, epoch)` of the next training update, both 1-based.
    pub fn next(&mut self) -> (usize, usize) {
        self.done += 1;
        (self.done, self.epoch())
    }

    /// The epoch of the last training update counted (its validation follows it).
    pub fn epoch(&self) -> usize {
        self.done.saturating_sub(1) / self.steps_per_epoch + 1
    }
}

/// burn's file logger (`train/epoch-N/*.log`, `valid/epoch-N/*.log`) with the epoch it is given
/// corrected: as burn passes it, a resumed run's first epoch overwrote the logs of epoch 1.
pub struct EpochCorrected<L> {
    inner: L,
    steps: StepCounter,
}

impl<L> EpochCorrected<L> {
    /// Wraps `inner` for a run resuming after `done` steps.
    pub fn new(inner: L, steps_per_epoch: usize, done: usize) -> Self {
        Self {
            inner,
            steps: StepCounter::new(steps_per_epoch, done),
        }
    }
}

impl<L: MetricLogger> MetricLogger for EpochCorrected<L> {
    fn log(&mut self, update: MetricsUpdate, epoch: usize, split: &Split) {
        let epoch = match split {
            Split::Train => self.steps.next().1,
            Split::Valid => self.steps.epoch(),
            _ => epoch,
        };
        self.inner.log(update, epoch, split);
    }

    fn read_numeric(
        &mut self,
        name: &str,
        epoch: usize,
        split: &Split,
    ) -> Result<Vec<NumericEntry>, String> {
        self.inner.read_numeric(name, epoch, split)
    }

    fn log_metric_definition(&mut self, definition: MetricDefinition) {
        self.inner.log_metric_definition(definition);
    }

    fn log_epoch_summary(&mut self, summary: EpochSummary) {
        self.inner.log_epoch_summary(summary);
    }
}

/// The last training step whose row `metrics.csv` holds (written and flushed), for a checkpoint
/// of that step to wait for: the metrics are logged on burn's processor thread, behind the
/// training.
#[derive(Clone, Default)]
pub struct Logged(Arc<(Mutex<usize>, Condvar)>);

impl Logged {
    fn set(&self, step: usize) {
        *self.0 .0.lock().unwrap_or_else(|e| e.into_inner()) = step;
        self.0 .1.notify_all();
    }

    /// Waits up to `timeout` for step `step`'s row; whether it came.
    pub fn wait_for(&self, step: usize, timeout: Duration) -> bool {
        let guard = self.0 .0.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = self
            .0
             .1
            .wait_timeout_while(guard, timeout, |logged| *logged < step)
            .unwrap_or_else(|e| e.into_inner());
        *guard >= step
    }
}

/// A metric logger appending to `metrics.csv`, flushed at every step. A run resumed from a
/// checkpoint first drops the rows after its step (a killed run may have logged steps it never
/// checkpointed), so the table of a resumed run is the table of the run it replaced. Each epoch's mean validation loss
/// also goes to the [`ValidLosses`] that keep the best checkpoint and stop early — when the
/// epoch's end reaches the logger, after all of the epoch's values, in order.
pub struct CsvLogger {
    losses: ValidLosses,
    out: Option<std::io::BufWriter<std::fs::File>>,
    steps_per_epoch: usize,
    names: HashMap<MetricId, String>,
    steps: StepCounter,
    /// Validation `(Σ value·count, Σ count)` per metric over the epoch so far.
    valid: BTreeMap<String, (f64, f64)>,
    failure: Arc<Mutex<Option<String>>>,
    divergence: Divergence,
    logged: Logged,
}

impl CsvLogger {
    /// Opens `metrics.csv` of `artifact` for a run starting at `start` (step 0 for a fresh
    /// run), keeping the training rows up to its step and the validation rows of the epochs
    /// before its own (taken from burn's epoch logs when a run older than the table is resumed).
    /// The returned slot receives the first write that failed (the run goes on; its end reports
    /// the table incomplete). A training loss that is not finite trips `divergence`; each step's
    /// rows, once flushed, are announced to `logged`.
    pub fn open(
        artifact: &ArtifactDir,
        steps_per_epoch: usize,
        start: StepPoint,
        losses: ValidLosses,
        divergence: Divergence,
        logged: Logged,
    ) -> Result<(Self, Arc<Mutex<Option<String>>>)> {
        let path = artifact.metrics();
        let kept: Vec<Row> = match start.step {
            0 => Vec::new(),
            _ => metrics::read(artifact, steps_per_epoch)?
                .into_iter()
                .filter(|row| match row.split.as_str() {
                    "train" => row.step <= start.step,
                    _ => row.epoch < start.epoch,
                })
                .collect(),
        };
        write_atomic(&path, to_csv(&kept).as_bytes())?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {} to append", path.display()))?;
        let failure = Arc::new(Mutex::new(None));
        let logger = Self {
            losses,
            out: Some(std::io::BufWriter::new(file)),
            steps_per_epoch,
            names: HashMap::new(),
            steps: StepCounter::new(steps_per_epoch, start.step),
            valid: BTreeMap::new(),
            failure: failure.clone(),
            divergence,
            logged,
        };
        Ok((logger, failure))
    }

    fn write(&mut self, row: Row) {
        let Some(out) = &mut self.out else {
            return;
        };
        if let Err(err) = out.write_all(row.line().as_bytes()) {
            self.fail(err);
        }
    }

    fn flush(&mut self) {
        if let Some(Err(err)) = self.out.as_mut().map(|out| out.flush()) {
            self.fail(err);
        }
    }

    /// Stops writing after the first failure (a full disk), keeping its message.
    fn fail(&mut self, err: std::io::Error) {
        self.out = None;
        let mut slot = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert_with(|| format!("metrics.csv: {err}"));
    }

    fn name(&self, id: &MetricId) -> Option<String> {
        self.names.get(id).map(|name| metric_key(name))
    }
}

/// `(value, count)` of one logged entry.
fn value_and_count(entry: &NumericEntry) -> (f64, f64) {
    match entry {
        NumericEntry::Value(v) => (*v, 1.0),
        NumericEntry::Aggregated {
            aggregated_value,
            count,
        } => (*aggregated_value, *count as f64),
    }
}

impl MetricLogger for CsvLogger {
    fn log(&mut self, update: MetricsUpdate, _epoch: usize, split: &Split) {
        match split {
            Split::Train => {
                let (step, epoch) = self.steps.next();
                for metric in update.entries_numeric {
                    let Some(name) = self.name(&metric.entry.metric_id) else {
                        continue;
                    };
                    let (value, _) = value_and_count(&metric.numeric_entry);
                    if name == "loss" && !value.is_finite() {
                        self.divergence.trip(step);
                    }
                    self.write(Row {
                        step,
                        epoch,
                        split: "train".into(),
                        metric: name,
                        value,
                    });
                }
                self.flush();
                self.logged.set(step);
            }
            Split::Valid => {
                for metric in update.entries_numeric {
                    let Some(name) = self.name(&metric.entry.metric_id) else {
                        continue;
                    };
                    let (value, count) = value_and_count(&metric.numeric_entry);
                    let sums = self.valid.entry(name).or_insert((0.0, 0.0));
                    sums.0 += value * count;
                    sums.1 += count;
                }
            }
            _ => {}
        }
    }

    fn read_numeric(
        &mut self,
        _name: &str,
        _epoch: usize,
        _split: &Split,
    ) -> Result<Vec<NumericEntry>, String> {
        Err("the metrics.csv logger is write-only".into())
    }

    fn log_metric_definition(&mut self, definition: MetricDefinition) {
        self.names.insert(definition.metric_id, definition.name);
    }

    fn log_epoch_summary(&mut self, summary: EpochSummary) {
        if summary.split == Split::Valid {
            let epoch = summary.epoch_number;
            for (metric, (sum, count)) in std::mem::take(&mut self.valid) {
                if count > 0.0 && metric == "loss" {
                    self.losses.set(epoch, sum / count);
                }
                if count > 0.0 {
                    self.write(Row {
                        step: epoch * self.steps_per_epoch,
                        epoch,
                        split: "valid".into(),
                        metric,
                        value: sum / count,
                    });
                }
            }
        }
        self.flush();
    }
}

impl Drop for CsvLogger {
    fn drop(&mut self) {
        self.flush();
    }
}
