//! [`super::reference`] on backend primitives: the bodies of [`super::LabBackend`]'s default
//! methods, and what a kernel-backed backend falls back to for inputs its kernels do not take
//! (flex, for dtypes other than `f32`).

use super::{reference, AdamWStep, DropoutMask, LabBackend, NormPrimitive};
use burn::prelude::*;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Slice, TensorMetadata, TensorPrimitive};

/// A float primitive as a tensor.
pub(super) fn tensor<B: Backend, const D: usize>(x: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// A float tensor's primitive.
pub(super) fn prim<B: Backend, const D: usize>(x: Tensor<B, D>) -> FloatTensor<B> {
    x.into_primitive().tensor()
}

/// `x` `[..., d]` as the rows `[n, d]` the row kernels take (a view where it is contiguous).
pub(super) fn rows<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let shape = x.shape();
    let d = shape[shape.num_dims() - 1];
    B::float_reshape(x, Shape::new([shape.num_elements() / d.max(1), d]))
}

/// See [`super::LabBackend::fused_gelu`].
pub fn gelu<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    prim(reference::gelu(tensor::<B, 1>(x)))
}

/// See [`super::LabBackend::fused_gelu_forward`]: the backend's GELU and its backward for a
/// gradient of ones, each then through the backend's dropout.
pub fn gelu_forward<B: LabBackend>(
    x: FloatTensor<B>,
    mask: Option<DropoutMask>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let x = tensor::<B, 1>(x);
    let ones = x.ones_like();
    let y = B::fused_gelu(prim(x.clone()));
    let derivative = B::fused_gelu_backward(prim(x), prim(ones));
    match mask {
        Some(mask) => (
            B::fused_dropout(y, mask),
            B::fused_dropout(derivative, mask),
        ),
        None => (y, derivative),
    }
}

/// See [`super::LabBackend::fused_gelu_backward`].
pub fn gelu_backward<B: Backend>(x: FloatTensor<B>, grad: FloatTensor<B>) -> FloatTensor<B> {
    prim(reference::gelu_backward(tensor::<B, 1>(x), tensor(grad)))
}

/// See [`super::LabBackend::fused_decode_linear`]: the backend's LayerNorm, linear layer,
/// GELU and addition, one after the other.
pub fn decode_linear<B: LabBackend>(
    x: FloatTensor<B>,
    norm: Option<NormPrimitive<B>>,
    w: FloatTensor<B>,
    b: Option<FloatTensor<B>>,
    gelu: bool,
    residual: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let x = match norm {
        Some(norm) => B::fused_layer_norm_forward(x, norm.gamma, norm.beta, norm.epsilon).0,
        None => x,
    };
    let mut y = B::fused_linear(x, w, b);
    if gelu {
        y = B::fused_gelu(y);
    }
    match residual {
        Some(residual) => B::float_add(residual, y),
        None => y,
    }
}

/// See [`super::LabBackend::fused_decode_qkv`]: the product, then the backend's append.
pub fn decode_qkv<B: LabBackend>(
    x: FloatTensor<B>,
    norm: Option<NormPrimitive<B>>,
    w: FloatTensor<B>,
    b: Option<FloatTensor<B>>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    at: usize,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let n = x.shape()[0];
    let [items, h, _, width] = keys.shape().dims();
    let (per_item, d) = (n / items, h * width);
    let y = tensor::<B, 2>(decode_linear::<B>(x, norm, w, b, false, None));
    // `[n, d]` columns as `[b, h, n/b, d/h]`, how a cache holds them.
    let heads = |from: usize| {
        y.clone()
            .slice([0..n, from..from + d])
            .reshape([items, per_item, h, width])
            .swap_dims(1, 2)
    };
    let (k, v) = (prim(heads(d)), prim(heads(2 * d)));
    let (keys, values) = B::write_columns_pair(keys, values, at, k, v);
    (prim(y.slice([0..n, 0..d])), keys, values)
}

