//! The fused kernels equal the composed operations they replace: values and gradients, on random
//! inputs and on the edge cases (fully masked rows, long rows, odd sizes, strided views), and a
//! model trains the same with them on or off.

use crate::common::{batch, small_lm, train_losses};
use burn::backend::{Autodiff, Flex, NdArray};
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{DropoutConfig, LayerNormConfig, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::Bool;
use transformer_lab::kernels::dropout::{next_mask, philox, reseed};
use transformer_lab::kernels::{self, cpu, with_fused, AdamWStep, DropoutMask, LabAutodiff};
use transformer_lab::models::LanguageModel;
use transformer_lab::nn::{AttentionMask, MultiHeadAttentionConfig};
use transformer_lab::train::{LabAdamW, ReferenceOptimizer};

type Ad = Autodiff<Flex>;

/// Largest `|a − b|` relative to the largest `|b|` (at least 1).
pub(crate) fn rel_diff<A: Backend, B: Backend, const D: usize>(
    a: Tensor<A, D>,
    b: Tensor<B, D>,
) -> f32 {
    let a: Vec<f32> = a.into_data().to_vec().unwrap();
    let b: Vec<f32> = b.into_data().to_vec().unwrap();
    assert_eq!(a.len(), b.len());
    // Checked before the folds: `f32::max` drops a NaN, so a NaN difference would vanish.
    assert!(
        a.iter().chain(&b).all(|x| x.is_finite()),
        "non-finite values"
    );
    let scale = b.iter().fold(1.0f32, |m, x| m.max(x.abs()));
    let worst = a
        .iter()
        .zip(&b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    worst / scale
}

use crate::common::normal as random;

/// The output of `f` on fresh leaves made from `inputs`, and each input's gradient of
/// `Σ f(x) ⊙ w` (random `w`), with our kernels on or off.
fn output_and_gradients<B: LabAutodiff, const D: usize, const N: usize>(
    fused: bool,
    inputs: &[Tensor<B, D>; N],
    f: impl Fn([Tensor<B, D>; N]) -> Tensor<B, D>,
) -> (Tensor<B::InnerBackend, D>, [Tensor<B::InnerBackend, D>; N]) {
    with_fused(fused, || {
        let leaves = inputs.clone().map(|x| x.detach().require_grad());
        let y = f(leaves.clone());
        let w = random::<B, D>(y.dims(), 99, &y.device());
        let grads = (y.clone() * w).sum().backward();
        let dx = leaves.map(|x| x.grad(&grads).expect("every input gets a gradient"));
        (y.inner(), dx)
    })
}

/// The largest relative difference of the outputs and of each input's gradient.
fn differences<A: Backend, B: Backend, const D: usize, const N: usize>(
    (y, dx): (Tensor<A, D>, [Tensor<A, D>; N]),
    (y_ref, dx_ref): (Tensor<B, D>, [Tensor<B, D>; N]),
) -> (f32, [f32; N]) {
    let mut dx_ref = dx_ref.into_iter();
    let grads = dx.map(|a| rel_diff(a, dx_ref.next().unwrap()));
    (rel_diff(y, y_ref), grads)
}

/// Runs `f` on fresh leaves made from `inputs`, fused and composed, and returns the largest
/// relative difference of the outputs and of each input's gradient (of `Σ y ⊙ w`, random `w`).
pub(crate) fn compare<B: LabAutodiff, const D: usize, const N: usize>(
    inputs: [Tensor<B, D>; N],
    f: impl Fn([Tensor<B, D>; N]) -> Tensor<B, D>,
) -> (f32, [f32; N]) {
    differences(
        output_and_gradients(true, &inputs, &f),
        output_and_gradients(false, &inputs, &f),
    )
}

/// [`compare`] with the composed form computed by `host`, the same operation on the CPU
/// (`Autodiff<Flex>`), from the same values: our kernels on `B` against a reference on another
/// backend. On lavapipe that also spares the composed form's kernels their compiling, burn's
/// autotuned matmul candidates first (~25 s for each new attention shape).
pub(crate) fn compare_with_host<B: LabAutodiff, const D: usize, const N: usize>(
    inputs: [Tensor<B, D>; N],
    f: impl Fn([Tensor<B, D>; N]) -> Tensor<B, D>,
    host: impl Fn([Tensor<Ad, D>; N]) -> Tensor<Ad, D>,
) -> (f32, [f32; N]) {
    let on_host = inputs
        .clone()
        .map(|x| Tensor::<Ad, D>::from_data(x.into_data(), &Default::default()));
    differences(
        output_and_gradients(true, &inputs, f),
        output_and_gradients(false, &on_host, host),
    )
}

pub(crate) fn assert_close(what: &str, (y, grads): (f32, impl AsRef<[f32]>), tol: f32) {
    assert!(y < tol, "{what}: outputs differ by {y}");
    for (i, g) in grads.as_ref().iter().enumerate() {
        assert!(*g < tol, "{what}: gradient of input {i} differs by {g}");
    }
}

/// erf in f64 by its Maclaurin series (|x| ≤ 3) or continued fraction of erfc (beyond).
pub(crate) fn erf64(x: f64) -> f64 {
    if x.abs() > 3.0 {
        let z = x.abs();
        let mut f = 0.0;
        for n in (1..200).rev() {
            f = n as f64 / 2.0 / (z + f);
        }
        let erfc = (-z * z).exp() / std::f64::consts::PI.sqrt() / (z + f);
        return x.signum() * (1.0 - erfc);
    }
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

#[test]
fn vectorised_exp_and_erf_are_accurate() {
    let mut worst_exp = 0.0f64;
    let mut worst_erf = 0.0f64;
    for i in 0..=200_000 {
        let x = -87.0 + 175.0 * i as f64 / 200_000.0;
        let x = x as f32 as f64; // the exact input the f32 function sees
        let rel = (cpu::exp(x as f32) as f64 - x.exp()).abs() / x.exp();
        worst_exp = worst_exp.max(rel);
        let x = (-6.0 + 12.0 * i as f64 / 200_000.0) as f32 as f64;
        worst_erf = worst_erf.max((cpu::erf(x as f32) as f64 - erf64(x)).abs());
    }
    assert!(worst_exp < 5e-7, "exp relative error {worst_exp}");
    assert!(worst_erf < 5e-7, "erf absolute error {worst_erf}");
    assert_eq!(cpu::exp(-1.0e9), 0.0);
    assert_eq!(cpu::exp(f32::NEG_INFINITY), 0.0);
}

#[test]
fn fused_gelu_equals_the_erf_form() {
    let device = Default::default();
    let x = random::<Ad, 3>([3, 37, 29], 1, &device).mul_scalar(3.0);
    assert_close("gelu", compare([x], |[x]| kernels::gelu(x)), 1e-6);
}

#[test]
fn gelu_and_the_dropout_after_it_in_one_kernel_equal_them_apart() {
    let device = Default::default();
    // One chunk on the calling thread, then chunks split across tasks (each drawing its own
    // stretch of the mask).
    for shape in [[3, 37, 29], [4, 100, 500]] {
        gelu_dropout_case::<Ad>(shape, 0.0, 1e-6, &device);
    }
    gelu_dropout_case::<Autodiff<NdArray>>([3, 37, 29], 0.0, 1e-6, &Default::default());
}

/// [`kernels::gelu_dropout`] of `x` `[b, t, d]` against [`kernels::gelu`] then
/// [`kernels::dropout`] from the same point of the mask stream: the values to within `tol`
/// (0: bit for bit), the input's gradient to within `grad_tol` (the kept derivative has the
/// mask in it, so the gradient is `g·(GELU'·M)` where apart it was `(g·M)·GELU'`).
pub(crate) fn gelu_dropout_case<B: LabAutodiff>(
    [b, t, d]: [usize; 3],
    tol: f32,
    grad_tol: f32,
    device: &B::Device,
) {
    let x = random::<B, 3>([b, t, d], 21, device).mul_scalar(2.0);
    let dropout = DropoutConfig::new(0.3).init();
    let run = |together: bool| {
        reseed(23);
        let x = x.clone().require_grad();
        let y = match together {
            true => kernels::gelu_dropout(&dropout, x.clone()),
            false => kernels::dropout(&dropout, kernels::gelu(x.clone())),
        };
        let g = (y.clone() * random(y.dims(), 24, device)).sum().backward();
        (y.inner(), x.grad(&g).unwrap())
    };
    let ((y1, g1), (y2, g2)) = (run(true), run(false));
    let zeros = y2
        .clone()
        .equal_elem(0.0)
        .int()
        .sum()
        .into_scalar()
        .elem::<i64>();
    assert!(
        zeros as f32 > 0.2 * (b * t * d) as f32,
        "the mask dropped {zeros} of {} elements, not about 30%",
        b * t * d
    );
    let (values, gradient) = (rel_diff(y1, y2), rel_diff(g1, g2));
    assert!(values <= tol, "values differ by {values}");
    assert!(gradient <= grad_tol, "gradients differ by {gradient}");
}

#[test]
fn feed_forward_in_one_node_equals_its_layers_apart() {
    // One core (GELU after the whole product, in tasks); products that split across the cores
    // with GELU as each block's epilogue: blocks of 256 rows × 200 columns, 3⅛ tasks of elements
    // each, so a block's mask starts inside a task's span; blocks of 240 rows × 1,000 columns in
    // parts of 65, 65, 65 and 45 rows; the default composition on ndarray.
    let shapes = [([3, 37, 29], 31), ([4, 128, 48], 200), ([4, 120, 16], 1000)];
    for (shape, hidden) in shapes {
        feed_forward_case::<Ad>(shape, hidden, &Default::default());
    }
    feed_forward_case::<Autodiff<NdArray>>([3, 37, 29], 31, &Default::default());
}

/// [`kernels::feed_forward`] of `x` `[b, t, d]` through `hidden` units against
/// [`kernels::linear`], [`kernels::gelu_dropout`] and [`kernels::linear`] from the same point of
/// the mask stream, with and without dropout and biases: the output and the gradients of `x` and
/// of both layers' weights and biases, bit for bit (the same products, GELU and multiplications,
/// in other places).
fn feed_forward_case<B: LabAutodiff>([b, t, d]: [usize; 3], hidden: usize, device: &B::Device) {
    let x = random::<B, 3>([b, t, d], 61, device).mul_scalar(2.0);
    let layer = |[i, o]: [usize; 2], bias: bool, seed: u64| {
        let mut layer = LinearConfig::new(i, o).with_bias(bias).init::<B>(device);
        layer.weight = Param::from_tensor(random([i, o], seed, device).mul_scalar(0.3));
        layer.bias = layer
            .bias
            .map(|_| Param::from_tensor(random([o], seed + 1, device)));
        layer
    };
    for (prob, bias) in [(0.0, true), (0.0, false), (0.3, true), (0.3, false)] {
        let dropout = DropoutConfig::new(prob).init();
        let (inner, outer) = (layer([d, hidden], bias, 62), layer([hidden, d], bias, 64));
        let run = |together: bool| {
            reseed(29);
            let x = x.clone().require_grad();
            let y = match together {
                true => kernels::feed_forward(&dropout, [&inner, &outer], x.clone()),
                false => {
                    let h = kernels::gelu_dropout(&dropout, kernels::linear(&inner, x.clone()));
                    kernels::linear(&outer, h)
                }
            };
            let g = (y.clone() * random(y.dims(), 66, device)).sum().backward();
            let flat = |t: Option<Tensor<B::InnerBackend, 2>>| t.map(|t| t.reshape([-1]));
            let grads = [&inner, &outer].map(|l| {
                let dw = flat(l.weight.val().grad(&g));
                let db = l.bias.as_ref().map(|b| b.val().grad(&g).unwrap());
                [dw, db]
            });
            (y.inner(), x.grad(&g).unwrap(), grads)
        };
        let ((y1, dx1, grads1), (y2, dx2, grads2)) = (run(true), run(false));
        let what = format!("[{b}, {t}, {d}] through {hidden}, dropout {prob}, bias {bias}");
        assert_eq!(rel_diff(y1, y2), 0.0, "{what}: outputs differ");
        assert_eq!(rel_diff(dx1, dx2), 0.0, "{what}: dx differs");
        let names = [["dW₁", "db₁"], ["dW₂", "db₂"]];
        for ((g1, g2), names) in grads1.into_iter().zip(grads2).zip(names) {
            for ((a, b), name) in g1.into_iter().zip(g2).zip(names) {
                match (a, b) {
                    (Some(a), Some(b)) => assert_eq!(rel_diff(a, b), 0.0, "{what}: {name} differs"),
                    (None, None) => assert!(!bias && name.starts_with("db"), "{what}: no {name}"),
                    _ => panic!("{what}: {name} in one run only"),
                }
            }
        }
    }
}

#[test]
fn fused_layer_norm_equals_burns() {
    let device = Default::default();
    for bias in [true, false] {
        layer_norm_case::<Ad>([5, 7, 33], bias, &device);
    }
}

/// The fused LayerNorm of a `[b, t, d]` input against burn's, values and the gradients of the
/// input, γ and β (non-trivial γ and β, so their gradients and effects are visible).
pub(crate) fn layer_norm_case<B: LabAutodiff>(
    [b, t, d]: [usize; 3],
    bias: bool,
    device: &B::Device,
) {
    // burn's default epsilon, and a large one the fused kernel must honour as burn's does.
    for epsilon in [kernels::LAYER_NORM_EPSILON, 0.5] {
        let mut norm = LayerNormConfig::new(d)
            .with_bias(bias)
            .with_epsilon(epsilon)
            .init::<B>(device);
        norm.gamma = Param::from_tensor((norm.gamma.val() + random([d], 2, device)).detach());
        norm.beta = norm
            .beta
            .map(|beta| Param::from_tensor((beta.val() + random([d], 3, device)).detach()));
        let x = random::<B, 3>([b, t, d], 4, device)
            .mul_scalar(2.0)
            .add_scalar(1.0);
        let case = compare([x.clone()], |[x]| kernels::layer_norm(&norm, epsilon, x));
        assert_close(
            &format!("layer norm (bias {bias}, ε {epsilon})"),
            case,
            1e-5,
        );
        // The input read by others too, before and after (a residual stream): their gradients
        // and LayerNorm's add up, whichever backward pass runs first.
        let case = compare([x], |[x]| {
            let before = x.clone().tanh();
            let y = kernels::layer_norm(&norm, epsilon, x.clone());
            before + y + x.mul_scalar(3.0)
        });
        assert_close(
            &format!("layer norm with other readers (bias {bias}, ε {epsilon})"),
            case,
            1e-5,
        );
        // The parameters' gradients.
        let grads = |on: bool| {
            with_fused(on, || {
                let x = random::<B, 3>([b, t, d], 4, device);
                let y = kernels::layer_norm(&norm, epsilon, x);
                let g = (y * random([b, t, d], 5, device)).sum().backward();
                let dgamma = norm.gamma.val().grad(&g).unwrap();
                let dbeta = norm.beta.as_ref().map(|b| b.val().grad(&g).unwrap());
                (dgamma, dbeta)
            })
        };
        let ((g1, b1), (g2, b2)) = (grads(true), grads(false));
        assert!(rel_diff(g1, g2) < 1e-5, "dγ differs");
        if let (Some(b1), Some(b2)) = (b1, b2) {
            assert!(rel_diff(b1, b2) < 1e-5, "dβ differs");
        }
    }
}

#[test]
fn the_residual_addition_and_layer_norm_in_one_kernel_equal_them_apart() {
    let device = Default::default();
    // One task's rows (below the split), then 300 rows of 500 split over tasks, each drawing
    // its own stretch of the dropout mask.
    for shape in [[3, 7, 33], [3, 100, 500]] {
        add_layer_norm_case::<Ad>(shape, 0.0, &device);
    }
    // The composed forms (ndarray's, and every backend's fallback).
    add_layer_norm_case::<Autodiff<NdArray>>([3, 7, 33], 0.0, &Default::default());
}

/// [`kernels::add_layer_norm`] of a `[b, t, d]` residual `x` and sublayer output `h` (with a
/// non-trivial γ and β): without dropout, against their sum and burn's LayerNorm (values of
/// both outputs and the gradients of x, h, γ, β); with dropout, against [`kernels::dropout_add`]
/// then [`kernels::layer_norm`] from the same point of the mask stream, to within `tol` (0: bit
/// for bit, where the kernel's arithmetic is theirs).
pub(crate) fn add_layer_norm_case<B: LabAutodiff>(
    [b, t, d]: [usize; 3],
    tol: f32,
    device: &B::Device,
) {
    let epsilon = kernels::LAYER_NORM_EPSILON;
    let mut norm = LayerNormConfig::new(d).init::<B>(device);
    norm.gamma = Param::from_tensor((norm.gamma.val() + random([d], 2, device)).detach());
    norm.beta = norm
        .beta
        .map(|beta| Param::from_tensor((beta.val() + random([d], 3, device)).detach()));
    let x = random::<B, 3>([b, t, d], 4, device).mul_scalar(2.0);
    let h = random::<B, 3>([b, t, d], 7, device).add_scalar(0.5);
    let kept = DropoutConfig::new(0.0).init();
    let both = |(sum, y): (Tensor<B, 3>, Tensor<B, 3>)| Tensor::cat(vec![sum, y], 0);
    let case = compare([x.clone(), h.clone()], |[x, h]| {
        both(kernels::add_layer_norm(&kept, x, h, &norm, epsilon))
    });
    assert_close("add + layer norm", case, 1e-5);

    let dropout = DropoutConfig::new(0.25).init();
    let run = |together: bool| {
        reseed(17);
        let (x, h) = (x.clone().require_grad(), h.clone().require_grad());
        let out = if together {
            both(kernels::add_layer_norm(
                &dropout,
                x.clone(),
                h.clone(),
                &norm,
                epsilon,
            ))
        } else {
            let sum = kernels::dropout_add(&dropout, x.clone(), h.clone());
            both((sum.clone(), kernels::layer_norm(&norm, epsilon, sum)))
        };
        let g = (out.clone() * random(out.dims(), 5, device))
            .sum()
            .backward();
        let grads: Vec<Tensor<B::InnerBackend, 1>> = vec![
            x.grad(&g).unwrap().reshape([-1]),
            h.grad(&g).unwrap().reshape([-1]),
            norm.gamma.val().grad(&g).unwrap(),
            norm.beta.as_ref().unwrap().val().grad(&g).unwrap(),
        ];
        (out.inner(), grads)
    };
    let ((y1, g1), (y2, g2)) = (run(true), run(false));
    let dropped = y2
        .clone()
        .slice(s![0..b])
        .equal(x.clone().inner())
        .int()
        .sum()
        .into_scalar()
        .elem::<i64>();
    assert!(
        dropped as f32 > 0.15 * (b * t * d) as f32,
        "the mask dropped {dropped} of {} elements, not about a quarter",
        b * t * d
    );
    let worst = g1
        .into_iter()
        .zip(g2)
        .fold(rel_diff(y1, y2), |m, (a, b)| m.max(rel_diff(a, b)));
    assert!(
        worst <= tol,
        "with dropout, together and apart differ by {worst}"
    );
}

#[test]
fn large_inputs_split_across_cores_and_still_agree() {
    // Above 2¹⁷ elements the element-wise and row-wise kernels split their work across rayon
    // tasks (below, they run on the calling thread, which the other tests cover).
    let device = Default::default();
    let x = random::<Ad, 2>([300, 500], 51, &device);
    assert_close("gelu", compare([x.clone()], |[x]| kernels::gelu(x)), 1e-6);
    assert_close(
        "softmax",
        compare([x.clone()], |[x]| kernels::softmax(x)),
        1e-5,
    );
    let norm = LayerNormConfig::new(500).init::<Ad>(&device);
    assert_close(
        "layer norm",
        compare([x.clone()], |[x]| {
            kernels::layer_norm(&norm, kernels::LAYER_NORM_EPSILON, x)
        }),
        1e-5,
    );
    assert_close(
        "layer norm with a residual reader",
        compare([x.clone()], |[x]| {
            kernels::layer_norm(&norm, kernels::LAYER_NORM_EPSILON, x.clone()) + x.mul_scalar(3.0)
        }),
        1e-5,
    );
    let w = random::<Ad, 2>([300, 500], 56, &device);
    let dgamma = |on| {
        with_fused(on, || {
            let g = (kernels::layer_norm(&norm, kernels::LAYER_NORM_EPSILON, x.clone())
                * w.clone())
            .sum()
            .backward();
            norm.gamma.val().grad(&g).unwrap()
        })
    };
    assert!(
        rel_diff(dgamma(true), dgamma(false)) < 1e-5,
        "layer norm dγ differs"
    );
    let (p, g) = (
        random::<Flex, 2>([400, 400], 52, &device),
        random([400, 400], 53, &device),
    );
    let moments = Some((
        random([400, 400], 54, &device),
        random([400, 400], 55, &device).abs(),
    ));
    let step = AdamWStep {
        lr: 1e-2,
        beta_1: 0.9,
        beta_2: 0.99,
        epsilon: 1e-8,
        weight_decay: 0.1,
        time: 3,
    };
    // Without clipping, and with clipping's factor on a transposed gradient (the view a
    // product's backward pass can leave).
    let g_t = g.clone().transpose();
    for (g, clip) in [(g.clone(), None), (g_t, Some(0.37))] {
        let clip = || clip.map(|c| Tensor::<Flex, 1>::from_floats([c], &device));
        let run = |on| {
            with_fused(on, || {
                kernels::adamw(p.clone(), g.clone(), moments.clone(), step, clip())
            })
        };
        let ((p1, m1, v1), (p2, m2, v2)) = (run(true), run(false));
        assert!(rel_diff(p1, p2) < 1e-6, "adamw parameters differ");
        assert!(
            rel_diff(m1, m2) < 1e-6 && rel_diff(v1, v2) < 1e-6,
            "adamw moments differ"
        );
    }
}

/// An optimizer step over 40 parameters at once ([`kernels::adamw_all`], fused) against
/// [`kernels::adamw`]'s composed form on each alone: vectors and matrices (decayed or not),
/// sizes from 1 to 5,000, some at their first step (no moments), some at step 7, every third
/// gradient a transposed view and every third the columns of a wider matrix (each read at its
/// strides), clipping's factor on all; each result in its parameter's shape. Returns the
/// parameters' count.
pub(crate) fn adamw_all_case<B: kernels::LabBackend>(device: &B::Device) -> usize {
    use burn::tensor::TensorPrimitive;
    let float = |t: Tensor<B, 2>| t.into_primitive().tensor();
    let back = |x| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x));
    let clip = Tensor::<B, 1>::from_floats([0.37], device);
    let mut items = Vec::new();
    let mut alone = Vec::new();
    for i in 0..40u64 {
        let (rows, cols) = match i % 4 {
            0 => (1, 1 + i as usize * 7),
            1 => (13, 1 + i as usize),
            2 => (50, 100),
            _ => (3, 5),
        };
        let param = random::<B, 2>([rows, cols], 100 + i, device);
        // Scaled before the view is taken: an operation on the view would make it contiguous.
        let grad = |shape: [usize; 2]| random::<B, 2>(shape, 200 + i, device).mul_scalar(0.1);
        let grad = match i % 3 {
            0 => grad([cols, rows]).transpose(),
            // Columns of a wider matrix, as a packed product's gradient is sliced.
            1 => grad([rows, cols + 5]).slice([0..rows, 3..cols + 3]),
            _ => grad([rows, cols]),
        };
        let moments = (i % 2 == 1).then(|| {
            (
                random::<B, 2>([rows, cols], 300 + i, device).mul_scalar(0.01),
                random::<B, 2>([rows, cols], 400 + i, device)
                    .abs()
                    .mul_scalar(0.001),
            )
        });
        let step = AdamWStep {
            lr: 3e-3,
            beta_1: 0.9,
            beta_2: 0.99,
            epsilon: 1e-8,
            weight_decay: if rows > 1 { 0.1 } else { 0.0 },
            time: if moments.is_some() { 7 } else { 1 },
        };
        let composed = with_fused(false, || {
            kernels::adamw(
                param.clone(),
                grad.clone(),
                moments.clone(),
                step,
                Some(clip.clone()),
            )
        });
        alone.push(composed);
        items.push(kernels::AdamWItem {
            param: float(param),
            grad: float(grad),
            moments: moments.map(|(m, v)| (float(m), float(v))),
            step,
        });
    }
    let together = with_fused(true, || kernels::adamw_all(items, Some(clip)));
    assert_eq!(together.len(), alone.len());
    for (i, ((p, m, v), (p2, m2, v2))) in together.into_iter().zip(alone).enumerate() {
        for (what, a, b) in [("parameter", p, p2), ("m", m, m2), ("v", v, v2)] {
            let (a, b) = (back(a), b);
            assert_eq!(a.shape(), b.shape(), "parameter {i}: {what}'s shape");
            let diff = rel_diff(a.reshape([-1]), b.reshape([-1]));
            assert!(diff < 1e-6, "parameter {i}: {what} differs by {diff}");
        }
    }
    40
}

#[test]
fn adamw_over_many_parameters_at_once_equals_each_alone() {
    adamw_all_case::<Flex>(&Default::default());
}

/// The fused clipping sum and AdamW read a gradient sliced from the columns of a packed
/// product's where it lies (rows of the slice's width at the wider matrix's stride) and give the
/// bits they give on a contiguous copy of it: over two chunks with a row across the edge between
/// them, on a one-column slice, on whole rows, and on a transposed view (copied first); the
/// sum also for each view alone.
#[test]
fn gradient_views_give_the_bits_of_their_contiguous_copies() {
    use burn::tensor::TensorPrimitive;
    let device = Default::default();
    let back = |x| Tensor::<Flex, 1>::from_primitive(TensorPrimitive::Float(x));
    // 150 × 200 of a 150 × 300 matrix: 30,000 elements, more than one chunk of 16,384 (whose
    // edge falls inside row 81).
    let wide = random::<Flex, 2>([150, 300], 11, &device);
    let views = [
        wide.clone().slice([0..150, 60..260]),
        wide.clone().slice([0..150, 7..8]),
        wide.clone().slice([10..20, 0..300]),
        random::<Flex, 2>([200, 150], 12, &device).transpose(),
    ];
    let copies: Vec<Tensor<Flex, 2>> = views
        .iter()
        .map(|v| Tensor::from_data(v.to_data(), &device))
        .collect();
    let sum = |grads: Vec<Tensor<Flex, 2>>| {
        let prims = grads.into_iter().map(|g| g.into_primitive().tensor());
        with_fused(true, || kernels::sum_squares_all::<Flex>(prims.collect()))
            .into_scalar()
            .to_bits()
    };
    assert_eq!(
        sum(views.to_vec()),
        sum(copies.clone()),
        "Σg² of the views and of their copies"
    );
    // One tensor alone (the backend's single-tensor entry) reads its view where it lies too.
    let one = |g: Tensor<Flex, 2>| {
        // Unflattened: flattening a column slice would copy it.
        let g = g.into_primitive().tensor();
        bits(back(<Flex as kernels::LabBackend>::fused_sum_squares(g)))
    };
    for (view, copy) in views.iter().zip(&copies) {
        assert_eq!(one(view.clone()), one(copy.clone()), "Σg² of one view");
    }
    let step = AdamWStep {
        lr: 3e-3,
        beta_1: 0.9,
        beta_2: 0.99,
        epsilon: 1e-8,
        weight_decay: 0.1,
        time: 7,
    };
    let clip = Tensor::<Flex, 1>::from_floats([0.37], &device);
    let adamw = |grads: Vec<Tensor<Flex, 2>>| {
        let items = grads
            .into_iter()
            .enumerate()
            .map(|(i, g)| {
                let like = |seed: u64| random::<Flex, 2>(g.dims(), seed + i as u64, &device);
                let float = |t: Tensor<Flex, 2>| t.into_primitive().tensor();
                kernels::AdamWItem {
                    param: float(like(20)),
                    grad: float(g.clone()),
                    moments: Some((float(like(30)), float(like(40).abs()))),
                    step,
                }
            })
            .collect();
        let out = with_fused(true, || kernels::adamw_all(items, Some(clip.clone())));
        let bits =
            |x| bits(Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(x)).reshape([-1]));
        out.into_iter()
            .flat_map(|(p, m, v)| [bits(p), bits(m), bits(v)])
            .collect::<Vec<_>>()
    };
    assert!(
        adamw(views.to_vec()) == adamw(copies),
        "AdamW on the views and on their copies"
    );
}

