//! Checkpoint housekeeping for burn's Learner: each epoch's validation loss (kept beside the
//! checkpoints, so a resumed run knows the earlier ones), which checkpoints to keep (the last
//! `keep` epochs and the best by validation loss), and early stopping on that loss.
//!
//! burn's own metric-based strategies read the event store while the asynchronous metric
//! processor may still be delivering the epoch's last values; here the loss is taken from a
//! metric logger when the epoch's end reaches it, so every decision depends on the numbers
//! alone and a resumed run decides as the uninterrupted one did.

use crate::artifact::{write_atomic, ArtifactDir, CheckpointWatch};
use burn::train::checkpoint::{CheckpointingAction, CheckpointingStrategy};
use burn::train::metric::store::EventStoreClient;
use burn::train::EarlyStoppingStrategy;
use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// How long a checkpoint decision waits for its epoch's validation loss to arrive.
const LOSS_WAIT: Duration = Duration::from_secs(60);

/// Validation loss per epoch, shared by the logger that fills it and the strategies that read
/// it.
#[derive(Clone, Default)]
pub struct ValidLosses(Arc<(Mutex<BTreeMap<usize, f64>>, Condvar)>);

impl ValidLosses {
    /// The losses saved in `artifact` for epochs up to `up_to` (none if the file is missing
    /// or unreadable: they only steer which checkpoint is kept and early stopping).
    pub fn load(artifact: &ArtifactDir, up_to: usize) -> Self {
        let saved: BTreeMap<usize, f64> = std::fs::read_to_string(artifact.valid_losses())
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok())
            .unwrap_or_default();
        let losses = Self::default();
        losses
            .lock()
            .extend(saved.into_iter().filter(|&(e, _)| e <= up_to));
        losses
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, f64>> {
        self.0 .0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes the losses to `checkpoint/valid-loss.json`.
    pub fn save(&self, artifact: &ArtifactDir) -> anyhow::Result<()> {
        let text = serde_json::to_string_pretty(&*self.lock())?;
        write_atomic(&artifact.valid_losses(), text.as_bytes())
    }

    pub(super) fn set(&self, epoch: usize, loss: f64) {
        self.lock().insert(epoch, loss);
        self.0 .1.notify_all();
    }

    /// Epoch `epoch`'s loss, waiting up to `timeout` for it.
    fn wait_for(&self, epoch: usize, timeout: Duration) -> Option<f64> {
        let guard = self.lock();
        let (guard, _) = self
            .0
             .1
            .wait_timeout_while(guard, timeout, |losses| !losses.contains_key(&epoch))
            .unwrap_or_else(|e| e.into_inner());
        guard.get(&epoch).copied()
    }

    /// Epoch `epoch`'s loss, if known.
    pub fn get(&self, epoch: usize) -> Option<f64> {
        self.lock().get(&epoch).copied()
    }

    /// The epoch with the lowest loss among `epochs` (the earliest of equals).
    pub fn best_of(&self, epochs: impl IntoIterator<Item = usize>) -> Option<(usize, f64)> {
        let losses = self.lock();
        epochs
            .into_iter()
            .filter_map(|e| Some((e, *losses.get(&e)?)))
            .fold(None, |best: Option<(usize, f64)>, (e, l)| match best {
                Some((_, b)) if b <= l => best,
                _ => Some((e, l)),
            })
    }

    /// Whether the best loss up to `epoch` is `patience` or more epochs old.
    pub fn no_improvement(&self, epoch: usize, patience: usize) -> bool {
        match self.best_of(1..=epoch) {
            Some((best, _)) => epoch - best >= patience,
            None => false,
        }
    }
}

/// Saves every epoch's checkpoint and deletes those no longer needed: all but the newest
/// `keep` and the best by validation loss. The newest checkpoint already on disk is kept until
/// the next one exists, even with `keep` 1, since this epoch's files are still being written when
/// the decision is made; [`prune`] trims to exactly `keep` when training ends.
pub struct KeepCheckpoints {
    artifact: ArtifactDir,
    keep: usize,
    losses: ValidLosses,
    watch: Arc<CheckpointWatch>,
}

/// The records burn-train's Learner saves per checkpoint: model, optimizer, scheduler.
const RECORDS_PER_CHECKPOINT: usize = 3;

impl KeepCheckpoints {
    /// The strategy for a run in `artifact`.
    /// `watch` is the checkpoint recorder's: each save is counted there until its records are
    /// read, so the loaders begin no epoch meanwhile.
    pub fn new(
        artifact: ArtifactDir,
        keep: usize,
        losses: ValidLosses,
        watch: Arc<CheckpointWatch>,
    ) -> Self {
        Self {
            artifact,
            keep: keep.max(1),
            losses,
            watch,
        }
    }
}

impl CheckpointingStrategy for KeepCheckpoints {
    fn checkpointing(&mut self, epoch: usize, _: &EventStoreClient) -> Vec<CheckpointingAction> {
        self.losses.wait_for(epoch, LOSS_WAIT);
        // Best effort: a failure here means the checkpoint write fails too, and reports it.
        let _ = self.losses.save(&self.artifact);
        let before: Vec<usize> = self
            .artifact
            .complete_checkpoints()
            .into_iter()
            .filter(|&e| e < epoch)
            .collect();
        let mut kept: Vec<usize> = before.iter().rev().take(self.keep - 1).copied().collect();
        kept.extend(before.last());
        kept.push(epoch);
        kept.extend(
            self.losses
                .best_of(before.iter().copied().chain([epoch]))
                .map(|b| b.0),
        );
        // The Learner hands the records over right after this returns.
        self.watch.reading(RECORDS_PER_CHECKPOINT);
        let mut actions = vec![CheckpointingAction::Save];
        actions.extend(
            before
                .into_iter()
                .filter(|e| !kept.contains(e))
                .map(CheckpointingAction::Delete),
        );
        actions
    }
}

/// Deletes every complete checkpoint but the newest `keep` and the best by validation loss;
/// returns the best.
pub fn prune(
    artifact: &ArtifactDir,
    keep: usize,
    losses: &ValidLosses,
) -> anyhow::Result<Option<(usize, f64)>> {
    let all = artifact.complete_checkpoints();
    let best = losses.best_of(all.iter().copied());
    let mut kept: Vec<usize> = all.iter().rev().take(keep.max(1)).copied().collect();
    kept.extend(best.map(|b| b.0));
    for epoch in all.into_iter().filter(|e| !kept.contains(e)) {
        artifact.remove_checkpoint(epoch)?;
    }
    Ok(best)
}

/// Stops training once the validation loss has not improved for `patience` epochs.
#[derive(Clone)]
pub struct Patience {
    patience: usize,
    losses: ValidLosses,
}

impl Patience {
    /// Early stopping after `patience` epochs without a better validation loss.
    pub fn new(patience: usize, losses: ValidLosses) -> Self {
        Self { patience, losses }
    }
}

impl EarlyStoppingStrategy for Patience {
    fn should_stop(&mut self, epoch: usize, _: &EventStoreClient) -> bool {
        self.losses.wait_for(epoch, LOSS_WAIT);
        self.losses.no_improvement(epoch, self.patience)
    }
}
