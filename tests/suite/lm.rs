//! The language model learns: a fixed batch overfits; weights survive a save → load round-trip
//! bit for bit; a file from another config is refused.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;

use common::{batch, overfit, small_lm};
use transformer_lab::artifact::{load_weights, ArtifactRecorder};
use transformer_lab::config::LmConfig;
use transformer_lab::models::LanguageModel;
use transformer_lab::nn::PositionKind;
use transformer_lab::nn::StackConfig;

type B = NdArray<f32>;
type AB = Autodiff<B>;

fn config() -> LmConfig {
    small_lm()
}

#[test]
fn a_fixed_batch_overfits() {
    for (norm_first, position) in [
        (true, PositionKind::Learned),
        (false, PositionKind::Sinusoidal),
    ] {
        let config = LmConfig {
            stack: StackConfig {
                norm_first,
                ..config().stack
            },
            position,
            ..config()
        };
        let (first, last) = overfit::<AB>(&config, 100, &Default::default());
        assert!(
            first > 2.0,
            "initial loss {first} should be near ln 13 = 2.56"
        );
        assert!(
            last < first / 10.0,
            "norm_first={norm_first}: loss {first} -> {last} after 100 steps"
        );
    }
}

#[test]
fn untied_head_trains_too() {
    let config = LmConfig {
        stack: StackConfig {
            bias: true,
            ..config().stack
        },
        tie_weights: false,
        ..config()
    };
    let (first, last) = overfit::<AB>(&config, 60, &Default::default());
    assert!(last < first / 10.0, "loss {first} -> {last}");
}

#[test]
fn save_then_load_gives_identical_logits() {
    let device = Default::default();
    let model: LanguageModel<B> = config().init(&device);
    let inputs = batch::<B>(&device).inputs;
    // The forward pass materialises the lazily initialised parameters before the clone is saved.
    let a: Vec<f32> = model
        .forward(inputs.clone())
        .logits
        .into_data()
        .to_vec()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model");
    model
        .clone()
        .save_file(path.clone(), &ArtifactRecorder::default())
        .unwrap();
    let fresh = config().init::<B>(&device);
    let before: Vec<f32> = fresh
        .forward(inputs.clone())
        .logits
        .into_data()
        .to_vec()
        .unwrap();
    assert_ne!(
        a, before,
        "a fresh model differs, so equality below means the load worked"
    );
    let loaded = load_weights(fresh, &path, &device).unwrap();
    let b: Vec<f32> = loaded.forward(inputs).logits.into_data().to_vec().unwrap();
    assert_eq!(a, b);
    // No temporary file is left behind.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("model.mpk")]);
}

#[test]
fn weights_of_another_config_are_refused() {
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model");
    let wide = LmConfig {
        stack: StackConfig {
            d_model: 48,
            ..config().stack
        },
        ..config()
    };
    wide.init::<B>(&device)
        .save_file(path.clone(), &ArtifactRecorder::default())
        .unwrap();
    let err = load_weights(config().init::<B>(&device), &path, &device).unwrap_err();
    assert!(format!("{err:#}").contains("another shape"), "{err:#}");
    let deeper = LmConfig {
        n_layers: 3,
        ..config()
    };
    let err = load_weights(deeper.init::<B>(&device), &path, &device).unwrap_err();
    assert!(format!("{err:#}").contains("model"), "{err:#}");
}