#[test]
fn fused_softmax_equals_burns_on_masked_and_long_rows() {
    let device = Default::default();
    // A fully masked row (every score the masked value), a partly masked one, and long rows.
    let x = random::<Ad, 3>([2, 3, 1000], 6, &device).mul_scalar(4.0);
    let mask = Tensor::<Ad, 1, Int>::arange(0..1000, &device)
        .reshape([1, 1, 1000])
        .greater_elem(400)
        .expand([2, 3, 1000])
        .slice_assign(
            [0..1, 0..1, 0..1000],
            Tensor::<Ad, 3, Bool>::full([1, 1, 1000], true, &device),
        );
    let case = compare([x], |[x]| {
        kernels::softmax(x.mask_fill(mask.clone(), -1.0e9))
    });
    assert_close("softmax", case, 1e-5);
    let odd = random::<Ad, 2>([17, 3], 7, &device);
    assert_close(
        "softmax 3 wide",
        compare([odd], |[x]| kernels::softmax(x)),
        1e-5,
    );
}

/// A `[b, s]` key-padding mask whose batch row `i` has its last `padded[i]` keys padded
/// (`padded` repeats over the rows); `None` for no padding.
pub(crate) fn padding<B: Backend>(
    b: usize,
    s: usize,
    padded: &[usize],
    device: &B::Device,
) -> Option<Tensor<B, 2, Bool>> {
    if padded.is_empty() {
        return None;
    }
    let pad: Vec<bool> = (0..b)
        .flat_map(|i| (0..s).map(move |j| j + padded[i % padded.len()] >= s))
        .collect();
    Some(Tensor::from_data(TensorData::new(pad, [b, s]), device))
}

