//! `bench train`: the training speed of a language-model experiment on one backend — tokens per
//! second over several runs (median, warm-up steps excluded) and where a step's time goes
//! (forward, backward, optimizer).
//!
//! The step is the one `train` runs (the model's loss, `backward`, AdamW with global-norm
//! clipping and decoupled decay) without the Learner around it; batches are drawn from the real
//! corpus and built before timing starts, so data loading is not measured. The backend is
//! synchronised after each phase, so on an asynchronous backend (wgpu) each phase is timed whole.

pub mod generate;
pub mod kernels;
pub mod mixers;

use crate::config::ExperimentConfig;
use crate::data::{LmBatcher, LmItem, TokenWindows};
use crate::kernels::{LabAutodiff, LabBackend};
use crate::kinds::Corpus;
use crate::models::{LanguageModel, LmBatch};
use crate::train::reference_adamw;
use anyhow::{anyhow, Result};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::optim::{GradientsParams, Optimizer};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::path::Path;
use std::time::Instant;

/// How long to measure.
#[derive(Clone, Copy, Debug)]
pub struct BenchPlan {
    /// Timed steps per run.
    pub steps: usize,
    /// Untimed steps before them (allocator and kernel warm-up).
    pub warmup: usize,
    /// Independent runs, each from a freshly initialised model.
    pub runs: usize,
}

/// Seconds per phase of every timed step of one run.
#[derive(Clone, Debug, Default)]
pub struct RunTimes {
    /// The forward pass and loss.
    pub forward: Vec<f64>,
    /// `backward()`.
    pub backward: Vec<f64>,
    /// Clipping, decay and the AdamW update.
    pub optimizer: Vec<f64>,
}

impl RunTimes {
    /// Wall time of the run's timed steps.
    pub fn total(&self) -> f64 {
        self.forward
            .iter()
            .chain(&self.backward)
            .chain(&self.optimizer)
            .sum()
    }
}

/// What a benchmark measured.
#[derive(Clone, Debug)]
pub struct BenchReport {
    /// Tokens in one training step (`batch_size · context`).
    pub tokens_per_step: usize,
    /// Per run.
    pub runs: Vec<RunTimes>,
}

/// The median of `values` (the mean of the middle two for an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

impl BenchReport {
    /// Tokens per second of each run.
    pub fn tokens_per_second(&self) -> Vec<f64> {
        self.runs
            .iter()
            .map(|r| (r.forward.len() * self.tokens_per_step) as f64 / r.total())
            .collect()
    }

    /// The report as text: per-run and median tokens/s, and the median step split in ms.
    pub fn render(&self, backend: &str) -> String {
        let speeds = self.tokens_per_second();
        let list: Vec<String> = speeds.iter().map(|s| format!("{s:.0}")).collect();
        let all = |f: fn(&RunTimes) -> &Vec<f64>| -> Vec<f64> {
            self.runs
                .iter()
                .flat_map(|r| f(r).iter().copied())
                .collect()
        };
        let (fwd, bwd, opt) = (
            median(&all(|r| &r.forward)) * 1e3,
            median(&all(|r| &r.backward)) * 1e3,
            median(&all(|r| &r.optimizer)) * 1e3,
        );
        format!(
            "{backend}: {:.0} tokens/s (median of {} runs: {}; {} tokens per step)\n\
             median step {:.1} ms = forward {fwd:.1} + backward {bwd:.1} + optimizer {opt:.1}\n",
            median(&speeds),
            speeds.len(),
            list.join(", "),
            self.tokens_per_step,
            fwd + bwd + opt,
        )
    }
}

fn sync<B: LabBackend>(device: &B::Device) -> Result<()> {
    B::sync(device).map_err(|e| anyhow!("the backend failed: {e:?}"))
}

/// Trains the language model of `config` for `plan` on backend `B` and times every step.
pub fn bench_lm<B: LabAutodiff>(
    config: &ExperimentConfig,
    data_dir: &Path,
    plan: BenchPlan,
    device: &B::Device,
) -> Result<BenchReport> {
    let mut config = config.clone();
    let corpus = Corpus::load(&config, data_dir, None)?;
    let vocab = corpus.tokenizer.vocab_size();
    config.model.set_vocab_sizes(vocab, vocab);
    let lm = config.model_as::<crate::config::LmConfig>()?.clone();
    let train = &config.train;
    let windows = TokenWindows::new(corpus.train.clone(), lm.context);
    let mut rng = StdRng::seed_from_u64(config.seed);
    let batches: Vec<LmBatch<B>> = (0..plan.warmup + plan.steps)
        .map(|_| {
            let items: Vec<LmItem> = (0..train.batch_size)
                .map(|_| {
                    windows
                        .get(rng.random_range(0..windows.len()))
                        .expect("in range")
                })
                .collect();
            LmBatcher.batch(items, device)
        })
        .collect();
    let mut runs = Vec::new();
    for run in 0..plan.runs {
        B::seed(device, config.seed + run as u64);
        let mut model: LanguageModel<B> = lm.init(device);
        let mut optimizer = reference_adamw::<B, LanguageModel<B>>(train);
        let mut times = RunTimes::default();
        for (step, batch) in batches.iter().enumerate() {
            let began = Instant::now();
            let (loss, _, _) = model.loss(batch.clone());
            sync::<B>(device)?;
            let forward = began.elapsed().as_secs_f64();
            let grads = loss.backward();
            sync::<B>(device)?;
            let backward = began.elapsed().as_secs_f64() - forward;
            let grads = GradientsParams::from_grads(grads, &model);
            model = optimizer.step(train.lr, model, grads);
            sync::<B>(device)?;
            let optimizer_time = began.elapsed().as_secs_f64() - forward - backward;
            if step >= plan.warmup {
                times.forward.push(forward);
                times.backward.push(backward);
                times.optimizer.push(optimizer_time);
            }
        }
        runs.push(times);
    }
    Ok(BenchReport {
        tokens_per_step: train.batch_size * lm.context,
        runs,
    })
}
