//! The composed forms of the fused operations, written with burn's tensor ops: the defaults of
//! [`super::LabBackend`] and the references the kernels are tested against.

use super::DropoutMask;
use burn::prelude::*;
use burn::tensor::Bool;
use std::f32::consts::{FRAC_1_SQRT_2, PI};

/// Score given to masked-out positions before the softmax. Finite, so a fully masked row gives
/// uniform weights instead of NaN.
pub const MASKED_SCORE: f32 = -1.0e9;

/// The causal mask: query `i` may attend to keys `j <= i` only.
///
/// Returns `[t, t]` with `true` (masked out) strictly above the diagonal.
pub fn causal_mask<B: Backend>(t: usize, device: &B::Device) -> Tensor<B, 2, Bool> {
    // `tril_mask(offset 0)` is true where j > i: exactly the future keys.
    Tensor::<B, 2, Bool>::tril_mask([t, t], 0, device)
}

/// Exact GELU: `x·Φ(x) = x·(1 + erf(x/√2))/2`.
pub fn gelu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let phi = x
        .clone()
        .mul_scalar(FRAC_1_SQRT_2)
        .erf()
        .add_scalar(1.0)
        .mul_scalar(0.5);
    x * phi
}

/// `grad · (Φ(x) + x·φ(x))`, the exact derivative of [`gelu`] times the output gradient.
pub fn gelu_backward<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    grad: Tensor<B, D>,
) -> Tensor<B, D> {
    let cdf = x
        .clone()
        .mul_scalar(FRAC_1_SQRT_2)
        .erf()
        .add_scalar(1.0)
        .mul_scalar(0.5);
    let pdf = x
        .clone()
        .powi_scalar(2)
        .mul_scalar(-0.5)
        .exp()
        .mul_scalar(1.0 / (2.0 * PI).sqrt());
    grad * (cdf + x * pdf)
}

/// LayerNorm of the rows of `x` `[n, d]`: `(y [n, d], mean [n], 1/σ [n])`.
pub fn layer_norm_forward<B: Backend>(
    x: Tensor<B, 2>,
    gamma: Tensor<B, 1>,
    beta: Option<Tensor<B, 1>>,
    epsilon: f64,
) -> (Tensor<B, 2>, Tensor<B, 1>, Tensor<B, 1>) {
    let mean = x.clone().mean_dim(1); // [n, 1]
    let centered = x - mean.clone();
    let var = centered.clone().powi_scalar(2).mean_dim(1);
    let rstd = var.add_scalar(epsilon).sqrt().recip(); // [n, 1]
    let y = centered * rstd.clone() * gamma.unsqueeze();
    let y = match beta {
        Some(beta) => y + beta.unsqueeze(),
        None => y,
    };
    (y, mean.squeeze_dim(1), rstd.squeeze_dim(1))
}

/// LayerNorm's gradients `(dx, dγ, dβ)` for the output gradient `dy` `[n, d]`.
pub fn layer_norm_backward<B: Backend>(
    x: Tensor<B, 2>,
    gamma: Tensor<B, 1>,
    mean: Tensor<B, 1>,
    rstd: Tensor<B, 1>,
    dy: Tensor<B, 2>,
) -> (Tensor<B, 2>, Tensor<B, 1>, Tensor<B, 1>) {
    let rstd = rstd.unsqueeze_dim::<2>(1); // [n, 1]
    let xhat = (x - mean.unsqueeze_dim(1)) * rstd.clone();
    let dgamma = (dy.clone() * xhat.clone()).sum_dim(0).squeeze_dim(0);
    let dbeta = dy.clone().sum_dim(0).squeeze_dim(0);
    let g = dy * gamma.unsqueeze(); // dL/dx̂
    let mean_g = g.clone().mean_dim(1);
    let mean_gx = (g.clone() * xhat.clone()).mean_dim(1);
    let dx = (g - mean_g - xhat * mean_gx) * rstd;
    (dx, dgamma, dbeta)
}

/// `p ⊙ (dp − Σ_j p_j·dp_j)` row by row: the softmax's input gradient, `p = softmax(x)` `[n, s]`.
pub fn softmax_backward<B: Backend>(p: Tensor<B, 2>, dp: Tensor<B, 2>) -> Tensor<B, 2> {
    let dot = (p.clone() * dp.clone()).sum_dim(1);
    p * (dp - dot)
}

