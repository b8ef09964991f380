//! Sparse softmax attention that computes only the allowed blocks of the score matrix.
//!
//! Both patterns are masks on the scores, `softmax((Q·Kᵀ)/√d_k + M)·V` with masked entries
//! excluded ([`super::mask::local_allows`], [`super::mask::strided_allows`]), but instead of
//! masking a dense `[t, t]` matrix the sequence is cut into blocks and each block of queries
//! meets only the keys its pattern can reach:
//!
//! - **local** (sliding window `w`): blocks of `c = min(w, t)` queries against their own and the
//!   neighbouring blocks, `O(t·w)` time and memory instead of `O(t²)`;
//! - **strided** (fixed block-sparse pattern, blocks of `l`): each block against itself plus the
//!   one summary key of every block, `O(t·l + t²/l)`.
//!
//! The dense references are [`super::attention::attention_weights`] with the pattern's mask;
//! the tests hold the two equal.

use super::attention::MASKED_SCORE;
use super::mask::{local_allows, strided_allows};
use crate::kernels::{softmax, LabBackend};
use burn::nn::Dropout;
use burn::prelude::*;
use burn::tensor::ops::PadMode;
use burn::tensor::Bool;

/// Sliding-window attention: query `i` attends to keys `i − w < j ≤ i` (causal) or
/// `|i − j| < w` (not causal), and to no padding key.
///
/// # Shapes
/// - `q`, `k`, `v`: `[b, h, t, k]` (self-attention: queries and keys are the same positions)
/// - `pad`: `[b, t]`, `true` at padding keys
/// - returns the context `[b, h, t, k]`
pub fn local_attention<B: LabBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    window: usize,
    causal: bool,
    pad: Option<&Tensor<B, 2, Bool>>,
    dropout: Option<&Dropout>,
) -> Tensor<B, 4> {
    let [b, h, t, d_head] = q.dims();
    let c = window.min(t).max(1); // block size
    let nb = t.div_ceil(c);
    // Blocks of keys a query block needs on each side, capped at the sequence.
    let reach = window.saturating_sub(1).div_ceil(c).min(nb - 1);
    let (before, after) = if causal { (reach, 0) } else { (reach, reach) };
    let span = (before + 1 + after) * c; // keys per query block

    let qb = pad_to(q, nb * c).reshape([b, h, nb, c, d_head]); // [b, h, nb, c, k]
    let kw = key_windows(k, c, nb, before, after); // [b, h, nb, span, k]
    let vw = key_windows(v, c, nb, before, after); // [b, h, nb, span, k]
    let scores = qb
        .matmul(kw.swap_dims(3, 4))
        .div_scalar((d_head as f32).sqrt()); // [b, h, nb, c, span]

    let device = scores.device();
    let pattern: Vec<bool> = (0..nb)
        .flat_map(|blk| (0..c).map(move |a| (blk, a)))
        .flat_map(|(blk, a)| (0..span).map(move |r| (blk, a, r)))
        .map(|(blk, a, r)| {
            let i = blk * c + a;
            let j = (blk * c + r) as isize - (before * c) as isize;
            !(j >= 0 && (j as usize) < t && local_allows(i, j as usize, window, causal))
        })
        .collect();
    let pattern = Tensor::<B, 3, Bool>::from_data(TensorData::new(pattern, [nb, c, span]), &device)
        .unsqueeze::<5>(); // [1, 1, nb, c, span]
    let mask = with_padding(pattern, pad.map(|p| pad_windows(p, c, nb, before, after)));

    let weights = block_softmax(scores, mask, dropout); // [b, h, nb, ·, keys]
    weights
        .matmul(vw) // [b, h, nb, c, k]
        .reshape([b, h, nb * c, d_head])
        .slice([0..b, 0..h, 0..t]) // [b, h, t, k]
}

/// Fixed block-sparse attention (Child et al. 2019, c = 1) with blocks of `stride` tokens:
/// each query sees its own block (causally when `causal`) and the last key of every other block
/// (of every earlier block when `causal`), never a padding key.
///
/// # Shapes
/// As [`local_attention`].
pub fn strided_attention<B: LabBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    stride: usize,
    causal: bool,
    pad: Option<&Tensor<B, 2, Bool>>,
    dropout: Option<&Dropout>,
) -> Tensor<B, 4> {
    let [b, h, t, d_head] = q.dims();
    let l = stride.max(1);
    let nb = t.div_ceil(l);
    let n = nb * l;
    let scale = (d_head as f32).sqrt();
    let qb = pad_to(q, n).reshape([b, h, nb, l, d_head]); // [b, h, nb, l, k]
    let kb = pad_to(k, n).reshape([b, h, nb, l, d_head]); // [b, h, nb, l, k]
    let vb = pad_to(v, n).reshape([b, h, nb, l, d_head]); // [b, h, nb, l, k]
    let summary_k = kb
        .clone()
        .slice(s![.., .., .., l - 1])
        .reshape([b, h, nb, d_head]); // [b, h, nb, k]
    let summary_v = vb
        .clone()
        .slice(s![.., .., .., l - 1])
        .reshape([b, h, nb, d_head]); // [b, h, nb, k]

    let own = qb.clone().matmul(kb.swap_dims(3, 4)).div_scalar(scale); // [b, h, nb, l, l]
    let summary = qb
        .reshape([b, h, n, d_head])
        .matmul(summary_k.swap_dims(2, 3)) // [b, h, n, nb]
        .reshape([b, h, nb, l, nb])
        .div_scalar(scale);
    let scores = Tensor::cat(vec![own, summary], 4); // [b, h, nb, l, l + nb]

    let device = scores.device();
    let width = l + nb;
    let pattern: Vec<bool> = (0..nb)
        .flat_map(|blk| (0..l).map(move |a| (blk, a)))
        .flat_map(|(blk, a)| (0..width).map(move |r| (blk, a, r)))
        .map(|(blk, a, r)| {
            let i = blk * l + a;
            // Own-block keys first, then the summary key of block `r − l`.
            let (j, own_block) = if r < l {
                (blk * l + r, true)
            } else {
                ((r - l) * l + l - 1, false)
            };
            // A summary in the query's own block is already among its own-block keys.
            let allowed = j < t && strided_allows(i, j, l, causal) && (own_block || j / l != blk);
            !allowed
        })
        .collect();
    let pattern =
        Tensor::<B, 3, Bool>::from_data(TensorData::new(pattern, [nb, l, width]), &device)
            .unsqueeze::<5>(); // [1, 1, nb, l, l + nb]
    let pad = pad.map(|p| {
        let p = pad_mask_to(p, n); // [b, n]
        let own = p.clone().reshape([b, 1, nb, 1, l]).expand([b, 1, nb, 1, l]);
        let summary = p
            .reshape([b, nb, l])
            .slice(s![.., .., l - 1])
            .reshape([b, 1, 1, 1, nb])
            .expand([b, 1, nb, 1, nb]);
        Tensor::cat(vec![own, summary], 4) // [b, 1, nb, 1, l + nb]
    });
    let mask = with_padding(pattern, pad);

    let weights = block_softmax(scores, mask, dropout); // [b, h, nb, ·, keys]
    let own = weights.clone().slice(s![.., .., .., .., 0..l]).matmul(vb); // [b, h, nb, l, k]
    let summary = weights
        .slice(s![.., .., .., .., l..width])
        .reshape([b, h, n, nb])
        .matmul(summary_v); // [b, h, n, k]
    (own.reshape([b, h, n, d_head]) + summary).slice([0..b, 0..h, 0..t]) // [b, h, t, k]
}

