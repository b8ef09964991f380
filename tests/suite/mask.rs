//! Masks: causal models cannot see the future, padding cannot leak, and the polarity is
//! `true` = masked out.

use burn::backend::NdArray;
use burn::prelude::*;
use burn::tensor::Distribution;
use transformer_lab::config::LmConfig;
use transformer_lab::nn::StackConfig;
use transformer_lab::nn::{
    causal_mask, padding_mask, AttentionMask, TransformerBlockConfig, TransformerStackConfig,
};

type B = NdArray<f32>;

fn max_abs_diff<const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> f32 {
    (a - b).abs().max().into_scalar()
}

#[test]
fn causal_mask_is_true_strictly_above_the_diagonal() {
    let mask: Vec<bool> = causal_mask::<B>(3, &Default::default())
        .into_data()
        .to_vec()
        .unwrap();
    assert_eq!(
        mask,
        vec![false, true, true, false, false, true, false, false, false]
    );
}

#[test]
fn padding_mask_marks_pad_tokens() {
    let tokens = Tensor::<B, 2, Int>::from_data([[5, 6, 0, 0], [7, 0, 0, 0]], &Default::default());
    let mask: Vec<bool> = padding_mask(&tokens, 0).into_data().to_vec().unwrap();
    assert_eq!(
        mask,
        vec![false, false, true, true, false, true, true, true]
    );
}

fn tiny_lm(norm_first: bool) -> LmConfig {
    LmConfig {
        stack: StackConfig {
            d_model: 16,
            n_heads: 4,
            norm_first,
            ..LmConfig::default().stack
        },
        vocab_size: 11,
        n_layers: 2,
        context: 12,
        ..LmConfig::default()
    }
}

#[test]
fn language_model_outputs_up_to_t_ignore_tokens_after_t() {
    let device = Default::default();
    for norm_first in [true, false] {
        let model = tiny_lm(norm_first).init::<B>(&device);
        let a = Tensor::<B, 2, Int>::from_data([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], &device);
        for t in [0usize, 3, 8] {
            // Replace every token after position t.
            let mut ids: Vec<i64> = (1..=10).collect();
            ids.iter_mut()
                .skip(t + 1)
                .for_each(|id| *id = (*id * 7) % 11);
            let b = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, 10]), &device);
            let out_a = model.forward(a.clone());
            let out_b = model.forward(b);
            let past = |x: Tensor<B, 3>| x.slice([0..1, 0..t + 1]);
            let diff = max_abs_diff(past(out_a.logits.clone()), past(out_b.logits.clone()));
            assert!(
                diff < 1e-6,
                "norm_first={norm_first}: position <= {t} changed by {diff}"
            );
            let later = max_abs_diff(
                out_a.logits.slice([0..1, t + 1..10]),
                out_b.logits.slice([0..1, t + 1..10]),
            );
            assert!(
                later > 1e-4,
                "the changed tokens must matter somewhere after {t}"
            );
            for w in out_a.attention {
                let upper: Vec<f32> = w.into_data().to_vec().unwrap();
                for (n, v) in upper.iter().enumerate() {
                    let (i, j) = ((n / 10) % 10, n % 10);
                    assert!(j <= i || *v == 0.0, "weight above the diagonal");
                }
            }
        }
    }
}

#[test]
fn padded_keys_cannot_leak_into_an_encoder() {
    let device = Default::default();
    let block = TransformerBlockConfig::new(16, 4, 32);
    for norm_first in [true, false] {
        let stack = TransformerStackConfig::encoder(2, block.clone().with_norm_first(norm_first))
            .init::<B>(&device);
        let x = Tensor::<B, 3>::random([2, 6, 16], Distribution::Normal(0.0, 1.0), &device);
        // Sequence 0 has 4 real tokens, sequence 1 has 2; the rest is padding.
        let pad = Tensor::<B, 2, Bool>::from_data(
            [
                [false, false, false, false, true, true],
                [false, false, true, true, true, true],
            ],
            &device,
        );
        let noise = Tensor::<B, 3>::random([2, 6, 16], Distribution::Normal(0.0, 5.0), &device);
        let keep = pad.clone().bool_not().float().unsqueeze_dim::<3>(2); // [b, s, 1]
        let x_other = x.clone() * keep.clone() + noise * (keep.clone().neg().add_scalar(1.0));
        let mask = AttentionMask::padding(pad);
        let a = stack.forward(x, Some(&mask), None).x * keep.clone();
        let b = stack.forward(x_other, Some(&mask), None).x * keep;
        let diff = max_abs_diff(a, b);
        assert!(
            diff < 1e-5,
            "norm_first={norm_first}: padding changed real positions by {diff}"
        );
    }
}

#[test]
fn padded_memory_cannot_leak_into_a_decoder() {
    let device = Default::default();
    let stack = TransformerStackConfig::decoder(2, TransformerBlockConfig::new(16, 4, 32), true)
        .init::<B>(&device);
    let x = Tensor::<B, 3>::random([1, 3, 16], Distribution::Normal(0.0, 1.0), &device);
    let memory = Tensor::<B, 3>::random([1, 5, 16], Distribution::Normal(0.0, 1.0), &device);
    let pad = Tensor::<B, 2, Bool>::from_data([[false, false, false, true, true]], &device);
    let memory_other = Tensor::cat(
        vec![
            memory.clone().slice([0..1, 0..3]),
            memory.clone().slice([0..1, 3..5]).mul_scalar(-9.0),
        ],
        1,
    );
    let memory_mask = AttentionMask::padding(pad);
    let causal = AttentionMask::causal(3, &device);
    let a = stack.forward(
        x.clone(),
        Some(&causal),
        Some((&memory, Some(&memory_mask))),
    );
    let b = stack.forward(x, Some(&causal), Some((&memory_other, Some(&memory_mask))));
    assert!(max_abs_diff(a.x, b.x) < 1e-5);
    assert_eq!(a.cross_attention.len(), 2);
    assert_eq!(a.cross_attention[0].dims(), [1, 4, 3, 5]);
}
