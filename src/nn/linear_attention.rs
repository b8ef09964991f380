//! Kernelized linear attention (Katharopoulos et al. 2020, "Transformers are RNNs").
//!
//! With a positive feature map φ(x) = elu(x) + 1 in place of `exp(q·k)`, attention becomes
//! `Vᵢ' = φ(qᵢ)·Σⱼ φ(kⱼ)ᵀvⱼ / φ(qᵢ)·Σⱼ φ(kⱼ)`: the sums over keys are computed once, so the cost
//! is `O(t·k²)` instead of `O(t²·k)`. The causal form sums only over `j ≤ i` — running (prefix)
//! sums, computed here chunk by chunk: inside a chunk of `c` positions the masked quadratic form,
//! across chunks the prefix sum of the earlier chunks' states. A generating model can carry the
//! two sums `S = Σ φ(k)ᵀv` `[k, k]` and `z = Σ φ(k)` `[k]` from token to token: constant memory
//! per generated token ([`LinearState`]).
//!
//! [`linear_attention_weights`] is the quadratic form `A = φ(Q)·φ(K)ᵀ` (masked, rows normalised),
//! the reference the tests hold the fast forms equal to and what inspection shows.

use crate::kernels::LabBackend;
use burn::prelude::*;
use burn::tensor::activation::elu;
use burn::tensor::ops::PadMode;
use burn::tensor::Bool;

/// Keeps the normaliser away from zero (φ > 0, so it only matters for fully masked rows).
const EPS: f32 = 1e-6;

/// The feature map φ(x) = elu(x) + 1 > 0.
pub fn feature_map<B: LabBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    elu(x, 1.0).add_scalar(1.0)
}

/// φ(K) with the rows of padding keys set to zero, so they add nothing to any sum.
fn key_features<B: LabBackend>(k: Tensor<B, 4>, pad: Option<&Tensor<B, 2, Bool>>) -> Tensor<B, 4> {
    let phi = feature_map(k); // [b, h, s, k]
    match pad {
        Some(pad) => {
            let [b, h, s, d_head] = phi.dims();
            let pad = pad.clone().reshape([b, 1, s, 1]).expand([b, h, s, d_head]);
            phi.mask_fill(pad, 0.0)
        }
        None => phi,
    }
}

/// Linear attention, `O(t)` in the sequence length.
///
/// Not causal: `φ(Q)·(φ(K)ᵀV) / φ(Q)·Σφ(K)`. Causal: the same with sums over `j ≤ i`, in chunks
/// of `chunk` positions.
///
/// # Shapes
/// - `q`: `[b, h, t, k]`; `k`, `v`: `[b, h, s, k]` (`s = t` when causal)
/// - `pad`: `[b, s]`, `true` at padding keys
/// - returns the context `[b, h, t, k]`
pub fn linear_attention<B: LabBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    pad: Option<&Tensor<B, 2, Bool>>,
    chunk: usize,
) -> Tensor<B, 4> {
    let phi_q = feature_map(q);
    let phi_k = key_features(k, pad);
    if causal {
        return causal_linear(phi_q, phi_k, v, chunk);
    }
    let kv = phi_k.clone().swap_dims(2, 3).matmul(v); // [b, h, k, k]
    let z = phi_k.sum_dim(2).swap_dims(2, 3); // [b, h, k, 1]
    let numerator = phi_q.clone().matmul(kv); // [b, h, t, k]
    let denominator = phi_q.matmul(z).add_scalar(EPS); // [b, h, t, 1]
    numerator / denominator
}

/// The causal form in chunks of `c`: within a chunk `(φQ·φKᵀ ⊙ L)·V` with `L` lower-triangular,
/// plus `φQ·S` where `S` is the sum of `φKᵀV` over all earlier chunks (an exclusive prefix sum).
fn causal_linear<B: LabBackend>(
    phi_q: Tensor<B, 4>,
    phi_k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    chunk: usize,
) -> Tensor<B, 4> {
    let [b, h, t, d_head] = phi_q.dims();
    let c = chunk.clamp(1, t.max(1));
    let nc = t.div_ceil(c);
    let padded = |x: Tensor<B, 4>| {
        x.pad([(0, nc * c - t), (0, 0)], PadMode::Constant(0.0))
            .reshape([b, h, nc, c, d_head]) // [b, h, nc, c, k]
    };
    // Zero padding is harmless: padded positions come after every real one, and φ(K) rows
    // there are zero, so they add nothing to any prefix sum.
    let (q, k, v) = (padded(phi_q), padded(phi_k), padded(v));

    let lower = Tensor::<B, 2, Bool>::tril_mask([c, c], 0, &q.device()) // true where j > i
        .unsqueeze::<5>()
        .expand([b, h, nc, c, c]);
    let scores = q
        .clone()
        .matmul(k.clone().swap_dims(3, 4))
        .mask_fill(lower, 0.0); // [b, h, nc, c, c]
    let intra_num = scores.clone().matmul(v.clone()); // [b, h, nc, c, k]
    let intra_den = scores.sum_dim(4); // [b, h, nc, c, 1]

    let states = k.clone().swap_dims(3, 4).matmul(v); // [b, h, nc, k, k]
    let sums = k.sum_dim(3).swap_dims(3, 4); // [b, h, nc, k, 1]
    let earlier_states = states.clone().cumsum(2) - states; // exclusive prefix sum over chunks
    let earlier_sums = sums.clone().cumsum(2) - sums;
    let inter_num = q.clone().matmul(earlier_states); // [b, h, nc, c, k]
    let inter_den = q.matmul(earlier_sums); // [b, h, nc, c, 1]

    let out = (intra_num + inter_num) / (intra_den + inter_den).add_scalar(EPS);
    out.reshape([b, h, nc * c, d_head])
        .slice([0..b, 0..h, 0..t]) // [b, h, t, k]
}

