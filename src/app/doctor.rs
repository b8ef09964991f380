//! The on-device check of the fused kernels (`kernels::check`): before a command first uses
//! them on a GPU backend, and as the `doctor` command (a training run then also checks its
//! first step, `kernels::step_check`). A disagreeing operation prints one
//! warning line and runs composed for the rest of the process; the result is cached per
//! backend, device, driver and binary in the user's cache directory, so the check runs once.

use crate::backend::BackendKind;
use crate::cli::KernelCheck;
use crate::kernels::check::{
    broken_label, check, check_all, read_cache, show_error, storable, write_cache, Cached, OpCheck,
};
use crate::kernels::{fall_back, fused, step_check, LabBackend, Op};
use crate::user_cache::binary_identity;
use anyhow::{bail, Result};
use burn::backend::Autodiff;
use std::collections::BTreeMap;
use std::time::Instant;

/// Runs before a command on backend `kind`: unless `mode` says otherwise (or the fused kernels
/// are off), checks the fused operations on `device` (or reads the cached check) and makes
/// each one that disagrees fall back to its composed form, with one warning line each.
pub fn prepare<B: LabBackend>(
    kind: BackendKind,
    mode: KernelCheck,
    device: &B::Device,
) -> Result<()> {
    let wanted = match mode {
        KernelCheck::Auto => on_gpu(kind),
        KernelCheck::Always => true,
        KernelCheck::Never => false,
    };
    if !wanted || !fused() {
        return Ok(());
    }
    let identity = identity(kind);
    // A training run also checks its own first step, at its own shapes (`kinds::train`).
    step_check::want(identity.clone());
    let mut cache = read_cache();
    let results = match cache.checks.get(&identity) {
        Some(results) => results.clone(),
        None => {
            eprintln!(
                "checking the fused kernels on {} against their composed forms (once per \
                 device, driver and binary; --kernel-check never skips it)",
                describe(kind)
            );
            let results = to_cache(&check_all::<Autodiff<B>>(device, head_dim(kind)));
            cache.checks.insert(identity, results.clone());
            write_cache(&cache);
            results
        }
    };
    for (name, result) in &results {
        if result.error <= result.tolerance {
            continue;
        }
        if let Some(op) = Op::from_name(name) {
            fall_back(op);
            eprintln!(
                "warning: the fused {name} kernel disagrees with its composed form on this \
                 device (relative error {} > {:.0e}): {name} runs composed in this run \
                 (`transformer-lab doctor` shows every operation)",
                show_error(result.error),
                result.tolerance
            );
        }
    }
    Ok(())
}

/// `doctor`: checks the fused operations on `device` now (whatever the cache holds), prints
/// one table row per operation, and caches the result. Fails where an operation disagrees.
/// `only` (when not empty) checks those operations alone and caches nothing: a run reads a
/// check of every operation.
pub fn run_doctor<B: LabBackend>(kind: BackendKind, device: &B::Device, only: &[Op]) -> Result<()> {
    anyhow::ensure!(fused(), "doctor checks the fused kernels: drop --no-fused");
    let name = describe(kind);
    let started = Instant::now();
    let checks: Vec<OpCheck> = Op::ALL
        .into_iter()
        .filter(|op| only.is_empty() || only.contains(op))
        .map(|op| check::<Autodiff<B>>(op, device, head_dim(kind)))
        .collect();
    let seconds = started.elapsed().as_secs_f64();
    let backend = format!("{kind:?}").to_lowercase();
    println!(
        "{:<8} {:<40} {:<18} {:>10} {:>9}  result",
        "backend", "device", "operation", "max error", "tolerance"
    );
    for check in &checks {
        println!(
            "{:<8} {:<40} {:<18} {:>10} {:>9.0e}  {}",
            backend,
            truncate(&name, 40),
            check.op.name(),
            show_error(check.error),
            check.tolerance,
            if check.passed() { "pass" } else { "fallback" }
        );
    }
    if only.is_empty() {
        let mut cache = read_cache();
        cache.checks.insert(identity(kind), to_cache(&checks));
        write_cache(&cache);
    }
    let failed: Vec<&str> = checks
        .iter()
        .filter(|c| !c.passed())
        .map(|c| c.op.name())
        .collect();
    println!(
        "{} of {} operations agree with their composed forms ({seconds:.1} s, compilation \
         included)",
        checks.len() - failed.len(),
        checks.len()
    );
    if !failed.is_empty() {
        bail!(
            "fused kernels wrong on this device: {} (runs use their composed forms)",
            failed.join(", ")
        );
    }
    Ok(())
}

/// Whether `kind` runs on a GPU: cuda, or wgpu on a hardware adapter (not a CPU driver such
/// as Mesa's lavapipe, whose kernels the test suite covers).
fn on_gpu(kind: BackendKind) -> bool {
    #[cfg(feature = "wgpu-backend")]
    if kind == BackendKind::Wgpu {
        return crate::backend::hardware_gpu_present();
    }
    kind == BackendKind::Cuda
}

/// The attention head dimension the check compiles: 64, the common one, except on wgpu without
/// a hardware GPU (Mesa's lavapipe takes minutes to compile that kernel; 8 there).
fn head_dim(kind: BackendKind) -> usize {
    match kind == BackendKind::Wgpu && !on_gpu(kind) {
        true => 8,
        false => 64,
    }
}

fn truncate(text: &str, width: usize) -> String {
    match text.chars().count() > width {
        true => text.chars().take(width - 1).chain(['…']).collect(),
        false => text.to_string(),
    }
}

fn to_cache(checks: &[OpCheck]) -> BTreeMap<String, Cached> {
    checks
        .iter()
        .map(|c| {
            let cached = Cached {
                error: storable(c.error),
                tolerance: c.tolerance,
            };
            (c.op.name().to_string(), cached)
        })
        .collect()
}

/// What a cached check is valid for: backend, device and driver, this binary (its version,
/// size and modification time: a rebuild compiles other kernels), and the operations broken on
/// purpose ([`crate::kernels::check::BREAK_ENV`]), so that a result found with one never
/// stands for a run without it.
fn identity(kind: BackendKind) -> String {
    let identity = format!("{kind:?} | {} | {}", describe(kind), binary_identity());
    match broken_label() {
        None => identity,
        Some(broken) => format!("{identity} | broken: {broken}"),
    }
}

/// The device as `doctor` and the check cache name it: the backend's description and, on flex,
/// the form of the CPU kernels this processor runs (part of what a check covers).
fn describe(kind: BackendKind) -> String {
    let device = crate::backend::describe_device(kind);
    match kind {
        BackendKind::Flex => format!("{device}, {} kernels", crate::kernels::cpu::isa().label()),
        _ => device,
    }
}