/// See [`super::LabBackend::fused_layer_norm_forward`].
pub fn layer_norm_forward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: Option<FloatTensor<B>>,
    epsilon: f64,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (y, mean, rstd) =
        reference::layer_norm_forward(tensor::<B, 2>(x), tensor(gamma), beta.map(tensor), epsilon);
    (prim(y), prim(mean), prim(rstd))
}

/// See [`super::LabBackend::fused_add_layer_norm_forward`]: the backend's dropout-and-add (or
/// addition), then its LayerNorm.
#[allow(clippy::type_complexity)]
pub fn add_layer_norm_forward<B: LabBackend>(
    x: FloatTensor<B>,
    h: FloatTensor<B>,
    mask: Option<DropoutMask>,
    gamma: FloatTensor<B>,
    beta: Option<FloatTensor<B>>,
    epsilon: f64,
) -> (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
) {
    let s = match mask {
        Some(mask) => B::fused_dropout_add(x, h, mask),
        None => B::float_add(x, h),
    };
    let (y, mean, rstd) = B::fused_layer_norm_forward(s.clone(), gamma, beta, epsilon);
    (s, y, mean, rstd)
}

/// See [`super::LabBackend::fused_layer_norm_backward`]: the residual gradient added after.
pub fn layer_norm_backward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    mean: FloatTensor<B>,
    rstd: FloatTensor<B>,
    dy: FloatTensor<B>,
    residual: Option<FloatTensor<B>>,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (dx, dgamma, dbeta) = reference::layer_norm_backward(
        tensor::<B, 2>(x),
        tensor(gamma),
        tensor(mean),
        tensor(rstd),
        tensor(dy),
    );
    let dx = match residual {
        Some(residual) => dx + tensor(residual),
        None => dx,
    };
    (prim(dx), prim(dgamma), prim(dbeta))
}

/// See [`super::LabBackend::fused_softmax`].
pub fn softmax<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    prim(burn::tensor::activation::softmax(tensor::<B, 2>(x), 1))
}

/// See [`super::LabBackend::fused_softmax_backward`].
pub fn softmax_backward<B: Backend>(p: FloatTensor<B>, dp: FloatTensor<B>) -> FloatTensor<B> {
    prim(reference::softmax_backward(tensor::<B, 2>(p), tensor(dp)))
}

/// See [`super::LabBackend::fused_attention_forward`].
pub fn attention_forward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    causal: bool,
    pad: Option<FloatTensor<B>>,
    dropout: Option<DropoutMask>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (o, lse) = reference::attention_forward(
        tensor::<B, 4>(q),
        tensor(k),
        tensor(v),
        causal,
        pad.map(tensor),
        dropout,
    );
    (prim(o), prim(lse))
}

/// See [`super::LabBackend::fused_attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    o: FloatTensor<B>,
    lse: FloatTensor<B>,
    d_o: FloatTensor<B>,
    causal: bool,
    pad: Option<FloatTensor<B>>,
    dropout: Option<DropoutMask>,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (dq, dk, dv) = reference::attention_backward(
        tensor::<B, 4>(q),
        tensor(k),
        tensor(v),
        tensor(o),
        tensor(lse),
        tensor(d_o),
        causal,
        pad.map(tensor),
        dropout,
    );
    (prim(dq), prim(dk), prim(dv))
}

/// See [`super::LabBackend::fused_dropout`]: the mask made on the host, one product (`x` of
/// any shape, its elements numbered row-major).
pub fn dropout<B: Backend>(x: FloatTensor<B>, mask: DropoutMask) -> FloatTensor<B> {
    let shape = x.shape();
    let x = tensor::<B, 1>(B::float_reshape(x, Shape::new([shape.num_elements()])));
    let multipliers = reference::dropout_multipliers::<B, 1>(mask, x.shape(), &x.device());
    B::float_reshape(prim(x * multipliers), shape)
}

/// See [`super::LabBackend::fused_linear`].
pub fn linear<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    b: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    prim(reference::linear_forward(
        tensor::<B, 2>(x),
        tensor(w),
        b.map(tensor),
    ))
}

/// See [`super::LabBackend::fused_linear_backward`].
pub fn linear_backward<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    dy: FloatTensor<B>,
    bias: bool,
) -> (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>) {
    let (dx, dw, db) = reference::linear_backward(tensor::<B, 2>(x), tensor(w), tensor(dy), bias);
    (prim(dx), prim(dw), db.map(prim))
}

