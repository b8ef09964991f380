//! Linear warmup then cosine decay, exactly nanoGPT's `get_lr`.

use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::LearningRate;
use burn::prelude::Backend;

/// `lr·(s+1)/(warmup+1)` for `s < warmup`, then `min + ½(1 + cos(π·r))(lr − min)` with
/// `r = (s − warmup)/(decay − warmup)`, then `min_lr` after `decay` steps.
///
/// Its record is the step counter, so a resumed run continues the schedule where it stopped.
#[derive(Clone, Debug)]
pub struct WarmupCosine {
    lr: f64,
    min_lr: f64,
    warmup: usize,
    decay: usize,
    step: usize,
}

impl WarmupCosine {
    /// A schedule peaking at `lr` after `warmup` steps and reaching `min_lr` at step `decay`.
    pub fn new(lr: f64, min_lr: f64, warmup: usize, decay: usize) -> Self {
        Self {
            lr,
            min_lr,
            warmup,
            decay,
            step: 0,
        }
    }

    /// The learning rate at step `s` (0-based), without advancing.
    pub fn at(&self, s: usize) -> f64 {
        if s < self.warmup {
            return self.lr * (s + 1) as f64 / (self.warmup + 1) as f64;
        }
        if s > self.decay {
            return self.min_lr;
        }
        let ratio = (s - self.warmup) as f64 / (self.decay - self.warmup).max(1) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        self.min_lr + coeff * (self.lr - self.min_lr)
    }
}

impl LrScheduler for WarmupCosine {
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
