//! Gradient clipping by the global norm over all parameters (PyTorch's `clip_grad_norm_`).
//!
//! burn's `GradientClipping::Norm` clips each tensor on its own; nanoGPT and most reference
//! trainers rescale all gradients together so that `‖g‖₂ over every parameter ≤ max_norm`.
//! The norm stays on the device: no host round-trip per step.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

/// Wraps an optimizer so every step first rescales the gradients to a global norm of at most
/// `max_norm` (no clipping when `max_norm` is 0).
#[derive(Clone)]
pub struct GlobalNormClip<O> {
    inner: O,
    max_norm: f32,
}

impl<O> GlobalNormClip<O> {
    /// Clips to `max_norm` before each step of `inner`.
    pub fn new(inner: O, max_norm: f32) -> Self {
        Self { inner, max_norm }
    }
}

impl<M, B, O> Optimizer<M, B> for GlobalNormClip<O>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    O: Optimizer<M, B>,
{
    type Record = O::Record;

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        let grads = if self.max_norm > 0.0 {
            clip_global_norm::<B, M>(&module, grads, self.max_norm)
        } else {
            grads
        };
        self.inner.step(lr, module, grads)
    }

    /// Multi-device steps are passed through unclipped (this project trains on one device).
    fn step_multi(&mut self, lr: f64, module: M, grads: MultiGradientsParams) -> M {
        self.inner.step_multi(lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        Self {
            inner: self.inner.load_record(record),
            max_norm: self.max_norm,
        }
    }
}

/// `g ← g · min(1, max_norm / (‖g‖₂ + 1e-6))` for every gradient of `module`, with `‖g‖₂` the
/// norm of all gradients concatenated.
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: GradientsParams,
    max_norm: f32,
) -> GradientsParams {
    let mut sum = SumSquares::<B> {
        grads: &grads,
        total: None,
    };
    module.visit(&mut sum);
    let Some(total) = sum.total else {
        return grads;
    };
    let norm = total.sqrt(); // [1]
    let scale = norm.add_scalar(1e-6).recip().mul_scalar(max_norm).clamp_max(1.0); // [1]
    let mut rescale = Rescale::<B> { grads, scale };
    module.visit(&mut rescale);
    rescale.grads
}

struct SumSquares<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    total: Option<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SumSquares<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let squares = grad.square().sum(); // [1]
            self.total = Some(match self.total.take() {
                Some(total) => total + squares,
                None => squares,
            });
        }
    }
}

struct Rescale<B: AutodiffBackend> {
    grads: GradientsParams,
    scale: Tensor<B::InnerBackend, 1>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Rescale<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let scale = self.scale.clone().reshape([1; D]); // broadcast over the gradient
            self.grads.register(param.id, grad * scale);
        }
    }
}