/// Fused attention on backend `B` (output and q/k/v gradients) against the composed form on the
/// CPU ([`compare_with_host`]).
pub(crate) fn attention_case<B: LabAutodiff>(
    [b, h, t, s, k]: [usize; 5],
    causal: bool,
    padded: &[usize],
    dropout: Option<DropoutMask>,
    device: &B::Device,
) -> (f32, [f32; 3]) {
    let q = random::<B, 4>([b, h, t, k], 11, device);
    let kk = random::<B, 4>([b, h, s, k], 12, device);
    let v = random::<B, 4>([b, h, s, k], 13, device);
    let pad = padding::<B>(b, s, padded, device);
    let host_pad = padding::<Ad>(b, s, padded, &Default::default());
    compare_with_host(
        [q, kk, v],
        |[q, k, v]| kernels::attention(q, k, v, causal, pad.as_ref(), dropout),
        |[q, k, v]| kernels::attention(q, k, v, causal, host_pad.as_ref(), dropout),
    )
}

#[test]
fn fused_attention_equals_the_composed_form() {
    let device = Default::default();
    let cases: &[([usize; 5], bool, &[usize], &str)] = &[
        ([2, 3, 70, 70, 8], true, &[], "causal, two key tiles"),
        (
            [2, 2, 9, 9, 5],
            true,
            &[0, 3],
            "causal with padding, odd head width",
        ),
        (
            [3, 2, 5, 131, 4],
            false,
            &[0, 7, 131],
            "cross, a fully padded row",
        ),
        ([1, 1, 3, 300, 16], false, &[11], "long rows"),
        (
            [2, 2, 70, 70, 32],
            true,
            &[],
            "causal, two tiles, head width 32 (rows read in place)",
        ),
        (
            [2, 1, 6, 6, 3],
            true,
            &[6, 0],
            "causal, every key of one row padded",
        ),
        ([1, 1, 1, 1, 1], true, &[], "one position"),
    ];
    // Without dropout, and with the weights dropped by one mask: the kernel draws it tile by
    // tile (again in the backward pass), the composed form multiplies the whole [b, h, t, s].
    let mask = DropoutMask::new(0.3, 77);
    for dropout in [None, Some(mask)] {
        for &(shape, causal, padded, what) in cases {
            assert_close(
                &format!("{what}, dropout {dropout:?}"),
                attention_case::<Ad>(shape, causal, padded, dropout, &device),
                2e-5,
            );
        }
    }
    // The composed defaults (ndarray) behind the same autodiff node.
    let device = Default::default();
    for dropout in [None, Some(mask)] {
        let shape = [2, 2, 9, 9, 5];
        let case = attention_case::<Autodiff<NdArray>>(shape, true, &[0, 3], dropout, &device);
        assert_close("ndarray defaults", case, 2e-5);
    }
}