/// The quadratic form's weights `Aᵢⱼ = φ(qᵢ)·φ(kⱼ) / Σⱼ' φ(qᵢ)·φ(kⱼ')` over the visible keys:
/// `A·V` is what [`linear_attention`] computes. Rows sum to 1, masked entries are 0.
///
/// # Shapes
/// `q`: `[b, h, t, k]`, `k`: `[b, h, s, k]`, `mask` broadcastable to `[b, h, t, s]`
/// (`true` = masked out) → `[b, h, t, s]`.
pub fn linear_attention_weights<B: LabBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
) -> Tensor<B, 4> {
    let [b, h, t, _] = q.dims();
    let s = k.dims()[2];
    let scores = feature_map(q).matmul(feature_map(k).swap_dims(2, 3)); // [b, h, t, s]
    let scores = match mask {
        Some(mask) => scores.mask_fill(mask.expand([b, h, t, s]), 0.0),
        None => scores,
    };
    let total = scores.clone().sum_dim(3).add_scalar(EPS); // [b, h, t, 1]
    scores / total
}

/// The running sums of causal linear attention after some tokens: all a generating model needs
/// to attend from the next token, whatever the length so far.
#[derive(Clone, Debug)]
pub struct LinearState<B: LabBackend> {
    /// `S = Σⱼ φ(kⱼ)ᵀvⱼ`, `[b, h, k, k]`.
    pub kv: Tensor<B, 4>,
    /// `z = Σⱼ φ(kⱼ)`, `[b, h, k, 1]`.
    pub z: Tensor<B, 4>,
}

impl<B: LabBackend> LinearState<B> {
    /// The state before any token.
    pub fn new(b: usize, h: usize, d_head: usize, device: &B::Device) -> Self {
        Self {
            kv: Tensor::zeros([b, h, d_head, d_head], device),
            z: Tensor::zeros([b, h, d_head, 1], device),
        }
    }

    /// Adds the keys and values of `n` new positions and attends from their queries, each
    /// over the positions before it and itself: the causal form's rows for those positions.
    ///
    /// # Shapes
    /// `q`, `k`, `v`: `[b, h, n, k]` → context `[b, h, n, k]`.
    pub fn extend(&mut self, q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 4> {
        let n = q.dims()[2];
        if n == 1 {
            return self.step(q, k, v);
        }
        let (phi_q, phi_k) = (feature_map(q), feature_map(k));
        let later = Tensor::<B, 2, Bool>::tril_mask([n, n], 0, &phi_q.device()) // true where j > i
            .unsqueeze::<4>();
        let scores = phi_q.clone().matmul(phi_k.clone().swap_dims(2, 3)); // [b, h, n, n]
        let scores = scores.clone().mask_fill(later.expand(scores.dims()), 0.0);
        let numerator = scores.clone().matmul(v.clone()) + phi_q.clone().matmul(self.kv.clone());
        let denominator = scores.sum_dim(3) + phi_q.matmul(self.z.clone()); // [b, h, n, 1]
        self.kv = self.kv.clone() + phi_k.clone().swap_dims(2, 3).matmul(v); // [b, h, k, k]
        self.z = self.z.clone() + phi_k.sum_dim(2).swap_dims(2, 3); // [b, h, k, 1]
        numerator / denominator.add_scalar(EPS)
    }

    /// Adds one token's key and value and attends from its query: `O(k²)` time and memory,
    /// independent of how many tokens came before.
    ///
    /// # Shapes
    /// `q`, `k`, `v`: `[b, h, 1, k]` → context `[b, h, 1, k]`.
    pub fn step(&mut self, q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 4> {
        let phi_k = feature_map(k); // [b, h, 1, k]
        self.kv = self.kv.clone() + phi_k.clone().swap_dims(2, 3).matmul(v); // [b, h, k, k]
        self.z = self.z.clone() + phi_k.swap_dims(2, 3); // [b, h, k, 1]
        let phi_q = feature_map(q);
        phi_q.clone().matmul(self.kv.clone()) / phi_q.matmul(self.z.clone()).add_scalar(EPS)
    }
}
