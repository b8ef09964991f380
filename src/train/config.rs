//! The `train` section of an experiment: the optimisation recipe and how a run is kept.

use crate::kernels::Precision;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// The learning rate after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// Cosine decay from `lr` to `min_lr` (nanoGPT, GPT-3).
    Cosine,
    /// Inverse square root ("Noam", Vaswani et al. 2017): `lr · min(step/warmup, √(warmup/step))`.
    Noam,
}

/// Optimisation: AdamW (weight decay on matrices only), linear warmup then cosine decay,
/// global-norm gradient clipping — nanoGPT's recipe.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Sequences per batch.
    pub batch_size: usize,
    /// Batches whose gradients make one optimizer step, their mean (nanoGPT's
    /// `gradient_accumulation_steps`): a step learns from `batch_size · grad_accumulation`
    /// items while only one batch's activations are held at a time. The data of a step are
    /// those of one batch of the product's size, so at an equal product the steps are the same
    /// up to rounding (where the loss is a mean over equal shares: fixed-length items).
    /// `steps`, `steps_per_epoch`, checkpoints and the learning-rate schedule count optimizer
    /// steps; a step's logged loss is the mean of its batches' losses, its accuracy and
    /// perplexity its last batch's.
    #[serde(skip_serializing_if = "is_one")]
    pub grad_accumulation: usize,
    /// Total optimizer steps.
    pub steps: usize,
    /// Steps between validations and checkpoints (one Learner "epoch"); must divide `steps`.
    pub steps_per_epoch: usize,
    /// Validation batches per evaluation, sampled at random from the validation split.
    pub eval_batches: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Linear warmup steps.
    pub warmup_steps: usize,
    /// Step at which the cosine decay reaches `min_lr` (`0` = `steps`).
    pub decay_steps: usize,
    /// AdamW β₁.
    pub beta1: f32,
    /// AdamW β₂.
    pub beta2: f32,
    /// AdamW ε.
    pub epsilon: f32,
    /// AdamW decoupled weight decay, applied to matrices (not to LayerNorm gains or biases).
    pub weight_decay: f32,
    /// Clip the global gradient norm to this value (`0` = no clipping).
    pub grad_clip: f32,
    /// Learning-rate schedule after warmup: `cosine` (to `min_lr` at `decay_steps`) or `noam`
    /// (`lr · √(warmup/step)`, the paper's inverse square root, peaking at `lr`).
    pub schedule: ScheduleKind,
    /// Label smoothing ε of the cross-entropy (the paper uses 0.1).
    pub label_smoothing: f32,
    /// Data-loading threads: they read the items of the next batches ahead of the training
    /// step (the batch's tensors are made on the training thread); the batches are the same
    /// whatever the number.
    pub num_workers: usize,
    /// Batch items of similar lengths together (translators and classifiers, whose sentences
    /// are padded to the longest of their batch): each epoch reads the same items, sorted by
    /// length, cut into batches, the batches shuffled — less padding, the same tokens per step.
    /// Fixed-length data (language-model windows, images) is unaffected.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub batch_by_length: bool,
    /// Checkpoints kept: the last `keep_checkpoints` epochs, plus the best by validation loss.
    pub keep_checkpoints: usize,
    /// A mid-epoch checkpoint as well, every so many minutes or steps (`{"minutes": 10}` or
    /// `{"steps": 500}`), for runs whose epochs are long: only the newest is kept, and it goes
    /// once a later epoch checkpoint is complete. Epoch checkpoints are unaffected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_every: Option<CheckpointEvery>,
    /// Stop when the validation loss has not improved for a number of epochs (none: train all
    /// `steps`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopping>,
    /// The number type of the linear layers' products: `f32` (the default), or `f16`/`bf16`
    /// on a GPU backend, with `f32` master weights (see [`Precision`]).
    #[serde(skip_serializing_if = "Precision::is_f32")]
    pub precision: Precision,
    /// The devices of the backend the run trains on, data-parallel (`[0, 1, 2, 3]`: four
    /// GPUs): each step's batch is split evenly across them, each computes the gradients of its
    /// share, and their mean (burn-collective's all-reduce) makes one optimizer step. None: the
    /// backend's default device. The batch, the steps and the checkpoints are those of one
    /// device; `batch_size` must be a multiple of the count.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<usize>>,
}

/// How often a run writes a mid-epoch checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum CheckpointEvery {
    /// After the first step that ends this many minutes after the last checkpoint.
    Minutes(f64),
    /// After every step that is a multiple of this.
    Steps(usize),
}

