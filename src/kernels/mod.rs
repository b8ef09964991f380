//! Fused kernels, through burn's backend-extension mechanism.
//!
//! [`LabBackend`] extends burn's `Backend` with the operations that dominate a transformer's
//! training step when they are composed from small tensor ops ([`Op`]: attention and packed
//! self-attention, LayerNorm, GELU, the softmax, dropout, cross-entropy, AdamW's update, the linear
//! layer, the embedding table's gradient). Every method has a default written with burn's own
//! tensor ops (so any backend works — ndarray uses the defaults), a backend may override it with a
//! kernel (flex does, in [`cpu`]; wgpu and CUDA in [`cube`]), and `Autodiff<B>` overrides the
//! differentiable entry points with one graph node each whose backward pass calls the inner
//! backend's fused backward ([`autodiff`]), instead of a dozen recorded element-wise ops.
//!
//! The model code calls the free functions of this module ([`gelu`], [`layer_norm`],
//! [`softmax`], [`attention`], …); each falls back to the composed reference ([`reference`])
//! when fused kernels are switched off ([`set_fused`], `--no-fused` on the command line) or
//! when its operation failed the on-device check ([`check`], [`fall_back`]) — which is also
//! how the tests and `bench kernels` compare the two.
//!
//! On burn's CubeCL backends (wgpu, CUDA) the methods are CubeCL kernels ([`cube`]); with burn's
//! fusion on, each is one custom operation in the fusion stream that runs that kernel.
//!
//! Attention here is "flash-style": the kernel walks `64 × 64` tiles of queries and keys with an
//! online softmax, saving only the output and each row's log-sum-exp for the backward pass,
//! which recomputes the probabilities tile by tile — the `t × s` score matrix is never stored.

mod autodiff;
pub mod check;
mod composed;
pub mod cpu;
#[cfg(feature = "cube-kernels")]
pub mod cube;
pub mod dropout;
#[cfg(feature = "flex")]
mod flex;
#[cfg(feature = "fusion")]
mod fusion;
pub mod matmul;
pub mod profile;
pub mod reference;
pub mod step_check;

use burn::nn::{LayerNorm, Linear};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Bool, TensorMetadata};
use composed::{prim, tensor};
pub use dropout::DropoutMask;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU8, Ordering};
use std::thread::LocalKey;

/// A backend with the fused operations of this crate. Every method has a composed default.
///
/// Shapes are those of the free functions below; `pad` is a `[b, s]` float tensor, `1` where the
/// key is padding (masked out), `0` elsewhere.
pub trait LabBackend: Backend {
    /// Whether each fused kernel runs to completion on the calling thread, so that its wall
    /// time is what it cost and `bench train --profile` can time it call by call ([`profile`]):
    /// flex's CPU kernels; not a GPU backend's, whose calls return before the device runs them.
    const TIMED_KERNELS: bool = false;

    /// `buffer` `[b, h, s, k]` with `value` `[b, h, n, k]` written into its positions
    /// `at..at + n` (dimension 2), in place where the buffer is held once: how a key–value
    /// cache appends a token's column. burn's `slice_assign` writes in place on the CubeCL
    /// backends; flex's copies the whole buffer first, so flex has its own.
    fn write_columns(
        buffer: FloatTensor<Self>,
        at: usize,
        value: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        composed::write_columns::<Self>(buffer, at, value)
    }

    /// [`Self::write_columns`] of a cache's keys and values together: `(keys, values)` with `k`
    /// and `v` written into their positions `at..at + n`. The default: one after the other;
    /// on a GPU one launch for both.
    fn write_columns_pair(
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        at: usize,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        (
            Self::write_columns(keys, at, k),
            Self::write_columns(values, at, v),
        )
    }

