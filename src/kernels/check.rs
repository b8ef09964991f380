//! Each fused operation checked against its composed form on the device it will run on: small
//! random inputs, the outputs and every input's gradient compared. A GPU kernel can pass every
//! test on one driver and be wrong on another (a missing barrier, a read of memory nobody
//! wrote, an assumption about the plane size): the composed form is built from the backend's
//! own well-tested operations, so a disagreement means the kernel is wrong *here*, and that
//! operation falls back to the composed form ([`super::fall_back`]).
//!
//! The shapes are small but not trivial: several query and key tiles with a partial last one,
//! padded and fully masked rows, dropout drawn in the kernel, and the attention head dimension
//! the caller names (each head dimension compiles its own attention kernel; 64 is the common
//! one on a GPU — a CPU's software Vulkan driver takes minutes to compile that one, so a
//! smaller head is checked there).

use super::sum_squares_all;
use super::{
    adamw, attention, cross_entropy, dropout::DropoutMask, embedding, gelu, layer_norm, prim,
};
use super::{decode_linear, decode_qkv, packed_self_attention, product, reference, softmax};
use super::{with_fused, AdamWStep, After, LabAutodiff};
use super::{with_precision, LabBackend, Op, Precision, LAYER_NORM_EPSILON};
use crate::files::write_atomic;
use crate::user_cache::cache_dir;
use burn::module::Param;
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, TensorMetadata, TensorPrimitive};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::OnceLock;

/// The largest relative difference (to the largest reference magnitude) an `f32` operation may
/// show: summation order and fused multiply–adds give ~1e-6; a GPU whose composed products run
/// on TF32 tensor cores gives ~1e-3; a wrong kernel gives 1e-2 and more.
pub const F32_TOLERANCE: f32 = 5e-3;

/// The same for the linear layers' products in half precision (bf16 keeps 8 significant bits).
pub const HALF_TOLERANCE: f32 = 5e-2;

/// The environment variable that breaks named fused operations on purpose (comma-separated
/// names, see [`Op::name`]): their outputs are scaled by 1.1. How the tests check that a wrong
/// kernel is caught and falls back.
pub const BREAK_ENV: &str = "TRANSFORMER_LAB_BREAK_KERNEL";

/// One operation's check: the largest relative difference between its fused and composed
/// forms over the outputs and the gradients, and the tolerance it was held to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpCheck {
    /// The operation.
    pub op: Op,
    /// The largest relative difference (infinite where the fused form gave a NaN or an
    /// infinity).
    pub error: f32,
    /// The largest the check accepts.
    pub tolerance: f32,
}

impl OpCheck {
    /// Whether the fused form agrees with the composed form.
    pub fn passed(&self) -> bool {
        self.error <= self.tolerance
    }
}

/// Checks every fused operation on `device` of the training backend `B` (the fused path of
/// the inner backend is what it exercises), attention with heads of `head_dim`.
pub fn check_all<B: LabAutodiff>(device: &B::Device, head_dim: usize) -> Vec<OpCheck> {
    Op::ALL
        .into_iter()
        .map(|op| check::<B>(op, device, head_dim))
        .collect()
}

/// Checks one fused operation on `device` (attention with heads of `head_dim`).
pub fn check<B: LabAutodiff>(op: Op, device: &B::Device, head_dim: usize) -> OpCheck {
    // On a GPU every output of our kernels starts as NaN, so an element one leaves unwritten
    // fails the comparison instead of holding whatever the memory held.
    #[cfg(feature = "cube-kernels")]
    let _poisoned = super::cube::poisoned();
    let error = match op {
        Op::Gelu => gelu_error::<B>(device).max(feed_forward_error::<B>(device)),
        Op::LayerNorm => layer_norm_error::<B>(device),
        Op::Softmax => compare::<B, 3, 1>([random([2, 67, 70], 2, 3.0, device)], |[x]| softmax(x)),
        Op::Attention => attention_error::<B>(device, head_dim),
        Op::PackedAttention => packed_attention_error::<B>(device, head_dim),
        Op::Dropout => dropout_error::<B>(device),
        Op::CrossEntropy => cross_entropy_error::<B>(device),
        Op::AdamW => adamw_error::<B::InnerBackend>(device),
        Op::Linear => return linear_check::<B>(device),
        Op::Embedding => embedding_error::<B>(device),
        Op::DecodeLinear => decode_linear_error::<B::InnerBackend>(device),
    };
    OpCheck {
        op,
        error,
        tolerance: F32_TOLERANCE,
    }
}