/// Early stopping on the validation loss.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopping {
    /// Epochs (validations) without a lower validation loss after which training stops.
    pub patience: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            batch_size: 12,
            grad_accumulation: 1,
            steps: 2000,
            steps_per_epoch: 250,
            eval_batches: 20,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 100,
            decay_steps: 0,
            beta1: 0.9,
            beta2: 0.99,
            epsilon: 1e-8,
            weight_decay: 0.1,
            grad_clip: 1.0,
            schedule: ScheduleKind::Cosine,
            label_smoothing: 0.0,
            num_workers: 1,
            batch_by_length: false,
            keep_checkpoints: 2,
            checkpoint_every: None,
            early_stopping: None,
            precision: Precision::F32,
            devices: None,
        }
    }
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

impl TrainConfig {
    /// The training batches of an epoch: `steps_per_epoch` optimizer steps of
    /// `grad_accumulation` batches each.
    pub fn batches_per_epoch(&self) -> usize {
        self.steps_per_epoch * self.grad_accumulation
    }

    /// How many devices the run trains on.
    pub fn device_count(&self) -> usize {
        self.devices.as_ref().map_or(1, Vec::len)
    }

    /// Number of Learner epochs (`steps / steps_per_epoch`).
    pub fn epochs(&self) -> usize {
        self.steps / self.steps_per_epoch
    }

    /// Step at which the cosine decay ends.
    pub fn decay_steps(&self) -> usize {
        if self.decay_steps == 0 {
            self.steps
        } else {
            self.decay_steps
        }
    }

    /// Checks the relations between fields.
    pub fn validate(&self) -> Result<()> {
        if self.batch_size == 0 || self.steps == 0 || self.steps_per_epoch == 0 {
            bail!("train: batch_size, steps and steps_per_epoch must all be at least 1");
        }
        if self.grad_accumulation == 0 {
            bail!("train: grad_accumulation must be at least 1 (1: a step of one batch)");
        }
        if !self.steps.is_multiple_of(self.steps_per_epoch) {
            bail!(
                "train: steps ({}) must be a multiple of steps_per_epoch ({})",
                self.steps,
                self.steps_per_epoch
            );
        }
        if self.eval_batches == 0 {
            bail!("train: eval_batches must be at least 1");
        }
        if !(self.lr > 0.0 && self.lr <= 1.0 && (0.0..=self.lr).contains(&self.min_lr)) {
            bail!(
                "train: need 0 < lr <= 1 and 0 <= min_lr <= lr (lr {}, min_lr {})",
                self.lr,
                self.min_lr
            );
        }
        if self.warmup_steps >= self.decay_steps() {
            bail!(
                "train: warmup_steps ({}) must be below the decay end ({})",
                self.warmup_steps,
                self.decay_steps()
            );
        }
        for (name, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                bail!("train: {name} must be in [0, 1), got {beta}");
            }
        }
        // As PyTorch's AdamW: 0 is allowed; below it the update's denominator √v̂ + ε can turn
        // negative, and the step goes uphill.
        if self.epsilon.is_nan() || self.epsilon < 0.0 {
            bail!("train: epsilon must not be negative, got {}", self.epsilon);
        }
        if self.grad_clip < 0.0 || self.weight_decay < 0.0 {
            bail!("train: grad_clip and weight_decay must not be negative");
        }
        if !(0.0..1.0).contains(&self.label_smoothing) {
            bail!("train: label_smoothing must be in [0, 1)");
        }
        if let Some(devices) = &self.devices {
            let mut sorted = devices.clone();
            sorted.sort_unstable();
            sorted.dedup();
            if devices.is_empty() || sorted.len() != devices.len() {
                bail!("train: devices must name each device once, got {devices:?}");
            }
            if !self.batch_size.is_multiple_of(devices.len()) {
                bail!(
                    "train: batch_size ({}) must be a multiple of the number of devices ({}): \
                     each device trains on an equal share of every batch",
                    self.batch_size,
                    devices.len()
                );
            }
        }
        if self.keep_checkpoints == 0 {
            bail!("train: keep_checkpoints must be at least 1 (resuming needs a checkpoint)");
        }
        match self.checkpoint_every {
            Some(CheckpointEvery::Minutes(m)) if !(m.is_finite() && m > 0.0) => {
                bail!("train: checkpoint_every.minutes must be above 0, got {m}")
            }
            Some(CheckpointEvery::Steps(0)) => {
                bail!("train: checkpoint_every.steps must be at least 1")
            }
            _ => {}
        }
        if self
            .early_stopping
            .as_ref()
            .is_some_and(|e| e.patience == 0)
        {
            bail!("train: early_stopping.patience must be at least 1");
        }
        Ok(())
    }
}