    /// Exact GELU, `x·Φ(x)` (the erf form).
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        composed::gelu::<Self>(x)
    }

    /// `grad · d GELU(x)/dx = grad · (Φ(x) + x·φ(x))`.
    fn fused_gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        composed::gelu_backward::<Self>(x, grad)
    }

    /// `a ⊙ b` of two tensors of one shape: the backward pass of an element-wise function
    /// whose derivative the forward pass kept (GELU's: `grad ⊙ GELU'(x)`). burn's product;
    /// on a processor in place and on both cores (flex multiplies on one).
    fn fused_mul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_mul(a, b)
    }

    /// `(GELU(x), GELU'(x))`: the forward pass of training, which keeps the derivative so the
    /// backward pass is one product (`erf` and `exp` evaluated once per element, not twice).
    /// With a dropout `mask`, both times its multipliers (elements as in
    /// [`Self::fused_dropout`]): GELU then dropout in one pass, and the backward pass still one
    /// product.
    fn fused_gelu_forward(
        x: FloatTensor<Self>,
        mask: Option<DropoutMask>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        composed::gelu_forward::<Self>(x, mask)
    }

    /// `GELU(x) ⊙ M`, dropout after GELU (a feed-forward network's): the differentiable entry
    /// point of [`Self::fused_gelu_forward`] with a mask.
    fn fused_gelu_dropout(x: FloatTensor<Self>, mask: DropoutMask) -> FloatTensor<Self> {
        Self::fused_gelu_forward(x, Some(mask)).0
    }

    /// LayerNorm of `x` `[..., d]` over its last dimension: the differentiable entry point,
    /// which takes the tensor as the graph has it (a reshape would put a node between the
    /// LayerNorm and the other readers of its input, whose gradients it adds).
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        let shape = x.shape();
        let y = Self::fused_layer_norm_forward(composed::rows::<Self>(x), gamma, beta, epsilon).0;
        Self::float_reshape(y, shape)
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

    /// The gradients `(dx [n, d], dγ [d], dβ [d])` of LayerNorm for the output gradient `dy`;
    /// with `residual` `[n, d]`, the gradient the input already has from its other readers (a
    /// residual stream's), `dx` is that plus LayerNorm's, added in the same pass.
    fn fused_layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        composed::layer_norm_backward::<Self>(x, gamma, mean, rstd, dy, residual)
    }

    /// The residual addition of a pre-norm block and the LayerNorm that reads its sum next:
    /// `s = x + h ⊙ M` (`x + h` without a mask, the mask's elements as in
    /// [`Self::fused_dropout`]) and the LayerNorm of the rows of `s` `[n, d]` → `(s, y)`. The
    /// differentiable entry point (`x`, `h` `[..., d]`, as [`Self::fused_layer_norm`] takes
    /// them): its backward pass is the addition's and LayerNorm's.
    fn fused_add_layer_norm(
        x: FloatTensor<Self>,
        h: FloatTensor<Self>,
        mask: Option<DropoutMask>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let shape = x.shape();
        let [x, h] = [x, h].map(composed::rows::<Self>);
        let (s, y, _, _) = Self::fused_add_layer_norm_forward(x, h, mask, gamma, beta, epsilon);
        (
            Self::float_reshape(s, shape.clone()),
            Self::float_reshape(y, shape),
        )
    }

    /// [`Self::fused_add_layer_norm`] returning `(s, y, mean, 1/σ)`, one pass where a kernel
    /// runs (the sum is written once and normalised while it is at hand). The default:
    /// [`Self::fused_dropout_add`] (or the addition), then [`Self::fused_layer_norm_forward`].
    fn fused_add_layer_norm_forward(
        x: FloatTensor<Self>,
        h: FloatTensor<Self>,
        mask: Option<DropoutMask>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        composed::add_layer_norm_forward::<Self>(x, h, mask, gamma, beta, epsilon)
    }

    /// Softmax over the last dimension of `x` `[n, s]`.
    fn fused_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        composed::softmax::<Self>(x)
    }

    /// `dx = p ⊙ (dp − Σ_j p_j·dp_j)`, row by row, for `p = softmax(x)` `[n, s]`.
    fn fused_softmax_backward(p: FloatTensor<Self>, dp: FloatTensor<Self>) -> FloatTensor<Self> {
        composed::softmax_backward::<Self>(p, dp)
    }

    /// `x` (any shape, elements numbered row-major) with each element multiplied by its
    /// multiplier in `mask` (`0` or `1/(1−p)`): dropout, and its own backward pass (the same mask
    /// applied to the gradient).
    fn fused_dropout(x: FloatTensor<Self>, mask: DropoutMask) -> FloatTensor<Self> {
        composed::dropout::<Self>(x, mask)
    }

    /// `x + h ⊙ M` for `x`, `h` of one shape (any; elements numbered row-major): a residual
    /// connection around a dropped-out sublayer, element `e` of `h` taking element `e` of
    /// `mask` as [`Self::fused_dropout`] does. The default: that dropout, then the addition.
    fn fused_dropout_add(
        x: FloatTensor<Self>,
        h: FloatTensor<Self>,
        mask: DropoutMask,
    ) -> FloatTensor<Self> {
        Self::float_add(x, Self::fused_dropout(h, mask))
    }

    /// Attention `softmax(Q·Kᵀ/√k + mask)·V` without its weights; with `dropout`, the weights
    /// are multiplied by that mask (element `((b·h + head)·t + i)·s + j`) before the product
    /// with V.
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        pad: Option<FloatTensor<Self>>,
        dropout: Option<DropoutMask>,
    ) -> FloatTensor<Self> {
        Self::fused_attention_forward(q, k, v, causal, pad, dropout).0
    }

    /// [`Self::fused_packed_attention_forward`] without its log-sum-exp (the differentiable
    /// entry point).
    fn fused_packed_attention(
        qkv: FloatTensor<Self>,
        heads: usize,
        causal: bool,
        pad: Option<FloatTensor<Self>>,
        dropout: Option<DropoutMask>,
    ) -> FloatTensor<Self> {
        Self::fused_packed_attention_forward(qkv, heads, causal, pad, dropout).0
    }

    /// Attention returning `(output [b, h, t, k], log-sum-exp of each row's scores [b, h, t])`.
    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        pad: Option<FloatTensor<Self>>,
        dropout: Option<DropoutMask>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        composed::attention_forward::<Self>(q, k, v, causal, pad, dropout)
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
        dropout: Option<DropoutMask>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        composed::attention_backward::<Self>(q, k, v, o, lse, d_o, causal, pad, dropout)
    }

    /// Self-attention on packed projections: `qkv` `[b, t, 3·d]` holds Q, K and V side by side
    /// (one product computed them), each split into `heads` heads → `(output [b, t, d],
    /// log-sum-exp [b, h, t])`. The default runs [`Self::fused_attention_forward`] on views.
    fn fused_packed_attention_forward(
        qkv: FloatTensor<Self>,
        heads: usize,
        causal: bool,
        pad: Option<FloatTensor<Self>>,
        dropout: Option<DropoutMask>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        composed::packed_attention_forward::<Self>(qkv, heads, causal, pad, dropout)
    }

    /// The gradient `[b, t, 3·d]` of packed self-attention for the output gradient `d_o`
    /// `[b, t, d]`. The default concatenates [`Self::fused_attention_backward`]'s three.
    #[allow(clippy::too_many_arguments)]
    fn fused_packed_attention_backward(
        qkv: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        heads: usize,
        causal: bool,
        pad: Option<FloatTensor<Self>>,
        dropout: Option<DropoutMask>,
    ) -> FloatTensor<Self> {
        composed::packed_attention_backward::<Self>(qkv, o, lse, d_o, heads, causal, pad, dropout)
    }

    /// `Σ x²` over `x` `[n]` → `[1]`: a gradient's share of the global norm clipping takes.
    fn fused_sum_squares(x: FloatTensor<Self>) -> FloatTensor<Self> {
        composed::sum_squares::<Self>(x)
    }

    /// `Σ x²` over every element of every tensor of `xs` (any shapes, at least one) → `[1]`:
    /// the squared global norm that clipping takes. The default: each tensor's
    /// [`Self::fused_sum_squares`], added in order.
    fn fused_sum_squares_all(xs: Vec<FloatTensor<Self>>) -> FloatTensor<Self> {
        composed::sum_squares_each::<Self>(xs, Self::fused_sum_squares)
    }

    /// `x · s` for `x` `[n]` and the one element of `s` `[1]`: clipping's rescale of a gradient.
    fn fused_scale(x: FloatTensor<Self>, s: FloatTensor<Self>) -> FloatTensor<Self> {
        composed::scale::<Self>(x, s)
    }

    /// One AdamW step of each parameter of `items` ([`AdamWItem`]: the parameter, its gradient
    /// (possibly a strided view) and its moments before the step (`None` at its first), all of
    /// the parameter's shape, element by element in its row-major order), all with the same
    /// `clip` `[1]`, which where given multiplies each gradient first (global-norm clipping's
    /// factor, [`Self::fused_scale`]): `(parameter, first moment, second moment)` after it, in
    /// the parameter's shape, in `items`' order. The default: the composed step of each; on a
    /// GPU several parameters a launch.
    fn fused_adamw_all(
        items: Vec<AdamWItem<Self>>,
        clip: Option<FloatTensor<Self>>,
    ) -> Vec<(FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>)> {
        composed::adamw_each::<Self>(items, clip)
    }

    /// Whether this backend runs the products of [`Self::fused_linear`] in `dtype` (half
    /// precision, see [`Precision`]) on `device`. The default: it does not.
    fn mixed_precision(_device: &Self::Device, _dtype: burn::tensor::FloatDType) -> bool {
        false
    }

    /// Times the products of `plan` on `device` with every matrix-product kernel this backend
    /// chooses among (`bench matmul`); `progress` sees each timing as it is made. The default:
    /// a backend without such a choice refuses.
    fn time_products(
        device: &Self::Device,
        plan: &matmul::MatmulPlan,
        progress: &mut dyn FnMut(&matmul::ProductTiming),
    ) -> anyhow::Result<Vec<matmul::ProductTiming>> {
        let _ = (plan, progress);
        anyhow::bail!(
            "bench matmul times a GPU backend's matrix-product kernels; {} has no choice among them (use --backend cuda or wgpu)",
            Self::name(device)
        )
    }

    /// Whether this backend picks its matrix-product kernels by benchmarking each new shape
    /// (burn's autotune on a GPU: on CUDA the first run of a shape compiles and times about ten
    /// candidate kernels). Decoding then pads its growing key–value columns to a few fixed
    /// lengths ([`crate::nn::attention::decode_columns`]). The default: it does not.
    fn autotunes() -> bool {
        false
    }

    /// A linear layer, `x·w + b`: `x` `[n, i]`, `w` `[i, o]`, `b` `[o]` → `[n, o]`. Under a
    /// half [`Precision`], a backend that supports it ([`Self::mixed_precision`]) multiplies in
    /// that type and returns the input's type.
    fn fused_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        composed::linear::<Self>(x, w, b)
    }

    /// [`Self::fused_linear`], and the operands its backward pass reads
    /// ([`Self::fused_linear_backward`]'s `x` and `w`): `x` and `w` themselves, or under a half
    /// [`Precision`] the half copies the product read, so the backward pass does not cast them
    /// again (two casts of a transposed operand fewer a layer, and the kept input takes half the
    /// bytes). The default: `x` and `w`.
    fn fused_linear_keeping(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        (Self::fused_linear(x.clone(), w.clone(), b), x, w)
    }

    /// The gradients `(dx [n, i], dw [i, o], db [o])` of [`Self::fused_linear`] for the output
    /// gradient `dy` (`db` only with a bias), in `dy`'s type; `x` and `w` as
    /// [`Self::fused_linear_keeping`] kept them (in half precision, possibly already half).
    fn fused_linear_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        bias: bool,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        composed::linear_backward::<Self>(x, w, dy, bias)
    }

    /// One product of a decoding step with what surrounds it: `LN(x)·w + b` (`x` `[n, i]`
    /// normalised first where `norm` is given), then GELU where `gelu`, then `+ residual`
    /// (`[n, o]`) where given → `[n, o]`. What [`decode_linear`] runs where
    /// [`folds_decode`] says so (a GPU, a few rows). The default: the backend's LayerNorm,
    /// product, GELU and addition one after the other; on a GPU one launch.
    fn fused_decode_linear(
        x: FloatTensor<Self>,
        norm: Option<NormPrimitive<Self>>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
        gelu: bool,
        residual: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        composed::decode_linear::<Self>(x, norm, w, b, gelu, residual)
    }

    /// A decoding step's query, key and value product ([`Self::fused_decode_linear`] without
    /// GELU or residual; `w` `[i, 3·d]`, the three side by side) whose keys and values go
    /// straight into a cache's buffers `keys`, `values` `[b, h, cap, d/h]`, in place where
    /// they are held once: row `r` of `x` `[n, i]` is item `r / (n/b)`'s position
    /// `at + r % (n/b)` → `(q [n, d], keys, values)`. The default: the product, then
    /// [`Self::write_columns_pair`]; on a GPU one launch.
    #[allow(clippy::too_many_arguments)]
    fn fused_decode_qkv(
        x: FloatTensor<Self>,
        norm: Option<NormPrimitive<Self>>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        at: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        composed::decode_qkv::<Self>(x, norm, w, b, keys, values, at)
    }

    /// `GELU(x·w + b)` and GELU's derivative there (`[n, o]` each), both times the dropout
    /// mask's multipliers where given — [`Self::fused_linear`] then [`Self::fused_gelu_forward`],
    /// the values of the two apart — and the operands the product's backward pass reads, as
    /// [`Self::fused_linear_keeping`] keeps them. The default runs the two apart; on a
    /// processor GELU is the product's epilogue (each core's rows while they are in its cache).
    fn fused_linear_gelu_keeping(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
        mask: Option<DropoutMask>,
    ) -> [FloatTensor<Self>; 4] {
        composed::linear_gelu_keeping::<Self>(x, w, b, mask)
    }

    /// A feed-forward network with GELU, `dropout(GELU(x·w₁ + b₁))·w₂ + b₂` for `x` `[n, d]`:
    /// [`Self::fused_linear_gelu_keeping`] then [`Self::fused_linear`], the values of the two
    /// apart. Under autodiff one graph node: its forward pass is those two, its backward pass
    /// [`Self::fused_gelu_linear_backward`] then [`Self::fused_linear_backward`].
    fn fused_feed_forward(
        x: FloatTensor<Self>,
        [w1, w2]: [FloatTensor<Self>; 2],
        [b1, b2]: [Option<FloatTensor<Self>>; 2],
        mask: Option<DropoutMask>,
    ) -> FloatTensor<Self> {
        let [h, ..] = Self::fused_linear_gelu_keeping(x, w1, b1, mask);
        Self::fused_linear(h, w2, b2)
    }

    /// The gradients `(dh, dw, db)` of `dropout(GELU(h))·w + b` from the layer's input `x`
    /// (the activation's output) and the `derivative` its forward pass kept: those of
    /// [`Self::fused_linear_backward`], with `dh = dx ⊙ derivative`. The default runs the two
    /// apart; on a processor the product by the derivative runs on the core that made `dx`
    /// while the other finishes `dw`.
    fn fused_gelu_linear_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        bias: bool,
        derivative: FloatTensor<Self>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        composed::gelu_linear_backward::<Self>(x, w, dy, bias, derivative)
    }

    /// The label-smoothed cross-entropy of each row of `logits` `[n, v]` against `targets`
    /// `[n]` (see [`cross_entropy`]) → `[n]`.
    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        smoothing: f32,
        ignore: Option<usize>,
    ) -> FloatTensor<Self> {
        Self::fused_cross_entropy_forward(logits, targets, smoothing, ignore).0
    }

    /// [`Self::fused_cross_entropy`] with each row's log-sum-exp `[n]`, what its backward needs.
    fn fused_cross_entropy_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        smoothing: f32,
        ignore: Option<usize>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        composed::cross_entropy_forward::<Self>(logits, targets, smoothing, ignore)
    }

    /// The gradient `[n, v]` of the row losses for their gradient `grad` `[n]`:
    /// `grad · (softmax(row) − (1−ε)·onehot(target) − ε/v)`, zero on ignored rows.
    fn fused_cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        smoothing: f32,
        ignore: Option<usize>,
    ) -> FloatTensor<Self> {
        composed::cross_entropy_backward::<Self>(logits, targets, lse, grad, smoothing, ignore)
    }

    /// The rows of `weight` `[v, d]` that `ids` `[b, n]` name → `[b, n, d]`: a token
    /// embedding's lookup, the differentiable entry point (its backward pass is
    /// [`Self::fused_embedding_backward`]). burn's `embedding`.
    fn fused_embedding(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        Self::embedding(weight, ids)
    }

    /// The gradient `[v, d]` of the table `weight` of a lookup of `ids` `[b, n]` whose output
    /// gradient is `grad` `[b, n, d]`: row `r` the sum of the rows of `grad` whose id is `r`.
    /// burn's `embedding_backward` (on its CubeCL backends one unit per column adds every row
    /// in turn: 16,384 dependent additions a unit at the GPU experiment's batch).
    fn fused_embedding_backward(
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        ids: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::embedding_backward(weight, grad, ids)
    }
}