/// The linear layer's product with bias, in `f32` and in each half type the device runs
/// (held to the half tolerance then).
fn linear_check<B: LabAutodiff>(device: &B::Device) -> OpCheck {
    let inputs = [
        random([67, 48], 3, 1.0, device),
        random([48, 40], 4, 0.2, device),
    ];
    let b = random::<B, 1>([40], 5, 1.0, device);
    let run = || compare::<B, 2, 2>(inputs.clone(), |[x, w]| product(x, w, Some(b.clone())));
    let mut error = with_precision(Precision::F32, run);
    let mut tolerance = F32_TOLERANCE;
    for half in [Precision::F16, Precision::Bf16] {
        let dtype = half.half().expect("a half precision");
        if B::InnerBackend::mixed_precision(device, dtype) {
            error = error.max(with_precision(half, run));
            tolerance = HALF_TOLERANCE;
        }
    }
    OpCheck {
        op: Op::Linear,
        error,
        tolerance,
    }
}

/// The operations [`BREAK_ENV`] breaks, read once per process, each with the size above which
/// it is broken: `gelu` breaks every GELU, `gelu>10000` only those of more than 10,000
/// elements (a kernel right on the check's small inputs and wrong on a run's: what the step
/// check is for).
pub(crate) fn broken() -> &'static [(Op, usize)] {
    static BROKEN: OnceLock<Vec<(Op, usize)>> = OnceLock::new();
    BROKEN.get_or_init(|| {
        std::env::var(BREAK_ENV)
            .unwrap_or_default()
            .split(',')
            .filter_map(|spec| {
                let (name, above) = spec.split_once('>').unwrap_or((spec, "0"));
                Some((Op::from_name(name.trim())?, above.trim().parse().ok()?))
            })
            .collect()
    })
}

/// The operations broken on purpose as [`BREAK_ENV`] names them (`gelu`, `gelu>10000`), for
/// the identity a check is cached under; `None` where none is.
pub(crate) fn broken_label() -> Option<String> {
    let names: Vec<String> = broken()
        .iter()
        .map(|&(op, above)| match above {
            0 => op.name().to_string(),
            _ => format!("{}>{above}", op.name()),
        })
        .collect();
    (!names.is_empty()).then(|| names.join(","))
}

