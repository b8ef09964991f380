//! The token mixers: every fast kernel equals its dense reference (sparse patterns, linear
//! attention's quadratic form, Hyena's direct convolution), causal mixers are causal by their
//! gradients, padding cannot leak, and a model of every causal mixer generates.

use burn::backend::{Autodiff, NdArray};
use burn::prelude::*;
use burn::tensor::Tolerance;
use transformer_lab::config::{ClassifierConfig, LmConfig};
use transformer_lab::generate::{generate, next_token_probs, Decoding, Sampling};
use transformer_lab::nn::fft::{direct_conv, fft, fft_conv, toeplitz_conv};
use transformer_lab::nn::linear_attention::{
    linear_attention, linear_attention_weights, LinearState,
};
use transformer_lab::nn::sparse::{local_attention, strided_attention};
use transformer_lab::nn::StackConfig;
use transformer_lab::nn::{
    causal_mask, local_mask, masked_attention_weights, strided_mask, AttentionMask, HyenaConfig,
    Mixer, TransformerBlockConfig,
};

type B = NdArray<f32>;
type AB = Autodiff<B>;

fn tol(v: f64) -> Tolerance<f32> {
    Tolerance::absolute(v)
}

fn random<Bk: Backend, const D: usize>(shape: [usize; D], seed: u64) -> Tensor<Bk, D> {
    crate::common::normal(shape, seed, &Default::default())
}

fn qkv(t: usize, seed: u64) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    (
        random([2, 3, t, 4], seed),
        random([2, 3, t, 4], seed + 1),
        random([2, 3, t, 4], seed + 2),
    )
}

/// `[2, t]`: the second sequence has its last three positions padded.
fn padding(t: usize) -> Tensor<B, 2, Bool> {
    let pad: Vec<bool> = (0..2 * t).map(|i| i >= t && i % t >= t - 3).collect();
    Tensor::from_data(TensorData::new(pad, [2, t]), &Default::default())
}

type Kernel = fn(
    Tensor<B, 4>,
    Tensor<B, 4>,
    Tensor<B, 4>,
    usize,
    bool,
    Option<&Tensor<B, 2, Bool>>,
    Option<&burn::nn::Dropout>,
) -> Tensor<B, 4>;

/// A blocked sparse kernel on `x = (q, k, v)`, without dropout.
fn sparse(
    kernel: Kernel,
    x: &(Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>),
    size: usize,
    causal: bool,
    pad: Option<&Tensor<B, 2, Bool>>,
) -> Tensor<B, 4> {
    kernel(
        x.0.clone(),
        x.1.clone(),
        x.2.clone(),
        size,
        causal,
        pad,
        None,
    )
}

/// The outputs of real (non-padding) queries of a [`padding`] batch: padding queries may see no
/// key at all, and what such a row holds is a convention (dense: uniform over every key).
fn real_queries(x: Tensor<B, 4>) -> Vec<f32> {
    let t = x.dims()[2];
    let first = x
        .clone()
        .slice(s![0..1])
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let second = x
        .slice(s![1..2, .., 0..t - 3])
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    [first, second].concat()
}

fn assert_close(a: Vec<f32>, b: Vec<f32>) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() < 1e-5, "element {i}: {x} vs {y}");
    }
}

/// Dense reference: softmax attention with `pattern` (`[t, t]`, true = masked) and padding.
fn dense(
    (q, k, v): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>),
    pattern: Tensor<B, 2, Bool>,
    pad: Option<Tensor<B, 2, Bool>>,
) -> Tensor<B, 4> {
    let t = pattern.dims()[0];
    let mut mask = pattern.unsqueeze::<4>().expand([2, 1, t, t]);
    if let Some(pad) = pad {
        mask = mask.bool_or(pad.reshape([2, 1, 1, t]).expand([2, 1, t, t]));
    }
    masked_attention_weights(q, k, Some(mask)).matmul(v)
}