/// A LayerNorm's parameters as a backend's primitives: `γ`, `β` where it has one, and `ε`
/// ([`LabBackend::fused_decode_linear`]'s prologue).
pub struct NormPrimitive<B: Backend> {
    /// `γ` `[d]`.
    pub gamma: FloatTensor<B>,
    /// `β` `[d]`.
    pub beta: Option<FloatTensor<B>>,
    /// `ε`.
    pub epsilon: f64,
}

impl<B: Backend> NormPrimitive<B> {
    /// `(γ, β, ε)`.
    pub fn parts(self) -> (FloatTensor<B>, Option<FloatTensor<B>>, f64) {
        (self.gamma, self.beta, self.epsilon)
    }
}

/// A training backend: autodiff over a [`LabBackend`], itself one.
pub trait LabAutodiff: AutodiffBackend<InnerBackend: LabBackend> + LabBackend {}

impl<B: AutodiffBackend<InnerBackend: LabBackend> + LabBackend> LabAutodiff for B {}

#[cfg(feature = "ndarray")]
impl LabBackend for crate::backend::Cpu {}

static FUSED: AtomicBool = AtomicBool::new(true);

thread_local! {
    static FUSED_HERE: Cell<Option<bool>> = const { Cell::new(None) };
    /// Operations made to run composed on this thread only (the step check's bisection).
    static COMPOSED_HERE: Cell<Option<u16>> = const { Cell::new(None) };
}

