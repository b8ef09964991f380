//! [`ReferenceOptimizer`] makes burn's AdamW train like the reference (PyTorch/nanoGPT) setup:
//!
//! - clipping by the global norm over all parameters (PyTorch's
//!   `clip_grad_norm_`). burn's `GradientClipping::Norm` clips each tensor on its own; nanoGPT
//!   rescales all gradients together so that `‖g‖₂ over every parameter ≤ max_norm`. The norm
//!   stays on the device: no host round-trip per step. With fused kernels the squares are
//!   summed without storing them (on a processor one parallel pass over all gradients; on a
//!   GPU partial sums of up to 32 gradients a launch and one launch adding them in a fixed
//!   order), and clipping's factor is multiplied into AdamW's update as it reads each gradient.
//! - every parameter updated in one call ([`AllAtOnce`]): on a processor one parallel pass over
//!   all of them (most are too small to split one at a time), on a GPU up to 32 a launch.
//! - decoupled weight decay on matrices only (linear weights,
//!   embeddings), none on LayerNorm gains and biases — nanoGPT's two parameter groups. burn's
//!   AdamW decays every parameter.

use crate::kernels::{self, AdamWItem, AdamWStep, LabAutodiff, LabBackend};
use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::GradAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{
    AdamWState, AdaptiveMomentumState, GradientsParams, LearningRate, MultiGradientsParams,
    Optimizer, SimpleOptimizer,
};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorPrimitive;
use hashbrown::HashMap;
use std::any::Any;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// Wraps an optimizer (AdamW without weight decay of its own) so every step first takes the
/// mean of accumulated gradients ([`ReferenceOptimizer::averaging`]) and clips the gradients
/// to a global norm of at most `max_grad_norm` (0 = no clipping), then applies
/// decoupled weight decay `θ ← θ·(1 − lr·λ)` to parameters of rank ≥ 2 (0 = none), as
/// PyTorch's AdamW does before its update.
#[derive(Clone)]
pub struct ReferenceOptimizer<O> {
    inner: O,
    weight_decay: f64,
    max_grad_norm: f32,
    /// Where the inner optimizer takes clipping's factor itself ([`LabAdamW`]): the gradients
    /// are then not rescaled first, the factor is multiplied in as the update reads them.
    clip: Option<ClipFactor>,
    /// What the gradients handed to a step are taken times: `1/n` where they are the sum of
    /// `n` batches' gradients (`train.grad_accumulation`), so the step takes their mean (and
    /// clips the mean's norm); 1 otherwise. Folded into the one factor the step multiplies the
    /// gradients by.
    grad_scale: f32,
    /// Steps taken by this process (for [`NAN_ENV`]).
    steps: usize,
}

/// Global-norm clipping's factor for the step under way, handed from [`ReferenceOptimizer`]
/// to the [`LabAdamW`] inside it (burn's optimizer interface passes one parameter's gradient
/// at a time): a `[1]` tensor of the inner backend, on the device, set for one step.
#[derive(Clone, Default)]
pub struct ClipFactor(Arc<Mutex<Option<Box<dyn Any + Send>>>>);

impl std::fmt::Debug for ClipFactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClipFactor")
    }
}

impl ClipFactor {
    fn set<B: Backend>(&self, factor: Option<Tensor<B, 1>>) {
        let mut slot = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *slot = factor.map(|t| Box::new(t) as Box<dyn Any + Send>);
    }

    fn get<B: Backend>(&self) -> Option<Tensor<B, 1>> {
        let slot = self.0.lock().unwrap_or_else(|e| e.into_inner());
        slot.as_ref().map(|t| {
            t.downcast_ref::<Tensor<B, 1>>()
                .expect("clipping's factor is a tensor of the optimizer's backend")
                .clone()
        })
    }
}

/// `TRANSFORMER_LAB_NAN_AFTER_STEPS=N`: every optimizer step after the process's N-th gets
/// NaN gradients, as a diverging run does (how the tests check that divergence stops loudly).
pub const NAN_ENV: &str = "TRANSFORMER_LAB_NAN_AFTER_STEPS";