/// `n` seeded random values, as the kernels' inputs.
fn random_values(n: usize, seed: u64) -> Vec<f32> {
    let t: Tensor<Flex, 1> = random([n], seed, &Default::default());
    t.into_data().to_vec().unwrap()
}

/// How many positions of `a` and `b` (over the shorter) hold different bits.
fn differing_bits(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// The CPU kernels' attention output, log-sum-exp and gradients `[o, lse, dq, dk, dv]` for
/// `q`, `k`, `v` and `d_o` laid out `[b, n, h, k]`, with attention dropout `dropout`.
fn cpu_attention(
    shape: cpu::AttentionShape,
    [q, k, v, d_o]: [&[f32]; 4],
    causal: bool,
    pad: Option<&[f32]>,
    dropout: Option<DropoutMask>,
) -> [Vec<f32>; 5] {
    let heads = |data, n| cpu::Heads {
        data,
        offset: 0,
        strides: shape.interleaved(n),
    };
    let (t, s) = (shape.t, shape.s);
    let (o, lse) = cpu::attention_forward(
        shape,
        heads(q, t),
        heads(k, s),
        heads(v, s),
        causal,
        pad,
        dropout,
    );
    let (dq, dk, dv) = cpu::attention_backward(
        shape,
        heads(q, t),
        heads(k, s),
        heads(v, s),
        heads(&o, t),
        &lse,
        heads(d_o, t),
        causal,
        pad,
        dropout,
    );
    [o, lse, dq, dk, dv]
}

#[test]
fn a_cpu_attention_head_does_not_depend_on_the_heads_before_it() {
    // Each task of the CPU kernel reuses its buffers from head to head without clearing them:
    // the first product into a tile of rows writes it whole, and rows that no query reaches
    // are zeroed. A batch row whose every key is padded weighs every key alike, so its heads
    // write every tile; the next batch row's causal heads stop at the diagonal. On one thread
    // the 6 heads of 3 batch rows run as two tasks of 3 (rayon splits once per thread), so the
    // last row's first head runs right after a fully padded row's head in the same task: the
    // last row's outputs and gradients must be those it gets alone, bit for bit.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    for (t, s, what) in [
        (70, 70, "two key tiles"),
        (5, 131, "keys past the last query"),
    ] {
        let (h, k) = (2, 8);
        // Three batch rows of queries, keys, values and output gradients.
        let (nq, nk) = (h * t * k, h * s * k);
        let inputs = [
            (random_values(3 * nq, 21), nq),
            (random_values(3 * nk, 22), nk),
            (random_values(3 * nk, 23), nk),
            (random_values(3 * nq, 24), nq),
        ];
        // Batch rows `first..first + b` of the inputs, on their own.
        let run = |b: usize, first: usize, pad: &[f32]| {
            let shape = cpu::AttentionShape { b, h, t, s, k };
            let [q, kk, v, d_o] = inputs
                .each_ref()
                .map(|(x, n)| x[first * n..(first + b) * n].to_vec());
            let pad = &pad[first * s..(first + b) * s];
            pool.install(|| {
                let per_row = |x: Vec<f32>| {
                    let n = x.len() / b;
                    x[(b - 1) * n..].to_vec()
                };
                cpu_attention(shape, [&q, &kk, &v, &d_o], true, Some(pad), None).map(per_row)
            })
        };
        // Batch rows 0 and 1: every key padded; batch row 2: none.
        let pad: Vec<f32> = (0..3 * s)
            .map(|j| if j < 2 * s { 1.0 } else { 0.0 })
            .collect();
        let after = run(3, 0, &pad);
        let alone = run(1, 2, &pad);
        for (name, (a, b)) in ["output", "lse", "dq", "dk", "dv"]
            .iter()
            .zip(after.iter().zip(&alone))
        {
            let differ = differing_bits(a, b);
            assert_eq!(
                differ,
                0,
                "{what}: {name}: {differ} of {} values differ",
                a.len()
            );
        }
        // Keys no query sees have no gradient (rows of `[s, h, k]`).
        let [.., dk, dv] = &alone;
        for (j, (dk, dv)) in dk.chunks(k).zip(dv.chunks(k)).enumerate() {
            if j / h >= t {
                assert!(dk.iter().chain(dv).all(|&x| x == 0.0), "{what}: key {j}");
            }
        }
    }
}

#[test]
fn small_heads_side_by_side_in_lanes_give_the_bits_of_one_head_at_a_time() {
    // The forward pass of short unmasked heads (a ViT's) runs sixteen at a time, one a lane of
    // each vector; each lane computes what the tiled kernel computes for its head, in the same
    // order, so the output and the log-sum-exp — and the gradients the backward pass makes from
    // them — must be the tiled kernel's bit for bit. The cases: a last group of 4 heads after a
    // whole one, head widths with a tail past the 16-lane units, more keys than queries, and
    // the projections packed side by side as training has them.
    for [b, h, t, s, k] in [[5, 4, 17, 19, 12], [4, 4, 17, 17, 16], [3, 6, 29, 31, 20]] {
        let shape = cpu::AttentionShape { b, h, t, s, k };
        assert!(cpu::heads_in_lanes(shape), "{shape:?}");
        let (nq, nk) = (b * t * h * k, b * s * h * k);
        let (q, kk, v, d_o) = (
            random_values(nq, 41),
            random_values(nk, 42),
            random_values(nk, 43),
            random_values(nq, 44),
        );
        let run = || {
            let [o, lse, dq, dk, dv] = cpu_attention(shape, [&q, &kk, &v, &d_o], false, None, None);
            // With as many keys as queries, also from Q, K and V packed as `[b, t, 3·h·k]`.
            let packed = (t == s).then(|| {
                let d = h * k;
                let qkv: Vec<f32> = (0..b * t)
                    .flat_map(|row| [&q, &kk, &v].map(|x| &x[row * d..(row + 1) * d]).concat())
                    .collect();
                let part = |i: usize| cpu::Heads {
                    data: &qkv,
                    offset: i * d,
                    strides: [t * 3 * d, k, 3 * d],
                };
                let (o, lse) =
                    cpu::attention_forward(shape, part(0), part(1), part(2), false, None, None);
                let dqkv =
                    cpu::packed_attention_backward(shape, &qkv, &o, &lse, &d_o, false, None, None);
                [o, lse, dqkv]
            });
            let mut out = vec![o, lse, dq, dk, dv];
            out.extend(packed.into_iter().flatten());
            out
        };
        let lanes = run();
        let tiles = cpu::with_tiles_only(run);
        assert!(lanes.iter().flatten().all(|x| x.is_finite()));
        let names = [
            "output",
            "lse",
            "dq",
            "dk",
            "dv",
            "packed output",
            "packed lse",
            "dqkv",
        ];
        for ((name, a), b) in names.iter().zip(&lanes).zip(&tiles) {
            let differ = differing_bits(a, b);
            assert!(
                a.len() == b.len() && differ == 0,
                "{shape:?}: {name}: {differ} of {} values differ",
                a.len()
            );
        }
        assert_eq!(lanes.len(), if t == s { 8 } else { 5 });
    }
}

#[test]
fn fused_attention_inside_multi_head_attention_matches_on_strided_heads() {
    // Heads split from [b, t, d] are strided views: the kernel reads them in place and writes its
    // output in the layout the heads are merged from.
    let device = Default::default();
    let mha = MultiHeadAttentionConfig::new(24, 3).init::<Ad>(&device);
    let x = random::<Ad, 3>([2, 13, 24], 21, &device);
    let pad = Tensor::<Ad, 2, Bool>::from_data(
        TensorData::new((0..26).map(|i| i >= 22).collect::<Vec<_>>(), [2, 13]),
        &device,
    );
    let mask = AttentionMask::causal(13, &device).with_padding(pad);
    let case = compare([x.clone()], |[x]| {
        mha.forward(x.clone(), x, Some(&mask)).context
    });
    assert_close("multi-head attention", case, 2e-5);
    // Self-attention from one packed Q/K/V product is the same layer.
    let case = compare([x.clone()], |[x]| mha.forward_self(x, Some(&mask)).context);
    assert_close("packed multi-head self-attention", case, 2e-5);
    let packed = with_fused(true, || mha.forward_self(x.clone(), Some(&mask)).context);
    let apart = with_fused(true, || mha.forward(x.clone(), x, Some(&mask)).context);
    assert!(
        rel_diff(packed, apart) < 1e-5,
        "forward_self differs from forward(x, x)"
    );
}

#[test]
fn rope_on_the_packed_heads_is_rope_on_each_head() {
    // Q and K of every head rotated value for value as `rope` rotates them apart; V untouched.
    use transformer_lab::kernels::reference::split_packed;
    use transformer_lab::nn::{rope, rope_packed};
    let device = Default::default();
    let (b, t, h, k) = (2, 7, 3, 6);
    let qkv = random::<NdArray, 3>([b, t, 3 * h * k], 61, &device);
    for start in [0, 5] {
        let (q, kk, v) = split_packed(qkv.clone(), h);
        let (q2, k2, v2) = split_packed(rope_packed(qkv.clone(), h, start), h);
        for (name, want, got) in [
            ("queries", rope(q, start), q2),
            ("keys", rope(kk, start), k2),
            ("values", v, v2),
        ] {
            let (want, got) = (want.into_data(), got.into_data());
            assert_eq!(want, got, "{name} at start {start}");
        }
    }
}

#[test]
fn fused_rope_attention_equals_the_composed_layer() {
    // With RoPE, training rotates Q and K inside the packed product and runs the packed kernel;
    // composed, the heads are split and rotated apart: the same layer, outputs and gradients.
    use transformer_lab::nn::RelativePosition;
    let device = Default::default();
    let mut config = MultiHeadAttentionConfig::new(24, 3);
    config.relative = RelativePosition::Rope;
    let mha = config.init::<Ad>(&device);
    let x = random::<Ad, 3>([2, 13, 24], 23, &device);
    let mask = AttentionMask::causal(13, &device);
    let case = compare([x], |[x]| mha.forward_self(x, Some(&mask)).context);
    assert_close("rope self-attention", case, 2e-5);
}