/// Switches the fused kernels on or off for the whole process (`--no-fused`).
pub fn set_fused(on: bool) {
    FUSED.store(on, Ordering::Relaxed);
}

/// Runs `f` on this thread with the fused kernels on or off, whatever the process setting
/// (tests compare both in one process).
pub fn with_fused<R>(on: bool, f: impl FnOnce() -> R) -> R {
    with_local(&FUSED_HERE, on, f)
}

/// Runs `f` with the thread-local setting `local` at `value`, restoring it after (also when `f`
/// panics).
fn with_local<T: Copy + 'static, R>(
    local: &'static LocalKey<Cell<Option<T>>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<T: Copy + 'static>(&'static LocalKey<Cell<Option<T>>>, Option<T>);
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _restore = Restore(local, local.with(|c| c.replace(Some(value))));
    f()
}

/// Whether the fused kernels are in use on this thread.
pub fn fused() -> bool {
    FUSED_HERE
        .with(Cell::get)
        .unwrap_or_else(|| FUSED.load(Ordering::Relaxed))
}

/// The fused operations, each of which can fall back to its composed form on its own (when
/// the on-device check finds it wrong, see [`check`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// [`gelu`], forward and backward, and [`gelu_dropout`], the dropout after it in the same
    /// kernel.
    Gelu,
    /// [`layer_norm`], forward and backward (input, γ, β), and [`add_layer_norm`], the
    /// residual addition before it in the same kernel.
    LayerNorm,
    /// [`softmax`], forward and backward.
    Softmax,
    /// [`attention`]: causal, padded, with dropout; forward and backward.
    Attention,
    /// [`packed_self_attention`], forward and backward.
    PackedAttention,
    /// [`dropout`] (the mask drawn in the kernel), forward and backward.
    Dropout,
    /// [`cross_entropy`], forward and backward.
    CrossEntropy,
    /// The optimizer's passes: [`adamw`]'s update (with clipping's factor), and the
    /// [`sum_squares_all`] (or [`LabBackend::fused_sum_squares`] per tensor) and [`scale`] of
    /// global-norm clipping.
    AdamW,
    /// [`product`], the linear layers (their products in the training precision).
    Linear,
    /// [`embedding`], the token lookup's gradient.
    Embedding,
    /// [`decode_linear`]: a decoding step's product with the LayerNorm before it and the GELU
    /// or residual addition after it, and [`decode_qkv`], the query, key and value product
    /// writing into a cache (forward only).
    DecodeLinear,
}

impl Op {
    /// Every operation, in the order the check runs them.
    pub const ALL: [Op; 11] = [
        Op::Gelu,
        Op::LayerNorm,
        Op::Softmax,
        Op::Attention,
        Op::PackedAttention,
        Op::Dropout,
        Op::CrossEntropy,
        Op::AdamW,
        Op::Linear,
        Op::Embedding,
        Op::DecodeLinear,
    ];

    /// Its name in tables, warnings and the check's cache.
    pub fn name(self) -> &'static str {
        match self {
            Op::Gelu => "gelu",
            Op::LayerNorm => "layer_norm",
            Op::Softmax => "softmax",
            Op::Attention => "attention",
            Op::PackedAttention => "packed_attention",
            Op::Dropout => "dropout",
            Op::CrossEntropy => "cross_entropy",
            Op::AdamW => "adamw",
            Op::Linear => "linear",
            Op::Embedding => "embedding",
            Op::DecodeLinear => "decode_linear",
        }
    }

    /// The operation called `name`.
    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }

    fn bit(self) -> u16 {
        1 << self as u16
    }
}

/// The operations that run composed although the fused kernels are on.
static FALLBACK: AtomicU16 = AtomicU16::new(0);

/// Makes `op` run as its composed form for the rest of the process (the others stay fused).
pub fn fall_back(op: Op) {
    FALLBACK.fetch_or(op.bit(), Ordering::Relaxed);
}

/// Runs `f` on this thread with `ops` composed as if they had fallen back (the others as the
/// process has them): how the step check compares the fused path with the composed one and
/// finds the operation at fault, in one process.
pub fn with_composed<R>(ops: &[Op], f: impl FnOnce() -> R) -> R {
    let mask = ops.iter().fold(0, |mask, op| mask | op.bit());
    with_local(&COMPOSED_HERE, mask, f)
}

/// Whether `op` runs as its fused kernel on this thread: the fused kernels are on and `op`
/// has not fallen back (for the process, or on this thread through [`with_composed`]).
pub fn uses(op: Op) -> bool {
    let composed = FALLBACK.load(Ordering::Relaxed) | COMPOSED_HERE.with(Cell::get).unwrap_or(0);
    fused() && composed & op.bit() == 0
}

/// The number type of the linear layers' products (nanoGPT's `dtype`, PyTorch's autocast):
/// `f32`, or `f16`/`bf16` on a GPU backend. In half precision the inputs of each product are
/// cast to the half type, the product accumulates and returns `f32`, and everything else stays
/// `f32` — the parameters (the master weights the optimizer updates), LayerNorm, softmax,
/// attention, the loss. Under `f16` (5 exponent bits) the output gradient of each product is
/// scaled so its largest magnitude is 2^15 before the cast, and the result unscaled: what
/// loss scaling does for the whole model, per product, with no skipped steps. `bf16` has
/// `f32`'s range and needs no scaling.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in `f32`.
    #[default]
    F32,
    /// Products in IEEE half precision, gradients scaled.
    F16,
    /// Products in bfloat16.
    Bf16,
}

impl Precision {
    /// The half type of the products, `None` for `f32`.
    pub fn half(self) -> Option<burn::tensor::FloatDType> {
        match self {
            Precision::F32 => None,
            Precision::F16 => Some(burn::tensor::FloatDType::F16),
            Precision::Bf16 => Some(burn::tensor::FloatDType::BF16),
        }
    }

    /// Whether it is the default (`f32`), which configs leave unwritten.
    pub fn is_f32(&self) -> bool {
        *self == Precision::F32
    }

    /// Its name in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
        }
    }
}

static PRECISION: AtomicU8 = AtomicU8::new(0);

thread_local! {
    static PRECISION_HERE: Cell<Option<Precision>> = const { Cell::new(None) };
}

