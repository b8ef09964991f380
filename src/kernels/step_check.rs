//! The step check: before a training run's first step on a GPU, one step of the model it is
//! about to train, on a batch of its own data (up to 16 items), fused and composed, compared — the loss, every
//! parameter's gradient, and the optimizer's update of every parameter.
//!
//! The operation check ([`super::check`]) runs each fused kernel on small inputs. A kernel can
//! be right there and wrong at a run's shapes (a grid past a limit, an index past 32 bits, a
//! tile count the small inputs never reach) or wrong only beside the others in a real step
//! (buffers reused across launches, streams): the H200 run that trained nothing passed its
//! first forward pass. This check runs the real thing once. Where the step disagrees, the
//! operations whose composed forms make it agree are found one at a time (each time the one
//! that helps most) and run composed for the run, each with one warning line; the result is
//! cached per device, driver, binary and run shape beside the operation check's.

use super::check::{read_cache, rel_error, show_error, storable, write_cache, CachedStep};
use super::{adamw, dropout, fall_back, uses, with_composed, with_precision, AdamWStep};
use super::{LabAutodiff, Op, Precision};
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use std::sync::OnceLock;

/// The largest relative difference a step may show between its fused and composed forms,
/// over the loss, each parameter's gradient (relative to that gradient's largest element) and
/// each update: rounding through a whole model gives ~1e-5 on a CPU, and a GPU's composed
/// products on TF32 tensor cores (10-bit mantissas) some 1e-3; an operation off by 10% (the
/// tests' broken kernel) gives 0.1, and a kernel that stops a model from learning 1 and more.
pub const STEP_TOLERANCE: f32 = 2e-2;

/// The dropout stream's seed for the check (both forms draw the same masks).
const SEED: u64 = 0x57e9_c4ec;

/// The device identity under which this process's operation check ran, where it ran: a
/// training run then checks its first step under the same identity.
static WANTED: OnceLock<String> = OnceLock::new();

/// Asks for the step check before training, cached under `identity` (the operation check's).
pub fn want(identity: String) {
    let _ = WANTED.set(identity);
}

/// The identity the step check is cached under, where one is wanted.
pub fn wanted() -> Option<&'static str> {
    WANTED.get().map(String::as_str)
}

/// A step check's result.
#[derive(Clone, Debug, PartialEq)]
pub struct StepCheck {
    /// The fused step's largest relative difference from the composed one.
    pub error: f32,
    /// The operations that run composed for the step to agree, in the order found.
    pub composed: Vec<Op>,
}

/// Checks one step of `model` (its loss `loss`) where [`wanted`], or reads the cached result
/// for `shape` (what makes this run's shapes: its model, data and batch), and makes each
/// operation at fault fall back with one warning line.
pub fn prepare<B, M>(shape: &str, model: &M, loss: impl Fn(&M) -> Tensor<B, 1>)
where
    B: LabAutodiff,
    M: AutodiffModule<B>,
{
    let Some(identity) = wanted() else { return };
    let key = format!("{identity} | step {shape}");
    let mut cache = read_cache();
    let cached = match cache.steps.get(&key) {
        Some(cached) => cached.clone(),
        None => {
            eprintln!(
                "checking this run's first step, fused against composed, at its own shapes \
                 (once per device, driver, binary and model shape)"
            );
            let result = check_step(model, &loss);
            let cached = CachedStep {
                error: storable(result.error),
                composed: result.composed.iter().map(|op| op.name().into()).collect(),
            };
            cache.steps.insert(key, cached.clone());
            write_cache(&cache);
            cached
        }
    };
    for name in &cached.composed {
        if let Some(op) = Op::from_name(name) {
            fall_back(op);
            eprintln!(
                "warning: a training step with the fused {name} kernel disagrees with its \
                 composed form on this device (relative error {} > {STEP_TOLERANCE:.0e}): {name} \
                 runs composed in this run",
                show_error(cached.error)
            );
        }
    }
}

/// One step of `model` fused against the same step composed: the error, and the operations
/// that must run composed for the step to agree (found greedily: each round adds the one whose
/// composed form leaves the smallest error). The products run in `f32` whatever the run's
/// precision: a half-precision product differs from the composed `f32` one by its rounding,
/// which is not a fault (the operation check holds it to its own tolerance).
pub fn check_step<B, M>(model: &M, loss: &impl Fn(&M) -> Tensor<B, 1>) -> StepCheck
where
    B: LabAutodiff,
    M: AutodiffModule<B>,
{
    // On a GPU every output of our kernels starts as NaN (as in the operation check).
    #[cfg(feature = "cube-kernels")]
    let _poisoned = super::cube::poisoned();
    with_precision(Precision::F32, || greedy(model, loss))
}

