//! The flex CPU backend computes what ndarray computes and trains.

use crate::common::{logit_difference_from_ndarray, overfit, small_lm};
use burn::backend::{Autodiff, Flex};

#[test]
fn flex_logits_equal_ndarray_logits() {
    let worst = logit_difference_from_ndarray::<Flex>(&Default::default());
    assert!(worst < 1e-4, "flex and ndarray logits differ by {worst}");
}

#[test]
fn a_tiny_model_trains_on_flex() {
    let (first, last) = overfit::<Autodiff<Flex>>(&small_lm(), 40, &Default::default());
    assert!(last < first / 4.0, "loss {first} -> {last} on flex");
}