/// Sets the precision of the linear layers' products for the process, after checking that
/// backend `B` runs them in that type on `device`: one error line when it does not, or when the
/// fused kernels are off (`--no-fused`: half precision lives in the fused linear layer).
/// The environment variable that makes a GPU backend's linear layers multiply with one named
/// kernel of burn's matmul (a name `bench matmul` lists, e.g. `matmul_simple_tma_mma`) instead of
/// the one autotune chooses for each shape, in `f32` as in half precision: for measuring a whole
/// step with a kernel `bench matmul` found faster. Where the kernel cannot take a product it
/// falls back to autotune's; the on-device check's `linear` row compares it with the composed
/// product.
pub const MATMUL_ENV: &str = "TRANSFORMER_LAB_MATMUL";

/// The kernel named for the products: [`MATMUL_ENV`]'s (read at the first call) unless
/// [`pin_matmul`] said otherwise.
static PINNED_MATMUL: std::sync::Mutex<Option<Option<String>>> = std::sync::Mutex::new(None);

/// The kernel named for the linear layers' products ([`MATMUL_ENV`]), if any.
pub fn pinned_matmul() -> Option<String> {
    let mut pinned = PINNED_MATMUL.lock().unwrap_or_else(|p| p.into_inner());
    pinned
        .get_or_insert_with(|| std::env::var(MATMUL_ENV).ok().filter(|n| !n.is_empty()))
        .clone()
}

/// Names the kernel for the products as [`MATMUL_ENV`] does (`None`: autotune's choice), for
/// this process from now on; the name before. For tests, which take turns on the GPU.
#[doc(hidden)]
pub fn pin_matmul(name: Option<&str>) -> Option<String> {
    let before = pinned_matmul();
    *PINNED_MATMUL.lock().unwrap_or_else(|p| p.into_inner()) = Some(name.map(str::to_string));
    before
}

pub fn use_precision<B: LabBackend>(
    precision: Precision,
    device: &B::Device,
) -> anyhow::Result<()> {
    if let Some(half) = precision.half() {
        let name = precision.name();
        anyhow::ensure!(
            fused(),
            "precision {name} needs the fused kernels: drop --no-fused"
        );
        anyhow::ensure!(
            B::mixed_precision(device, half),
            "precision {name} is not supported by this backend and device (half precision runs \
             on the GPU backends: f16 on wgpu where the device has 16-bit floats, f16 or bf16 on \
             cuda); use f32"
        );
    }
    PRECISION.store(precision as u8, Ordering::Relaxed);
    Ok(())
}

/// Runs `f` on this thread with the products in `precision`, whatever the process setting
/// (tests compare precisions in one process; unchecked: see [`use_precision`]).
pub fn with_precision<R>(precision: Precision, f: impl FnOnce() -> R) -> R {
    with_local(&PRECISION_HERE, precision, f)
}

/// The precision of the linear layers' products on this thread (see [`use_precision`]).
pub fn precision() -> Precision {
    PRECISION_HERE
        .with(Cell::get)
        .unwrap_or_else(|| match PRECISION.load(Ordering::Relaxed) {
            1 => Precision::F16,
            2 => Precision::Bf16,
            _ => Precision::F32,
        })
}

/// GELU (exact, erf form), any shape.
pub fn gelu<B: LabBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    if !uses(Op::Gelu) {
        return reference::gelu(x);
    }
    let shape = x.shape();
    let y = tensor::<B, 1>(B::fused_gelu(prim(x.reshape([-1])))).reshape(shape);
    check::sabotage(Op::Gelu, y)
}

/// `norm` applied to the last dimension of `x`. `epsilon` must be the one `norm` was built with
/// (burn keeps it private): [`LAYER_NORM_EPSILON`] unless a config chose another (BERT's 1e-12).
pub fn layer_norm<B: LabBackend, const D: usize>(
    norm: &LayerNorm<B>,
    epsilon: f64,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    if !uses(Op::LayerNorm) {
        return norm.forward(x);
    }
    let y = B::fused_layer_norm(
        prim(x),
        prim(norm.gamma.val()),
        norm.beta.as_ref().map(|beta| prim(beta.val())),
        epsilon,
    );
    check::sabotage(Op::LayerNorm, tensor::<B, D>(y))
}

/// The epsilon of a LayerNorm unless its config chooses another (burn's `LayerNormConfig`
/// default).
pub const LAYER_NORM_EPSILON: f64 = 1e-5;

/// Softmax over the last dimension, any shape.
pub fn softmax<B: LabBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    if !uses(Op::Softmax) {
        return burn::tensor::activation::softmax(x, D - 1);
    }
    let shape = x.shape();
    let s = shape[D - 1];
    let y = tensor::<B, 2>(B::fused_softmax(prim(x.reshape([-1, s as i32])))).reshape(shape);
    check::sabotage(Op::Softmax, y)
}

/// `buffer` `[b, h, s, k]` with `value` `[b, h, n, k]` written into its positions `at..at + n`,
/// in place where the buffer is held once ([`LabBackend::write_columns`]).
pub fn write_columns<B: LabBackend>(
    buffer: Tensor<B, 4>,
    at: usize,
    value: Tensor<B, 4>,
) -> Tensor<B, 4> {
    tensor(B::write_columns(prim(buffer), at, prim(value)))
}

/// [`write_columns`] of keys and values together ([`LabBackend::write_columns_pair`]: one
/// launch on a GPU).
pub fn write_columns_pair<B: LabBackend>(
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    at: usize,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let (keys, values) = B::write_columns_pair(prim(keys), prim(values), at, prim(k), prim(v));
    (tensor(keys), tensor(values))
}

/// Softmax attention without its weights: `softmax(Q·Kᵀ/√k + mask)·V`, masked scores set to
/// [`MASKED_SCORE`](reference::MASKED_SCORE) (a fully masked row attends uniformly, as the composed form does).
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
    dropout: Option<DropoutMask>,
) -> Tensor<B, 4> {
    let pad = pad.map(|pad| pad.clone().float());
    attention_padded(q, k, v, causal, pad, dropout)
}

/// [`attention`] with the padding mask given as numbers, `1` = padding: a mask made on the host
/// is uploaded as it is, where a `Bool` mask costs a cast on the device.
pub fn attention_padded<B: LabBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    pad: Option<Tensor<B, 2>>,
    dropout: Option<DropoutMask>,
) -> Tensor<B, 4> {
    debug_assert!(!causal || q.dims()[2] == k.dims()[2]);
    if !uses(Op::Attention) {
        return reference::attention_forward(q, k, v, causal, pad, dropout).0;
    }
    let o = tensor(B::fused_attention(
        prim(q),
        prim(k),
        prim(v),
        causal,
        pad.map(prim),
        dropout,
    ));
    check::sabotage(Op::Attention, o)
}