/// [`check_step`] at the thread's precision.
fn greedy<B, M>(model: &M, loss: &impl Fn(&M) -> Tensor<B, 1>) -> StepCheck
where
    B: LabAutodiff,
    M: AutodiffModule<B>,
{
    let reference = Step::run(model, loss, &Op::ALL);
    let error_with = |composed: &[Op]| Step::run(model, loss, composed).error(&reference, composed);
    let error = error_with(&[]);
    let mut composed = Vec::new();
    let mut left = error;
    while left > STEP_TOLERANCE {
        let best = Op::ALL
            .into_iter()
            .filter(|op| uses(*op) && !composed.contains(op))
            .map(|op| {
                let with: Vec<Op> = composed.iter().copied().chain([op]).collect();
                (op, error_with(&with))
            })
            .min_by(|a, b| a.1.total_cmp(&b.1));
        let Some((op, error)) = best else { break };
        composed.push(op);
        left = error;
    }
    StepCheck { error, composed }
}

/// A parameter, flattened, and its gradient where it has one.
type ParamGrad<B> = (
    Tensor<<B as AutodiffBackend>::InnerBackend, 1>,
    Option<Tensor<<B as AutodiffBackend>::InnerBackend, 1>>,
);

/// What one step gives: its loss, and each parameter (flattened) with its gradient.
struct Step<B: AutodiffBackend> {
    loss: f32,
    params: Vec<ParamGrad<B>>,
}

impl<B: LabAutodiff> Step<B> {
    /// The loss and gradients of `model` with `composed` composed (the rest fused), dropout
    /// drawing the check's masks.
    fn run<M: AutodiffModule<B>>(
        model: &M,
        loss: &impl Fn(&M) -> Tensor<B, 1>,
        composed: &[Op],
    ) -> Self {
        with_composed(composed, || {
            dropout::reseed(SEED);
            let value = loss(model);
            let grads = value.backward();
            let mut visitor = Gradients::<B> {
                grads: &grads,
                params: Vec::new(),
            };
            model.visit(&mut visitor);
            Step {
                loss: value.into_scalar().elem::<f32>(),
                params: visitor.params,
            }
        })
    }

    /// The largest relative difference of this step from `reference`: the loss, each
    /// gradient, and AdamW's first two updates of each parameter from the reference gradient
    /// (the optimizer with `composed` composed against the optimizer composed).
    fn error(&self, reference: &Self, composed: &[Op]) -> f32 {
        let mut error = (self.loss - reference.loss).abs() / reference.loss.abs().max(1e-6);
        if !error.is_finite() {
            return f32::INFINITY;
        }
        for ((_, grad), (param, reference_grad)) in self.params.iter().zip(&reference.params) {
            error = error.max(match (grad, reference_grad) {
                (Some(a), Some(b)) => rel_error(a.clone(), b.clone()),
                (None, None) => 0.0,
                _ => f32::INFINITY,
            });
            if let Some(grad) = reference_grad {
                error = error.max(adamw_error::<B>(param, grad, composed));
            }
        }
        error
    }
}

/// AdamW's first two steps on `param` with `grad`, with `composed` composed, against both
/// steps composed: the updates and the moments.
fn adamw_error<B: LabAutodiff>(
    param: &Tensor<B::InnerBackend, 1>,
    grad: &Tensor<B::InnerBackend, 1>,
    composed: &[Op],
) -> f32 {
    let step = |time| AdamWStep {
        lr: 1e-3,
        beta_1: 0.9,
        beta_2: 0.99,
        epsilon: 1e-8,
        weight_decay: 0.1,
        time,
    };
    // Clipping's factor as training passes it (a global norm over the limit).
    let clip = || Some(Tensor::from_floats([0.7], &param.device()));
    let steps = |ops: &[Op]| {
        with_composed(ops, || {
            let (p1, m1, v1) = adamw(param.clone(), grad.clone(), None, step(1), clip());
            let moments = Some((m1.clone(), v1));
            let (p2, m2, v2) = adamw(p1.clone(), grad.clone(), moments, step(2), clip());
            [p1 - param.clone(), p2 - param.clone(), m1, m2, v2]
        })
    };
    let (ours, theirs) = (steps(composed), steps(&Op::ALL));
    ours.into_iter()
        .zip(theirs)
        .fold(0.0f32, |error, (a, b)| error.max(rel_error(a, b)))
}

/// Collects each float parameter of a module, flattened, with its gradient.
struct Gradients<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    params: Vec<ParamGrad<B>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Gradients<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        let grad = value.grad(self.grads).map(|g| g.reshape([-1]));
        self.params.push((value.inner().reshape([-1]), grad));
    }
}