/// `x` scaled by 1.1 where [`BREAK_ENV`] names `op` (at `x`'s size), else `x`.
pub(crate) fn sabotage<B: Backend, const D: usize>(op: Op, x: Tensor<B, D>) -> Tensor<B, D> {
    let x = sabotage_float::<B>(op, x.into_primitive().tensor());
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// [`sabotage`] of a tensor of any rank.
pub(crate) fn sabotage_float<B: Backend>(op: Op, x: FloatTensor<B>) -> FloatTensor<B> {
    let elements = x.shape().num_elements();
    match broken()
        .iter()
        .any(|&(o, above)| o == op && elements > above)
    {
        true => B::float_mul_scalar(x, 1.1f32.into()),
        false => x,
    }
}

/// One operation's result as the cache keeps it.
#[derive(Serialize, Deserialize, Clone, Copy)]
pub(crate) struct Cached {
    /// The largest relative difference (`f32::MAX` for a non-finite one).
    pub error: f32,
    /// What it was held to.
    pub tolerance: f32,
}

/// A step check's result as the cache keeps it ([`super::step_check`]).
#[derive(Serialize, Deserialize, Clone)]
pub(crate) struct CachedStep {
    /// The fused step's largest relative difference from the composed one.
    pub error: f32,
    /// The operations that must run composed for the step to agree (none where it did).
    pub composed: Vec<String>,
}

/// The cache file: each device identity's operation checks, by operation name, and each step
/// check, by device identity and run shape.
#[derive(Serialize, Deserialize, Default)]
pub(crate) struct Cache {
    pub checks: BTreeMap<String, BTreeMap<String, Cached>>,
    #[serde(default)]
    pub steps: BTreeMap<String, CachedStep>,
}

/// `kernel-check.json` in the user's cache directory ([`cache_dir`]).
fn cache_file() -> Option<PathBuf> {
    Some(cache_dir()?.join("kernel-check.json"))
}

/// The cache, empty where there is none or it cannot be read (the checks then run again).
pub(crate) fn read_cache() -> Cache {
    cache_file()
        .and_then(|path| std::fs::read(path).ok())
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or_default()
}

/// Writes the cache whole; a cache that cannot be written only costs a check next time.
pub(crate) fn write_cache(cache: &Cache) {
    let Some(path) = cache_file() else { return };
    let written = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .map_err(anyhow::Error::from)
        .and_then(|()| Ok(serde_json::to_vec_pretty(cache)?))
        .and_then(|bytes| write_atomic(&path, &bytes));
    if let Err(err) = written {
        eprintln!(
            "note: the kernel check's cache was not written ({err:#}); it runs again next time"
        );
    }
}

/// An error as the cache keeps it: JSON has no infinity or NaN, so a non-finite one is
/// `f32::MAX` (which [`show_error`] prints as non-finite).
pub(crate) fn storable(error: f32) -> f32 {
    match error.is_finite() {
        true => error,
        false => f32::MAX,
    }
}

/// An error as the warnings and `doctor` print it.
pub(crate) fn show_error(error: f32) -> String {
    match error.is_finite() && error < f32::MAX {
        true => format!("{error:.1e}"),
        false => "non-finite".into(),
    }
}

/// A seeded tensor of uniform values with standard deviation `scale`.
fn random<B: Backend, const D: usize>(
    shape: [usize; D],
    seed: u64,
    scale: f32,
    device: &B::Device,
) -> Tensor<B, D> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = shape.iter().product();
    let half_width = scale * 3f32.sqrt();
    let values: Vec<f32> = (0..n)
        .map(|_| rng.random_range(-half_width..half_width))
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// The largest `|a − b|` relative to the largest `|b|`; infinite where `a` is not finite.
pub(crate) fn rel_error<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> f32 {
    let read = |x: Tensor<B, D>| -> Vec<f32> {
        x.into_data().convert::<f32>().to_vec().unwrap_or_default()
    };
    let (a, b) = (read(a), read(b));
    if a.len() != b.len() || a.iter().any(|x| !x.is_finite()) {
        return f32::INFINITY;
    }
    let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    let worst = a
        .iter()
        .zip(&b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    worst / scale
}

/// Runs `f` on fresh leaves made from `inputs`, fused and composed: the largest relative
/// difference of the outputs and of each input's gradient (of `Σ y ⊙ w`, random `w`).
fn compare<B: LabAutodiff, const D: usize, const N: usize>(
    inputs: [Tensor<B, D>; N],
    f: impl Fn([Tensor<B, D>; N]) -> Tensor<B, D>,
) -> f32 {
    let run = |on: bool| {
        with_fused(on, || {
            let leaves = inputs.clone().map(|x| x.detach().require_grad());
            let y = f(leaves.clone());
            let w = random::<B, D>(y.dims(), 99, 1.0, &y.device());
            let grads = (y.clone() * w).sum().backward();
            let dx = leaves.map(|x| x.grad(&grads).map(|g| g.reshape([-1])));
            (y.inner(), dx)
        })
    };
    worst::<B, D>(run(true), run(false))
}

/// The largest relative error of the fused run's output and gradients against the composed
/// run's; infinite where only one of them has a gradient.
fn worst<B: LabAutodiff, const D: usize>(
    (y_fused, grads_fused): (
        Tensor<B::InnerBackend, D>,
        impl IntoIterator<Item = Grad<B>>,
    ),
    (y_ref, grads_ref): (
        Tensor<B::InnerBackend, D>,
        impl IntoIterator<Item = Grad<B>>,
    ),
) -> f32 {
    let mut error = rel_error(y_fused, y_ref);
    for (a, b) in grads_fused.into_iter().zip(grads_ref) {
        error = error.max(match (a, b) {
            (Some(a), Some(b)) => rel_error(a, b),
            (None, None) => 0.0,
            _ => f32::INFINITY,
        });
    }
    error
}

/// A flattened gradient, where there is one.
type Grad<B> = Option<Tensor<<B as burn::tensor::backend::AutodiffBackend>::InnerBackend, 1>>;

/// GELU, and GELU with the dropout after it in one kernel (against GELU times the mask's
/// multipliers): outputs and the input's gradient.
fn gelu_error<B: LabAutodiff>(device: &B::Device) -> f32 {
    let x = random::<B, 3>([2, 67, 48], 1, 2.0, device);
    let plain = compare::<B, 3, 1>([x.clone()], |[x]| gelu(x));
    let n = 2 * 67 * 48;
    let drop = DropoutMask::new(0.25, 4444);
    let multipliers = Tensor::<B, 1>::from_data(TensorData::new(drop.multipliers(n), [n]), device);
    let run = |fused: bool| {
        let x = x.clone().reshape([n]).require_grad();
        let y = if fused {
            let y = B::fused_gelu_dropout(prim(x.clone()), drop);
            sabotage(
                Op::Gelu,
                Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(y)),
            )
        } else {
            super::reference::gelu(x.clone()) * multipliers.clone()
        };
        let w = random::<B, 1>([n], 97, 1.0, device);
        let grads = (y.clone() * w).sum().backward();
        (y.inner(), [x.grad(&grads)])
    };
    plain.max(worst::<B, 1>(run(true), run(false)))
}

/// A feed-forward network with GELU and dropout in one graph node (on a processor GELU is the
/// first product's epilogue) against the products, GELU and the mask's multipliers composed:
/// the output and the gradients of the input and of both layers' weights and biases.
fn feed_forward_error<B: LabAutodiff>(device: &B::Device) -> f32 {
    let [n, d, hidden] = [67, 48, 40];
    let x = random::<B, 2>([n, d], 21, 1.0, device);
    let weights = [([d, hidden], 22), ([hidden, d], 24)]
        .map(|(shape, seed)| random::<B, 2>(shape, seed, 0.2, device));
    let biases = [(hidden, 23), (d, 25)].map(|(o, seed)| random::<B, 1>([o], seed, 1.0, device));
    let drop = DropoutMask::new(0.25, 4545);
    let multipliers = TensorData::new(drop.multipliers(n * hidden), [n, hidden]);
    let multipliers = Tensor::<B, 2>::from_data(multipliers, device);
    let run = |fused: bool| {
        let x = x.clone().require_grad();
        let [w1, w2] = weights.clone().map(|w| w.require_grad());
        let [b1, b2] = biases.clone().map(|b| b.require_grad());
        let y = if fused {
            let y = B::fused_feed_forward(
                prim(x.clone()),
                [prim(w1.clone()), prim(w2.clone())],
                [Some(prim(b1.clone())), Some(prim(b2.clone()))],
                Some(drop),
            );
            sabotage(
                Op::Gelu,
                Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y)),
            )
        } else {
            let h = super::reference::linear_forward(x.clone(), w1.clone(), Some(b1.clone()));
            let h = super::reference::gelu(h) * multipliers.clone();
            super::reference::linear_forward(h, w2.clone(), Some(b2.clone()))
        };
        let w = random::<B, 2>(y.dims(), 96, 1.0, device);
        let grads = (y.clone() * w).sum().backward();
        let flat = |t: Tensor<B, 2>| t.grad(&grads).map(|g| g.reshape([-1]));
        let [dx, dw1, dw2] = [x, w1, w2].map(flat);
        let [db1, db2] = [b1, b2].map(|b| b.grad(&grads));
        (y.inner(), [dx, dw1, db1, dw2, db2])
    };
    worst::<B, 2>(run(true), run(false))
}