/// Dropout of probability `prob` in training (`B` tracks gradients), the identity elsewhere:
/// with fused kernels on, a fresh mask of the counter-based stream ([`dropout::next_mask`])
/// applied in one pass, its backward pass drawing the same mask again (nothing stored); where
/// dropout alone fell back, the same mask as a product of multipliers (the run keeps its
/// masks); with the fused kernels off, burn's `Dropout`.
pub fn dropout<B: LabBackend, const D: usize>(
    module: &burn::nn::Dropout,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    if !B::ad_enabled(&x.device()) || module.prob == 0.0 {
        return x;
    }
    if !fused() {
        return module.forward(x);
    }
    let shape = x.shape();
    let mask = dropout::next_mask(module.prob);
    if !uses(Op::Dropout) {
        return tensor::<B, 1>(composed::dropout::<B>(prim(x.reshape([-1])), mask)).reshape(shape);
    }
    let y = tensor::<B, 1>(B::fused_dropout(prim(x.reshape([-1])), mask)).reshape(shape);
    check::sabotage(Op::Dropout, y)
}

/// `dropout(GELU(x))` (exact GELU, as [`gelu`]), a feed-forward network's activation and its
/// dropout: the same mask and values as the two apart, in one pass where both run fused, whose
/// backward pass is one product by the derivative kept with the mask in it (on a GPU one launch
/// each way instead of two).
pub fn gelu_dropout<B: LabBackend, const D: usize>(
    module: &burn::nn::Dropout,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    if !B::ad_enabled(&x.device()) || module.prob == 0.0 || !uses(Op::Gelu) || !uses(Op::Dropout) {
        return dropout(module, gelu(x));
    }
    let shape = x.shape();
    let mask = dropout::next_mask(module.prob);
    let y = tensor::<B, 1>(B::fused_gelu_dropout(prim(x.reshape([-1])), mask)).reshape(shape);
    check::sabotage(Op::Gelu, y)
}

/// `outer(dropout(GELU(inner(x))))`: a feed-forward network with GELU, the values of
/// [`linear`], [`gelu_dropout`] and [`linear`] (the same mask). While training with the three
/// fused, one graph node ([`LabBackend::fused_feed_forward`]): on a processor GELU runs as the
/// first product's epilogue, on each core's rows while they are in its cache, and the backward
/// pass multiplies the second product's input gradient by the kept derivative on the core that
/// made it, while the other core finishes that product's weight gradient.
pub fn feed_forward<B: LabBackend, const D: usize>(
    module: &burn::nn::Dropout,
    [inner, outer]: [&Linear<B>; 2],
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    let training = B::ad_enabled(&x.device());
    let masked = training && module.prob != 0.0;
    let fused = uses(Op::Gelu) && uses(Op::Linear) && (!masked || uses(Op::Dropout));
    if !training || !fused || !check::broken().is_empty() {
        return linear(outer, gelu_dropout(module, linear(inner, x)));
    }
    let mask = masked.then(|| dropout::next_mask(module.prob));
    let mut shape = x.dims();
    let x = x.reshape([-1, shape[D - 1] as i32]);
    let parts = |l: &Linear<B>| (prim(l.weight.val()), l.bias.as_ref().map(|b| prim(b.val())));
    let ((w1, b1), (w2, b2)) = (parts(inner), parts(outer));
    let y = tensor::<B, 2>(B::fused_feed_forward(prim(x), [w1, w2], [b1, b2], mask));
    shape[D - 1] = y.dims()[1];
    y.reshape(shape)
}

/// `x + dropout(h)` (a residual connection around a sublayer): as `x + dropout(module, h)`, the
/// same mask and the same values, in one kernel where the dropout kernel runs (on a GPU one
/// launch instead of two), and its backward pass `dx = g`, `dh = g ⊙ M`.
pub fn dropout_add<B: LabBackend, const D: usize>(
    module: &burn::nn::Dropout,
    x: Tensor<B, D>,
    h: Tensor<B, D>,
) -> Tensor<B, D> {
    if !B::ad_enabled(&h.device()) || module.prob == 0.0 || !fused() || !uses(Op::Dropout) {
        return x + dropout(module, h);
    }
    let shape = h.shape();
    let mask = dropout::next_mask(module.prob);
    let y = B::fused_dropout_add(prim(x.reshape([-1])), prim(h.reshape([-1])), mask);
    check::sabotage(Op::Dropout, tensor::<B, 1>(y).reshape(shape))
}

/// `x + dropout(h)` and `norm` applied to that sum (its last dimension): the residual
/// connection of a pre-norm block and the LayerNorm that reads the sum next (the next
/// sublayer's, or a stack's final one). The values of [`dropout_add`] then [`layer_norm`], the
/// same mask, in one kernel where both run fused: on a GPU one launch instead of two, on a CPU
/// one pass over the rows. `epsilon` as in [`layer_norm`]. Returns `(sum, normalised sum)`.
pub fn add_layer_norm<B: LabBackend, const D: usize>(
    module: &burn::nn::Dropout,
    x: Tensor<B, D>,
    h: Tensor<B, D>,
    norm: &LayerNorm<B>,
    epsilon: f64,
) -> (Tensor<B, D>, Tensor<B, D>) {
    let dropped = B::ad_enabled(&h.device()) && module.prob > 0.0;
    if !uses(Op::LayerNorm) || (dropped && !uses(Op::Dropout)) {
        let sum = dropout_add(module, x, h);
        return (sum.clone(), layer_norm(norm, epsilon, sum));
    }
    let mask = dropped.then(|| dropout::next_mask(module.prob));
    let (sum, y) = B::fused_add_layer_norm(
        prim(x),
        prim(h),
        mask,
        prim(norm.gamma.val()),
        norm.beta.as_ref().map(|beta| prim(beta.val())),
        epsilon,
    );
    (
        tensor(sum),
        check::sabotage(Op::LayerNorm, tensor::<B, D>(y)),
    )
}

/// A fresh mask for attention dropout of probability `prob` in training, none elsewhere.
pub fn attention_dropout<B: LabBackend>(prob: f64, device: &B::Device) -> Option<DropoutMask> {
    (B::ad_enabled(device) && prob > 0.0).then(|| dropout::next_mask(prob))
}

/// Reseeds the backend's generator and the stream of dropout masks: what every run does before
/// it draws its first random number, and before each training batch.
pub fn seed<B: Backend>(device: &B::Device, seed: u64) {
    B::seed(device, seed);
    dropout::reseed(seed);
}

/// `layer` applied to the last dimension of `x`, as one `[n, d_in]·[d_in, d_out]` product over
/// all leading dimensions, the bias added in the same pass (one graph node under autodiff).
///
/// burn's `Linear` on a `[b, t, d]` input runs a batched product against the broadcast weight,
/// whose backward pass is `b` small products summed over the batch; one flat product is several
/// times faster on a CPU. With fused kernels off this is burn's `Linear` on the flattened input.
pub fn linear<B: LabBackend, const D: usize>(layer: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    linear_parts(&[layer], x)
}

/// Several linear layers with the same input as one product against their weights side by
/// side: `[.., d_in]` → `[.., Σ d_out]`, each layer's outputs in its own columns (how
/// self-attention computes Q, K and V together).
pub fn linear_parts<B: LabBackend, const D: usize>(
    layers: &[&Linear<B>],
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    PackedLinear::new(layers).forward(x)
}

/// Linear layers with the same input, their weights `[d_in, Σ d_out]` and biases side by side
/// ([`linear_parts`]): made once, as a decode does to project every step through the same
/// layers with one product and no copy of the weights per step.
#[derive(Clone, Debug)]
pub struct PackedLinear<B: Backend> {
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
}