impl<O> ReferenceOptimizer<O> {
    /// Decays matrices by `weight_decay` (λ) and clips to `max_grad_norm` around `inner`.
    pub fn new(inner: O, weight_decay: f64, max_grad_norm: f32) -> Self {
        Self {
            inner,
            weight_decay,
            max_grad_norm,
            clip: None,
            grad_scale: 1.0,
            steps: 0,
        }
    }

    /// Steps on the mean of gradients summed over `batches` batches (1: as handed over).
    pub fn averaging(self, batches: usize) -> Self {
        Self {
            grad_scale: 1.0 / batches.max(1) as f32,
            ..self
        }
    }
}

impl<M, B> ReferenceOptimizer<AllAtOnce<M, B>>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend<InnerBackend: LabBackend>,
{
    /// [`LabAdamW`] inside global-norm clipping to `max_grad_norm` (0 = none), the clipping
    /// factor multiplied into its update (one pass over each gradient fewer), every parameter
    /// updated in one call ([`AllAtOnce`]).
    pub fn lab_adamw(adamw: LabAdamW, max_grad_norm: f32) -> Self {
        let clip = adamw.clip.clone();
        Self {
            clip: Some(clip),
            ..Self::new(AllAtOnce::new(adamw), 0.0, max_grad_norm)
        }
    }
}

/// [`LabAdamW`] over a whole module in one call ([`kernels::adamw_all`]: on a GPU several
/// parameters a launch, where burn's [`OptimizerAdaptor`](burn::optim::adaptor::OptimizerAdaptor) steps one parameter at a time). Its
/// record is the adaptor's, so checkpoints of either load in the other.
#[derive(Clone)]
pub struct AllAtOnce<M, B: AutodiffBackend<InnerBackend: LabBackend>> {
    adamw: LabAdamW,
    records: HashMap<ParamId, AdaptorRecord<LabAdamW, B>>,
    module: PhantomData<M>,
}

impl<M, B: AutodiffBackend<InnerBackend: LabBackend>> AllAtOnce<M, B> {
    /// `adamw` with no state yet.
    pub fn new(adamw: LabAdamW) -> Self {
        Self {
            adamw,
            records: HashMap::new(),
            module: PhantomData,
        }
    }
}

impl<M, B> AllAtOnce<M, B>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend<InnerBackend: LabBackend>,
{
    fn step_all(&mut self, lr: LearningRate, module: M, grads: GradAdaptor) -> M {
        // The parameters are taken out of the module, not cloned, so that the update writes
        // into their buffers instead of copying each one first.
        let mut gather = Gather::<B> {
            adamw: &self.adamw,
            lr,
            records: &mut self.records,
            grads,
            items: Vec::new(),
            taken: Vec::new(),
            placeholders: HashMap::new(),
        };
        let module = module.map(&mut gather);
        let Gather { items, taken, .. } = gather;
        if items.is_empty() {
            return module;
        }
        let clip = self.adamw.clip.get::<B::InnerBackend>();
        let updated = kernels::adamw_all(items, clip);
        let mut results: HashMap<ParamId, Updated<B>> = taken
            .into_iter()
            .zip(updated)
            .map(|(taken, (p, m, v))| (taken.id, (p, m, v, taken)))
            .collect();
        module.map(&mut Scatter::<B> {
            records: &mut self.records,
            results: &mut results,
        })
    }
}

impl<M, B> Optimizer<M, B> for AllAtOnce<M, B>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend<InnerBackend: LabBackend>,
{
    type Record = HashMap<ParamId, AdaptorRecord<LabAdamW, B>>;

    fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        self.step_all(lr, module, grads.into())
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        self.step_all(lr, module, grads.into())
    }

    fn to_record(&self) -> Self::Record {
        self.records.clone()
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        self.records = record;
        self
    }
}

/// One parameter's update, flattened: the parameter and its two moments after the step, and
/// what was noted when it was taken out of the module.
type Updated<B> = (
    FloatTensor<<B as AutodiffBackend>::InnerBackend>,
    FloatTensor<<B as AutodiffBackend>::InnerBackend>,
    FloatTensor<<B as AutodiffBackend>::InnerBackend>,
    Taken,
);