/// LayerNorm with random γ and β: outputs and the gradients of the input, γ and β.
fn layer_norm_error<B: LabAutodiff>(device: &B::Device) -> f32 {
    let d = 96;
    let mut norm = LayerNormConfig::new(d).init::<B>(device);
    norm.gamma = Param::from_tensor(random::<B, 1>([d], 6, 1.0, device).add_scalar(1.0));
    norm.beta = Some(Param::from_tensor(random::<B, 1>([d], 7, 1.0, device)));
    let x = random::<B, 3>([2, 67, d], 8, 2.0, device).add_scalar(1.0);
    let run = |on: bool| {
        with_fused(on, || {
            let x = x.clone().require_grad();
            let y = layer_norm(&norm, LAYER_NORM_EPSILON, x.clone());
            let w = random::<B, 3>(y.dims(), 99, 1.0, device);
            let grads = (y.clone() * w).sum().backward();
            let gamma = norm.gamma.val().grad(&grads);
            let beta = norm.beta.as_ref().and_then(|beta| beta.val().grad(&grads));
            let dx = x.grad(&grads).map(|g| g.reshape([-1]));
            (y.inner(), [dx, gamma, beta])
        })
    };
    let plain = worst::<B, 3>(run(true), run(false));
    // The residual form, `s = x + h ⊙ M` and its LayerNorm in one kernel, against the sum (the
    // mask as multipliers) and burn's LayerNorm: both outputs and the gradients of x, h, γ, β.
    let h = random::<B, 3>([2, 67, d], 9, 1.0, device);
    let drop = DropoutMask::new(0.25, 4343);
    let multipliers = Tensor::<B, 3>::from_data(
        TensorData::new(drop.multipliers(2 * 67 * d), [2, 67, d]),
        device,
    );
    let residual = |mask: Option<DropoutMask>, fused: bool| {
        let (x, h) = (x.clone().require_grad(), h.clone().require_grad());
        let (sum, y) = if fused {
            let (sum, y) = B::fused_add_layer_norm(
                prim(x.clone()),
                prim(h.clone()),
                mask,
                prim(norm.gamma.val()),
                norm.beta.as_ref().map(|beta| prim(beta.val())),
                LAYER_NORM_EPSILON,
            );
            let y = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(y));
            let sum = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(sum));
            (sum, sabotage(Op::LayerNorm, y))
        } else {
            let h = match mask {
                Some(_) => h.clone() * multipliers.clone(),
                None => h.clone(),
            };
            let sum = x.clone() + h;
            (sum.clone(), norm.forward(sum))
        };
        let both = Tensor::cat(vec![sum, y], 0);
        let w = random::<B, 3>(both.dims(), 98, 1.0, device);
        let grads = (both.clone() * w).sum().backward();
        let gamma = norm.gamma.val().grad(&grads);
        let beta = norm.beta.as_ref().and_then(|beta| beta.val().grad(&grads));
        let [dx, dh] = [x, h].map(|leaf| leaf.grad(&grads).map(|g| g.reshape([-1])));
        (both.inner(), [dx, dh, gamma, beta])
    };
    [Some(drop), None].into_iter().fold(plain, |error, mask| {
        error.max(worst::<B, 3>(residual(mask, true), residual(mask, false)))
    })
}