impl<B: LabBackend> PackedLinear<B> {
    /// `layers`' weights side by side (one layer's are its own, not copied).
    pub fn new(layers: &[&Linear<B>]) -> Self {
        let (weight, bias) = match layers {
            [layer] => (layer.weight.val(), layer.bias.as_ref().map(|b| b.val())),
            _ => {
                let weights = layers.iter().map(|l| l.weight.val()).collect();
                let biases: Option<Vec<_>> = layers
                    .iter()
                    .map(|l| l.bias.as_ref().map(|b| b.val()))
                    .collect();
                (Tensor::cat(weights, 1), biases.map(|b| Tensor::cat(b, 0)))
            }
        };
        Self { weight, bias }
    }

    /// `[.., d_in]` → `[.., Σ d_out]`, each layer's outputs in its own columns.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let mut shape = x.dims();
        let d_in = shape[D - 1];
        let x = x.reshape([-1, d_in as i32]);
        let y = product(x, self.weight.clone(), self.bias.clone());
        shape[D - 1] = y.dims()[1];
        y.reshape(shape)
    }

    /// The query, key and value projections of a decoding step through [`decode_qkv`]: `x`
    /// `[b, n, d_in]` normalised by `norm` → the queries `[b, n, d]`, the keys and values
    /// written into `keys`, `values` `[b, h, cap, d/h]` at positions `at..at + n`.
    pub fn forward_qkv(
        &self,
        x: Tensor<B, 3>,
        norm: (&LayerNorm<B>, f64),
        keys: Tensor<B, 4>,
        values: Tensor<B, 4>,
        at: usize,
    ) -> (Tensor<B, 3>, Tensor<B, 4>, Tensor<B, 4>) {
        let [b, n, d_in] = x.dims();
        let x = x.reshape([b * n, d_in]);
        let (w, bias) = (self.weight.clone(), self.bias.clone());
        let (q, keys, values) = decode_qkv(x, Some(norm), w, bias, keys, values, at);
        let d = q.dims()[1];
        (q.reshape([b, n, d]), keys, values)
    }

    /// [`Self::forward`] of a decoding step through [`decode_linear`]: `x` `[.., d_in]`
    /// normalised by `norm` first where given, `after` applied (a residual as rows, `[n, Σ
    /// d_out]`).
    pub fn forward_step<const D: usize>(
        &self,
        x: Tensor<B, D>,
        norm: Option<(&LayerNorm<B>, f64)>,
        after: After<B>,
    ) -> Tensor<B, D> {
        let mut shape = x.dims();
        let d_in = shape[D - 1];
        let x = x.reshape([-1, d_in as i32]);
        let y = decode_linear(x, norm, self.weight.clone(), self.bias.clone(), after);
        shape[D - 1] = y.dims()[1];
        y.reshape(shape)
    }
}

/// `x·w + b` for a weight `w` `[i, o]` (any view of a parameter, e.g. a tied embedding's
/// transpose): `x` `[n, i]` → `[n, o]`, through the fused linear layer (so in the training
/// [`precision`]) unless the fused kernels are off.
pub fn product<B: LabBackend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    b: Option<Tensor<B, 1>>,
) -> Tensor<B, 2> {
    if uses(Op::Linear) {
        check::sabotage(
            Op::Linear,
            tensor(B::fused_linear(prim(x), prim(w), b.map(prim))),
        )
    } else {
        reference::linear_forward(x, w, b)
    }
}

/// The most rows (sequences of a batch, one new token each) a decoding step's products take
/// through [`decode_linear`]; more go through the LayerNorm, product and GELU apart.
pub const DECODE_ROWS: usize = 16;

/// Whether a decoding step of `rows` rows runs its products through [`decode_linear`], the
/// LayerNorm before each and the GELU or residual addition after it in the same launch: on a
/// backend that autotunes (a GPU, where each of those launches costs more than its arithmetic)
/// with the fused kernel on, for at most [`DECODE_ROWS`] rows, outside autodiff (a decode
/// trains nothing, and its dropout is off).
pub fn folds_decode<B: LabBackend>(rows: usize, device: &B::Device) -> bool {
    B::autotunes()
        && uses(Op::DecodeLinear)
        && (1..=DECODE_ROWS).contains(&rows)
        && !B::ad_enabled(device)
}

/// What follows a product of a decoding step in the same launch ([`decode_linear`]).
pub enum After<B: Backend> {
    /// Nothing.
    Nothing,
    /// GELU (a feed-forward network's inner layer).
    Gelu,
    /// The residual stream `[n, o]` added (a sublayer's last product).
    Residual(Tensor<B, 2>),
}

/// A decoding step's product `LN(x)·w + b` (`x` `[n, i]`, normalised by `norm` at `ε` where
/// given; `w` `[i, o]`, any view) followed by `after` → `[n, o]`, in one launch on a GPU
/// ([`LabBackend::fused_decode_linear`]). In `f32` whatever the training precision: a decode
/// reads one row a sequence. Called where [`folds_decode`] says so.
pub fn decode_linear<B: LabBackend>(
    x: Tensor<B, 2>,
    norm: Option<(&LayerNorm<B>, f64)>,
    w: Tensor<B, 2>,
    b: Option<Tensor<B, 1>>,
    after: After<B>,
) -> Tensor<B, 2> {
    let norm = norm.map(|(norm, epsilon)| NormPrimitive {
        gamma: prim(norm.gamma.val()),
        beta: norm.beta.as_ref().map(|beta| prim(beta.val())),
        epsilon,
    });
    let (gelu, residual) = match after {
        After::Nothing => (false, None),
        After::Gelu => (true, None),
        After::Residual(x) => (false, Some(prim(x))),
    };
    let y = B::fused_decode_linear(prim(x), norm, prim(w), b.map(prim), gelu, residual);
    check::sabotage(Op::DecodeLinear, tensor(y))
}

/// A decoding step's query, key and value product `LN(x)·w + b` (`x` `[n, i]`, `w` `[i, 3·d]`)
/// whose keys and values are written into a cache's buffers `keys`, `values` `[b, h, cap,
/// d/h]` at positions `at..` of each item ([`LabBackend::fused_decode_qkv`]: one launch on a
/// GPU, where the product and the append were two) → `(q [n, d], keys, values)`. Called
/// where [`folds_decode`] says so.
pub fn decode_qkv<B: LabBackend>(
    x: Tensor<B, 2>,
    norm: Option<(&LayerNorm<B>, f64)>,
    w: Tensor<B, 2>,
    b: Option<Tensor<B, 1>>,
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    at: usize,
) -> (Tensor<B, 2>, Tensor<B, 4>, Tensor<B, 4>) {
    let norm = norm.map(|(norm, epsilon)| NormPrimitive {
        gamma: prim(norm.gamma.val()),
        beta: norm.beta.as_ref().map(|beta| prim(beta.val())),
        epsilon,
    });
    let (keys, values) = (prim(keys), prim(values));
    let (q, keys, values) =
        B::fused_decode_qkv(prim(x), norm, prim(w), b.map(prim), keys, values, at);
    (
        check::sabotage(Op::DecodeLinear, tensor(q)),
        tensor(keys),
        tensor(values),
    )
}

