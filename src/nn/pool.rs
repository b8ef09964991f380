//! Pooling a sequence of states into one vector per example, for classifiers.

use burn::prelude::*;
use serde::{Deserialize, Serialize};

/// How a classifier summarises its encoder's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The state of the first token, a classification token prepended to the input (BERT, ViT).
    Cls,
    /// The mean of the states of all non-padding tokens.
    Mean,
    /// The state of the last non-padding token: an end-of-text token appended to the input
    /// (CLIP's text encoder).
    Last,
}

/// Pools `x` into one vector per example.
///
/// # Shapes
/// - `x`: `[b, n, d]` → `[b, d]`
/// - `padding`: `[b, n]`, `true` = padding (excluded from the mean); `None` = no padding
pub fn pool<B: Backend>(
    x: Tensor<B, 3>,
    pooling: Pooling,
    padding: Option<Tensor<B, 2, Bool>>,
) -> Tensor<B, 2> {
    let [b, n, d] = x.dims();
    match (pooling, padding) {
        (Pooling::Cls, _) => x.narrow(1, 0, 1).reshape([b, d]),
        (Pooling::Mean, None) => x.mean_dim(1).reshape([b, d]),
        (Pooling::Mean, Some(padding)) => {
            let keep = padding.bool_not().float().reshape([b, n, 1]); // [b, n, 1]
            let count = keep.clone().sum_dim(1).clamp_min(1.0); // [b, 1, 1]
            (x * keep).sum_dim(1).div(count).reshape([b, d])
        }
        (Pooling::Last, None) => x.narrow(1, n - 1, 1).reshape([b, d]),
        (Pooling::Last, Some(padding)) => {
            // Padding is on the right: the last kept token is at (kept count − 1).
            let kept = padding.bool_not().int().sum_dim(1); // [b, 1]
            let last = (kept - 1).clamp_min(0).reshape([b, 1, 1]).expand([b, 1, d]);
            x.gather(1, last).reshape([b, d])
        }
    }
}
