//! Helpers shared by the test files: a fixed batch and a short training loop on it.

use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use transformer_lab::config::LmConfig;
use transformer_lab::models::{LanguageModel, LmBatch};
use transformer_lab::train::ReferenceOptimizer;

/// The small language model the tests train: vocabulary 13, 2 layers, 4 heads, width 32.
#[allow(dead_code)]
pub fn small_lm() -> LmConfig {
    LmConfig {
        vocab_size: 13,
        d_model: 32,
        n_layers: 2,
        n_heads: 4,
        context: 16,
        ..LmConfig::default()
    }
}

/// The validation losses in a plain training log.
#[allow(dead_code)]
pub fn valid_losses(log: &str) -> Vec<f64> {
    log.lines()
        .filter(|l| l.contains(" valid "))
        .filter_map(|l| {
            l.split("loss ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// Four sequences of 16 tokens over a vocabulary of 13, targets shifted by one.
pub fn batch<B: Backend>(device: &B::Device) -> LmBatch<B> {
    let ids: Vec<i64> = (0..4 * 17).map(|i| (i * 7 + i / 5) % 13).collect();
    let rows = |offset: usize| -> Vec<i64> {
        (0..4)
            .flat_map(|r| ids[r * 17 + offset..r * 17 + offset + 16].to_vec())
            .collect()
    };
    LmBatch {
        inputs: Tensor::from_data(TensorData::new(rows(0), [4, 16]), device),
        targets: Tensor::from_data(TensorData::new(rows(1), [4, 16]), device),
    }
}

/// Trains on [`batch`] for `steps` AdamW steps (lr 3e-3, global clip 1) and returns the first
/// and the last loss.
#[allow(dead_code)]
pub fn overfit<B: AutodiffBackend>(
    config: &LmConfig,
    steps: usize,
    device: &B::Device,
) -> (f32, f32) {
    B::seed(device, 7);
    let mut model: LanguageModel<B> = config.init(device);
    let mut optim =
        ReferenceOptimizer::new(AdamWConfig::new().with_weight_decay(0.0).init(), 0.0, 1.0);
    let mut losses = Vec::new();
    for _ in 0..steps {
        let (loss, _, _) = model.loss(batch(device));
        losses.push(loss.clone().into_scalar().elem::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
    }
    (losses[0], *losses.last().unwrap())
}