#[test]
fn local_blocks_equal_the_dense_sliding_window() {
    let device = Default::default();
    for t in [1, 7, 11, 16] {
        for window in [1, 3, 4, 5, 16] {
            let x = qkv(t, 10);
            let causal = sparse(local_attention, &x, window, true, None);
            let reference = dense(x.clone(), local_mask(t, window, true, &device), None);
            causal
                .into_data()
                .assert_approx_eq(&reference.into_data(), tol(1e-5));
            if t > 3 {
                let pad = padding(t);
                let both = sparse(local_attention, &x, window, false, Some(&pad));
                let reference = dense(x, local_mask(t, window, false, &device), Some(pad));
                assert_close(real_queries(both), real_queries(reference));
            }
        }
    }
}

#[test]
fn local_with_a_window_as_long_as_the_sequence_is_full_attention() {
    let device = Default::default();
    let t = 9;
    for window in [9, 12, 100] {
        let x = qkv(t, 20);
        let local = sparse(local_attention, &x, window, true, None);
        let full = dense(x.clone(), causal_mask(t, &device), None);
        local
            .into_data()
            .assert_approx_eq(&full.into_data(), tol(1e-5));
        let pad = padding(t);
        let local = sparse(local_attention, &x, window, false, Some(&pad));
        let nothing =
            Tensor::<B, 2, Bool>::from_data(TensorData::new(vec![false; t * t], [t, t]), &device);
        let full = dense(x, nothing, Some(pad));
        assert_close(real_queries(local), real_queries(full));
    }
}

#[test]
fn strided_blocks_equal_the_dense_fixed_pattern() {
    let device = Default::default();
    for t in [5, 12, 13] {
        for stride in [1, 2, 3, 4, 16] {
            let x = qkv(t, 30);
            let causal = sparse(strided_attention, &x, stride, true, None);
            let reference = dense(x.clone(), strided_mask(t, stride, true, &device), None);
            causal
                .into_data()
                .assert_approx_eq(&reference.into_data(), tol(1e-5));
            let pad = padding(t);
            let both = sparse(strided_attention, &x, stride, false, Some(&pad));
            let reference = dense(x, strided_mask(t, stride, false, &device), Some(pad));
            assert_close(real_queries(both), real_queries(reference));
        }
    }
}

#[test]
fn the_strided_pattern_is_the_papers() {
    // stride 3, causal: row 7 (block 2) sees 6 and 7 in its block and the summaries 2 and 5.
    let mask = strided_mask::<B>(9, 3, true, &Default::default());
    let row: Vec<bool> = mask.slice([7..8, 0..9]).into_data().to_vec().unwrap();
    let seen: Vec<usize> = (0..9).filter(|&j| !row[j]).collect();
    assert_eq!(seen, vec![2, 5, 6, 7]);
}

#[test]
fn linear_attention_equals_its_quadratic_form() {
    let device = Default::default();
    let t = 13;
    let (q, k, v) = qkv(t, 40);
    let pad = padding(t);
    let fast = linear_attention(q.clone(), k.clone(), v.clone(), false, Some(&pad), 64);
    let mask = pad.clone().reshape([2, 1, 1, t]);
    let slow = linear_attention_weights(q.clone(), k.clone(), Some(mask)).matmul(v.clone());
    fast.into_data()
        .assert_approx_eq(&slow.into_data(), tol(1e-5));

    let causal = causal_mask::<B>(t, &device).unsqueeze::<4>();
    let slow = linear_attention_weights(q.clone(), k.clone(), Some(causal)).matmul(v.clone());
    for chunk in [1, 4, 5, 13, 64] {
        let prefix = linear_attention(q.clone(), k.clone(), v.clone(), true, None, chunk);
        prefix
            .into_data()
            .assert_approx_eq(&slow.clone().into_data(), tol(1e-5));
    }

    // Token by token from the running sums: the same outputs, O(k²) state.
    let mut state = LinearState::<B>::new(2, 3, 4, &device);
    let one = |x: &Tensor<B, 4>, i: usize| x.clone().slice(s![.., .., i..i + 1]);
    let steps: Vec<_> = (0..t)
        .map(|i| state.step(one(&q, i), one(&k, i), one(&v, i)))
        .collect();
    Tensor::cat(steps, 2)
        .into_data()
        .assert_approx_eq(&slow.into_data(), tol(1e-5));
}