#[test]
fn packed_self_attention_equals_the_composed_form() {
    // Q, K and V side by side in one [b, t, 3·d] tensor, read in place; the gradient is written
    // back into one buffer of that shape.
    let device = Default::default();
    let cases: &[([usize; 4], bool, &[usize], &str)] = &[
        ([2, 70, 3, 8], true, &[], "causal, two key tiles"),
        (
            [3, 17, 4, 16],
            false,
            &[],
            "bidirectional, short heads 16 wide (rows read in place)",
        ),
        (
            [5, 17, 4, 16],
            false,
            &[],
            "bidirectional, 20 short heads: without dropout, sixteen at a time in lanes",
        ),
        (
            [2, 70, 2, 32],
            true,
            &[0, 9],
            "causal with padding, two tiles, 32 wide (rows read in place)",
        ),
        (
            [2, 9, 2, 5],
            true,
            &[0, 3],
            "causal with padding, odd head width",
        ),
        (
            [3, 6, 2, 4],
            false,
            &[0, 2, 6],
            "bidirectional, a fully padded row",
        ),
        ([1, 1, 1, 1], true, &[], "one position"),
    ];
    let cases = cases
        .iter()
        .flat_map(|&case| [(case, None), (case, Some(DropoutMask::new(0.2, 5)))]);
    for (([b, t, h, k], causal, padded, what), dropout) in cases {
        let qkv = random::<Ad, 3>([b, t, 3 * h * k], 31, &device);
        let pad = padding::<Ad>(b, t, padded, &device);
        let case = compare([qkv], |[qkv]| {
            kernels::packed_self_attention(qkv, h, causal, pad.as_ref(), dropout)
        });
        assert_close(&format!("{what}, dropout {dropout:?}"), case, 2e-5);
    }
}

#[test]
fn fused_linear_equals_the_composed_product() {
    let device = Default::default();
    for bias in [true, false] {
        let mut layer = LinearConfig::new(29, 23)
            .with_bias(bias)
            .init::<Ad>(&device);
        layer.weight = Param::from_tensor(random([29, 23], 41, &device));
        layer.bias = layer
            .bias
            .map(|_| Param::from_tensor(random([23], 42, &device)));
        // A plain input, and a transposed (strided) one, as the flat product sees them.
        let x = random::<Ad, 3>([3, 37, 29], 43, &device);
        let case = compare([x], |[x]| kernels::linear(&layer, x));
        assert_close(&format!("linear (bias {bias})"), case, 1e-5);
        let xt = random::<Ad, 2>([29, 37], 44, &device);
        let case = compare([xt], |[xt]| {
            kernels::linear(&layer, xt.transpose()).transpose()
        });
        assert_close(
            &format!("linear on a transposed input (bias {bias})"),
            case,
            1e-5,
        );
        // The parameters' gradients.
        let grads = |on: bool| {
            with_fused(on, || {
                let y = kernels::linear(&layer, random::<Ad, 2>([37, 29], 45, &device));
                let g = (y * random([37, 23], 46, &device)).sum().backward();
                let dw = layer.weight.val().grad(&g).unwrap();
                let db = layer.bias.as_ref().map(|b| b.val().grad(&g).unwrap());
                (dw, db)
            })
        };
        let ((w1, b1), (w2, b2)) = (grads(true), grads(false));
        assert!(rel_diff(w1, w2) < 1e-5, "dW differs");
        if let (Some(b1), Some(b2)) = (b1, b2) {
            assert!(rel_diff(b1, b2) < 1e-5, "db differs");
        }
        // A product large enough to be split across the cores by blocks of rows (301 rows:
        // blocks of unequal length), plain and transposed.
        let big = LinearConfig::new(130, 70)
            .with_bias(bias)
            .init::<Ad>(&device);
        let x = random::<Ad, 2>([301, 130], 48, &device);
        let case = compare([x], |[x]| kernels::linear(&big, x));
        assert_close(&format!("split linear (bias {bias})"), case, 1e-5);
        let xt = random::<Ad, 2>([130, 301], 49, &device);
        let case = compare([xt], |[xt]| kernels::linear(&big, xt.transpose()));
        assert_close(
            &format!("split linear, transposed (bias {bias})"),
            case,
            1e-5,
        );
        // Several layers side by side are each layer on its own columns.
        let other = LinearConfig::new(29, 5).with_bias(bias).init::<Ad>(&device);
        let x = random::<Ad, 2>([37, 29], 47, &device);
        let both = kernels::linear_parts(&[&layer, &other], x.clone());
        let apart = Tensor::cat(
            vec![
                kernels::linear(&layer, x.clone()),
                kernels::linear(&other, x),
            ],
            1,
        );
        assert!(rel_diff(both, apart) < 1e-6, "packed layers differ");
    }
}