/// A padding mask `[b, s]` whose first row pads its last third and whose second row pads
/// every key (a fully masked row attends uniformly).
fn padding<B: Backend>(b: usize, s: usize, device: &B::Device) -> Tensor<B, 2, Bool> {
    let flags: Vec<bool> = (0..b * s)
        .map(|e| match e / s {
            0 => e % s >= s - s / 3,
            1 => true,
            _ => false,
        })
        .collect();
    Tensor::from_data(TensorData::new(flags, [b, s]), device)
}

/// Attention with `k`-wide heads over three key tiles: causal, padded (keys longer than
/// queries, one fully masked row), and causal with dropout.
fn attention_error<B: LabAutodiff>(device: &B::Device, k: usize) -> f32 {
    let qkv = |t: usize, s: usize, seed: u64| {
        [
            random::<B, 4>([2, 3, t, k], seed, 1.0, device),
            random::<B, 4>([2, 3, s, k], seed + 1, 1.0, device),
            random::<B, 4>([2, 3, s, k], seed + 2, 1.0, device),
        ]
    };
    let causal = compare::<B, 4, 3>(qkv(67, 67, 10), |[q, k, v]| {
        attention(q, k, v, true, None, None)
    });
    let pad = padding::<B>(2, 80, device);
    let [q, k, v] = qkv(45, 80, 20);
    let padded = compare::<B, 4, 3>([q, k, v], |[q, k, v]| {
        attention(q, k, v, false, Some(&pad), None)
    });
    let mask = DropoutMask::new(0.2, 4242);
    let dropped = compare::<B, 4, 3>(qkv(67, 67, 30), |[q, k, v]| {
        attention(q, k, v, true, None, Some(mask))
    });
    causal.max(padded).max(dropped)
}

