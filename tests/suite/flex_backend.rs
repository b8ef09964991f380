//! The flex CPU backend computes what ndarray computes and trains.

use crate::common::{batch, overfit, small_lm};
use burn::backend::{Autodiff, Flex, NdArray};
use burn::module::Module;
use transformer_lab::artifact::{load_weights, ArtifactRecorder};

#[test]
fn flex_logits_equal_ndarray_logits() {
    let model = small_lm().init::<NdArray<f32>>(&Default::default());
    let expected = model
        .forward(batch::<NdArray<f32>>(&Default::default()).inputs)
        .logits;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model");
    model
        .save_file(path.clone(), &ArtifactRecorder::default())
        .unwrap();
    let device = Default::default();
    let on_flex = load_weights(small_lm().init::<Flex>(&device), &path, &device).unwrap();
    let actual = on_flex.forward(batch::<Flex>(&device).inputs).logits;
    let a: Vec<f32> = expected.into_data().to_vec().unwrap();
    let b: Vec<f32> = actual.into_data().convert::<f32>().to_vec().unwrap();
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(worst < 1e-4, "flex and ndarray logits differ by {worst}");
}

#[test]
fn a_tiny_model_trains_on_flex() {
    let (first, last) = overfit::<Autodiff<Flex>>(&small_lm(), 40, &Default::default());
    assert!(last < first / 4.0, "loss {first} -> {last} on flex");
}
