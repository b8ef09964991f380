//! Timing training steps, for `bench train`: a fresh model trained on batches from the
//! training loader, every phase of every step timed (forward, backward, optimizer), and the
//! padding that variable-length batches carry.

use crate::config::ExperimentConfig;
use crate::kernels::profile::{self, OpTime, Phase};
use crate::kernels::{LabAutodiff, LabBackend};
use crate::train::{mix, padding_fraction, reference_adamw, replacement_batches};
use anyhow::{anyhow, Result};
use burn::data::dataloader::DataLoader;
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
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
    /// Also time every fused kernel call of the timed steps ([`crate::kernels::profile`]).
    pub profile: bool,
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
    /// Whole untimed warm-up steps (the first compiles kernels and autotunes on a GPU).
    pub warmup: Vec<f64>,
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
    /// What is counted: `tokens`, `target tokens`, `images`, `sentences`.
    pub unit: &'static str,
    /// Units in the timed steps of one run (every run trains on the same batches).
    pub units_per_run: usize,
    /// Per run.
    pub runs: Vec<RunTimes>,
    /// Lines printed under the numbers (padding of variable-length batches).
    pub notes: Vec<String>,
    /// The model's parameters (what a data-parallel step all-reduces, one f32 gradient each).
    pub parameters: usize,
    /// Each fused kernel's calls over every timed step of every run, when profiled.
    pub profile: Vec<OpTime>,
    /// The `f32` multiply-add rate the CPU's threads reach together on a loop that does
    /// nothing else, in FLOP/s ([`crate::kernels::cpu::fma_peak`]), measured after the runs
    /// when profiled on a CPU backend: the ceiling the products' rates are set against.
    pub peak: Option<f64>,
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
    /// Units per second of each run.
    pub fn per_second(&self) -> Vec<f64> {
        self.runs
            .iter()
            .map(|r| self.units_per_run as f64 / r.total())
            .collect()
    }

    /// The report as text: per-run and median units/s, and the median step split in ms.
    pub fn render(&self, backend: &str) -> String {
        let speeds = self.per_second();
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
        let steps = self.runs.first().map_or(1, |r| r.forward.len().max(1));
        let mut text = format!(
            "{backend}: {:.0} {unit}/s (median of {} runs: {}; {:.0} {unit} per step)\n\
             median step {:.1} ms = forward {fwd:.1} + backward {bwd:.1} + optimizer {opt:.1}\n",
            median(&speeds),
            speeds.len(),
            list.join(", "),
            self.units_per_run as f64 / steps as f64,
            fwd + bwd + opt,
            unit = self.unit,
        );
        if let Some(first) = self.runs.first().filter(|r| !r.warmup.is_empty()) {
            text.push_str(&format!(
                "warm-up, not counted above: the first step {:.2} s (kernel compilation, autotune), \
                 {} warm-up steps {:.2} s in the first run, {:.2} s in the last\n",
                first.warmup[0],
                first.warmup.len(),
                first.warmup.iter().sum::<f64>(),
                self.runs.last().map_or(0.0, |r| r.warmup.iter().sum::<f64>()),
            ));
        }
        if self.parameters > 0 {
            text.push_str(&format!(
                "{:.2} M parameters: a data-parallel step (--devices) all-reduces {:.1} MB of \
                 f32 gradients\n",
                self.parameters as f64 / 1e6,
                self.parameters as f64 * 4.0 / 1e6,
            ));
        }
        text.push_str(&self.render_profile());
        for note in &self.notes {
            text.push_str(note);
            text.push('\n');
        }
        text
    }

    /// Where a step's time goes, when profiled: each phase's fused kernels (calls and ms per
    /// step, share of the phase, means over every timed step) and the rest of the phase.
    fn render_profile(&self) -> String {
        let steps: usize = self.runs.iter().map(|r| r.forward.len()).sum();
        if self.profile.is_empty() || steps == 0 {
            return String::new();
        }
        let per_step = |seconds: f64| seconds * 1e3 / steps as f64;
        let mut text = format!(
            "where a step's time goes (means over {} runs × {} steps; each fused kernel timed \
             call by call; its matrix products' work a step, and that work over its time):\n\
             {:<10} {:<32} {:>9} {:>9} {:>7} {:>11} {:>9}\n",
            self.runs.len(),
            steps / self.runs.len().max(1),
            "phase",
            "operation",
            "calls",
            "ms/step",
            "share",
            "MFLOP/step",
            "GFLOP/s",
        );
        for phase in Phase::ALL {
            let phase_ms = per_step(
                self.runs
                    .iter()
                    .map(|r| match phase {
                        Phase::Forward => r.forward.iter().sum::<f64>(),
                        Phase::Backward => r.backward.iter().sum(),
                        Phase::Optimizer => r.optimizer.iter().sum(),
                    })
                    .sum(),
            );
            let share = |ms: f64| 100.0 * ms / phase_ms.max(f64::MIN_POSITIVE);
            let mut kernels = 0.0;
            for op in self.profile.iter().filter(|op| op.phase == phase) {
                let ms = per_step(op.seconds);
                kernels += ms;
                let [work, rate] = if op.flops > 0.0 {
                    [
                        format!("{:.1}", op.flops / steps as f64 / 1e6),
                        format!("{:.1}", op.flops / op.seconds.max(f64::MIN_POSITIVE) / 1e9),
                    ]
                } else {
                    Default::default()
                };
                let row = format!(
                    "{:<10} {:<32} {:>9.1} {:>9.2} {:>6.1}% {:>11} {:>9}",
                    phase.name(),
                    op.name,
                    op.calls as f64 / steps as f64,
                    ms,
                    share(ms),
                    work,
                    rate,
                );
                text.push_str(row.trim_end());
                text.push('\n');
            }
            let rest = phase_ms - kernels;
            text.push_str(&format!(
                "{:<10} {:<32} {:>9} {:>9.2} {:>6.1}%\n",
                phase.name(),
                "outside the fused kernels",
                "",
                rest,
                share(rest),
            ));
        }
        let (flops, seconds) = self
            .profile
            .iter()
            .filter(|op| op.flops > 0.0)
            .fold((0.0, 0.0), |(f, t), op| (f + op.flops, t + op.seconds));
        if let Some(peak) = self.peak.filter(|_| flops > 0.0) {
            let rate = flops / seconds.max(f64::MIN_POSITIVE);
            text.push_str(&format!(
                "the linear layers ran at {:.1} GFLOP/s over their calls: {:.0}% of the {:.1} \
                 GFLOP/s this machine's {} threads reach on f32 multiply-adds alone (measured \
                 now)\n",
                rate / 1e9,
                100.0 * rate / peak,
                peak / 1e9,
                rayon::current_num_threads(),
            ));
        }
        text
    }
}

