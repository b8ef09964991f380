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

fn normal(shape: [usize; 4], seed: u64) -> Tensor<B, 4> {
    crate::common::normal::<B, 4>(shape, seed, &Default::default())
}

#[test]
fn rope_scores_depend_only_on_the_relative_position() {
    use transformer_lab::nn::rope;
    let (q, k) = (normal([2, 3, 10, 8], 1), normal([2, 3, 10, 8], 2));
    let scores = |shift| rope(q.clone(), shift).matmul(rope(k.clone(), shift).swap_dims(2, 3));
    let base = scores(0);
    for shift in [1, 7, 100, 1000] {
        let diff: f32 = (scores(shift) - base.clone()).abs().max().into_scalar();
        assert!(
            diff < 1e-3,
            "shifting every position by {shift} changed Q·Kᵀ by {diff}"
        );
    }
    // A rotation: each vector keeps its length, and position 0 is left as it is.
    let norms = |x: Tensor<B, 4>| x.powi_scalar(2).sum_dim(3);
    let diff: f32 = (norms(rope(q.clone(), 5)) - norms(q.clone()))
        .abs()
        .max()
        .into_scalar();
    assert!(diff < 1e-4);
    let at0 = rope(q.clone().narrow(2, 0, 1), 0);
    at0.into_data()
        .assert_approx_eq::<f32>(&q.clone().narrow(2, 0, 1).into_data(), Default::default());
    // And not a no-op: the scores of different offsets differ.
    let moved: f32 = (rope(q.clone(), 0).matmul(rope(k.clone(), 3).swap_dims(2, 3)) - base)
        .abs()
        .max()
        .into_scalar();
    assert!(moved > 1e-2);
}

#[test]
fn alibi_slopes_are_the_papers_geometric_sequence() {
    use transformer_lab::nn::alibi_slopes;
    // 8 heads: 1/2, 1/4, …, 1/256 (Press et al. 2022, §3).
    let expected: Vec<f64> = (1..=8).map(|i| 0.5f64.powi(i)).collect();
    assert_eq!(alibi_slopes(8), expected);
    // 16 heads: the geometric sequence starting at 2^(-1/2).
    assert!((alibi_slopes(16)[0] - 2f64.powf(-0.5)).abs() < 1e-12);
    // 6 heads (not a power of two): the 4-head slopes, then every other 8-head slope.
    assert_eq!(
        alibi_slopes(6),
        vec![0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    );
}

fn relative_lm(
    position: PositionKind,
    context: usize,
) -> transformer_lab::models::LanguageModel<B> {
    use transformer_lab::config::LmConfig;
    use transformer_lab::nn::StackConfig;
    LmConfig {
        stack: StackConfig {
            d_model: 16,
            n_heads: 4,
            ..LmConfig::default().stack
        },
        vocab_size: 11,
        n_layers: 2,
        context,
        position,
        ..LmConfig::default()
    }
    .init(&Default::default())
}

#[test]
fn relative_position_models_run_past_their_training_length_and_stay_causal() {
    let device = Default::default();
    for position in [PositionKind::Rope, PositionKind::Alibi] {
        let model = relative_lm(position, 8);
        assert!(model.any_length());
        let ids: Vec<i64> = (0..40).map(|i| (i * 5 % 11) as i64).collect();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, 40]), &device);
        let long = model.forward(tokens.clone()).logits; // 5× the training length
        assert!(long.clone().is_finite().all().into_scalar(), "{position:?}");
        let prefix = model.forward(tokens.slice([0..1, 0..8])).logits;
        prefix
            .into_data()
            .assert_approx_eq::<f32>(&long.slice([0..1, 0..8]).into_data(), Default::default());
    }
}

#[test]
fn a_rolling_cache_generates_what_the_sliding_window_generates() {
    use transformer_lab::generate::{generate, Decoding, Sampling};
    let device = Default::default();
    let greedy = Sampling {
        greedy: true,
        ..Sampling::default()
    };
    for position in [PositionKind::Rope, PositionKind::Alibi] {
        let model = relative_lm(position, 8);
        assert!(model.rolls());
        let run = |decoding| {
            generate(
                &model,
                &[1, 2, 3],
                40,
                &greedy,
                0,
                decoding,
                &device,
                |_, _| Ok(()),
            )
            .unwrap()
        };
        assert_eq!(
            run(Decoding::Cached),
            run(Decoding::Recompute),
            "{position:?}"
        );
    }
}

#[test]
fn alibi_needs_full_attention_and_rope_an_even_head_width() {
    use transformer_lab::config::LmConfig;
    use transformer_lab::nn::{Mixer, StackConfig};
    let config = |position, mixer, d_model| LmConfig {
        stack: StackConfig {
            d_model,
            n_heads: 2,
            mixer,
            ..LmConfig::default().stack
        },
        vocab_size: 11,
        position,
        ..LmConfig::default()
    };
    let err = |c: LmConfig| c.validate().unwrap_err().to_string();
    assert!(
        err(config(PositionKind::Alibi, Mixer::Local { window: 4 }, 16)).contains("mixer full")
    );
    assert!(err(config(PositionKind::Rope, Mixer::Full, 6)).contains("even head width"));
    assert!(config(PositionKind::Rope, Mixer::Local { window: 4 }, 16)
        .validate()
        .is_ok());
}