#[test]
fn fft_matches_the_dft_and_fft_convolution_the_direct_one() {
    // The DFT of an impulse at n = 1 is e^{−2πif/N}.
    let n = 128;
    let device = Default::default();
    let mut impulse = vec![0.0f32; n];
    impulse[1] = 1.0;
    let re = Tensor::<B, 2>::from_data(TensorData::new(impulse, [1, n]), &device);
    let (fr, fi) = fft((re.clone(), re.zeros_like()));
    let (fr, fi): (Vec<f32>, Vec<f32>) = (
        fr.into_data().to_vec().unwrap(),
        fi.into_data().to_vec().unwrap(),
    );
    for f in 0..n {
        let angle = -2.0 * std::f64::consts::PI * f as f64 / n as f64;
        assert!(
            (fr[f] as f64 - angle.cos()).abs() < 1e-5 && (fi[f] as f64 - angle.sin()).abs() < 1e-5
        );
    }

    for l in [1, 5, 33, 100] {
        let u: Tensor<B, 3> = random([2, 3, l], 50);
        let h: Tensor<B, 2> = random([3, l], 51);
        let fast = fft_conv(u.clone(), h.clone());
        let toeplitz = toeplitz_conv(u.clone(), h.clone());
        let slow = direct_conv(u, h);
        fast.into_data()
            .assert_approx_eq(&slow.clone().into_data(), tol(1e-4));
        toeplitz
            .into_data()
            .assert_approx_eq(&slow.into_data(), tol(1e-4));
    }
}

#[test]
fn fft_convolution_has_the_direct_convolutions_gradient() {
    let l = 70;
    let grads = |conv: fn(Tensor<AB, 3>, Tensor<AB, 2>) -> Tensor<AB, 3>| {
        let u: Tensor<AB, 3> = random::<AB, 3>([2, 3, l], 60).require_grad();
        let h: Tensor<AB, 2> = random::<AB, 2>([3, l], 61).require_grad();
        let w: Tensor<AB, 3> = random([2, 3, l], 62);
        let g = (conv(u.clone(), h.clone()) * w).sum().backward();
        (u.grad(&g).unwrap(), h.grad(&g).unwrap())
    };
    let (fu, fh) = grads(fft_conv);
    let (du, dh) = grads(direct_conv);
    fu.into_data().assert_approx_eq(&du.into_data(), tol(1e-3));
    fh.into_data().assert_approx_eq(&dh.into_data(), tol(1e-3));
}

fn hyena() -> Mixer {
    Mixer::Hyena(HyenaConfig::default())
}

fn causal_mixers() -> Vec<Mixer> {
    vec![
        Mixer::Full,
        Mixer::Local { window: 3 },
        Mixer::Strided { stride: 3 },
        Mixer::Linear { chunk: 4 },
        hyena(),
    ]
}

#[test]
fn hyena_by_fft_equals_hyena_by_direct_convolution() {
    let device = Default::default();
    let block = TransformerBlockConfig::new(16, 2, 32)
        .with_mixer(hyena())
        .with_max_len(64)
        .init::<B>(&device);
    let hyena = block.hyena.as_ref().unwrap();
    let x: Tensor<B, 3> = random([2, 37, 16], 70);
    let fast = hyena.forward(x.clone());
    let slow = hyena.forward_direct(x);
    fast.into_data()
        .assert_approx_eq(&slow.into_data(), tol(1e-4));
}