/// See [`super::LabBackend::fused_gelu_linear_backward`]: the backend's linear backward, then
/// `dx` multiplied by the kept GELU derivative.
pub fn gelu_linear_backward<B: LabBackend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    dy: FloatTensor<B>,
    bias: bool,
    derivative: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>) {
    let (dx, dw, db) = B::fused_linear_backward(x, w, dy, bias);
    (B::fused_mul(dx, derivative), dw, db)
}

/// See [`super::LabBackend::fused_linear_gelu_keeping`]: the backend's linear layer keeping its
/// operands, then its GELU (with the mask): `[y, derivative, x kept, w kept]`.
pub fn linear_gelu_keeping<B: LabBackend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    b: Option<FloatTensor<B>>,
    mask: Option<DropoutMask>,
) -> [FloatTensor<B>; 4] {
    let (h, x, w) = B::fused_linear_keeping(x, w, b);
    let (y, derivative) = B::fused_gelu_forward(h, mask);
    [y, derivative, x, w]
}

/// See [`super::LabBackend::fused_packed_attention_forward`]: the backend's attention on views
/// of the packed projections.
pub fn packed_attention_forward<B: LabBackend>(
    qkv: FloatTensor<B>,
    heads: usize,
    causal: bool,
    pad: Option<FloatTensor<B>>,
    dropout: Option<DropoutMask>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (q, k, v) = reference::split_packed(tensor::<B, 3>(qkv), heads);
    let (o, lse) = B::fused_attention_forward(prim(q), prim(k), prim(v), causal, pad, dropout);
    (prim(reference::merge_heads(tensor::<B, 4>(o))), lse)
}

/// See [`super::LabBackend::fused_packed_attention_backward`]: the backend's attention backward
/// on views, its three gradients concatenated.
#[allow(clippy::too_many_arguments)]
pub fn packed_attention_backward<B: LabBackend>(
    qkv: FloatTensor<B>,
    o: FloatTensor<B>,
    lse: FloatTensor<B>,
    d_o: FloatTensor<B>,
    heads: usize,
    causal: bool,
    pad: Option<FloatTensor<B>>,
    dropout: Option<DropoutMask>,
) -> FloatTensor<B> {
    let (q, k, v) = reference::split_packed(tensor::<B, 3>(qkv), heads);
    let [b, t, d] = tensor::<B, 3>(o.clone()).dims();
    let to_heads = |x: FloatTensor<B>| {
        tensor::<B, 3>(x)
            .reshape([b, t, heads, d / heads])
            .swap_dims(1, 2)
    };
    let (dq, dk, dv) = B::fused_attention_backward(
        prim(q),
        prim(k),
        prim(v),
        prim(to_heads(o)),
        lse,
        prim(to_heads(d_o)),
        causal,
        pad,
        dropout,
    );
    let merged = [dq, dk, dv].map(|g| reference::merge_heads(tensor::<B, 4>(g)));
    prim(Tensor::cat(merged.to_vec(), 2))
}

/// See [`super::LabBackend::fused_sum_squares`].
pub fn sum_squares<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    prim(tensor::<B, 1>(x).square().sum())
}

/// See [`super::LabBackend::fused_sum_squares_all`]: each tensor's [`sum_squares`], added in
/// order.
pub fn sum_squares_all<B: Backend>(xs: Vec<FloatTensor<B>>) -> FloatTensor<B> {
    sum_squares_each::<B>(xs, sum_squares::<B>)
}

