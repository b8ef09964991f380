//! The subcommands, each generic over the backend: one file per command family, each thin (the
//! work is in the layers below; a model kind is asked of `kinds`, never matched here).

mod bench;
mod checkpoints;
mod doctor;
mod inspect;
mod text;
mod train;

use crate::backend::{check_available, default_backend, BackendKind};
use crate::cli::{Command, KernelCheck};
use crate::kernels::LabBackend;
use crate::nn::without_weights;
use anyhow::{Context, Result};
use std::io::BufRead;

/// Something to run on a backend chosen at run time.
pub trait BackendTask {
    /// Runs on backend `B` with device `device`.
    fn run<B: LabBackend>(self, device: B::Device) -> Result<()>;
}

/// Runs `task` on the chosen backend (the default one when `kind` is `None`).
pub fn dispatch(kind: Option<BackendKind>, task: impl BackendTask) -> Result<()> {
    let kind = kind.unwrap_or_else(default_backend);
    check_available(kind)?;
    match kind {
        #[cfg(feature = "ndarray")]
        BackendKind::Ndarray => task.run::<crate::backend::Cpu>(Default::default()),
        #[cfg(feature = "flex")]
        BackendKind::Flex => task.run::<crate::backend::Flex>(Default::default()),
        #[cfg(feature = "wgpu-backend")]
        BackendKind::Wgpu => task.run::<crate::backend::Gpu>(Default::default()),
        #[cfg(feature = "cuda-backend")]
        BackendKind::Cuda => task.run::<crate::backend::CudaGpu>(Default::default()),
        #[allow(unreachable_patterns)]
        _ => unreachable!("check_available refuses backends left out of the build"),
    }
}

/// Runs `command`: on the backend `kind` names (the default one when `None`), or on none when
/// it computes nothing (`curves` reads files and draws). Commands that compute check the
/// fused kernels on the device first, as `check` says ([`doctor::prepare`]).
pub fn run(kind: Option<BackendKind>, check: KernelCheck, command: Command) -> Result<()> {
    let kind = kind.unwrap_or_else(default_backend);
    match command {
        Command::Curves(args) => run_curves(args),
        command => dispatch(
            Some(kind),
            Checked {
                kind,
                check,
                command,
            },
        ),
    }
}

/// A command run after the kernel check.
struct Checked {
    kind: BackendKind,
    check: KernelCheck,
    command: Command,
}

impl BackendTask for Checked {
    fn run<B: LabBackend>(self, device: B::Device) -> Result<()> {
        if let Command::Doctor = self.command {
            return doctor::run_doctor::<B>(self.kind, &device);
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
        &args.out,
        args.csv.as_deref(),
    )
}

impl BackendTask for Command {
    fn run<B: LabBackend>(self, device: B::Device) -> Result<()> {
        match self {
            Command::Train(args) => train::run_train::<B>(args, device),
            // These read logits only: attention runs as the fused kernel.
            Command::Generate(args) => without_weights(|| text::run_generate::<B>(args, device)),
            Command::Eval(args) => without_weights(|| inspect::run_eval::<B>(args, device)),
            Command::Translate(args) => without_weights(|| text::run_translate::<B>(args, device)),
            Command::Predict(args) => without_weights(|| text::run_predict::<B>(args, device)),
            Command::ZeroShot(args) => without_weights(|| text::run_zero_shot::<B>(args, device)),
            Command::Classify(args) => without_weights(|| text::run_classify::<B>(args, device)),
            Command::Embed(args) => text::run_embed::<B>(args, device),
            Command::Bench(args) => bench::run_bench::<B>(args, device),
            Command::Attention(args) => inspect::run_attention::<B>(args, device),
            Command::Explain(args) => inspect::run_explain::<B>(args, device),
            Command::Heads(args) => inspect::run_heads::<B>(args, device),
            Command::Import(args) => checkpoints::run_import::<B>(args, device),
            Command::Export(args) => checkpoints::run_export::<B>(args, device),
            Command::Curves(args) => run_curves(args),
            Command::Doctor => unreachable!("doctor runs through Checked"),
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