/// The softmax over each block's keys with `mask` (`true` = masked out, broadcast over heads),
/// then attention dropout when given.
fn block_softmax<B: LabBackend>(
    scores: Tensor<B, 5>,
    mask: Tensor<B, 5, Bool>,
    dropout: Option<&Dropout>,
) -> Tensor<B, 5> {
    let shape = scores.dims();
    let weights = softmax(scores.mask_fill(mask.expand(shape), MASKED_SCORE));
    match dropout {
        Some(dropout) => crate::kernels::dropout(dropout, weights),
        None => weights,
    }
}

/// `[b, h, t, k]` → `[b, h, n, k]`, zeros after `t`.
fn pad_to<B: LabBackend>(x: Tensor<B, 4>, n: usize) -> Tensor<B, 4> {
    let t = x.dims()[2];
    x.pad([(0, n - t), (0, 0)], PadMode::Constant(0.0))
}

/// `[b, t]` → `[b, n]`, `true` (padding) after `t`.
fn pad_mask_to<B: LabBackend>(pad: &Tensor<B, 2, Bool>, n: usize) -> Tensor<B, 2, Bool> {
    let t = pad.dims()[1];
    pad.clone()
        .float()
        .pad([(0, n - t)], PadMode::Constant(1.0))
        .greater_elem(0.5)
}

/// For each of `nb` blocks of `c` positions, the keys of the `before` blocks before it, itself
/// and the `after` blocks after it (zeros outside the sequence).
///
/// `[b, h, t, k]` → `[b, h, nb, (before + 1 + after)·c, k]`.
fn key_windows<B: LabBackend>(
    x: Tensor<B, 4>,
    c: usize,
    nb: usize,
    before: usize,
    after: usize,
) -> Tensor<B, 5> {
    let [b, h, t, d_head] = x.dims();
    let padded = x.pad(
        [(before * c, nb * c - t + after * c), (0, 0)],
        PadMode::Constant(0.0),
    ); // [b, h, (before + nb + after)·c, k]
    let blocks = padded.reshape([b, h, before + nb + after, c, d_head]);
    let shifted = (0..=before + after)
        .map(|s| blocks.clone().slice(s![.., .., s..s + nb]))
        .collect();
    Tensor::cat(shifted, 3) // [b, h, nb, span, k]
}

/// [`key_windows`] for a `[b, t]` key-padding mask: `[b, 1, nb, 1, span]`, `true` = masked.
fn pad_windows<B: LabBackend>(
    pad: &Tensor<B, 2, Bool>,
    c: usize,
    nb: usize,
    before: usize,
    after: usize,
) -> Tensor<B, 5, Bool> {
    let [b, t] = pad.dims();
    let padded = pad.clone().float().pad(
        [(before * c, nb * c - t + after * c)],
        PadMode::Constant(1.0),
    ); // [b, (before + nb + after)·c]
    let blocks = padded.reshape([b, before + nb + after, c]);
    let shifted = (0..=before + after)
        .map(|s| blocks.clone().slice(s![.., s..s + nb]))
        .collect();
    let span = (before + 1 + after) * c;
    Tensor::cat(shifted, 2)
        .greater_elem(0.5)
        .reshape([b, 1, nb, 1, span])
}

/// The pattern `[1, 1, nb, c, span]` or'ed with a padding mask `[b, 1, nb, 1, span]`.
fn with_padding<B: LabBackend>(
    pattern: Tensor<B, 5, Bool>,
    pad: Option<Tensor<B, 5, Bool>>,
) -> Tensor<B, 5, Bool> {
    match pad {
        None => pattern,
        Some(pad) => {
            let [_, _, nb, c, span] = pattern.dims();
            let b = pad.dims()[0];
            pattern
                .expand([b, 1, nb, c, span])
                .bool_or(pad.expand([b, 1, nb, c, span]))
        }
    }
}