fn sync<B: LabBackend>(device: &B::Device) -> Result<()> {
    B::sync(device).map_err(|e| anyhow!("the backend failed: {e:?}"))
}

/// The first `n` batches `loader` serves, epoch after epoch, built before anything is timed.
pub fn draw_batches<B: Backend, O>(loader: &dyn DataLoader<B, O>, n: usize) -> Vec<O> {
    let mut batches = Vec::with_capacity(n);
    while batches.len() < n {
        let before = batches.len();
        batches.extend(loader.iter().take(n - batches.len()));
        assert!(batches.len() > before, "a training loader served no batch");
    }
    batches
}

/// Trains a fresh model from `init` for `plan` on the batches `loader` serves (warm-up
/// batches first, all built before timing) with the step `train` runs — `loss`, `backward`,
/// AdamW with global-norm clipping and decoupled decay — and times every phase; each run
/// reseeds the backend with `seed + run` first. `units` counts a batch's `unit`s.
#[allow(clippy::too_many_arguments)]
pub fn bench_training<B, M, O>(
    config: &ExperimentConfig,
    plan: BenchPlan,
    loader: &dyn DataLoader<B, O>,
    unit: &'static str,
    units: impl Fn(&O) -> usize,
    init: impl Fn() -> M,
    loss: impl Fn(&M, O) -> Tensor<B, 1>,
    device: &B::Device,
) -> Result<BenchReport>
where
    B: LabAutodiff,
    M: AutodiffModule<B>,
    O: Clone,
{
    let train = &config.train;
    let batches = draw_batches(loader, plan.warmup + plan.steps);
    let units_per_run = batches[plan.warmup..].iter().map(units).sum();
    let mut runs = Vec::new();
    let mut parameters = 0;
    for run in 0..plan.runs {
        crate::kernels::seed::<B>(device, config.seed + run as u64);
        let mut model = init();
        parameters = model.num_params();
        let mut optimizer = reference_adamw::<B, M>(train);
        let mut times = RunTimes::default();
        for (step, batch) in batches.iter().enumerate() {
            let profiled = plan.profile && step >= plan.warmup;
            profile::enable(profiled);
            profile::set_phase(Phase::Forward);
            let began = Instant::now();
            let loss = loss(&model, batch.clone());
            sync::<B>(device)?;
            let forward = began.elapsed().as_secs_f64();
            profile::set_phase(Phase::Backward);
            let grads = loss.backward();
            sync::<B>(device)?;
            let backward = began.elapsed().as_secs_f64() - forward;
            profile::set_phase(Phase::Optimizer);
            let grads = GradientsParams::from_grads(grads, &model);
            model = optimizer.step(train.lr, model, grads);
            sync::<B>(device)?;
            let optimizer_time = began.elapsed().as_secs_f64() - forward - backward;
            profile::enable(false);
            if step >= plan.warmup {
                times.forward.push(forward);
                times.backward.push(backward);
                times.optimizer.push(optimizer_time);
            } else {
                times.warmup.push(began.elapsed().as_secs_f64());
                if run == 0 && step == 0 {
                    eprintln!(
                        "bench: the first step took {:.1} s (kernel compilation and autotune on \
                         a GPU); timing {} runs of {} steps",
                        began.elapsed().as_secs_f64(),
                        plan.runs,
                        plan.steps
                    );
                }
            }
        }
        runs.push(times);
    }
    Ok(BenchReport {
        unit,
        units_per_run,
        runs,
        notes: Vec::new(),
        parameters,
        profile: if plan.profile {
            profile::take()
        } else {
            Vec::new()
        },
        peak: (plan.profile && B::TIMED_KERNELS).then(crate::kernels::cpu::fma_peak),
    })
}

/// What padding costs the first epoch of `config`'s training draw over items of `lengths`
/// (one list per padded side, e.g. source and target), batched in draw order and by length
/// (grouped by `keys`): one line, e.g. `padding (epoch 1): source 41.0% → 3.2% by length`.
pub fn padding_note(
    config: &ExperimentConfig,
    sides: &[(&str, Vec<usize>)],
    keys: &[usize],
) -> String {
    let train = &config.train;
    let draw = |by_length: bool| {
        replacement_batches(
            keys.len(),
            train.steps_per_epoch,
            train.batch_size,
            mix(config.seed, 1),
            by_length.then_some(keys),
        )
    };
    let (plain, grouped) = (draw(false), draw(true));
    let parts: Vec<String> = sides
        .iter()
        .map(|(side, lengths)| {
            format!(
                "{side} {:.1}% → {:.1}% by length",
                100.0 * padding_fraction(&plain, lengths),
                100.0 * padding_fraction(&grouped, lengths)
            )
        })
        .collect();
    format!(
        "padding (positions that are padding, epoch 1): {}; timed batches {}",
        parts.join(", "),
        if train.batch_by_length {
            "grouped by length (train.batch_by_length)"
        } else {
            "in draw order (train.batch_by_length is off)"
        }
    )
}
