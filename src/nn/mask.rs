//! Attention masks. **Polarity: `true` = masked out** (that key may not be attended to).
//!
//! Masks broadcast over the score tensor `[b, h, t, s]`: a causal mask is `[t, s]` (the same for
//! every sequence), a padding mask `[b, s]` (one row of key positions per sequence).
//! [`AttentionMask`] holds the combination and expands it once to `[b, 1, t, s]`.

use burn::prelude::*;
use burn::tensor::Bool;

/// The causal mask: query `i` may attend to keys `j <= i` only.
///
/// Returns `[t, t]` with `true` (masked out) strictly above the diagonal.
pub fn causal_mask<B: Backend>(t: usize, device: &B::Device) -> Tensor<B, 2, Bool> {
    // `tril_mask(offset 0)` is true where j > i: exactly the future keys.
    Tensor::<B, 2, Bool>::tril_mask([t, t], 0, device)
}

/// The padding mask of a batch of token ids: `true` where the token is `pad_id`.
///
/// `tokens`: `[b, s]` → `[b, s]`.
pub fn padding_mask<B: Backend>(tokens: &Tensor<B, 2, Int>, pad_id: usize) -> Tensor<B, 2, Bool> {
    tokens.clone().equal_elem(pad_id as i64)
}

/// The combined mask for one attention call, in the broadcastable `[b, 1, t, s]` form.
///
/// `true` = masked out. Built from an optional causal part `[t, s]` and an optional key-padding
/// part `[b, s]`.
#[derive(Clone, Debug)]
pub struct AttentionMask<B: Backend> {
    mask: Tensor<B, 4, Bool>,
}

impl<B: Backend> AttentionMask<B> {
    /// Combines a `[t, s]` pattern (causal, local, …) with a `[b, s]` key-padding mask.
    /// Returns `None` when both are absent.
    pub fn new(
        pattern: Option<Tensor<B, 2, Bool>>,
        pad: Option<Tensor<B, 2, Bool>>,
    ) -> Option<Self> {
        let mask = match (pattern, pad) {
            (None, None) => return None,
            (Some(pattern), None) => pattern.unsqueeze::<4>(), // [1, 1, t, s]
            (None, Some(pad)) => {
                let [b, s] = pad.dims();
                pad.reshape([b, 1, 1, s])
            }
            (Some(pattern), Some(pad)) => {
                let [b, s] = pad.dims();
                let [t, _] = pattern.dims();
                let pattern = pattern.unsqueeze::<4>().expand([b, 1, t, s]); // [b, 1, t, s]
                let pad = pad.reshape([b, 1, 1, s]).expand([b, 1, t, s]);
                pattern.bool_or(pad)
            }
        };
        Some(Self { mask })
    }

    /// A causal mask for `t` positions.
    pub fn causal(t: usize, device: &B::Device) -> Self {
        Self::new(Some(causal_mask(t, device)), None).expect("a pattern was given")
    }

    /// A key-padding mask `[b, s]`.
    pub fn padding(pad: Tensor<B, 2, Bool>) -> Self {
        Self::new(None, Some(pad)).expect("a padding mask was given")
    }

    /// The mask as a `[b|1, 1, t|1, s]` boolean tensor, `true` = masked out.
    pub fn tensor(&self) -> Tensor<B, 4, Bool> {
        self.mask.clone()
    }
}
