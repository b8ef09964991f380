//! Attention masks. **Polarity: `true` = masked out** (that key may not be attended to).
//!
//! Masks broadcast over the score tensor `[b, h, t, s]`: a causal mask is `[t, s]` (the same for
//! every sequence), a padding mask `[b, s]` (one row of key positions per sequence).
//! [`AttentionMask`] keeps the two parts apart, so sub-quadratic mixers can apply them without
//! ever building the dense `[b, 1, t, s]` mask that [`AttentionMask::tensor`] expands to.
//! The sparse patterns ([`local_mask`], [`strided_mask`]) are the dense references of what the
//! blocked kernels in [`super::sparse`] compute.

use burn::prelude::*;
use burn::tensor::Bool;

pub use crate::kernels::reference::causal_mask;

/// The padding mask of a batch of token ids: `true` where the token is `pad_id`.
///
/// `tokens`: `[b, s]` → `[b, s]`.
pub fn padding_mask<B: Backend>(tokens: &Tensor<B, 2, Int>, pad_id: usize) -> Tensor<B, 2, Bool> {
    tokens.clone().equal_elem(pad_id as i64)
}

/// Whether the sliding-window pattern of width `window` lets query `i` see key `j`: the `window`
/// most recent keys `i − window < j ≤ i` when causal, keys with `|i − j| < window` otherwise.
pub fn local_allows(i: usize, j: usize, window: usize, causal: bool) -> bool {
    if causal {
        j <= i && i - j < window
    } else {
        i.abs_diff(j) < window
    }
}

/// Whether the fixed block-sparse pattern of Child et al. (2019, "Sparse Transformers", §4.2,
/// c = 1) with blocks of `stride` tokens lets query `i` see key `j`: every key in its own block
/// (`j ≤ i` too when causal), plus the last key of every other block (earlier blocks only when
/// causal): the "summary" positions, one every `stride` tokens.
pub fn strided_allows(i: usize, j: usize, stride: usize, causal: bool) -> bool {
    let (block_i, block_j) = (i / stride, j / stride);
    let summary = j % stride == stride - 1;
    if causal {
        j <= i && (block_j == block_i || summary)
    } else {
        block_j == block_i || summary
    }
}

/// The dense `[t, t]` mask of a pattern, `true` = masked out.
pub fn pattern_mask<B: Backend>(
    t: usize,
    allows: impl Fn(usize, usize) -> bool,
    device: &B::Device,
) -> Tensor<B, 2, Bool> {
    pattern_rows(t, t, allows, device)
}

/// The dense `[t, s]` mask of a pattern between `t` queries and `s` keys, `true` = masked out.
pub fn pattern_rows<B: Backend>(
    t: usize,
    s: usize,
    allows: impl Fn(usize, usize) -> bool,
    device: &B::Device,
) -> Tensor<B, 2, Bool> {
    let masked: Vec<bool> = (0..t)
        .flat_map(|i| (0..s).map(move |j| (i, j)))
        .map(|(i, j)| !allows(i, j))
        .collect();
    Tensor::from_data(TensorData::new(masked, [t, s]), device)
}

/// [`local_allows`] as a dense `[t, t]` mask, `true` = masked out.
pub fn local_mask<B: Backend>(
    t: usize,
    window: usize,
    causal: bool,
    device: &B::Device,
) -> Tensor<B, 2, Bool> {
    pattern_mask(t, |i, j| local_allows(i, j, window, causal), device)
}

/// [`strided_allows`] as a dense `[t, t]` mask, `true` = masked out.
pub fn strided_mask<B: Backend>(
    t: usize,
    stride: usize,
    causal: bool,
    device: &B::Device,
) -> Tensor<B, 2, Bool> {
    pattern_mask(t, |i, j| strided_allows(i, j, stride, causal), device)
}

/// The mask of one attention call: causal or not, with an optional key-padding part.
/// `true` = masked out.
#[derive(Clone, Debug)]
pub struct AttentionMask<B: Backend> {
    /// `Some(t)` for a causal mask over `t` positions.
    causal: Option<usize>,
    /// `[b, s]`, `true` at padding keys.
    pad: Option<Tensor<B, 2, Bool>>,
    device: B::Device,
}

impl<B: Backend> AttentionMask<B> {
    /// A causal mask for `t` positions.
    pub fn causal(t: usize, device: &B::Device) -> Self {
        Self {
            causal: Some(t),
            pad: None,
            device: device.clone(),
        }
    }

    /// A key-padding mask `[b, s]`.
    pub fn padding(pad: Tensor<B, 2, Bool>) -> Self {
        Self {
            causal: None,
            device: pad.device(),
            pad: Some(pad),
        }
    }

    /// Adds a key-padding part `[b, s]` to this mask.
    pub fn with_padding(self, pad: Tensor<B, 2, Bool>) -> Self {
        Self {
            pad: Some(pad),
            ..self
        }
    }

    /// Whether query `i` is kept from keys `j > i`.
    pub fn is_causal(&self) -> bool {
        self.causal.is_some()
    }

    /// The key-padding part `[b, s]`, `true` at padding keys.
    pub fn pad(&self) -> Option<&Tensor<B, 2, Bool>> {
        self.pad.as_ref()
    }

    /// The dense mask as a `[b|1, 1, t|1, s]` boolean tensor, `true` = masked out.
    pub fn tensor(&self) -> Tensor<B, 4, Bool> {
        let causal = self.causal.map(|t| causal_mask::<B>(t, &self.device));
        match (causal, &self.pad) {
            (Some(causal), None) => causal.unsqueeze::<4>(), // [1, 1, t, t]
            (None, Some(pad)) => {
                let [b, s] = pad.dims();
                pad.clone().reshape([b, 1, 1, s])
            }
            (Some(causal), Some(pad)) => {
                let [b, s] = pad.dims();
                let [t, _] = causal.dims();
                let causal = causal.unsqueeze::<4>().expand([b, 1, t, s]); // [b, 1, t, s]
                let pad = pad.clone().reshape([b, 1, 1, s]).expand([b, 1, t, s]);
                causal.bool_or(pad)
            }
            (None, None) => unreachable!("a mask has a causal or a padding part"),
        }
    }
}