/// `∂ out[t0] / ∂ x[j]` for every `j`: its largest magnitude per position.
fn gradient_by_position(mixer: &Mixer, t: usize, t0: usize) -> Vec<f32> {
    let device = Default::default();
    let block = TransformerBlockConfig::new(16, 2, 32)
        .with_mixer(mixer.clone())
        .with_max_len(t)
        .init::<AB>(&device);
    let x: Tensor<AB, 3> = random::<AB, 3>([1, t, 16], 80).require_grad();
    let mask = AttentionMask::causal(t, &device);
    let out = block.forward(x.clone(), Some(&mask), None).x;
    let grads = out.slice(s![.., t0]).sum().backward();
    let g = x.grad(&grads).unwrap().abs().max_dim(2).reshape([t]);
    g.into_data().to_vec().unwrap()
}

#[test]
fn every_causal_mixer_is_causal_by_its_gradients() {
    let (t, t0) = (12, 5);
    for mixer in causal_mixers() {
        let g = gradient_by_position(&mixer, t, t0);
        assert!(
            g[..=t0].iter().any(|&v| v > 0.0),
            "{}: no gradient at all",
            mixer.name()
        );
        let largest = g.iter().cloned().fold(0.0, f32::max);
        for (j, &v) in g.iter().enumerate().skip(t0 + 1) {
            // The FFT's circular convolution spreads float rounding over every position; the
            // other mixers (and Hyena's direct convolution, below) are exactly zero.
            let bound = if matches!(mixer, Mixer::Hyena(_)) {
                1e-6 * largest
            } else {
                0.0
            };
            assert!(
                v <= bound,
                "{}: output {t0} depends on input {j} ({v})",
                mixer.name()
            );
        }
    }
}

#[test]
fn hyena_by_direct_convolution_is_exactly_causal() {
    let device = Default::default();
    let block = TransformerBlockConfig::new(16, 2, 32)
        .with_mixer(hyena())
        .with_max_len(12)
        .init::<AB>(&device);
    let x: Tensor<AB, 3> = random::<AB, 3>([1, 12, 16], 81).require_grad();
    let out = block.hyena.as_ref().unwrap().forward_direct(x.clone());
    let grads = out.slice(s![.., 5]).sum().backward();
    let g = x.grad(&grads).unwrap().slice(s![.., 6..]).abs().max();
    assert_eq!(g.into_scalar(), 0.0);
}

fn lm(mixer: Mixer) -> transformer_lab::models::LanguageModel<B> {
    B::seed(&Default::default(), 3);
    crate::common::mixer_lm(mixer, 24)
}

#[test]
fn a_prefix_gives_the_same_logits_alone_as_inside_a_longer_sequence() {
    let ids: Vec<i64> = (0..20).map(|i| (i * 7 % 11) as i64).collect();
    let device = Default::default();
    for mixer in causal_mixers() {
        let model = lm(mixer.clone());
        let all = Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), [1, 20]), &device);
        let prefix = all.clone().slice([0..1, 0..9]);
        let long = model.forward(all).logits.slice([0..1, 0..9]);
        let short = model.forward(prefix).logits;
        short
            .into_data()
            .assert_approx_eq(&long.into_data(), tol(1e-4));
    }
}

#[test]
fn every_causal_mixer_generates_its_most_likely_tokens_greedily() {
    let device = Default::default();
    let greedy = Sampling {
        greedy: true,
        ..Sampling::default()
    };
    for mixer in causal_mixers() {
        let model = lm(mixer.clone());
        let tokens = generate(
            &model,
            &[1, 2, 3],
            30,
            &greedy,
            0,
            Decoding::Recompute,
            &device,
            |_, _| Ok(()),
        )
        .unwrap();
        assert_eq!(tokens.len(), 33, "{}", mixer.name());
        // Each generated token is the argmax after the (last `context`) tokens before it.
        for i in 3..33usize {
            let window = &tokens[i.saturating_sub(24)..i];
            let probs = next_token_probs(&model, window, &device);
            let best = (0..probs.len())
                .max_by(|&a, &b| probs[a].total_cmp(&probs[b]))
                .unwrap();
            assert_eq!(tokens[i], best, "{}: token {i}", mixer.name());
        }
    }
}