/// Packed self-attention (2 heads of `k`): causal with dropout, and padded.
fn packed_attention_error<B: LabAutodiff>(device: &B::Device, k: usize) -> f32 {
    let qkv = random::<B, 3>([2, 67, 3 * 2 * k], 40, 1.0, device);
    let mask = DropoutMask::new(0.2, 77);
    let causal = compare::<B, 3, 1>([qkv.clone()], |[x]| {
        packed_self_attention(x, 2, true, None, Some(mask))
    });
    let pad = padding::<B>(2, 67, device);
    let padded = compare::<B, 3, 1>([qkv], |[x]| {
        packed_self_attention(x, 2, false, Some(&pad), None)
    });
    causal.max(padded)
}

/// Dropout drawn in the kernel against the CPU stream's mask, values and gradients.
fn dropout_error<B: LabAutodiff>(device: &B::Device) -> f32 {
    let n = 4099;
    let mask = DropoutMask::new(0.25, 4242);
    let multipliers = Tensor::<B, 1>::from_data(TensorData::new(mask.multipliers(n), [n]), device);
    let x = random::<B, 1>([n], 50, 1.0, device).require_grad();
    let w = random::<B, 1>([n], 51, 1.0, device);
    let y = with_fused(true, || {
        let y = B::fused_dropout(x.clone().into_primitive().tensor(), mask);
        sabotage(
            Op::Dropout,
            Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(y)),
        )
    });
    let grads = (y.clone() * w.clone()).sum().backward();
    let dx = x.grad(&grads);
    let values = rel_error(y.inner(), (x.clone() * multipliers.clone()).inner());
    let gradient = match dx {
        Some(dx) => rel_error(dx, (w.clone() * multipliers.clone()).inner()),
        None => f32::INFINITY,
    };
    // The residual form `r + x ⊙ M`: its values and both inputs' gradients.
    let r = random::<B, 1>([n], 52, 1.0, device).require_grad();
    let y = with_fused(true, || {
        let y = B::fused_dropout_add(
            r.clone().into_primitive().tensor(),
            x.clone().into_primitive().tensor(),
            mask,
        );
        sabotage(
            Op::Dropout,
            Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(y)),
        )
    });
    let grads = (y.clone() * w.clone()).sum().backward();
    let residual = rel_error(
        y.inner(),
        (r.clone() + x.clone() * multipliers.clone()).inner(),
    );
    let residual_gradients = match (r.grad(&grads), x.grad(&grads)) {
        (Some(dr), Some(dx)) => {
            rel_error(dr, w.clone().inner()).max(rel_error(dx, (w * multipliers).inner()))
        }
        _ => f32::INFINITY,
    };
    values.max(gradient).max(residual).max(residual_gradients)
}

