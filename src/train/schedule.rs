//! Learning-rate schedules: linear warmup, then cosine decay (nanoGPT's `get_lr`) or the
//! paper's inverse square root ("Noam").

use crate::config::{ScheduleKind, TrainConfig};
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::LearningRate;
use burn::prelude::Backend;

/// Warmup `lr·(s+1)/(warmup+1)` for `s < warmup`, then
/// - cosine: `min + ½(1 + cos(π·r))(lr − min)` with `r = (s − warmup)/(decay − warmup)`, and
///   `min_lr` after `decay` steps;
/// - Noam: `lr·√(warmup/(s+1))`. With `lr = (d_model·warmup)^-½` this is the paper's
///   `d_model^-½ · min(step^-½, step·warmup^-1.5)`.
///
/// Its record is the step counter, so a resumed run continues the schedule where it stopped.
#[derive(Clone, Debug)]
pub struct WarmupSchedule {
    kind: ScheduleKind,
    lr: f64,
    min_lr: f64,
    warmup: usize,
    decay: usize,
    step: usize,
}

impl WarmupSchedule {
    /// Cosine: peaks at `lr` after `warmup` steps and reaches `min_lr` at step `decay`.
    pub fn new(lr: f64, min_lr: f64, warmup: usize, decay: usize) -> Self {
        Self {
            kind: ScheduleKind::Cosine,
            lr,
            min_lr,
            warmup,
            decay,
            step: 0,
        }
    }

    /// Inverse square root: peaks at `lr` after `warmup` steps, then decays as `1/√step`.
    pub fn noam(lr: f64, warmup: usize) -> Self {
        Self {
            kind: ScheduleKind::Noam,
            lr,
            min_lr: 0.0,
            warmup,
            decay: usize::MAX,
            step: 0,
        }
    }

    /// The schedule a training config asks for.
    pub fn from_config(train: &TrainConfig) -> Self {
        match train.schedule {
            ScheduleKind::Cosine => Self::new(
                train.lr,
                train.min_lr,
                train.warmup_steps,
                train.decay_steps(),
            ),
            ScheduleKind::Noam => Self::noam(train.lr, train.warmup_steps),
        }
    }

    /// The learning rate at step `s` (0-based), without advancing.
    pub fn at(&self, s: usize) -> f64 {
        match self.kind {
            // The paper's d^-½·min(n^-½, n·w^-1.5) with n = s + 1, scaled so the peak (n = w) is lr.
            ScheduleKind::Noam => {
                let (n, w) = ((s + 1) as f64, self.warmup.max(1) as f64);
                self.lr * (n / w).min((w / n).sqrt())
            }
            // nanoGPT's get_lr: linear warmup, cosine decay to min_lr, then flat.
            ScheduleKind::Cosine if s < self.warmup => {
                self.lr * (s + 1) as f64 / (self.warmup + 1) as f64
            }
            ScheduleKind::Cosine if s > self.decay => self.min_lr,
            ScheduleKind::Cosine => {
                let ratio = (s - self.warmup) as f64 / (self.decay - self.warmup).max(1) as f64;
                let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
                self.min_lr + coeff * (self.lr - self.min_lr)
            }
        }
    }
}

impl LrScheduler for WarmupSchedule {
    type Record<B: Backend> = usize;

    fn step(&mut self) -> LearningRate {
        let lr = self.at(self.step);
        self.step += 1;
        lr
    }

    fn to_record<B: Backend>(&self) -> usize {
        self.step
    }

    fn load_record<B: Backend>(mut self, record: usize) -> Self {
        self.step = record;
        self
    }
}
