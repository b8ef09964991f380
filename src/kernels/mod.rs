//! Fused kernels, through burn's backend-extension mechanism.
//!
//! [`LabBackend`] extends burn's `Backend` with the operations that dominate a transformer's
//! training step when they are composed from small tensor ops: GELU, LayerNorm, the softmax of
//! attention, and attention itself. Every method has a default written with burn's own tensor
//! ops (so any backend works — ndarray and wgpu use the defaults), a backend may override it with
//! a kernel (flex does, in [`cpu`]), and `Autodiff<B>` overrides the differentiable entry points
//! with one graph node each whose backward pass calls the inner backend's fused backward
//! ([`autodiff`]), instead of a dozen recorded element-wise ops.
//!
//! The model code calls the free functions of this module ([`gelu`], [`layer_norm`],
//! [`softmax`], [`attention`]); each falls back to the composed reference ([`reference`]) when
//! fused kernels are switched off ([`set_fused`], `--no-fused` on the command line), which is how
//! the tests and `bench kernels` compare the two.
//!
//! Attention here is "flash-style": the kernel walks `64 × 64` tiles of queries and keys with an
//! online softmax, saving only the output and each row's log-sum-exp for the backward pass,
//! which recomputes the probabilities tile by tile — the `t × s` score matrix is never stored.

mod autodiff;
mod composed;
pub mod cpu;
#[cfg(feature = "flex")]
mod flex;
pub mod reference;

use burn::nn::LayerNorm;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::Bool;
use composed::{prim, tensor};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

/// A backend with the fused operations of this crate. Every method has a composed default.
///
/// Shapes are those of the free functions below; `pad` is a `[b, s]` float tensor, `1` where the
/// key is padding (masked out), `0` elsewhere.
pub trait LabBackend: Backend {
    /// Exact GELU, `x·Φ(x)` (the erf form).
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        composed::gelu::<Self>(x)
    }

    /// `grad · d GELU(x)/dx = grad · (Φ(x) + x·φ(x))`.
    fn fused_gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        composed::gelu_backward::<Self>(x, grad)
    }

    /// LayerNorm of the rows of `x` `[n, d]`.
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        Self::fused_layer_norm_forward(x, gamma, beta, epsilon).0
    }

    /// LayerNorm returning `(y [n, d], mean [n], 1/σ [n])`, what its backward needs.
    fn fused_layer_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        composed::layer_norm_forward::<Self>(x, gamma, beta, epsilon)
    }

    /// The gradients `(dx [n, d], dγ [d], dβ [d])` of LayerNorm for the output gradient `dy`.
    fn fused_layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        composed::layer_norm_backward::<Self>(x, gamma, mean, rstd, dy)
    }

    /// Softmax over the last dimension of `x` `[n, s]`.
    fn fused_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        composed::softmax::<Self>(x)
    }

    /// `dx = p ⊙ (dp − Σ_j p_j·dp_j)`, row by row, for `p = softmax(x)` `[n, s]`.
    fn fused_softmax_backward(p: FloatTensor<Self>, dp: FloatTensor<Self>) -> FloatTensor<Self> {
        composed::softmax_backward::<Self>(p, dp)
    }

    /// Attention `softmax(Q·Kᵀ/√k + mask)·V` without its weights.
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        pad: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        Self::fused_attention_forward(q, k, v, causal, pad).0
    }

    /// Attention returning `(output [b, h, t, k], log-sum-exp of each row's scores [b, h, t])`.
    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        pad: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        composed::attention_forward::<Self>(q, k, v, causal, pad)
    }

    /// The gradients `(dq, dk, dv)` of attention for the output gradient `d_o`, from the
    /// forward pass's output and log-sum-exp.
    #[allow(clippy::too_many_arguments)]
    fn fused_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        causal: bool,
        pad: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        composed::attention_backward::<Self>(q, k, v, o, lse, d_o, causal, pad)
    }
}

/// A training backend: autodiff over a [`LabBackend`], itself one.
pub trait LabAutodiff: AutodiffBackend<InnerBackend: LabBackend> + LabBackend {}

impl<B: AutodiffBackend<InnerBackend: LabBackend> + LabBackend> LabAutodiff for B {}

#[cfg(feature = "ndarray")]
impl LabBackend for crate::backend::Cpu {}

#[cfg(feature = "wgpu")]
impl LabBackend for crate::backend::Gpu {}

static FUSED: AtomicBool = AtomicBool::new(true);

thread_local! {
    static FUSED_HERE: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Switches the fused kernels on or off for the whole process (`--no-fused`).
pub fn set_fused(on: bool) {
    FUSED.store(on, Ordering::Relaxed);
}

/// Runs `f` on this thread with the fused kernels on or off, whatever the process setting
/// (tests compare both in one process).
pub fn with_fused<R>(on: bool, f: impl FnOnce() -> R) -> R {
    let before = FUSED_HERE.with(|c| c.replace(Some(on)));
    struct Restore(Option<bool>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FUSED_HERE.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(before);
    f()
}

/// Whether the fused kernels are in use on this thread.
pub fn fused() -> bool {
    FUSED_HERE
        .with(Cell::get)
        .unwrap_or_else(|| FUSED.load(Ordering::Relaxed))
}

/// GELU (exact, erf form), any shape.
pub fn gelu<B: LabBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    if !fused() {
        return reference::gelu(x);
    }
    let shape = x.shape();
    tensor::<B, 1>(B::fused_gelu(prim(x.reshape([-1])))).reshape(shape)
}

/// `norm` applied to the last dimension of `x`.
pub fn layer_norm<B: LabBackend, const D: usize>(
    norm: &LayerNorm<B>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    if !fused() {
        return norm.forward(x);
    }
    let shape = x.shape();
    let d = shape[D - 1];
    let y = B::fused_layer_norm(
        prim(x.reshape([-1, d as i32])),
        prim(norm.gamma.val()),
        norm.beta.as_ref().map(|beta| prim(beta.val())),
        LAYER_NORM_EPSILON,
    );
    tensor::<B, 2>(y).reshape(shape)
}

/// The epsilon of every LayerNorm in the crate (burn's `LayerNormConfig` default).
pub const LAYER_NORM_EPSILON: f64 = 1e-5;

/// Softmax over the last dimension, any shape.
pub fn softmax<B: LabBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    if !fused() {
        return burn::tensor::activation::softmax(x, D - 1);
    }
    let shape = x.shape();
    let s = shape[D - 1];
    tensor::<B, 2>(B::fused_softmax(prim(x.reshape([-1, s as i32])))).reshape(shape)
}

/// Softmax attention without its weights: `softmax(Q·Kᵀ/√k + mask)·V`, masked scores set to
/// [`MASKED_SCORE`](crate::nn::attention::MASKED_SCORE) (a fully masked row attends uniformly, as the composed form does).
///
/// # Shapes
/// `q`: `[b, h, t, k]`, `k`, `v`: `[b, h, s, k]`; `causal` needs `t = s`; `pad`: `[b, s]`,
/// `true` = masked out → `[b, h, t, k]`.
pub fn attention<B: LabBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    pad: Option<&Tensor<B, 2, Bool>>,
) -> Tensor<B, 4> {
    debug_assert!(!causal || q.dims()[2] == k.dims()[2]);
    let pad = pad.map(|pad| pad.clone().float());
    if !fused() {
        return reference::attention_forward(q, k, v, causal, pad).0;
    }
    tensor(B::fused_attention(
        prim(q),
        prim(k),
        prim(v),
        causal,
        pad.map(prim),
    ))
}