/// Label-smoothed cross-entropy with ignored rows: row losses and the logits' gradient.
fn cross_entropy_error<B: LabAutodiff>(device: &B::Device) -> f32 {
    let (n, v) = (70, 65);
    let logits = random::<B, 2>([n, v], 60, 3.0, device);
    let mut rng = StdRng::seed_from_u64(61);
    let classes: Vec<i64> = (0..n).map(|_| rng.random_range(0..v as i64)).collect();
    let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(classes, [n]), device);
    compare::<B, 2, 1>([logits], |[x]| {
        cross_entropy(x, targets.clone(), 0.1, Some(3)).unsqueeze_dim(1)
    })
}

/// The token embedding's lookup and its table's gradient: 600 ids (three chunks of the GPU
/// kernel's), most rows named several times, one row (the last) by the first id, into a table
/// of 70 rows (two of the kernel's blocks of 64) 48 wide (one and a half blocks of columns).
fn embedding_error<B: LabAutodiff>(device: &B::Device) -> f32 {
    let (v, d, b, n) = (70, 48, 3, 200);
    let table = random::<B, 2>([v, d], 80, 1.0, device);
    let mut rng = StdRng::seed_from_u64(81);
    let mut ids: Vec<i64> = (0..b * n)
        .map(|_| rng.random_range(0..v as i64 - 1))
        .collect();
    ids[0] = v as i64 - 1;
    let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, n]), device);
    compare::<B, 2, 1>([table], |[w]| embedding(w, ids.clone()).reshape([b * n, d]))
}

/// A decoding step's products ([`decode_linear`]) against LayerNorm, the product, GELU and the
/// addition composed: 5 rows (two cubes of rows), 70 outputs (a partial block of columns), a
/// weight laid out as a linear layer's and one read transposed (a tied output layer's), with
/// and without each part; and the query, key and value product that writes into a cache.
fn decode_linear_error<B: LabBackend>(device: &B::Device) -> f32 {
    let (n, d, o) = (5, 96, 70);
    let mut norm = LayerNormConfig::new(d).init::<B>(device);
    norm.gamma = Param::from_tensor(random::<B, 1>([d], 80, 1.0, device).add_scalar(1.0));
    norm.beta = Some(Param::from_tensor(random::<B, 1>([d], 81, 1.0, device)));
    let mut plain = LayerNormConfig::new(d).with_bias(false).init::<B>(device);
    plain.gamma = norm.gamma.clone();
    let x = random::<B, 2>([n, d], 82, 2.0, device).add_scalar(1.0);
    let w = random::<B, 2>([d, o], 83, 0.2, device);
    let table = random::<B, 2>([o, d], 84, 0.2, device).transpose();
    let b = random::<B, 1>([o], 85, 1.0, device);
    let residual = random::<B, 2>([n, o], 86, 1.0, device);
    let cases = [
        (Some(&norm), w.clone(), Some(b.clone()), After::Nothing),
        (Some(&plain), table.clone(), None, After::Gelu),
        (None, w, Some(b), After::Gelu),
        (None, table, None, After::Residual(residual)),
    ];
    cases
        .into_iter()
        .map(|(norm, w, b, after)| {
            let input = match norm {
                Some(norm) => {
                    let beta = norm.beta.as_ref().map(|beta| beta.val());
                    let y = reference::layer_norm_forward(
                        x.clone(),
                        norm.gamma.val(),
                        beta,
                        LAYER_NORM_EPSILON,
                    );
                    y.0
                }
                None => x.clone(),
            };
            let y = reference::linear_forward(input, w.clone(), b.clone());
            let expected = match &after {
                After::Nothing => y,
                After::Gelu => reference::gelu(y),
                After::Residual(residual) => residual.clone() + y,
            };
            let norm = norm.map(|norm| (norm, LAYER_NORM_EPSILON));
            rel_error(decode_linear(x.clone(), norm, w, b, after), expected)
        })
        .fold(0.0, f32::max)
        .max(decode_qkv_error::<B>(&x, &norm, device))
}

