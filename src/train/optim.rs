//! [`ReferenceOptimizer`] makes burn's AdamW train like the reference (PyTorch/nanoGPT) setup:
//!
//! - clipping by the global norm over all parameters (PyTorch's
//!   `clip_grad_norm_`). burn's `GradientClipping::Norm` clips each tensor on its own; nanoGPT
//!   rescales all gradients together so that `‖g‖₂ over every parameter ≤ max_norm`. The norm
//!   stays on the device: no host round-trip per step.
//! - decoupled weight decay on matrices only (linear weights,
//!   embeddings), none on LayerNorm gains and biases — nanoGPT's two parameter groups. burn's
//!   AdamW decays every parameter.

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

/// Wraps an optimizer (AdamW without weight decay of its own) so every step first clips the
/// gradients to a global norm of at most `max_grad_norm` (0 = no clipping), then applies
/// decoupled weight decay `θ ← θ·(1 − lr·λ)` to parameters of rank ≥ 2 (0 = none), as
/// PyTorch's AdamW does before its update.
#[derive(Clone)]
pub struct ReferenceOptimizer<O> {
    inner: O,
    weight_decay: f64,
    max_grad_norm: f32,
}

impl<O> ReferenceOptimizer<O> {
    /// Decays matrices by `weight_decay` (λ) and clips to `max_grad_norm` around `inner`.
    pub fn new(inner: O, weight_decay: f64, max_grad_norm: f32) -> Self {
        Self {
            inner,
            weight_decay,
            max_grad_norm,
        }
    }
}

/// The optimizer training uses for `train`'s settings: AdamW (β₁, β₂, ε; no decay of its own)
/// inside global-norm clipping and decoupled decay of matrices.
pub fn reference_adamw<B: AutodiffBackend, M: AutodiffModule<B>>(
    train: &crate::config::TrainConfig,
) -> ReferenceOptimizer<impl Optimizer<M, B>> {
    let adamw = burn::optim::AdamWConfig::new()
        .with_beta_1(train.beta1)
        .with_beta_2(train.beta2)
        .with_epsilon(train.epsilon)
        .with_weight_decay(0.0)
        .init::<B, M>();
    ReferenceOptimizer::new(adamw, train.weight_decay as f64, train.grad_clip)
}

impl<M, B, O> Optimizer<M, B> for ReferenceOptimizer<O>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    O: Optimizer<M, B>,
{
    type Record = O::Record;

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        let grads = if self.max_grad_norm > 0.0 {
            clip_global_norm::<B, M>(&module, grads, self.max_grad_norm)
        } else {
            grads
        };
        let module = if self.weight_decay > 0.0 {
            module.map(&mut ScaleMatrices {
                factor: 1.0 - lr * self.weight_decay,
            })
        } else {
            module
        };
        self.inner.step(lr, module, grads)
    }

    /// Multi-device steps are passed through as they are (this project trains on one device).
    fn step_multi(&mut self, lr: f64, module: M, grads: MultiGradientsParams) -> M {
        self.inner.step_multi(lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        Self {
            inner: self.inner.load_record(record),
            ..self
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
    let scale = norm
        .add_scalar(1e-6)
        .recip()
        .mul_scalar(max_norm)
        .clamp_max(1.0); // [1]
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

/// Multiplies every parameter of rank ≥ 2 by `factor`, outside the autodiff graph.
struct ScaleMatrices {
    factor: f64,
}

impl<B: AutodiffBackend> ModuleMapper<B> for ScaleMatrices {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if D < 2 {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        let mut scaled = Tensor::from_inner(tensor.inner().mul_scalar(self.factor));
        if require_grad {
            scaled = scaled.require_grad();
        }
        Param::from_mapped_value(id, scaled, mapper)
    }
}
