//! Positional encodings: sinusoid values against hand-computed numbers; learned tables are
//! trainable parameters and sinusoids are not.

use burn::backend::NdArray;
use burn::module::Module;
use burn::prelude::*;
use transformer_lab::nn::{sinusoid_table, PositionEncodingConfig, PositionKind};

type B = NdArray<f32>;

#[test]
fn sinusoids_match_hand_computed_values() {
    let table = sinusoid_table::<B>(3, 4, &Default::default());
    let values: Vec<f32> = table.into_data().to_vec().unwrap();
    // PE(pos, 2i) = sin(pos / 10000^(2i/4)), PE(pos, 2i+1) = cos(…); 10000^(2/4) = 100.
    let expected = [
        [0.0, 1.0, 0.0, 1.0],
        [0.841_470_96, 0.540_302_3, 0.009_999_833, 0.999_95],
        [0.909_297_4, -0.416_146_84, 0.019_998_667, 0.999_8],
    ];
    for (pos, row) in expected.iter().enumerate() {
        for (j, e) in row.iter().enumerate() {
            let a = values[pos * 4 + j];
            assert!((a - e).abs() < 1e-6, "PE({pos}, {j}) = {a}, expected {e}");
        }
    }
}

#[test]
fn sinusoidal_encoding_adds_the_table_and_has_no_parameters() {
    let device = Default::default();
    let pe = PositionEncodingConfig::new(PositionKind::Sinusoidal, 10, 6).init::<B>(&device);
    assert_eq!(pe.num_params(), 0);
    let x = Tensor::<B, 3>::zeros([2, 5, 6], &device);
    let out = pe.forward(x);
    let expected = sinusoid_table::<B>(5, 6, &device)
        .unsqueeze::<3>()
        .repeat_dim(0, 2);
    out.into_data()
        .assert_approx_eq::<f32>(&expected.into_data(), Default::default());
}

#[test]
fn learned_encoding_is_a_trainable_table() {
    let device = Default::default();
    let pe = PositionEncodingConfig::new(PositionKind::Learned, 10, 6).init::<B>(&device);
    assert_eq!(pe.num_params(), 60);
    assert_eq!(pe.max_len(), 10);
}

/// Saved weights name the fixed table's variant `Sinusoidal`, as artifacts trained by earlier
/// versions do; renaming it would make those artifacts unloadable.
#[test]
fn saved_fixed_tables_keep_the_name_old_artifacts_carry() {
    use transformer_lab::artifact::ArtifactRecorder;
    let dir = tempfile::tempdir().unwrap();
    for kind in [PositionKind::Sinusoidal, PositionKind::Sincos2d] {
        let module = PositionEncodingConfig::new(kind, 17, 8)
            .with_grid(Some([4, 4]))
            .init::<B>(&Default::default());
        let path = dir.path().join("positions");
        module
            .save_file(&path, &ArtifactRecorder::default())
            .unwrap();
        let bytes = std::fs::read(path.with_extension("mpk")).unwrap();
        assert!(bytes.windows(10).any(|w| w == b"Sinusoidal"), "{kind:?}");
    }
}
