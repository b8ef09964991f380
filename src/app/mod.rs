//! The subcommands, each generic over the backend: one file per command family, each thin (the
//! work is in the layers below; a model kind is asked of `kinds`, never matched here).

mod bench;
mod checkpoints;
mod doctor;
mod inspect;
mod text;
mod train;

use crate::backend::{check_available, default_backend, BackendKind};
use crate::cli::{BenchCommand, Command, ComputeArgs, KernelCheck};
use crate::kernels::LabBackend;
use crate::nn::without_weights;
use anyhow::{Context, Result};
use std::io::BufRead;

/// Something to run on a backend chosen at run time.
pub trait BackendTask: Send {
    /// Runs on backend `B` with device `device`.
    fn run<B: LabBackend>(self, device: B::Device) -> Result<()>;

    /// Whether a CPU backend runs it on a thread of the kernels' pool
    /// ([`crate::kernels::cpu::in_pool`]).
    fn in_pool(&self) -> bool {
        false
    }
}

/// Runs `task` on the chosen backend (the default one when `kind` is `None`).
pub fn dispatch(kind: Option<BackendKind>, task: impl BackendTask) -> Result<()> {
    let kind = kind.unwrap_or_else(default_backend);
    check_available(kind)?;
    match kind {
        #[cfg(feature = "ndarray")]
        BackendKind::Ndarray => on_cpu(task, |task| {
            task.run::<crate::backend::Cpu>(Default::default())
        }),
        #[cfg(feature = "flex")]
        BackendKind::Flex => on_cpu(task, |task| {
            task.run::<crate::backend::Flex>(Default::default())
        }),
        #[cfg(feature = "wgpu-backend")]
        BackendKind::Wgpu => {
            crate::backend::prepare_gpu(kind);
            task.run::<crate::backend::Gpu>(Default::default())
        }
        #[cfg(feature = "cuda-backend")]
        BackendKind::Cuda => {
            crate::backend::prepare_gpu(kind);
            task.run::<crate::backend::CudaGpu>(Default::default())
        }
        #[allow(unreachable_patterns)]
        _ => unreachable!("check_available refuses backends left out of the build"),
    }
}

/// Runs a task on a CPU backend: in the kernels' thread pool when it asks to be.
#[allow(dead_code)] // unused in builds without a CPU backend
fn on_cpu<T: BackendTask>(task: T, run: impl FnOnce(T) -> Result<()> + Send) -> Result<()> {
    if task.in_pool() {
        crate::kernels::cpu::in_pool(|| run(task))
    } else {
        run(task)
    }
}

/// What a command computes on.
enum Needs {
    /// Nothing: it reads files and draws.
    Nothing,
    /// The default CPU backend: it moves weights between formats and computes nothing.
    Cpu,
    /// A backend, with the fused kernels as they are (it compares them with the composed
    /// forms itself).
    Backend(Option<BackendKind>),
    /// A backend, fused or composed, with the kernel check before.
    Compute(ComputeArgs),
}

impl Command {
    /// The backend options this command takes (its own, before those given before its name).
    fn needs(&self, outer: &ComputeArgs) -> Needs {
        let compute = |own: &ComputeArgs| Needs::Compute(own.clone().or(outer));
        match self {
            Command::Curves(_) => Needs::Nothing,
            Command::Import(_) | Command::Export(_) => Needs::Cpu,
            Command::Doctor(args) => Needs::Backend(args.backend.backend.or(outer.backend)),
            Command::Train(args) => compute(&args.compute),
            Command::Generate(args) => compute(&args.compute),
            Command::Serve(args) => compute(&args.compute),
            Command::Eval(args) => compute(&args.compute),
            Command::Translate(args) => compute(&args.compute),
            Command::Predict(args) => compute(&args.compute),
            Command::ZeroShot(args) => compute(&args.compute),
            Command::Classify(args) => compute(&args.compute),
            Command::FillMask(args) => compute(&args.compute),
            Command::Embed(args) => compute(&args.compute),
            Command::Attention(args) => compute(&args.compute),
            Command::Explain(args) => compute(&args.compute),
            Command::Heads(args) => compute(&args.compute),
            Command::Bench(args) => match &args.what {
                BenchCommand::Train(args) => compute(&args.compute),
                BenchCommand::Mixers(args) => compute(&args.compute),
                BenchCommand::Generate(args) => compute(&args.compute),
                BenchCommand::Serve(_) => Needs::Nothing,
                BenchCommand::Kernels(args) => {
                    Needs::Backend(args.backend.backend.or(outer.backend))
                }
                BenchCommand::Matmul(args) => {
                    Needs::Backend(args.backend.backend.or(outer.backend))
                }
            },
        }
    }
}