/// The query, key and value product of a decoding step writing its keys and values into a
/// cache ([`decode_qkv`]) against the product and the cache's columns written apart: 5
/// sequences, 2 heads 4 wide, position 3 of a buffer of 6.
fn decode_qkv_error<B: LabBackend>(
    x: &Tensor<B, 2>,
    norm: &LayerNorm<B>,
    device: &B::Device,
) -> f32 {
    let [n, d_in] = x.dims();
    let (heads, width, capacity, at) = (2, 4, 6, 3);
    let d = heads * width;
    let w = random::<B, 2>([d_in, 3 * d], 87, 0.2, device);
    let b = random::<B, 1>([3 * d], 88, 1.0, device);
    let shape = [n, heads, capacity, width];
    let keys = random::<B, 4>(shape, 89, 1.0, device);
    let values = random::<B, 4>(shape, 90, 1.0, device);
    let beta = norm.beta.as_ref().map(|beta| beta.val());
    let (normed, _, _) =
        reference::layer_norm_forward(x.clone(), norm.gamma.val(), beta, LAYER_NORM_EPSILON);
    let y = reference::linear_forward(normed, w.clone(), Some(b.clone()));
    let part = |from: usize| {
        y.clone()
            .slice([0..n, from..from + d])
            .reshape([n, 1, heads, width])
            .swap_dims(1, 2)
    };
    let column = |buffer: Tensor<B, 4>, new: Tensor<B, 4>| {
        buffer.slice_assign([0..n, 0..heads, at..at + 1, 0..width], new)
    };
    let expected_keys = column(keys.clone(), part(d));
    let expected_values = column(values.clone(), part(2 * d));
    let norm = Some((norm, LAYER_NORM_EPSILON));
    let (q, keys, values) = decode_qkv(x.clone(), norm, w, Some(b), keys, values, at);
    rel_error(q, y.slice([0..n, 0..d]))
        .max(rel_error(keys, expected_keys))
        .max(rel_error(values, expected_values))
}

/// Two AdamW steps (the first, without moments, and a later one): parameter and moments, the
/// gradient a transposed view (read at its strides) scaled by clipping's factor; and the
/// squared global norm of that gradient and another.
fn adamw_error<B: LabBackend>(device: &B::Device) -> f32 {
    let shape = [67, 48];
    let param = random::<B, 2>(shape, 70, 1.0, device);
    let grad = random::<B, 2>([48, 67], 71, 0.1, device).transpose();
    let moments = (
        random::<B, 2>(shape, 72, 0.01, device),
        random::<B, 2>(shape, 73, 0.001, device).abs(),
    );
    let clip = || Some(Tensor::<B, 1>::from_floats([0.7], device));
    let step = |time| AdamWStep {
        lr: 3e-3,
        beta_1: 0.9,
        beta_2: 0.99,
        epsilon: 1e-8,
        weight_decay: 0.1,
        time,
    };
    let mut error = 0.0f32;
    for (moments, time) in [(None, 1), (Some(moments), 7)] {
        let run = |on: bool| {
            with_fused(on, || {
                adamw(
                    param.clone(),
                    grad.clone(),
                    moments.clone(),
                    step(time),
                    clip(),
                )
            })
        };
        let (p1, m1, v1) = run(true);
        let (p2, m2, v2) = run(false);
        // The update is small beside the parameter: compare the change, not the result.
        let update = rel_error(p1 - param.clone(), p2 - param.clone());
        error = error
            .max(update)
            .max(rel_error(m1, m2))
            .max(rel_error(v1, v2));
    }
    let other = random::<B, 1>([5_000], 74, 1.0, device);
    let [fused, composed] = [true, false].map(|on| {
        with_fused(on, || {
            let xs = vec![prim(grad.clone()), prim(other.clone())];
            sum_squares_all::<B>(xs)
        })
    });
    error.max(rel_error(fused, composed))
}
