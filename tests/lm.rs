//! The language model learns: a fixed batch overfits; weights survive a save → load round-trip
//! bit for bit; a file from another config is refused.

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use transformer_lab::artifact::{load_weights, ArtifactRecorder};
use transformer_lab::config::LmConfig;
use transformer_lab::models::{LanguageModel, LmBatch};
use transformer_lab::nn::PositionKind;
use transformer_lab::train::GlobalNormClip;

type B = NdArray<f32>;
type AB = Autodiff<B>;

fn config() -> LmConfig {
    LmConfig {
        vocab_size: 13,
        d_model: 32,
        n_layers: 2,
        n_heads: 4,
        context: 16,
        ..LmConfig::default()
    }
}

fn batch<Bk: Backend>(device: &Bk::Device) -> LmBatch<Bk> {
    let ids: Vec<i64> = (0..4 * 17).map(|i| (i * 7 + i / 5) % 13).collect();
    let window = |row: usize, offset: usize| ids[row * 17 + offset..row * 17 + offset + 16].to_vec();
    let rows = |offset| (0..4).flat_map(|r| window(r, offset)).collect::<Vec<i64>>();
    LmBatch {
        inputs: Tensor::from_data(TensorData::new(rows(0), [4, 16]), device),
        targets: Tensor::from_data(TensorData::new(rows(1), [4, 16]), device),
    }
}

/// Trains on one batch for `steps` steps and returns the first and last loss.
pub fn overfit(config: &LmConfig, steps: usize) -> (f32, f32) {
    let device = Default::default();
    AB::seed(&device, 7);
    let mut model: LanguageModel<AB> = config.init(&device);
    let mut optim = GlobalNormClip::new(AdamWConfig::new().with_weight_decay(0.0).init(), 1.0);
    let mut losses = Vec::new();
    for _ in 0..steps {
        let (loss, _, _) = model.loss(batch(&device));
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
    }
    (losses[0], *losses.last().unwrap())
}

#[test]
fn a_fixed_batch_overfits() {
    for (norm_first, position) in [(true, PositionKind::Learned), (false, PositionKind::Sinusoidal)] {
        let config = LmConfig { norm_first, position, ..config() };
        let (first, last) = overfit(&config, 100);
        assert!(first > 2.0, "initial loss {first} should be near ln 13 = 2.56");
        assert!(last < first / 10.0, "norm_first={norm_first}: loss {first} -> {last} after 100 steps");
    }
}

#[test]
fn untied_head_trains_too() {
    let config = LmConfig { tie_weights: false, bias: true, ..config() };
    let (first, last) = overfit(&config, 60);
    assert!(last < first / 10.0, "loss {first} -> {last}");
}

#[test]
fn save_then_load_gives_identical_logits() {
    let device = Default::default();
    let model: LanguageModel<B> = config().init(&device);
    let inputs = batch::<B>(&device).inputs;
    // The forward pass materialises the lazily initialised parameters before the clone is saved.
    let a: Vec<f32> = model.forward(inputs.clone()).logits.into_data().to_vec().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model");
    model.clone().save_file(path.clone(), &ArtifactRecorder::default()).unwrap();
    let fresh = config().init::<B>(&device);
    let before: Vec<f32> = fresh.forward(inputs.clone()).logits.into_data().to_vec().unwrap();
    assert_ne!(a, before, "a fresh model differs, so equality below means the load worked");
    let loaded = load_weights(fresh, &path, &device).unwrap();
    let b: Vec<f32> = loaded.forward(inputs).logits.into_data().to_vec().unwrap();
    assert_eq!(a, b);
    // No temporary file is left behind.
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("model.mpk")]);
}

#[test]
fn weights_of_another_config_are_refused() {
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model");
    let wide = LmConfig { d_model: 48, ..config() };
    wide.init::<B>(&device).save_file(path.clone(), &ArtifactRecorder::default()).unwrap();
    let err = load_weights(config().init::<B>(&device), &path, &device).unwrap_err();
    assert!(format!("{err:#}").contains("another shape"), "{err:#}");
    let deeper = LmConfig { n_layers: 3, ..config() };
    let err = load_weights(deeper.init::<B>(&device), &path, &device).unwrap_err();
    assert!(format!("{err:#}").contains("model"), "{err:#}");
}
