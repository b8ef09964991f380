//! The Vision Transformer: patches reassemble into the image, the classification token sees
//! every patch, without positions the model cannot tell patch order, a tiny ViT overfits a
//! handful of images, and the 2-D sin-cos table is what its formula says.

use burn::backend::{Autodiff, NdArray};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use transformer_lab::config::VitConfig;
use transformer_lab::models::{patchify, unpatchify, VisionTransformer};
use transformer_lab::nn::StackConfig;
use transformer_lab::nn::{sincos_2d_table, sinusoid_table, Pooling, PositionKind};

type B = NdArray<f32>;
type A = Autodiff<B>;

fn tiny(position: PositionKind, pool: Pooling) -> VitConfig {
    VitConfig {
        stack: StackConfig {
            d_model: 16,
            n_heads: 2,
            d_ff: 32,
            dropout: 0.0,
            ..VitConfig::default().stack
        },
        image_size: 8,
        patch_size: 2,
        n_classes: 3,
        n_layers: 2,
        position,
        pool,
        ..VitConfig::default()
    }
}

/// `[b, 1, 8, 8]` images with distinct pixel values.
fn images<Bk: Backend>(b: usize, device: &Bk::Device) -> Tensor<Bk, 4> {
    let values: Vec<f32> = (0..b * 64)
        .map(|i| ((i * 37 % 101) as f32) / 50.0 - 1.0)
        .collect();
    Tensor::from_data(TensorData::new(values, [b, 1, 8, 8]), device)
}

#[test]
fn patches_reassemble_into_the_image_and_hold_the_right_pixels() {
    let device = Default::default();
    let x = images::<B>(2, &device);
    let patches = patchify(x.clone(), 2); // [2, 16, 4]
    assert_eq!(patches.dims(), [2, 16, 4]);
    // Patch 5 is grid row 1, column 1: pixels (2..4, 2..4), row-major.
    let expected = x.clone().slice([0..1, 0..1, 2..4, 2..4]).reshape([4]);
    let got = patches.clone().slice([0..1, 5..6, 0..4]).reshape([4]);
    got.into_data().assert_eq(&expected.into_data(), true);
    unpatchify(patches, 1, 8, 8)
        .into_data()
        .assert_eq(&x.into_data(), true);
}

#[test]
fn an_image_size_that_is_not_a_multiple_of_the_patch_is_a_config_error() {
    let config = VitConfig {
        image_size: 28,
        patch_size: 5,
        ..VitConfig::default()
    };
    let message = config.validate().unwrap_err().to_string();
    assert!(message.contains("multiple of patch_size"), "{message}");
}

#[test]
fn the_classification_token_sees_every_patch() {
    let device = Default::default();
    let model: VisionTransformer<A> = tiny(PositionKind::Learned, Pooling::Cls).init(&device);
    let x = images::<A>(1, &device).require_grad();
    let pooled = model.forward(x.clone()).pooled; // the classification token's final state
                                                  // A fixed generic projection of it (its plain sum is constant after the final LayerNorm).
    let weights: Vec<f32> = (0..16)
        .map(|i| ((i * 7 % 5) as f32) - 2.0 + 0.1 * i as f32)
        .collect();
    let w = Tensor::<A, 1>::from_data(TensorData::new(weights, [16]), &device).reshape([1, 16]);
    let grads = (pooled * w).sum().backward();
    let grad = x.grad(&grads).unwrap(); // [1, 1, 8, 8]
    let per_patch = patchify(grad.abs(), 2).sum_dim(2).reshape([16]); // [16]
    let per_patch: Vec<f32> = per_patch.into_data().to_vec().unwrap();
    assert!(
        per_patch.iter().all(|&g| g > 1e-6),
        "every patch must influence the classification token: {per_patch:?}"
    );
}

/// The same images with their patches in another order (a fixed permutation of the grid).
fn permute_patches(x: Tensor<B, 4>) -> Tensor<B, 4> {
    let patches = patchify(x, 2); // [b, 16, 4]
    let order: Vec<i64> = (0..16).map(|i| (i * 5 + 3) % 16).collect();
    let index = Tensor::from_data(TensorData::new(order, [16]), &patches.device());
    unpatchify(patches.select(1, index), 1, 8, 8)
}

#[test]
fn without_positions_patch_order_cannot_change_the_pooled_output() {
    let device = Default::default();
    let x = images::<B>(2, &device);
    for pool in [Pooling::Cls, Pooling::Mean] {
        let model: VisionTransformer<B> = tiny(PositionKind::None, pool).init(&device);
        let a = model.forward(x.clone()).pooled;
        let b = model.forward(permute_patches(x.clone())).pooled;
        a.into_data()
            .assert_approx_eq::<f32>(&b.into_data(), burn::tensor::Tolerance::absolute(1e-5));
    }
    // With positions the order is visible.
    let model: VisionTransformer<B> = tiny(PositionKind::Sincos2d, Pooling::Cls).init(&device);
    let a = model.forward(x.clone()).pooled;
    let b = model.forward(permute_patches(x)).pooled;
    let diff: f32 = (a - b).abs().max().into_scalar();
    assert!(
        diff > 1e-3,
        "positions must make patch order matter (diff {diff})"
    );
}

#[test]
fn sincos_2d_encodes_rows_in_the_first_half_and_columns_in_the_second() {
    let device = Default::default();
    let table = sincos_2d_table::<B>(3, 4, 8, &device); // [12, 8]
    let rows = sinusoid_table::<B>(3, 4, &device);
    let cols = sinusoid_table::<B>(4, 4, &device);
    // Patch 6 is grid row 1, column 2.
    let patch = table.slice([6..7, 0..8]).reshape([8]);
    let expected = Tensor::cat(
        vec![
            rows.slice([1..2, 0..4]).reshape([4]),
            cols.slice([2..3, 0..4]).reshape([4]),
        ],
        0,
    );
    patch.into_data().assert_eq(&expected.into_data(), true);
}

#[test]
fn a_tiny_vit_overfits_a_handful_of_images() {
    let device = Default::default();
    A::seed(&device, 3);
    let mut model: VisionTransformer<A> = tiny(PositionKind::Learned, Pooling::Cls).init(&device);
    let x = images::<A>(6, &device);
    let labels =
        Tensor::<A, 1, Int>::from_data(TensorData::new(vec![0i64, 1, 2, 0, 1, 2], [6]), &device);
    let mut optim = AdamWConfig::new().with_weight_decay(0.0).init();
    let mut first = None;
    let mut last = 0.0;
    for _ in 0..250 {
        let (loss, _, _) = model.loss(x.clone(), labels.clone());
        last = loss.clone().into_scalar().elem::<f32>();
        first.get_or_insert(last);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
    }
    let predicted = model.forward(x).logits.argmax(1).reshape([6]);
    predicted.into_data().assert_eq(&labels.into_data(), false);
    assert!(
        last < 0.1 * first.unwrap(),
        "loss {} → {last}",
        first.unwrap()
    );
}