/// A parameter [`Gather`] took out of the module (leaving a one-element placeholder): its id,
/// whether it requires a gradient, and the number of the step being taken.
struct Taken {
    id: ParamId,
    require_grad: bool,
    time: usize,
}

/// Takes every parameter that has a gradient out of the module, with its gradient and
/// moments, as [`kernels::adamw_all`] takes them (the module keeps a placeholder until
/// [`Scatter`] puts the update back). Nothing is reshaped or copied on the way, and the
/// placeholders are one tensor per rank: on a GPU backend each of those would be one more
/// operation through its fusion stream, several a parameter, for a step whose work is one
/// launch for every 32 parameters.
struct Gather<'a, B: AutodiffBackend<InnerBackend: LabBackend>> {
    adamw: &'a LabAdamW,
    lr: LearningRate,
    records: &'a mut HashMap<ParamId, AdaptorRecord<LabAdamW, B>>,
    grads: GradAdaptor,
    items: Vec<AdamWItem<B::InnerBackend>>,
    taken: Vec<Taken>,
    /// The one-element placeholder of each rank (a `Tensor<B, D>`), made at its first use.
    placeholders: HashMap<usize, Box<dyn Any>>,
}

impl<B: AutodiffBackend<InnerBackend: LabBackend>> ModuleMapper<B> for Gather<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, value, mapper) = param.consume();
        let Some((grad, device)) = self.grads.remove::<B::InnerBackend, D>(id) else {
            return Param::from_mapped_value(id, value, mapper);
        };
        let require_grad = value.is_require_grad();
        let placeholder = self
            .placeholders
            .entry(D)
            .or_insert_with(|| Box::new(Tensor::<B, D>::empty([1; D], &value.device())))
            .downcast_ref::<Tensor<B, D>>()
            .expect("a placeholder of rank D")
            .clone();
        let tensor = value.inner().to_device(&device);
        let state = self.records.remove(&id).map(|record| {
            let state: AdamWState<B::InnerBackend, D> = record.into_state();
            LabAdamW::to_device(state, &device).momentum
        });
        let time = state.as_ref().map_or(1, |s| s.time + 1);
        let float = |x: Tensor<B::InnerBackend, D>| x.into_primitive().tensor();
        self.items.push(AdamWItem {
            param: float(tensor),
            grad: float(grad),
            moments: state.map(|s| (float(s.moment_1), float(s.moment_2))),
            step: self.adamw.settings::<D>(self.lr, time),
        });
        self.taken.push(Taken {
            id,
            require_grad,
            time,
        });
        Param::from_mapped_value(id, placeholder, mapper)
    }
}

/// Puts each updated parameter back in the module in place of its placeholder, and its
/// moments in the records.
struct Scatter<'a, B: AutodiffBackend<InnerBackend: LabBackend>> {
    records: &'a mut HashMap<ParamId, AdaptorRecord<LabAdamW, B>>,
    results: &'a mut HashMap<ParamId, Updated<B>>,
}

impl<B: AutodiffBackend<InnerBackend: LabBackend>> ModuleMapper<B> for Scatter<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some((p, m, v, taken)) = self.results.remove(&id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        // In the parameter's shape already.
        let back = |x| Tensor::<B::InnerBackend, D>::from_primitive(TensorPrimitive::Float(x));
        let momentum = AdaptiveMomentumState {
            time: taken.time,
            moment_1: back(m),
            moment_2: back(v),
            max_moment_2: None,
        };
        self.records
            .insert(id, AdaptorRecord::from_state::<D>(AdamWState { momentum }));
        let mut updated = Tensor::from_inner(back(p));
        if taken.require_grad {
            updated = updated.require_grad();
        }
        Param::from_mapped_value(id, updated, mapper)
    }
}