/// The label-smoothed cross-entropy of each row of `logits` `[n, v]` against `targets` `[n]`,
/// `−(1−ε)·log p_y − ε·mean_j log p_j` with `p = softmax(row)`, and `0` for rows whose target
/// is `ignore`; with each row's log-sum-exp `[n]` (what the backward pass needs).
pub fn cross_entropy_forward<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    smoothing: f32,
    ignore: Option<usize>,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let [n, _] = logits.dims();
    let log_p = burn::tensor::activation::log_softmax(logits.clone(), 1);
    let lse = (logits.slice([0..n, 0..1]) - log_p.clone().slice([0..n, 0..1])).reshape([n]);
    let picked = log_p
        .clone()
        .gather(1, targets.clone().reshape([n, 1]))
        .reshape([n]);
    let mut loss = picked.mul_scalar(smoothing - 1.0);
    if smoothing > 0.0 {
        loss = loss - log_p.mean_dim(1).reshape([n]).mul_scalar(smoothing);
    }
    if let Some(ignore) = ignore {
        loss = loss * targets.not_equal_elem(ignore as i64).float();
    }
    (loss, lse)
}

/// The gradient `[n, v]` of [`cross_entropy_forward`]'s row losses for their gradient `grad`
/// `[n]`: `grad · (softmax(row) − (1−ε)·onehot(y) − ε/v)`, zero on ignored rows.
pub fn cross_entropy_backward<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    lse: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    smoothing: f32,
    ignore: Option<usize>,
) -> Tensor<B, 2> {
    let [n, v] = logits.dims();
    let grad = match ignore {
        Some(ignore) => grad * targets.clone().not_equal_elem(ignore as i64).float(),
        None => grad,
    };
    let p = (logits - lse.reshape([n, 1])).exp();
    let target = targets.one_hot::<2>(v).float().mul_scalar(1.0 - smoothing);
    (p - target).sub_scalar(smoothing / v as f32) * grad.reshape([n, 1])
}

/// The mask of attention scores, `true` = masked out, broadcastable to `[b, h, t, s]`.
fn score_mask<B: Backend>(
    t: usize,
    s: usize,
    causal: bool,
    pad: Option<Tensor<B, 2>>,
    device: &B::Device,
) -> Option<Tensor<B, 4, Bool>> {
    let pad = pad.map(|pad| {
        let b = pad.dims()[0];
        pad.greater_elem(0.5).reshape([b, 1, 1, s])
    });
    let causal = causal.then(|| causal_mask::<B>(t, device).unsqueeze::<4>());
    match (causal, pad) {
        (Some(c), Some(p)) => {
            let b = p.dims()[0];
            Some(c.expand([b, 1, t, s]).bool_or(p.expand([b, 1, t, s])))
        }
        (c, p) => c.or(p),
    }
}

/// The masked, scaled scores `[b, h, t, s]`.
fn scores<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    mask: Option<&Tensor<B, 4, Bool>>,
) -> Tensor<B, 4> {
    let [b, h, t, d_head] = q.dims();
    let s = k.dims()[2];
    let scores = q.matmul(k.transpose()).div_scalar((d_head as f32).sqrt());
    match mask {
        Some(mask) => scores.mask_fill(mask.clone().expand([b, h, t, s]), MASKED_SCORE),
        None => scores,
    }
}

/// Attention's output `[b, h, t, k]` and each row's log-sum-exp of scores `[b, h, t]`, composed.
/// `pad` `[b, s]` is `1` at padded keys.
pub fn attention_forward<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    pad: Option<Tensor<B, 2>>,
    dropout: Option<DropoutMask>,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let (t, s) = (q.dims()[2], k.dims()[2]);
    let mask = score_mask(t, s, causal, pad, &q.device());
    let scores = scores(q, k, mask.as_ref());
    let max = scores.clone().max_dim(3).detach();
    let exp = (scores - max.clone()).exp();
    let sum = exp.clone().sum_dim(3); // [b, h, t, 1]
    let lse = sum.clone().log() + max;
    // Divided by the sum rather than `exp(scores − lse)`: a fully masked row's lse is
    // −10⁹ + ln s, which rounds to −10⁹ in f32.
    let p = exp / sum;
    let p = match dropout {
        Some(mask) => p.clone() * dropout_multipliers(mask, p.shape(), &p.device()),
        None => p,
    };
    (p.matmul(v), lse.squeeze_dim(3))
}