#[test]
fn each_form_of_the_linear_gradients_gives_the_products_and_the_same_bits() {
    // `linear_backward` runs `dx = dy·wᵀ` and `dw = xᵀ·dy` each in one of two forms (as is, or
    // through a transposed copy), chosen per shape by timing them. Every combination must give
    // the products (against sums in f64 here) and the same bits, so the choice changes no run.
    let values = |n: usize, seed: u64| -> Vec<f32> {
        (0..n)
            .map(|j| {
                let h =
                    (j as u64 ^ seed.wrapping_mul(0x9e37_79b9)).wrapping_mul(0x2545_f491_4f6c_dd1d);
                ((h >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    };
    let forms = [cpu::Form::AsIs, cpu::Form::Transposed];
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // Ragged against every block size; one large enough to split by rows (where the pool has
    // more than two threads); a wide one.
    for (n, i, o) in [(37, 29, 23), (301, 130, 70), (70, 17, 200)] {
        let (x, w, dy, derivative) = (
            values(n * i, 1),
            values(i * o, 2),
            values(n * o, 3),
            values(n * i, 4),
        );
        let xt: Vec<f32> = (0..i * n).map(|j| x[(j % n) * i + j / n]).collect();
        fn matrix(data: &[f32], shape: [usize; 2]) -> cpu::Matrix<'_> {
            cpu::Matrix {
                data,
                offset: 0,
                shape,
                strides: [shape[1], 1],
            }
        }
        // `x` both row-major and as the transposed view of its transpose.
        let inputs = [
            matrix(&x, [n, i]),
            cpu::Matrix {
                data: &xt,
                offset: 0,
                shape: [n, i],
                strides: [1, n],
            },
        ];
        let sum = |len: usize, f: &dyn Fn(usize) -> f64| (0..len).map(f).sum::<f64>();
        let expected_dx: Vec<f64> = (0..n * i)
            .map(|e| {
                let (r, c) = (e / i, e % i);
                let s = sum(o, &|p| dy[r * o + p] as f64 * w[c * o + p] as f64);
                s * derivative[e] as f64
            })
            .collect();
        let expected_dw: Vec<f64> = (0..i * o)
            .map(|e| sum(n, &|r| x[r * i + e / o] as f64 * dy[r * o + e % o] as f64))
            .collect();
        let expected_db: Vec<f64> = (0..o).map(|c| sum(n, &|r| dy[r * o + c] as f64)).collect();
        let close = |what: &str, got: &[f32], expected: &[f64]| {
            let scale = expected.iter().fold(1.0f64, |m, x| m.max(x.abs()));
            let worst = got
                .iter()
                .zip(expected)
                .fold(0.0f64, |m, (&g, &e)| m.max((g as f64 - e).abs()));
            assert!(
                got.len() == expected.len() && worst / scale < 1e-5,
                "{what} ({n} × {i} → {o}): off by {worst:e}"
            );
        };
        let mut first: Option<(Vec<f32>, Vec<f32>)> = None;
        for (input, x) in inputs.into_iter().enumerate() {
            for fx in forms {
                for fw in forms {
                    let (dx, dw, db) = cpu::linear_backward_in(
                        Some([fx, fw]),
                        x,
                        matrix(&w, [i, o]),
                        matrix(&dy, [n, o]),
                        true,
                        Some(&derivative),
                    );
                    let what = format!("input {input}, dx {fx:?}, dw {fw:?}");
                    close(&format!("dx, {what}"), &dx, &expected_dx);
                    close(&format!("dw, {what}"), &dw, &expected_dw);
                    close(&format!("db, {what}"), &db.unwrap(), &expected_db);
                    match &first {
                        None => first = Some((dx, dw)),
                        Some((dx0, dw0)) => {
                            assert!(bits(&dx) == bits(dx0), "dx's bits, {what}");
                            assert!(bits(&dw) == bits(dw0), "dw's bits, {what}");
                        }
                    }
                }
            }
        }
        // The forms as chosen: the first call compares them, the next ones time them in turn.
        let (dx0, dw0) = first.unwrap();
        for call in 0..8 {
            let (dx, dw, _) = cpu::linear_backward(
                matrix(&x, [n, i]),
                matrix(&w, [i, o]),
                matrix(&dy, [n, o]),
                false,
                Some(&derivative),
            );
            assert!(
                bits(&dx) == bits(&dx0) && bits(&dw) == bits(&dw0),
                "call {call} of the chosen forms differs"
            );
        }
    }
}

#[test]
fn training_with_fused_kernels_follows_the_composed_loss_curve() {
    let device = Default::default();
    // One initial model for both (the backend's seed is shared with tests running beside).
    // Parameters are initialised lazily (on first use): fix their values before cloning.
    let model: LanguageModel<Ad> = small_lm().init(&device);
    let model = small_lm().init(&device).load_record(model.into_record());
    let fused = with_fused(true, || train_losses(model.clone(), 8, &device));
    let composed = with_fused(false, || train_losses(model, 8, &device));
    for (step, (a, b)) in fused.iter().zip(&composed).enumerate() {
        assert!(
            (a - b).abs() < 1e-4 * b.abs().max(1.0),
            "step {step}: loss {a} fused, {b} composed"
        );
    }
    assert!(fused.last() < fused.first(), "the loss falls: {fused:?}");
}

/// Trains `model` for `steps` on the fixed batch with `optim`; the losses and the optimizer.
fn steps_with<O: Optimizer<LanguageModel<Ad>, Ad>>(
    mut model: LanguageModel<Ad>,
    mut optim: O,
    steps: usize,
) -> (Vec<f32>, LanguageModel<Ad>, O) {
    let device = Default::default();
    let mut losses = Vec::new();
    for _ in 0..steps {
        let (loss, _, _) = model.loss(batch(&device));
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
    }
    (losses, model, optim)
}

#[test]
fn fused_adamw_steps_like_burns_adamw_and_shares_its_checkpoints() {
    let device = Default::default();
    let model: LanguageModel<Ad> = small_lm().init(&device);
    let model = small_lm().init(&device).load_record(model.into_record());
    let (weight_decay, clip) = (0.1, 1.0);
    let ours = || ReferenceOptimizer::lab_adamw(LabAdamW::new(0.9, 0.99, 1e-5, weight_decay), clip);
    let burns = || {
        let adamw = AdamWConfig::new()
            .with_beta_2(0.99)
            .with_weight_decay(0.0)
            .init::<Ad, LanguageModel<Ad>>();
        ReferenceOptimizer::new(adamw, weight_decay as f64, clip)
    };
    // Every parameter, flattened (LayerNorm gains and biases included: they are not decayed).
    let embedding = |m: &LanguageModel<Ad>| {
        let mut weights = Weights(Vec::new());
        m.visit(&mut weights);
        let all = weights.0.concat();
        let n = all.len();
        Tensor::<Flex, 1>::from_data(TensorData::new(all, [n]), &Default::default())
    };
    let (reference, reference_model, burn_optim) = steps_with(model.clone(), burns(), 4);
    for on in [true, false] {
        let (losses, trained, _) = with_fused(on, || steps_with(model.clone(), ours(), 4));
        for (a, b) in losses.iter().zip(&reference) {
            assert!((a - b).abs() < 1e-5, "fused {on}: loss {a} vs burn's {b}");
        }
        let diff = rel_diff(embedding(&trained), embedding(&reference_model));
        assert!(diff < 1e-5, "fused {on}: parameters differ by {diff}");
    }
    // The optimizer state of one is the other's checkpoint: after burn's 4 steps, ours resumes
    // from burn's saved record and takes the same 5th step.
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder.record(burn_optim.to_record(), ()).unwrap();
    let resumed = ours().load_record(recorder.load(bytes, &device).unwrap());
    let (ours_next, ..) = steps_with(reference_model.clone(), resumed, 2);
    let (burns_next, ..) = steps_with(reference_model, burn_optim, 2);
    assert!(
        (ours_next[1] - burns_next[1]).abs() < 1e-5,
        "{ours_next:?} vs {burns_next:?}"
    );
}

/// The address of each parameter's buffer (Autodiff<Flex>).
struct Buffers(Vec<usize>);

impl ModuleVisitor<Ad> for Buffers {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Ad, D>>) {
        let inner = param.val().inner().into_primitive().tensor();
        self.0.push(inner.bytes().as_ptr() as usize);
    }
}

#[test]
fn the_optimizer_updates_each_parameter_in_its_own_buffer() {
    // The optimizer takes the parameters out of the module rather than cloning them, so the
    // update writes into their buffers: a copy of every parameter per step is gone. A copy
    // would live at another address while the original is still held.
    let device = Default::default();
    let mut model: LanguageModel<Ad> = small_lm().init(&device);
    let mut optim = ReferenceOptimizer::lab_adamw(LabAdamW::new(0.9, 0.99, 1e-5, 0.1), 1.0);
    let buffers = |m: &LanguageModel<Ad>| {
        let mut found = Buffers(Vec::new());
        m.visit(&mut found);
        found.0
    };
    with_fused(true, || {
        for step in 0..3 {
            let before = buffers(&model);
            let (loss, _, _) = model.loss(batch(&device));
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(3e-3, model, grads);
            let after = buffers(&model);
            assert_eq!(before.len(), after.len());
            let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
            assert_eq!(
                moved,
                0,
                "step {step}: {moved} of {} parameters copied",
                after.len()
            );
        }
    });
}

#[test]
fn a_parameter_held_elsewhere_is_updated_into_a_new_buffer_with_the_same_bits() {
    // burn's `Learner` hands the optimizer a clone of its module and keeps the original until
    // the step returns, so each parameter's buffer has two holders there: the update reads it
    // where it lies and writes a new buffer (no copy first). The other holder must keep the old
    // values, and the new ones must be the bits an unshared parameter's update gives. Sizes of
    // 1, 5,000 and 40,000 elements (one and three chunks of 16,384), moments and not.
    use burn::tensor::TensorPrimitive;
    let device = Default::default();
    let float = |t: Tensor<Flex, 1>| t.into_primitive().tensor();
    let back = |x| Tensor::<Flex, 1>::from_primitive(TensorPrimitive::Float(x));
    let sizes = [1, 5_000, 40_000];
    let params: Vec<Tensor<Flex, 1>> = sizes
        .iter()
        .map(|&n| random::<Flex, 1>([n], n as u64, &device))
        .collect();
    let items = |params: Vec<Tensor<Flex, 1>>| -> Vec<kernels::AdamWItem<Flex>> {
        params
            .into_iter()
            .zip(sizes)
            .enumerate()
            .map(|(i, (param, n))| {
                let grad = random::<Flex, 1>([n], 7 + n as u64, &device).mul_scalar(0.1);
                let moments = (i != 1).then(|| {
                    let m = random::<Flex, 1>([n], 9 + n as u64, &device).mul_scalar(0.01);
                    let v = random::<Flex, 1>([n], 11 + n as u64, &device).abs();
                    (float(m), float(v.mul_scalar(0.001)))
                });
                kernels::AdamWItem {
                    param: float(param),
                    grad: float(grad),
                    step: AdamWStep {
                        lr: 3e-3,
                        beta_1: 0.9,
                        beta_2: 0.99,
                        epsilon: 1e-8,
                        weight_decay: 0.1,
                        time: if moments.is_some() { 4 } else { 1 },
                    },
                    moments,
                }
            })
            .collect()
    };
    let clip = || Some(Tensor::<Flex, 1>::from_floats([0.5], &device));
    let before: Vec<Vec<u32>> = params.iter().map(|p| bits(p.clone())).collect();
    // Unshared: copies of the values in buffers of their own.
    let copies = params
        .iter()
        .map(|p| Tensor::from_data(p.to_data(), &device))
        .collect();
    let alone = with_fused(true, || kernels::adamw_all(items(copies), clip()));
    // Shared: `params` keeps holding the buffers handed over.
    let shared = with_fused(true, || kernels::adamw_all(items(params.clone()), clip()));
    for (i, (((p, m, v), (p2, m2, v2)), held)) in
        shared.into_iter().zip(alone).zip(&params).enumerate()
    {
        assert_eq!(
            bits(held.clone()),
            before[i],
            "parameter {i}: the other holder's values changed"
        );
        for (what, a, b) in [("parameter", p, p2), ("m", m, m2), ("v", v, v2)] {
            assert_eq!(bits(back(a)), bits(back(b)), "parameter {i}: {what}'s bits");
        }
    }
}

/// The bits of each element of a flex tensor, for comparisons that must be exact.
fn bits(t: Tensor<Flex, 1>) -> Vec<u32> {
    let v = t.into_data().to_vec::<f32>().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

/// Targets `[n]` in `0..v` from a seeded generator, with every third row set to `ignore`.
pub(crate) fn targets<B: Backend>(
    n: usize,
    v: usize,
    ignore: Option<usize>,
    device: &B::Device,
) -> Tensor<B, 1, Int> {
    use rand::{rngs::StdRng, RngExt, SeedableRng};
    let mut rng = StdRng::seed_from_u64(n as u64 * 31 + v as u64);
    let ys: Vec<i64> = (0..n)
        .map(|i| match ignore {
            Some(pad) if i % 3 == 2 => pad as i64,
            _ => rng.random_range(0..v) as i64,
        })
        .collect();
    Tensor::from_data(TensorData::new(ys, [n]), device)
}

#[test]
fn fused_cross_entropy_equals_the_composed_form() {
    let device = Default::default();
    // Odd widths, a vocabulary-sized row, label smoothing on and off, ignored (padding) rows,
    // and an input large enough (> 2^17 elements) to take the multi-core path.
    for (n, v, smoothing, ignore) in [
        (7, 3, 0.0, None),
        (12, 65, 0.0, None),
        (10, 1000, 0.1, Some(0)),
        (40, 4000, 0.1, Some(3)),
        (6, 17, 0.3, Some(16)),
    ] {
        let x = random::<Ad, 2>([n, v], 8, &device).mul_scalar(3.0);
        let y = targets::<Ad>(n, v, ignore, &device);
        let case = compare([x], |[x]| {
            kernels::cross_entropy(x, y.clone(), smoothing, ignore).unsqueeze_dim(1)
        });
        assert_close(&format!("cross-entropy {n}×{v}, ε {smoothing}"), case, 1e-5);
    }
}

#[test]
fn cross_entropy_matches_hand_computed_values_and_burns_loss() {
    let device = Default::default();
    // Row [0, ln 3]: p = [1/4, 3/4]. Target 1: −ln(3/4) = 0.287682; with ε = 0.1:
    // 0.9·0.287682 + 0.1·(ln 4 + ln(4/3))/2 = 0.342611. The second row is ignored: 0.
    let x = Tensor::<Ad, 2>::from_floats([[0.0, 3f32.ln()], [5.0, -2.0]], &device);
    let y = Tensor::<Ad, 1, Int>::from_ints([1, 0], &device);
    for on in [true, false] {
        with_fused(on, || {
            let leaf = x.clone().require_grad();
            let loss = kernels::cross_entropy(leaf.clone(), y.clone(), 0.1, Some(0));
            let got: Vec<f32> = loss.clone().into_data().to_vec().unwrap();
            assert!((got[0] - 0.342_611).abs() < 1e-5, "fused {on}: {got:?}");
            assert_eq!(got[1], 0.0, "fused {on}: an ignored row costs nothing");
            let plain: Vec<f32> = kernels::cross_entropy(x.clone(), y.clone(), 0.0, None)
                .into_data()
                .to_vec()
                .unwrap();
            assert!((plain[0] - 0.287_682).abs() < 1e-5, "fused {on}: {plain:?}");
            // d/dx of row 0: p − 0.9·onehot − 0.05 = [0.25 − 0.05, 0.75 − 0.9 − 0.05].
            let grad: Vec<f32> = leaf
                .grad(&loss.sum().backward())
                .unwrap()
                .into_data()
                .to_vec()
                .unwrap();
            let expected = [0.2, -0.2, 0.0, 0.0];
            for (g, e) in grad.iter().zip(expected) {
                assert!((g - e).abs() < 1e-6, "fused {on}: gradient {grad:?}");
            }
        });
    }
    // The mean over rows is burn's CrossEntropyLoss (with its own label smoothing).
    let x = random::<Ad, 2>([9, 11], 12, &device);
    let y = targets::<Ad>(9, 11, None, &device);
    for smoothing in [None, Some(0.2)] {
        let burns = burn::nn::loss::CrossEntropyLossConfig::new()
            .with_smoothing(smoothing)
            .init(&device)
            .forward(x.clone(), y.clone());
        let ours = kernels::cross_entropy(x.clone(), y.clone(), smoothing.unwrap_or(0.0), None);
        assert!(
            rel_diff(ours.mean(), burns) < 1e-6,
            "smoothing {smoothing:?}"
        );
    }
}

#[test]
fn philox_gives_the_reference_implementations_known_answers() {
    // Random123's known-answer vectors for Philox4x32-10.
    assert_eq!(
        philox([0; 4], [0; 2]),
        [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
    );
    assert_eq!(
        philox([u32::MAX; 4], [u32::MAX; 2]),
        [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
    );
    assert_eq!(
        philox(
            [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
            [0xa409_3822, 0x299f_31d0]
        ),
        [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
    );
}

#[test]
fn a_dropout_mask_is_a_function_of_its_seed_and_position() {
    let mask = DropoutMask::new(0.3, 12345);
    let whole = mask.multipliers(10_007);
    // Any window drawn on its own (as a kernel tile is) is the same part of the mask.
    for (start, len) in [(0, 1), (3, 9), (1001, 333), (9_999, 8)] {
        let mut part = vec![0.0; len];
        mask.fill(start as u64, &mut part);
        assert_eq!(part, whole[start..start + len], "window at {start}");
    }
    // Element e: word e % 4 of the Philox block e / 4 under the seed, dropped below p · 2³².
    let threshold = (0.3 * 4_294_967_296.0) as u64;
    for (e, &m) in whole.iter().enumerate() {
        let word = philox([(e / 4) as u32, 0, 0, 0], [12345, 0])[e % 4];
        assert_eq!(m == 0.0, (word as u64) < threshold, "element {e}");
    }
    let scale = 1.0 / 0.7f32;
    assert!(whole.iter().all(|&m| m == 0.0 || m == scale));
    let dropped = whole.iter().filter(|&&m| m == 0.0).count() as f64 / whole.len() as f64;
    assert!((dropped - 0.3).abs() < 0.015, "dropped {dropped}");
    assert_ne!(DropoutMask::new(0.3, 12346).multipliers(64), whole[..64]);
    // The stream of masks restarts with its seed…
    reseed(9);
    let first = [next_mask(0.1), next_mask(0.1)];
    reseed(9);
    assert_eq!(first, [next_mask(0.1), next_mask(0.1)]);
    assert_ne!(first[0], first[1]);
    // …and is this thread's: another thread reseeding and drawing (a test beside this one)
    // takes nothing from it.
    reseed(9);
    let one = next_mask(0.1);
    std::thread::spawn(|| {
        reseed(1);
        next_mask(0.1)
    })
    .join()
    .unwrap();
    assert_eq!([one, next_mask(0.1)], first);
}

#[test]
fn fused_dropout_multiplies_values_and_gradients_by_its_mask() {
    fn case<B: LabAutodiff>(device: &B::Device) {
        let mask = DropoutMask::new(0.25, 4242);
        let n = 3 * 70_001; // several chunks of the flex kernel
        let x = random::<B, 1>([n], 3, device).require_grad();
        let y = Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(
            B::fused_dropout(x.clone().into_primitive().tensor(), mask),
        ));
        let w = random::<B, 1>([n], 4, device);
        let grads = (y.clone() * w.clone()).sum().backward();
        let m = Tensor::<B, 1>::from_data(TensorData::new(mask.multipliers(n), [n]), device);
        assert!(rel_diff(y, x.clone() * m.clone()) < 1e-6, "values");
        assert!(
            rel_diff(x.grad(&grads).unwrap(), (w * m).inner()) < 1e-6,
            "gradients"
        );
    }
    case::<Ad>(&Default::default());
    case::<Autodiff<NdArray>>(&Default::default());
}

#[test]
fn layer_norm_backward_adds_the_residual_gradient_row_for_row() {
    // On the calling thread (3 rows) and split across tasks (1200 rows), each task adding its
    // own rows of the residual gradient: bit for bit the LayerNorm gradient plus it.
    let d = 256;
    let wave = |i: usize, k: f32| ((i as f32 * k).sin() * 2.0) + 0.1 * (i % 7) as f32;
    for rows in [3, 1200] {
        let x: Vec<f32> = (0..rows * d).map(|i| wave(i, 0.37)).collect();
        let dy: Vec<f32> = (0..rows * d).map(|i| wave(i, 1.13)).collect();
        let residual: Vec<f32> = (0..rows * d).map(|i| wave(i, 0.53) * 10.0).collect();
        let gamma: Vec<f32> = (0..d).map(|i| 1.0 + wave(i, 0.7) / 4.0).collect();
        let (_, mean, rstd) = cpu::layer_norm(&x, d, &gamma, None, 1e-5);
        let (dx, dgamma, dbeta) = cpu::layer_norm_backward(&x, d, &gamma, &mean, &rstd, &dy, None);
        let (sum, dgamma_r, dbeta_r) =
            cpu::layer_norm_backward(&x, d, &gamma, &mean, &rstd, &dy, Some(&residual));
        for (i, ((a, r), s)) in dx.iter().zip(&residual).zip(&sum).enumerate() {
            assert_eq!((a + r).to_bits(), s.to_bits(), "element {i} of {rows} rows");
        }
        assert_eq!((dgamma, dbeta), (dgamma_r, dbeta_r));
    }
}

#[test]
fn layer_norm_gradients_are_the_same_whatever_the_threads_and_their_scheduling() {
    // dγ and dβ sum over every row; split across rayon tasks, the partial sums must be added
    // in one fixed order (a rayon fold/reduce groups them by work stealing: a run's weights
    // then differed from the last run's in the 7th digit).
    // 307,200 elements split across tasks wherever the call comes from; 98,304 (the default
    // language model's LayerNorm) split on a pool's thread and not outside one: the same tasks
    // either way, run on one thread or several.
    for (rows, d) in [(1200, 256), (768, 128)] {
        let wave = |i: usize, k: f32| ((i as f32 * k).sin() * 2.0) + 0.1 * (i % 7) as f32;
        let x: Vec<f32> = (0..rows * d).map(|i| wave(i, 0.37)).collect();
        let dy: Vec<f32> = (0..rows * d).map(|i| wave(i, 1.13)).collect();
        let gamma: Vec<f32> = (0..d).map(|i| 1.0 + wave(i, 0.7) / 4.0).collect();
        let (_, mean, rstd) = cpu::layer_norm(&x, d, &gamma, None, 1e-5);
        let run = || cpu::layer_norm_backward(&x, d, &gamma, &mean, &rstd, &dy, None);
        let backward = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(run)
        };
        let one = run(); // on this thread, outside any pool
        for threads in [1, 2, 3, 4] {
            for _ in 0..4 {
                let other = backward(threads);
                assert!(
                    one.1 == other.1 && one.2 == other.2,
                    "{rows}×{d}, {threads} threads: dγ or dβ differ"
                );
                assert!(
                    one.0 == other.0,
                    "{rows}×{d}, {threads} threads: dx differs"
                );
            }
        }
    }
}

#[test]
fn the_element_wise_product_in_place_leaves_a_shared_input_as_it_was() {
    // GELU's backward pass multiplies the incoming gradient by the kept derivative in place,
    // into whichever of the two buffers nothing else holds: never into one still in use.
    // Above and below the size that splits the work across cores, against burn's product.
    use burn::tensor::TensorPrimitive;
    let device = Default::default();
    let prim = |t: &Tensor<Flex, 2>| t.clone().into_primitive().tensor();
    for (rows, cols, seed) in [(3, 7, 1), (400, 500, 2)] {
        let a = random::<Flex, 2>([rows, cols], seed, &device);
        let b = random::<Flex, 2>([rows, cols], seed + 10, &device);
        let (a_data, b_data) = (a.to_data(), b.to_data());
        let expected = a.clone().mul(b.clone()).into_data();
        let from = |x| Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(x));
        // Both shared (their clones held here), then each alone unique, then both.
        let cases = [
            (prim(&a), prim(&b)),
            (prim(&a.clone().mul_scalar(1.0)), prim(&b)),
            (prim(&a), prim(&b.clone().mul_scalar(1.0))),
        ];
        for (i, (x, y)) in cases.into_iter().enumerate() {
            let got = from(<Flex as kernels::LabBackend>::fused_mul(x, y)).into_data();
            assert_eq!(got, expected, "{rows}×{cols}, case {i}: not burn's product");
            assert_eq!(
                a.to_data(),
                a_data,
                "{rows}×{cols}, case {i}: a shared input changed"
            );
            assert_eq!(
                b.to_data(),
                b_data,
                "{rows}×{cols}, case {i}: a shared input changed"
            );
        }
        let (x, y) = (a.clone().mul_scalar(1.0), b.clone().mul_scalar(1.0));
        let got = from(<Flex as kernels::LabBackend>::fused_mul(prim(&x), prim(&y)));
        drop((x, y));
        assert_eq!(got.into_data(), expected, "{rows}×{cols}: both unique");
    }
}

#[test]
fn clipping_sums_squares_and_rescales_like_the_composed_ops() {
    // Lengths: shorter than one 16-lane block, a ragged tail after whole blocks, and above the
    // size that splits the work across threads (several chunks, the last one ragged).
    let mut all = Vec::new();
    for (n, seed) in [(5, 1), (16 * 3 + 7, 2), (200_003, 3)] {
        // Magnitudes from 10⁻² to 10² by chunk of 16,384: added in another order, the chunks'
        // sums round differently.
        let x: Vec<f32> = random::<Flex, 1>([n], seed, &Default::default())
            .into_data()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, v)| v * 10f32.powi((i / 16_384 % 5) as i32 - 2))
            .collect();
        let t = Tensor::<Flex, 1>::from_floats(x.as_slice(), &Default::default());
        // Against the sum in f64, term by term.
        let exact: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
        let sum = cpu::sum_squares(&x);
        assert!(
            ((sum as f64 - exact) / exact).abs() < 1e-6,
            "n = {n}: Σx² = {sum}, in f64 {exact}"
        );
        // The same bits whatever the threads and their scheduling.
        for threads in [1, 2, 3, 4] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for _ in 0..4 {
                let again = pool.install(|| cpu::sum_squares(&x));
                assert_eq!(sum.to_bits(), again.to_bits(), "n = {n}, {threads} threads");
            }
        }
        // Through the backend, fused and composed, on a matrix's gradient shape.
        let m = t.clone().reshape([1, n]);
        let [fused, composed] = [true, false].map(|on| {
            with_fused(on, || {
                kernels::sum_squares_all::<Flex>(vec![m.clone().into_primitive().tensor()])
                    .into_scalar()
            })
        });
        // Each against the sum in f64: the fused kernel as tightly as above; the composed op
        // is burn's own f32 sum, whose rounding depends on the processor's vector width (on an
        // AVX2-only Zen 3 it is 1.4·10⁻⁶ off at n = 200,003), so it gets an f32 running sum's
        // error bound instead.
        assert!(
            ((fused as f64 - exact) / exact).abs() < 1e-6,
            "n = {n}: fused {fused}, in f64 {exact}"
        );
        assert!(
            ((composed as f64 - exact) / exact).abs() < 1e-5,
            "n = {n}: composed {composed}, in f64 {exact}"
        );
        // The rescale is one multiplication per element: the composed op's bits exactly.
        for factor in [0.37f32, 1.0, f32::NAN] {
            let s = Tensor::<Flex, 1>::from_floats([factor], &Default::default());
            let [fused, composed] = [true, false].map(|on| {
                let y = with_fused(on, || kernels::scale(m.clone(), s.clone()));
                assert_eq!(y.dims(), [1, n]);
                y.into_data().to_vec::<f32>().unwrap()
            });
            let by_hand: Vec<f32> = x.iter().map(|v| v * factor).collect();
            for (which, y) in [("fused", &fused), ("composed", &composed)] {
                let same = y
                    .iter()
                    .zip(&by_hand)
                    .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
                assert!(
                    same,
                    "n = {n}, factor {factor}: {which} rescale differs from x·s"
                );
            }
        }
        all.push(x);
    }
    // All three in one pass: the bits of each one's sum added in order, on any thread count.
    let each: f32 = all
        .iter()
        .map(|x| cpu::sum_squares(x))
        .reduce(|a, b| a + b)
        .unwrap();
    let slices: Vec<cpu::Strided> = all.iter().map(|x| x.as_slice().into()).collect();
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let together = pool.install(|| cpu::sum_squares_all(&slices));
        assert_eq!(together.to_bits(), each.to_bits(), "{threads} threads");
    }
}