/// Runs `command` on the backend its options (or `outer`, the options given before its name)
/// choose, the default one where none is named; commands that compute nothing run on none
/// (`curves`) or on the CPU (`import`, `export`) and take no backend options (those given
/// before their name are for the commands that compute). Commands that compute check the
/// fused kernels on the device first ([`doctor::prepare`]).
pub fn run(outer: ComputeArgs, command: Command) -> Result<()> {
    match command.needs(&outer) {
        Needs::Nothing => match command {
            Command::Curves(args) => run_curves(args),
            Command::Bench(crate::cli::BenchArgs {
                what: BenchCommand::Serve(args),
            }) => bench::run_bench_serve(args),
            _ => unreachable!("only curves and bench serve need nothing"),
        },
        Needs::Cpu => dispatch(Some(crate::backend::cpu_default()), command),
        Needs::Backend(kind) => {
            let kind = kind.unwrap_or_else(default_backend);
            dispatch(
                Some(kind),
                Checked {
                    kind,
                    check: KernelCheck::Never,
                    command,
                },
            )
        }
        Needs::Compute(compute) => {
            let kind = compute.backend.unwrap_or_else(default_backend);
            crate::kernels::set_fused(!compute.no_fused);
            dispatch(
                Some(kind),
                Checked {
                    kind,
                    check: compute.kernel_check.unwrap_or(KernelCheck::Auto),
                    command,
                },
            )
        }
    }
}

/// A command run after the kernel check.
struct Checked {
    kind: BackendKind,
    check: KernelCheck,
    command: Command,
}

impl BackendTask for Checked {
    fn in_pool(&self) -> bool {
        self.command.in_pool()
    }

    fn run<B: LabBackend>(self, device: B::Device) -> Result<()> {
        if let Command::Doctor(args) = &self.command {
            return doctor::run_doctor::<B>(self.kind, &device, &args.only);
        }
        doctor::prepare::<B>(self.kind, self.check, &device)?;
        self.command.run::<B>(device)
    }
}

fn run_curves(args: crate::cli::CurvesArgs) -> Result<()> {
    crate::curves::compare(
        &args.dirs,
        &args.metric,
        &args.split,
        args.out.as_deref(),
        args.csv.as_deref(),
    )
}

impl BackendTask for Command {
    fn in_pool(&self) -> bool {
        // Training and its benchmarks, where the latches cost most. The commands whose
        // answers the server must reproduce run where the server's workers run them.
        matches!(self, Command::Train(_) | Command::Bench(_))
    }

    fn run<B: LabBackend>(self, device: B::Device) -> Result<()> {
        match self {
            Command::Train(args) => train::run_train::<B>(args, device),
            // These read logits only: attention runs as the fused kernel.
            Command::Generate(args) => without_weights(|| text::run_generate::<B>(args, device)),
            Command::Serve(args) => text::run_serve::<B>(args, device),
            Command::Eval(args) => without_weights(|| inspect::run_eval::<B>(args, device)),
            Command::Translate(args) => without_weights(|| text::run_translate::<B>(args, device)),
            Command::Predict(args) => without_weights(|| text::run_predict::<B>(args, device)),
            Command::ZeroShot(args) => without_weights(|| text::run_zero_shot::<B>(args, device)),
            Command::Classify(args) => without_weights(|| text::run_classify::<B>(args, device)),
            Command::FillMask(args) => without_weights(|| text::run_fill_mask::<B>(args, device)),
            Command::Embed(args) => text::run_embed::<B>(args, device),
            Command::Bench(args) => bench::run_bench::<B>(args, device),
            Command::Attention(args) => inspect::run_attention::<B>(args, device),
            Command::Explain(args) => inspect::run_explain::<B>(args, device),
            Command::Heads(args) => inspect::run_heads::<B>(args, device),
            Command::Import(args) => checkpoints::run_import::<B>(args, device),
            Command::Export(args) => checkpoints::run_export::<B>(args, device),
            Command::Curves(args) => run_curves(args),
            Command::Doctor(_) => unreachable!("doctor runs through Checked"),
        }
    }
}

/// The texts given as arguments, or else stdin's lines.
pub(crate) fn texts_or_stdin(texts: Vec<String>) -> Result<Vec<String>> {
    if !texts.is_empty() {
        return Ok(texts);
    }
    std::io::stdin()
        .lock()
        .lines()
        .collect::<std::io::Result<Vec<String>>>()
        .context("cannot read stdin as UTF-8 text")
}