/// The multipliers (`0` or `1/(1−p)`) of `mask` as a tensor of `shape`, element `e` (row-major)
/// the mask's element `e`.
pub fn dropout_multipliers<B: Backend, const D: usize>(
    mask: DropoutMask,
    shape: Shape,
    device: &B::Device,
) -> Tensor<B, D> {
    let multipliers = mask.multipliers(shape.num_elements());
    Tensor::from_data(TensorData::new(multipliers, shape), device)
}

/// Attention's gradients `(dq, dk, dv)` for the output gradient `d_o`, composed (the
/// probabilities recomputed by a softmax of the scores; `lse` is what a kernel would use).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    o: Tensor<B, 4>,
    _lse: Tensor<B, 3>,
    d_o: Tensor<B, 4>,
    causal: bool,
    pad: Option<Tensor<B, 2>>,
    dropout: Option<DropoutMask>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    let [b, h, t, d_head] = q.dims();
    let s = k.dims()[2];
    let scale = 1.0 / (d_head as f32).sqrt();
    let mask = score_mask(t, s, causal, pad, &q.device());
    // P by a softmax, not `exp(scores − lse)`: exact on fully masked rows too (see
    // attention_forward).
    let p = burn::tensor::activation::softmax(scores(q.clone(), k.clone(), mask.as_ref()), 3);
    // With dropout M: O = (P⊙M)·V, so dV = (P⊙M)ᵀ·dO and dP = (dO·Vᵀ)⊙M; D = Σ_j P⊙dP is
    // still rowsum(dO⊙O).
    let multipliers = dropout.map(|mask| dropout_multipliers::<B, 4>(mask, p.shape(), &p.device()));
    let dropped = match &multipliers {
        Some(m) => p.clone() * m.clone(),
        None => p.clone(),
    };
    let dv = dropped.transpose().matmul(d_o.clone());
    let dp = d_o.clone().matmul(v.transpose());
    let dp = match multipliers {
        Some(m) => dp * m,
        None => dp,
    };
    let delta = (d_o * o).sum_dim(3); // [b, h, t, 1]
    let ds = p * (dp - delta);
    // Masked scores are constants: no gradient reaches q or k through them.
    let ds = match mask {
        Some(mask) => ds.mask_fill(mask.expand([b, h, t, s]), 0.0),
        None => ds,
    }
    .mul_scalar(scale);
    let dq = ds.clone().matmul(k);
    let dk = ds.transpose().matmul(q);
    (dq, dk, dv)
}

/// `x·w + b`: `x` `[n, i]`, `w` `[i, o]`, `b` `[o]` → `[n, o]`.
pub fn linear_forward<B: Backend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    b: Option<Tensor<B, 1>>,
) -> Tensor<B, 2> {
    let y = x.matmul(w);
    match b {
        Some(b) => y + b.unsqueeze(),
        None => y,
    }
}

/// The gradients `(dx = dy·wᵀ, dw = xᵀ·dy, db = Σ_rows dy)` of [`linear_forward`].
pub fn linear_backward<B: Backend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    dy: Tensor<B, 2>,
    bias: bool,
) -> (Tensor<B, 2>, Tensor<B, 2>, Option<Tensor<B, 1>>) {
    let db = bias.then(|| dy.clone().sum_dim(0).squeeze_dim(0));
    (
        dy.clone().matmul(w.transpose()),
        x.transpose().matmul(dy),
        db,
    )
}

/// Q, K and V `[b, h, t, k]` of packed projections `[b, t, 3·d]` (Q, K, V side by side, each
/// split into `heads` heads): views, no copies.
pub fn split_packed<B: Backend>(
    qkv: Tensor<B, 3>,
    heads: usize,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    let [b, t, d3] = qkv.dims();
    let k = d3 / 3 / heads;
    let all = qkv.reshape([b, t, 3 * heads, k]).swap_dims(1, 2); // [b, 3h, t, k]
    let part = |i: usize| all.clone().narrow(1, i * heads, heads);
    (part(0), part(1), part(2))
}

/// Heads `[b, h, t, k]` merged into `[b, t, h·k]`.
pub fn merge_heads<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [b, h, t, k] = x.dims();
    x.swap_dims(1, 2).reshape([b, t, h * k])
}