#[test]
fn padding_cannot_leak_into_bidirectional_mixers() {
    let device = Default::default();
    for mixer in [
        Mixer::Full,
        Mixer::Local { window: 2 },
        Mixer::Strided { stride: 2 },
        Mixer::Linear { chunk: 64 },
    ] {
        let block = TransformerBlockConfig::new(16, 2, 32)
            .with_mixer(mixer.clone())
            .init::<B>(&device);
        let pad = Tensor::<B, 2, Bool>::from_data(
            TensorData::new((0..7).map(|i| i >= 5).collect::<Vec<_>>(), [1, 7]),
            &device,
        );
        let mask = AttentionMask::padding(pad);
        let x: Tensor<B, 3> = random([1, 7, 16], 90);
        let other = Tensor::cat(
            vec![x.clone().slice(s![.., 0..5]), random([1, 2, 16], 91)],
            1,
        );
        let a = block.forward(x, Some(&mask), None).x.slice(s![.., 0..5]);
        let b = block
            .forward(other, Some(&mask), None)
            .x
            .slice(s![.., 0..5]);
        a.into_data().assert_approx_eq(&b.into_data(), tol(1e-5));
        let _ = mixer;
    }
}

#[test]
fn dense_mixer_weights_reproduce_the_forward_pass() {
    // weights·V through W^O is exactly what the fast kernel computed.
    let device = Default::default();
    for mixer in causal_mixers().into_iter().filter(Mixer::is_attention) {
        let block = TransformerBlockConfig::new(16, 2, 32)
            .with_mixer(mixer.clone())
            .init::<B>(&device);
        let attention = block.attention();
        let x: Tensor<B, 3> = random([1, 10, 16], 100);
        let mask = AttentionMask::causal(10, &device);
        let weights = attention.mixer_weights(x.clone(), x.clone(), Some(&mask)); // [1, h, t, t]
        let sums = weights.clone().sum_dim(3);
        sums.into_data().assert_approx_eq(
            &Tensor::<B, 4>::ones([1, 2, 10, 1], &device).into_data(),
            tol(1e-5),
        );
        let (_, _, v) = attention.project(x.clone(), x.clone());
        let context = weights.matmul(v).swap_dims(1, 2).reshape([1, 10, 16]);
        let expected = attention.output.forward(context);
        let fast = attention.forward(x.clone(), x, Some(&mask)).context;
        fast.into_data()
            .assert_approx_eq(&expected.into_data(), tol(1e-5));
    }
}

#[test]
fn hyena_cannot_serve_an_encoder_and_bad_settings_are_refused() {
    let classifier = ClassifierConfig {
        stack: StackConfig {
            mixer: hyena(),
            ..ClassifierConfig::default().stack
        },
        vocab_size: 10,
        ..ClassifierConfig::default()
    };
    let err = classifier.validate().unwrap_err().to_string();
    assert!(err.contains("hyena is causal"), "{err}");
    let lm = LmConfig {
        stack: StackConfig {
            mixer: Mixer::Local { window: 0 },
            ..LmConfig::default().stack
        },
        ..LmConfig::default()
    };
    assert!(lm.validate().unwrap_err().to_string().contains("window"));
    let parsed: Mixer = serde_json::from_str(r#"{"kind": "strided", "stride": 8}"#).unwrap();
    assert_eq!(parsed, Mixer::Strided { stride: 8 });
    assert!(serde_json::from_str::<Mixer>(r#"{"kind": "sparse"}"#).is_err());
}