/// Everything the fused kernels compute for one small training run and a set of direct calls:
/// the losses and final weights of three dropout-on training steps of the small model (LayerNorm,
/// packed causal attention with dropout, GELU, linear layers, cross-entropy, AdamW), and the
/// outputs of kernels called on sizes with ragged tails and above the size that splits work
/// across threads.
fn everything_the_cpu_kernels_compute() -> Vec<Vec<f32>> {
    let device = Default::default();
    let mut config = small_lm();
    config.stack.dropout = 0.1;
    let model: LanguageModel<Ad> = crate::common::explicit_weights(config.init(&device), 7);
    reseed(5); // the same dropout masks in every run
    let optim = ReferenceOptimizer::lab_adamw(LabAdamW::new(0.9, 0.99, 1e-8, 0.1), 1.0);
    let (losses, model, _) = with_fused(true, || steps_with(model, optim, 3));
    let mut out = vec![losses];
    let mut weights = Weights(Vec::new());
    model.visit(&mut weights);
    out.extend(weights.0);

    let big = random_values(768 * 200 + 5, 1); // above the threads' split, a ragged tail
    let (gelu, derivative) = cpu::gelu_with_derivative(&big, None);
    out.extend([cpu::gelu(&big), gelu, derivative]);
    let mut scaled = big.clone();
    cpu::scale(&mut scaled, 0.37);
    out.extend([vec![cpu::sum_squares(&big)], scaled]);
    let d = 131; // LayerNorm rows with a tail of 3 after the 16-lane chunks
    let rows = &big[..d * 1100]; // above the split too
    let gamma = random_values(d, 2);
    let (y, mean, rstd) = cpu::layer_norm(rows, d, &gamma, Some(&gamma), 1e-5);
    let (dx, dg, db) =
        cpu::layer_norm_backward(rows, d, &gamma, &mean, &rstd, &big[5..5 + rows.len()], None);
    out.extend([y, mean, rstd, dx, dg, db]);
    let p = cpu::softmax(rows, d);
    out.push(cpu::softmax_backward(&p, &big[7..7 + rows.len()], d));
    out.push(p);
    let targets: Vec<usize> = (0..1100).map(|i| i * 31 % d).collect();
    let (loss, lse) = cpu::cross_entropy(rows, d, &targets, 0.1, Some(3));
    out.push(cpu::cross_entropy_backward(
        rows,
        d,
        &targets,
        &lse,
        &loss,
        0.1,
        Some(3),
    ));
    out.extend([loss, lse]);
    // Padded, non-causal attention with dropout, 70 keys: two tiles, the second ragged.
    let shape = cpu::AttentionShape {
        b: 2,
        h: 3,
        t: 70,
        s: 70,
        k: 20,
    };
    let n = 2 * 70 * 3 * 20;
    let (q, k, v, d_o) = (
        random_values(n, 3),
        random_values(n, 4),
        random_values(n, 5),
        random_values(n, 6),
    );
    let pad: Vec<f32> = (0..140)
        .map(|j| if j % 70 > 60 { 1.0 } else { 0.0 })
        .collect();
    let mask = Some(DropoutMask::new(0.2, 11));
    let inputs = [&q[..], &k, &v, &d_o];
    out.extend(cpu_attention(shape, inputs, false, Some(&pad), mask));
    // Causal without padding, the same shape: the tiles' products skip what the mask hides.
    out.extend(cpu_attention(shape, inputs, true, None, mask));
    // Short unmasked heads, their forward pass sixteen at a time in lanes (a last group of 4),
    // more keys than queries: 20 wide, and 12.
    for k in [20, 12] {
        let shape = cpu::AttentionShape {
            b: 5,
            h: 4,
            t: 17,
            s: 19,
            k,
        };
        assert!(cpu::heads_in_lanes(shape));
        let (nq, nk) = (5 * 17 * 4 * k, 5 * 19 * 4 * k);
        let inputs = [
            &big[..nq],
            &big[1..1 + nk],
            &big[2..2 + nk],
            &big[3..3 + nq],
        ];
        out.extend(cpu_attention(shape, inputs, false, None, None));
    }
    out
}