/// The optimizer training uses for `train`'s settings: [`LabAdamW`] (β₁, β₂, ε, decoupled
/// decay of matrices) inside global-norm clipping.
pub fn reference_adamw<B: LabAutodiff, M: AutodiffModule<B>>(
    train: &crate::config::TrainConfig,
) -> ReferenceOptimizer<impl Optimizer<M, B>> {
    let adamw = LabAdamW::new(train.beta1, train.beta2, train.epsilon, train.weight_decay);
    // The decay is the optimizer's own (fused into its update): none in the wrapper.
    ReferenceOptimizer::lab_adamw(adamw, train.grad_clip).averaging(train.grad_accumulation)
}

/// AdamW as PyTorch and nanoGPT run it, one fused pass over each parameter: moments, bias
/// correction, decoupled weight decay of matrices (rank ≥ 2; none on biases and LayerNorm
/// gains), clipping's factor where [`ReferenceOptimizer::lab_adamw`] passes it, and the update
/// together. Training runs it over all parameters at once ([`AllAtOnce`],
/// [`kernels::adamw_all`]); as burn's `SimpleOptimizer` it steps one ([`kernels::adamw`]). Its
/// state is burn's `AdamWState`, so its checkpoints and burn's AdamW's are the same records.
#[derive(Clone, Debug)]
pub struct LabAdamW {
    /// β₁.
    pub beta_1: f32,
    /// β₂.
    pub beta_2: f32,
    /// ε.
    pub epsilon: f32,
    /// Decoupled weight decay λ of matrices.
    pub weight_decay: f32,
    /// Clipping's factor for the step under way, where the wrapper hands it over.
    clip: ClipFactor,
}

impl LabAdamW {
    /// AdamW with β₁, β₂, ε and decoupled weight decay λ of matrices.
    pub fn new(beta_1: f32, beta_2: f32, epsilon: f32, weight_decay: f32) -> Self {
        Self {
            beta_1,
            beta_2,
            epsilon,
            weight_decay,
            clip: ClipFactor::default(),
        }
    }
}

impl LabAdamW {
    /// The settings of step `time` (from 1) of a parameter of rank `D`: matrices decay, biases
    /// and gains do not.
    fn settings<const D: usize>(&self, lr: LearningRate, time: usize) -> AdamWStep {
        AdamWStep {
            lr: lr as f32,
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            weight_decay: if D >= 2 { self.weight_decay } else { 0.0 },
            time: time as i32,
        }
    }
}