/// Causal or padded self-attention on packed projections `qkv` `[b, t, 3·d]` (Q, K and V side
/// by side, from [`linear_parts`]) with `heads` heads → `[b, t, d]`, merged heads. Under
/// autodiff its gradient is written into one `[b, t, 3·d]` buffer: no split, no concatenation.
pub fn packed_self_attention<B: LabBackend>(
    qkv: Tensor<B, 3>,
    heads: usize,
    causal: bool,
    pad: Option<&Tensor<B, 2, Bool>>,
    dropout: Option<DropoutMask>,
) -> Tensor<B, 3> {
    let pad = pad.map(|pad| pad.clone().float());
    if !uses(Op::PackedAttention) {
        let (q, k, v) = reference::split_packed(qkv, heads);
        let o = reference::attention_forward(q, k, v, causal, pad, dropout).0;
        return reference::merge_heads(o);
    }
    let o = tensor(B::fused_packed_attention(
        prim(qkv),
        heads,
        causal,
        pad.map(prim),
        dropout,
    ));
    check::sabotage(Op::PackedAttention, o)
}

/// The settings of one AdamW step (PyTorch's `AdamW`, burn's `AdamW`): for gradient `g`,
/// `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`, and
/// `θ ← θ(1 − lr·λ) − lr · (m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f32,
    /// β₁.
    pub beta_1: f32,
    /// β₂.
    pub beta_2: f32,
    /// ε.
    pub epsilon: f32,
    /// Decoupled weight decay λ.
    pub weight_decay: f32,
    /// The step number `t`, from 1.
    pub time: i32,
}

/// One parameter's share of an AdamW step over many ([`adamw_all`]): the parameter, its gradient
/// (possibly a strided view) and its moments before the step (`None` at its first), all of the
/// parameter's shape — none is reshaped on the way (each reshape would be one more operation in
/// a GPU backend's fusion stream, six a matrix a step) — and the step's settings.
pub struct AdamWItem<B: Backend> {
    /// The parameter.
    pub param: FloatTensor<B>,
    /// Its gradient.
    pub grad: FloatTensor<B>,
    /// The first and second moments.
    pub moments: Option<(FloatTensor<B>, FloatTensor<B>)>,
    /// The step.
    pub step: AdamWStep,
}

/// `Σ x²` over every element of every tensor of `xs` (at least one) → `[1]`: the squared
/// global norm of a model's gradients. Fused on a GPU, up to 32 tensors a launch (as the
/// device's binding limit allows), each read where it lies (no copy of a transposed gradient),
/// and one launch adding up; on a processor, one parallel pass over all of them, the same bits
/// as each tensor's [`LabBackend::fused_sum_squares`] added in order.
pub fn sum_squares_all<B: LabBackend>(xs: Vec<FloatTensor<B>>) -> Tensor<B, 1> {
    tensor(match uses(Op::AdamW) {
        true => B::fused_sum_squares_all(xs),
        false => composed::sum_squares_all::<B>(xs),
    })
}

/// `x · s` for the one element of `s` `[1]` (clipping's rescale), which stays on the device.
/// Fused on a processor, a factor of exactly 1 (no clipping this step) returns `x` itself.
pub fn scale<B: LabBackend, const D: usize>(x: Tensor<B, D>, s: Tensor<B, 1>) -> Tensor<B, D> {
    let shape = x.shape();
    let (x, s) = (prim(x.reshape([-1])), prim(s));
    let y = match uses(Op::AdamW) {
        true => B::fused_scale(x, s),
        false => composed::scale::<B>(x, s),
    };
    tensor::<B, 1>(y).reshape(shape)
}

/// One AdamW step of `param`: `(parameter, first moment, second moment)` after it (see
/// [`AdamWStep`]), the gradient first multiplied by `clip`'s one element where given
/// (global-norm clipping's factor, as [`scale`]); one pass over the elements with fused
/// kernels, the composed tensor ops without.
pub fn adamw<B: LabBackend, const D: usize>(
    param: Tensor<B, D>,
    grad: Tensor<B, D>,
    moments: Option<(Tensor<B, D>, Tensor<B, D>)>,
    step: AdamWStep,
    clip: Option<Tensor<B, 1>>,
) -> (Tensor<B, D>, Tensor<B, D>, Tensor<B, D>) {
    let item = AdamWItem {
        param: prim(param),
        grad: prim(grad),
        moments: moments.map(|(m, v)| (prim(m), prim(v))),
        step,
    };
    let (p, m, v) = adamw_all(vec![item], clip)
        .pop()
        .unwrap_or_else(|| unreachable!("one result per parameter"));
    (tensor(p), tensor(m), tensor(v))
}

/// [`adamw`] of every parameter of `items` in one call, the same `clip` for all: each result in
/// its parameter's shape, in `items`' order, the values those of [`adamw`] on each. Fused on a
/// GPU, several parameters a launch (an optimizer step's launches are otherwise one per
/// parameter).
pub fn adamw_all<B: LabBackend>(
    items: Vec<AdamWItem<B>>,
    clip: Option<Tensor<B, 1>>,
) -> Vec<(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>)> {
    let clip = clip.map(prim);
    if !uses(Op::AdamW) {
        return composed::adamw_each::<B>(items, clip);
    }
    B::fused_adamw_all(items, clip)
        .into_iter()
        .map(|(p, m, v)| (check::sabotage_float::<B>(Op::AdamW, p), m, v))
        .collect()
}

/// The cross-entropy of each row of `logits` `[n, v]` against its class in `targets` `[n]`,
/// with label smoothing `ε`: `−(1−ε)·log p_y − ε·mean_j log p_j`, `p = softmax(row)`; rows
/// whose target is `ignore` (padding) give `0`. → `[n]`.
///
/// Fused, the forward pass keeps only each row's log-sum-exp and the backward pass writes
/// `softmax − target distribution` in one pass over the logits — the `[n, v]` log-probabilities,
/// one-hot targets and their products are never made (with a large vocabulary, they are most
/// of a translator's step).
pub fn cross_entropy<B: LabBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    smoothing: f32,
    ignore: Option<usize>,
) -> Tensor<B, 1> {
    if !uses(Op::CrossEntropy) {
        return reference::cross_entropy_forward(logits, targets, smoothing, ignore).0;
    }
    let loss = tensor(B::fused_cross_entropy(
        prim(logits),
        targets.into_primitive(),
        smoothing,
        ignore,
    ));
    check::sabotage(Op::CrossEntropy, loss)
}

/// The rows of the embedding table `weight` `[v, d]` that `tokens` `[b, n]` name → `[b, n, d]`
/// (burn's `Embedding::forward`; models pass `table.weight.val()`).
///
/// Fused, on a GPU the table's gradient is summed by a kernel that spreads the rows over the
/// device (each cube a chunk of rows, a block of columns and up to 64 of the table's rows, then
/// the chunks added in order: the same bits every run), where burn's gives each column one unit
/// that adds every row in turn. The lookup itself is burn's.
pub fn embedding<B: LabBackend>(weight: Tensor<B, 2>, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    if !uses(Op::Embedding) {
        return burn::tensor::module::embedding(weight, tokens);
    }
    let x = tensor(B::fused_embedding(prim(weight), tokens.into_primitive()));
    check::sabotage(Op::Embedding, x)
}