/// Every float parameter's values, in the module's order.
struct Weights(Vec<Vec<f32>>);

impl<B: Backend> ModuleVisitor<B> for Weights {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(param.val().into_data().to_vec().unwrap());
    }
}

#[test]
fn each_instruction_set_the_processor_offers_gives_the_same_bits() {
    // The kernels are built for AVX-512, AVX2 and the baseline and the widest the processor has
    // runs; the forms compute the same operations in the same order, so a run must not depend
    // on the machine's vector width. Compared with the baseline form, bit for bit.
    let forms: Vec<cpu::Isa> = cpu::Isa::ALL
        .into_iter()
        .filter(|isa| isa.available())
        .collect();
    let run = |isa| {
        cpu::Isa::force(Some(isa));
        let out = everything_the_cpu_kernels_compute();
        cpu::Isa::force(None);
        out
    };
    let baseline = run(cpu::Isa::Baseline);
    assert!(baseline.iter().all(|v| v.iter().all(|x| x.is_finite())));
    for isa in forms {
        let out = run(isa);
        assert_eq!(out.len(), baseline.len());
        for (i, (a, b)) in out.iter().zip(&baseline).enumerate() {
            let differ = differing_bits(a, b);
            assert!(
                a.len() == b.len() && differ == 0,
                "{isa:?}: output {i}: {differ} of {} values differ from the baseline form's",
                a.len()
            );
        }
    }
    if std::env::var("CI_EXPECT_AVX512").is_ok_and(|v| v == "1") {
        assert!(
            cpu::Isa::Avx512.available(),
            "CI_EXPECT_AVX512=1 but this processor has no AVX-512"
        );
    }
}

#[test]
fn a_post_norm_stack_normalises_with_its_own_epsilon_fused_or_not() {
    // BERT's stack: post-norm, ε 1e-12. With a large ε the choice shows in every output; the
    // fused kernel and burn's LayerNorm must both use the config's, and it must differ from
    // burn's default.
    let device = Default::default();
    let stack = |epsilon: f64| transformer_lab::nn::StackConfig {
        d_model: 16,
        n_heads: 2,
        norm_first: false,
        norm_epsilon: epsilon,
        ..Default::default()
    };
    let x = random::<Ad, 3>([2, 5, 16], 61, &device);
    let out = |stack: &transformer_lab::nn::TransformerStack<Ad>, fused| {
        with_fused(fused, || stack.forward(x.clone(), None, None).x)
    };
    let wide = stack(0.5).encoder(2, 8).init::<Ad>(&device);
    // (The first forward pass draws the lazily initialised weights; the copy takes them after.)
    let (fused, composed) = (out(&wide, true), out(&wide, false));
    assert!(
        rel_diff(fused.clone(), composed) < 1e-5,
        "fused and composed differ"
    );
    let plain = stack(kernels::LAYER_NORM_EPSILON)
        .encoder(2, 8)
        .init::<Ad>(&device)
        .load_record(wide.clone().into_record());
    assert!(
        rel_diff(fused, out(&plain, true)) > 1e-2,
        "ε 0.5 normalises as ε 1e-5 does"
    );
}

/// Times the threads of `pool` have gone to sleep (blocked) so far, from Linux's per-thread
/// `voluntary_ctxt_switches`.
#[cfg(target_os = "linux")]
fn sleeps(pool: &rayon::ThreadPool) -> u64 {
    let tasks = pool.broadcast(|_| std::fs::read_link("/proc/thread-self").unwrap());
    tasks
        .iter()
        .map(|task| {
            let status =
                std::fs::read_to_string(std::path::Path::new("/proc").join(task).join("status"))
                    .unwrap_or_else(|err| panic!("{}: {err}", task.display()));
            let line = status
                .lines()
                .find_map(|line| line.strip_prefix("voluntary_ctxt_switches:"))
                .expect("a voluntary_ctxt_switches line");
            line.trim().parse::<u64>().unwrap()
        })
        .sum()
}

#[test]
#[cfg(target_os = "linux")]
fn idle_workers_stay_awake_between_a_steps_parallel_passes() {
    // A training step hands work to the other cores about a hundred times, between stretches
    // of serial work (autodiff's bookkeeping, small passes) of tens to hundreds of µs. rayon's
    // published workers look for work for ~32 rounds (~22 µs on a 2-core cloud processor)
    // and then sleep, and waking one costs more than the work it is woken for (a step took 9%
    // longer); the vendored rayon-core searches ~2000 rounds first (vendor/README.md). Here:
    // 200 parallel passes, each after 100 µs of serial work. On a quiet machine the published
    // rayon-core sleeps in nearly every gap (186–200 sleeps measured); ours stays awake through
    // them (0). On a busy machine each round's `yield_now` can hand the core away for a whole
    // time slice, so even the published one rarely sleeps there, while ours sleeps now and then
    // (51 times, measured with the other test thread and lavapipe's compiler running beside
    // it): this test tells the two apart only where the machine is quiet, and must pass
    // everywhere. So it passes when one of three tries stays under half the published one's
    // least (93).
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let spin = |micros: u64| {
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_micros(micros) {
            std::hint::spin_loop();
        }
    };
    let mut counts = Vec::new();
    for _ in 0..3 {
        // Start both threads, then count from a quiet moment.
        pool.install(|| rayon::join(|| spin(50), || spin(50)));
        let before = sleeps(&pool);
        pool.install(|| {
            for _ in 0..200 {
                spin(100);
                rayon::join(|| spin(5), || spin(5));
            }
        });
        let slept = sleeps(&pool) - before;
        if slept < 93 {
            return;
        }
        counts.push(slept);
    }
    panic!("the pool's workers slept {counts:?} times in three tries of 200 gaps of 100 µs");
}