impl<B: LabBackend> SimpleOptimizer<B> for LabAdamW {
    type State<const D: usize> = AdamWState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let (moments, time) = match state {
            Some(AdamWState { momentum }) => (
                Some((momentum.moment_1, momentum.moment_2)),
                momentum.time + 1,
            ),
            None => (None, 1),
        };
        let step = self.settings::<D>(lr, time);
        let clip = self.clip.get::<B>();
        let (tensor, moment_1, moment_2) = kernels::adamw(tensor, grad, moments, step, clip);
        let momentum = AdaptiveMomentumState {
            time,
            moment_1,
            moment_2,
            max_moment_2: None,
        };
        (tensor, Some(AdamWState { momentum }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        AdamWState {
            momentum: state.momentum.to_device(device),
        }
    }
}

impl<M, B, O> Optimizer<M, B> for ReferenceOptimizer<O>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend<InnerBackend: LabBackend>,
    O: Optimizer<M, B>,
{
    type Record = O::Record;

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        self.steps += 1;
        let poisoned = std::env::var(NAN_ENV)
            .ok()
            .and_then(|n| n.parse::<usize>().ok())
            .is_some_and(|n| self.steps > n);
        let grads = match poisoned {
            true => poison::<B, M>(&module, grads),
            false => grads,
        };
        // What the gradients are multiplied by: the accumulation's mean and clipping, one factor.
        let (max_norm, scale) = (self.max_grad_norm, self.grad_scale);
        let factor = match (max_norm > 0.0, scale == 1.0) {
            (true, _) => clip_factor::<B, M>(&module, &grads, max_norm, scale),
            (false, false) => scale_factor::<B, M>(&module, scale),
            (false, true) => None,
        };
        let grads = match (&self.clip, factor) {
            // The inner optimizer multiplies the factor in as it reads each gradient.
            (Some(clip), factor) => {
                clip.set(factor);
                grads
            }
            (None, Some(factor)) => rescale::<B, M>(&module, grads, factor),
            (None, None) => grads,
        };
        let module = if self.weight_decay > 0.0 {
            module.map(&mut ScaleMatrices {
                factor: 1.0 - lr * self.weight_decay,
            })
        } else {
            module
        };
        let module = self.inner.step(lr, module, grads);
        if let Some(clip) = &self.clip {
            clip.set::<B::InnerBackend>(None);
        }
        module
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
pub fn clip_global_norm<B: AutodiffBackend<InnerBackend: LabBackend>, M: AutodiffModule<B>>(
    module: &M,
    grads: GradientsParams,
    max_norm: f32,
) -> GradientsParams {
    match clip_factor::<B, M>(module, &grads, max_norm, 1.0) {
        Some(factor) => rescale::<B, M>(module, grads, factor),
        None => grads,
    }
}

/// Every gradient of `module` multiplied by `factor` `[1]`.
fn rescale<B: AutodiffBackend<InnerBackend: LabBackend>, M: AutodiffModule<B>>(
    module: &M,
    grads: GradientsParams,
    factor: Tensor<B::InnerBackend, 1>,
) -> GradientsParams {
    let mut rescale = Rescale::<B> {
        grads,
        scale: factor,
    };
    module.visit(&mut rescale);
    rescale.grads
}

/// The factor of gradients `g` that clips `scale · g` to a global norm of `max_norm`:
/// `scale · min(1, max_norm / (scale · ‖g‖₂ + 1e-6))` `[1]`, on the device (`None` where
/// `module` has no gradient). With `scale` 1, clipping's own factor, bit for bit.
fn clip_factor<B: AutodiffBackend<InnerBackend: LabBackend>, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
    max_norm: f32,
    scale: f32,
) -> Option<Tensor<B::InnerBackend, 1>> {
    let mut all = AllGradients::<B> {
        grads,
        found: Vec::new(),
    };
    module.visit(&mut all);
    if all.found.is_empty() {
        return None;
    }
    let mut norm = kernels::sum_squares_all(all.found).sqrt(); // [1]
    if scale != 1.0 {
        norm = norm.mul_scalar(scale);
    }
    let factor = norm
        .add_scalar(1e-6)
        .recip()
        .mul_scalar(max_norm)
        .clamp_max(1.0);
    Some(if scale == 1.0 {
        factor
    } else {
        factor.mul_scalar(scale)
    })
}

/// `scale` as a `[1]` factor on `module`'s device (`None` where it has no parameter).
fn scale_factor<B: AutodiffBackend<InnerBackend: LabBackend>, M: AutodiffModule<B>>(
    module: &M,
    scale: f32,
) -> Option<Tensor<B::InnerBackend, 1>> {
    let device = module.devices().into_iter().next()?;
    Some(Tensor::from_floats([scale], &device))
}

/// Every gradient of `module` made NaN.
fn poison<B: AutodiffBackend<InnerBackend: LabBackend>, M: AutodiffModule<B>>(
    module: &M,
    grads: GradientsParams,
) -> GradientsParams {
    match scale_factor::<B, M>(module, f32::NAN) {
        Some(nan) => rescale::<B, M>(module, grads, nan),
        None => grads,
    }
}

/// Every gradient of a module, in the order its parameters are visited.
struct AllGradients<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    found: Vec<FloatTensor<B::InnerBackend>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for AllGradients<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
            self.found.push(grad.into_primitive().tensor());
        }
    }
}

struct Rescale<B: AutodiffBackend> {
    grads: GradientsParams,
    scale: Tensor<B::InnerBackend, 1>,
}

impl<B: AutodiffBackend<InnerBackend: LabBackend>> ModuleVisitor<B> for Rescale<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let scaled = kernels::scale(grad, self.scale.clone());
            self.grads.register(param.id, scaled);
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