/// `Σ` over `xs` in order of `sum(x)` for each `x` flattened: global-norm clipping's total.
pub fn sum_squares_each<B: Backend>(
    xs: Vec<FloatTensor<B>>,
    sum: impl Fn(FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    xs.into_iter()
        .map(|x| {
            let n = x.shape().num_elements();
            sum(B::float_reshape(x, Shape::new([n])))
        })
        .reduce(|total, s| B::float_add(total, s))
        .expect("at least one tensor")
}

/// See [`super::LabBackend::fused_scale`].
pub fn scale<B: Backend>(x: FloatTensor<B>, s: FloatTensor<B>) -> FloatTensor<B> {
    prim(tensor::<B, 1>(x) * tensor::<B, 1>(s))
}

/// [`adamw`] of each parameter of `items` (see [`super::LabBackend::fused_adamw_all`]).
pub fn adamw_each<B: Backend>(
    items: Vec<super::AdamWItem<B>>,
    clip: Option<FloatTensor<B>>,
) -> Vec<(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>)> {
    let step = |item: super::AdamWItem<B>| {
        adamw::<B>(item.param, item.grad, item.moments, item.step, clip.clone())
    };
    items.into_iter().map(step).collect()
}

/// One parameter's step of [`super::LabBackend::fused_adamw_all`]: burn's AdamW update, op by
/// op.
pub fn adamw<B: Backend>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    moments: Option<(FloatTensor<B>, FloatTensor<B>)>,
    step: AdamWStep,
    clip: Option<FloatTensor<B>>,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    // Element by element in the parameter's row-major order, flattened (a gradient that is a
    // strided view is copied by its reshape); the results in the parameter's shape.
    let shape = param.shape();
    let flat = |x: FloatTensor<B>| B::float_reshape(x, Shape::new([shape.num_elements()]));
    let back = |x: Tensor<B, 1>| B::float_reshape(prim(x), shape.clone());
    let grad = flat(grad);
    let grad = match clip {
        Some(clip) => scale::<B>(grad, clip),
        None => grad,
    };
    let AdamWStep {
        lr,
        beta_1,
        beta_2,
        epsilon,
        weight_decay,
        time,
    } = step;
    let grad = tensor::<B, 1>(grad);
    let (m, v) = match moments {
        Some((m, v)) => (
            tensor::<B, 1>(flat(m)).mul_scalar(beta_1) + grad.clone().mul_scalar(1.0 - beta_1),
            tensor::<B, 1>(flat(v)).mul_scalar(beta_2) + grad.square().mul_scalar(1.0 - beta_2),
        ),
        None => (
            grad.clone().mul_scalar(1.0 - beta_1),
            grad.square().mul_scalar(1.0 - beta_2),
        ),
    };
    let m_hat = m.clone().div_scalar(1.0 - beta_1.powi(time));
    let v_hat = v.clone().div_scalar(1.0 - beta_2.powi(time));
    let delta = m_hat / v_hat.sqrt().add_scalar(epsilon);
    let param =
        tensor::<B, 1>(flat(param)).mul_scalar(1.0 - lr * weight_decay) - delta.mul_scalar(lr);
    (back(param), back(m), back(v))
}

/// See [`super::LabBackend::fused_cross_entropy_forward`].
pub fn cross_entropy_forward<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    smoothing: f32,
    ignore: Option<usize>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let (loss, lse) =
        reference::cross_entropy_forward(tensor::<B, 2>(logits), targets, smoothing, ignore);
    (prim(loss), prim(lse))
}

/// See [`super::LabBackend::fused_cross_entropy_backward`].
pub fn cross_entropy_backward<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    smoothing: f32,
    ignore: Option<usize>,
) -> FloatTensor<B> {
    prim(reference::cross_entropy_backward(
        tensor::<B, 2>(logits),
        Tensor::from_primitive(targets),
        tensor(lse),
        tensor(grad),
        smoothing,
        ignore,
    ))
}

/// `buffer` `[b, h, s, k]` with `value` `[b, h, n, k]` in its positions `at..at + n` of
/// dimension 2, through the backend's `slice_assign` (in place on CubeCL where the buffer is held
/// once; flex copies the buffer first).
pub fn write_columns<B: Backend>(
    buffer: FloatTensor<B>,
    at: usize,
    value: FloatTensor<B>,
) -> FloatTensor<B> {
    let n = value.shape()[2];
    let mut slices = [Slice::full(), Slice::full(), Slice::full(), Slice::full()];
    slices[2] = Slice::from(at..at + n);
    B::float_slice_assign(buffer, &slices, value)
}
