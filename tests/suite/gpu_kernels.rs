//! Our CubeCL kernels (src/kernels/cube) on the wgpu backend — lavapipe in CI — against the
//! composed forms they replace, values and gradients, on the cases the CPU kernels are held to:
//! odd sizes, fully masked rows, several key tiles, strided heads, dropout drawn in the kernel.
//! Each test also checks that our kernels ran (a silent fallback to the composed form would pass
//! the comparisons without testing anything). The attention tests compute the composed form on
//! the CPU from the same values ([`compare_with_host`]): on lavapipe its kernels took longer to
//! compile than ours.

use crate::kernels::{
    add_layer_norm_case, assert_close, attention_case, compare, compare_with_host,
    gelu_dropout_case, layer_norm_case, padding, rel_diff, targets,
};
use crate::wgpu_backend::wgpu_turn;
use burn::backend::{Autodiff, Wgpu};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType, TensorPrimitive};
use transformer_lab::kernels::{
    self, cube, with_fused, with_precision, AdamWStep, DropoutMask, LabBackend, Precision,
};

type Inner = Wgpu<f32, i32>;
type Gpu = Autodiff<Inner>;

use crate::common::normal as random;

/// Runs `f` and what it queued (with fusion, operations run when the stream is flushed) →
/// its result and how many of our kernels it launched.
fn counted<R>(f: impl FnOnce() -> R) -> (R, u64) {
    let before = cube::launches();
    let out = f();
    Inner::sync(&Default::default()).unwrap();
    (out, cube::launches() - before)
}

/// Runs `f` and asserts that it launched at least `expected` of our kernels.
fn launching<R>(expected: u64, f: impl FnOnce() -> R) -> R {
    let (out, ran) = counted(f);
    assert!(
        ran >= expected,
        "{ran} of our kernels ran, expected {expected}"
    );
    out
}

#[test]
fn gpu_launches_count_for_the_thread_whose_work_they_do() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    // Kernels another thread queues (fusion runs them on the device's thread) are that
    // thread's: a test here never sees them as its own.
    let before = cube::launches();
    let theirs = std::thread::spawn(|| {
        launching(1, || {
            let x = random::<Gpu, 2>([8, 33], 11, &Default::default());
            kernels::gelu(x).into_data()
        });
        cube::launches()
    })
    .join()
    .unwrap();
    Inner::sync(&Default::default()).unwrap();
    assert!(theirs >= 1);
    assert_eq!(
        cube::launches(),
        before,
        "another thread's launches were counted here"
    );
    // …and this thread's own are.
    launching(1, || {
        kernels::gelu(random::<Gpu, 2>([8, 33], 12, &Default::default()))
    });
}

#[test]
fn gpu_gelu_and_dropout_equal_the_composed_forms() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let device = Default::default();
    let x = random::<Gpu, 3>([3, 37, 29], 1, &device).mul_scalar(3.0);
    // Under autodiff the forward kernel also writes GELU's derivative, which the backward pass
    // multiplies in: one launch. The backward kernel (for backends that keep no derivative) is
    // held to the composed gradient directly.
    let case = launching(1, || compare([x.clone()], |[x]| kernels::gelu(x)));
    assert_close("gelu", case, 1e-5);
    let w = random::<Gpu, 3>([3, 37, 29], 2, &device);
    let leaf = x.clone().require_grad();
    let grads = with_fused(false, || {
        (kernels::gelu(leaf.clone()) * w.clone()).sum().backward()
    });
    let expected = leaf.grad(&grads).unwrap();
    let dx = launching(1, || {
        Tensor::<Inner, 3>::from_primitive(TensorPrimitive::Float(Inner::fused_gelu_backward(
            x.inner().into_primitive().tensor(),
            w.inner().into_primitive().tensor(),
        )))
    });
    let diff = rel_diff(dx, expected);
    assert!(diff < 1e-5, "GELU's backward kernel differs by {diff}");

    // Dropout: the kernel draws element e of the mask from Philox in the shader; it must be the
    // CPU stream's element e, values and gradients.
    let mask = DropoutMask::new(0.25, 4242);
    let n = 70_001;
    let x = random::<Gpu, 1>([n], 3, &device).require_grad();
    let w = random::<Gpu, 1>([n], 4, &device);
    let (y, dx) = launching(2, || {
        let y = Tensor::<Gpu, 1>::from_primitive(TensorPrimitive::Float(Gpu::fused_dropout(
            x.clone().into_primitive().tensor(),
            mask,
        )));
        let grads = (y.clone() * w.clone()).sum().backward();
        (y, x.grad(&grads).unwrap())
    });
    let m = Tensor::<Gpu, 1>::from_data(TensorData::new(mask.multipliers(n), [n]), &device);
    assert!(rel_diff(y, x.clone() * m.clone()) < 1e-6, "dropout values");
    assert!(
        rel_diff(dx, (w.clone() * m.clone()).inner()) < 1e-6,
        "dropout gradients"
    );

    // The residual form `r + x ⊙ M` in one kernel: the same mask, r's gradient passed through,
    // x's masked (the backward pass is the dropout kernel).
    let r = random::<Gpu, 1>([n], 5, &device).require_grad();
    let (y, dr, dx) = launching(2, || {
        let y = Tensor::<Gpu, 1>::from_primitive(TensorPrimitive::Float(Gpu::fused_dropout_add(
            r.clone().into_primitive().tensor(),
            x.clone().into_primitive().tensor(),
            mask,
        )));
        let grads = (y.clone() * w.clone()).sum().backward();
        (y, r.grad(&grads).unwrap(), x.grad(&grads).unwrap())
    });
    assert!(
        rel_diff(y, r.clone() + x.clone() * m.clone()) < 1e-6,
        "dropout_add values"
    );
    assert!(
        rel_diff(dr, w.clone().inner()) < 1e-6,
        "dropout_add: r's gradient"
    );
    assert!(
        rel_diff(dx, (w * m).inner()) < 1e-6,
        "dropout_add: x's gradient"
    );
}

#[test]
fn gpu_adamw_equals_the_composed_step() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let device = Default::default();
    let shape = [37, 29];
    let param = random::<Inner, 2>(shape, 1, &device);
    let grad = random::<Inner, 2>(shape, 2, &device).mul_scalar(0.1);
    // A gradient the kernel reads at its strides: a transposed view, [37, 29] of a [29, 37].
    let strided = random::<Inner, 2>([29, 37], 5, &device)
        .mul_scalar(0.1)
        .transpose();
    let moments = (
        random::<Inner, 2>(shape, 3, &device).mul_scalar(0.01),
        random::<Inner, 2>(shape, 4, &device)
            .abs()
            .mul_scalar(0.001),
    );
    let step = |time| AdamWStep {
        lr: 3e-3,
        beta_1: 0.9,
        beta_2: 0.99,
        epsilon: 1e-8,
        weight_decay: 0.1,
        time,
    };
    let cases = [
        (None, 1, &grad, None),
        (Some(moments), 7, &grad, None),
        (None, 1, &strided, Some(0.37)),
    ];
    for (moments, time, grad, clip) in cases {
        let clip = || clip.map(|c| Tensor::<Inner, 1>::from_floats([c], &device));
        let run = |on: bool| {
            with_fused(on, || {
                kernels::adamw(
                    param.clone(),
                    grad.clone(),
                    moments.clone(),
                    step(time),
                    clip(),
                )
            })
        };
        let (p1, m1, v1) = launching(1, || run(true));
        let (p2, m2, v2) = run(false);
        for (what, a, b) in [("parameter", p1, p2), ("m", m1, m2), ("v", v1, v2)] {
            let diff = rel_diff(a, b);
            assert!(diff < 1e-6, "AdamW step {time}: {what} differs by {diff}");
        }
    }
}

#[test]
fn gpu_adamw_over_many_parameters_takes_few_launches() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let (count, ran) = counted(|| crate::kernels::adamw_all_case::<Inner>(&Default::default()));
    // The case's composed steps launch none of ours; the fused step over all takes as many
    // parameters a launch as the device's binding limit allows, seven bindings each: 4 on
    // lavapipe (about 30 bindings), 32 (the most) on CUDA (1,024).
    assert!(
        (1..=count.div_ceil(4) as u64).contains(&ran),
        "{ran} launches for {count} parameters"
    );
}

/// A key–value cache's appends on the GPU: keys and values written in one launch (in place,
/// into buffers that grow), the live columns exactly those appended, through 300 appends, drops
/// from the front and a beam's choice of rows.
#[test]
fn gpu_key_value_columns_hold_what_was_appended_with_one_launch_an_append() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let (pushes, ran) = counted(|| crate::cache::columns_case::<Inner>(&Default::default()));
    // One launch an append, and one a reallocation (at most 12).
    assert!(
        (pushes as u64..=pushes as u64 + 12).contains(&ran),
        "{ran} launches for {pushes} appends"
    );
}

#[test]
fn gpu_global_sum_of_squares_equals_the_sum_in_f64() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let device = Default::default();
    // Several cubes' worth (200,000 elements), one element, a transposed view and the left half
    // of a matrix's columns (a view with gaps): each tensor is read where it lies, every
    // element once.
    let big = random::<Inner, 1>([200_000], 6, &device);
    let one = random::<Inner, 1>([1], 7, &device);
    let transposed = random::<Inner, 2>([33, 70], 8, &device).transpose();
    let sliced = random::<Inner, 2>([64, 128], 9, &device).slice([0..64, 0..64]);
    let values = |t: Vec<f32>| t.iter().map(|&v| v as f64 * v as f64).sum::<f64>();
    let exact = values(big.to_data().to_vec().unwrap())
        + values(one.to_data().to_vec().unwrap())
        + values(transposed.to_data().to_vec().unwrap())
        + values(sliced.to_data().to_vec().unwrap());
    let prims = || {
        vec![
            big.clone().into_primitive().tensor(),
            one.clone().into_primitive().tensor(),
            transposed.clone().into_primitive().tensor(),
            sliced.clone().into_primitive().tensor(),
        ]
    };
    // One partial-sum launch for the four and one adding them up.
    let fused: f32 = launching(2, || {
        with_fused(true, || {
            kernels::sum_squares_all::<Inner>(prims()).into_scalar()
        })
    });
    let composed: f32 = with_fused(false, || {
        kernels::sum_squares_all::<Inner>(prims()).into_scalar()
    });
    for (what, sum) in [("fused", fused), ("composed", composed)] {
        let error = (sum as f64 - exact).abs() / exact;
        assert!(error < 1e-5, "{what}: Σx² = {sum}, in f64 {exact}");
    }
    // The same bits every time: the partial sums are added in a fixed order.
    for _ in 0..3 {
        let again: f32 = with_fused(true, || {
            kernels::sum_squares_all::<Inner>(prims()).into_scalar()
        });
        assert_eq!(again.to_bits(), fused.to_bits());
    }
    // 40 gradients: two launches of partial sums (32 a launch at most) and the addition, every
    // element counted once.
    let many: Vec<Tensor<Inner, 2>> = (0..40)
        .map(|i| random::<Inner, 2>([1 + i % 7, 3 + i * 11], 20 + i as u64, &device))
        .collect();
    let exact: f64 = many
        .iter()
        .map(|t| values(t.to_data().to_vec().unwrap()))
        .sum();
    let (sum, ran): (f32, _) = counted(|| {
        with_fused(true, || {
            let prims = many.iter().map(|t| t.clone().into_primitive().tensor());
            kernels::sum_squares_all::<Inner>(prims.collect()).into_scalar()
        })
    });
    assert_eq!(ran, 3);
    let error = (sum as f64 - exact).abs() / exact;
    assert!(error < 1e-5, "40 gradients: Σx² = {sum}, in f64 {exact}");
}

/// Runs `check` with the row kernels (LayerNorm, the cross-entropy) in each form: a plane a row,
/// as lavapipe's planes allow, then a cube a row, as where planes cannot add up. The caller
/// holds the GPU turn, which keeps the other GPU tests from seeing the forced form.
fn in_both_row_forms(check: impl Fn(&str)) {
    struct Unforce;
    impl Drop for Unforce {
        fn drop(&mut self) {
            cube::force_cube_rows(false);
        }
    }
    let _unforce = Unforce;
    let device = Default::default();
    let in_planes = |d| cube::rows_in_planes::<cubecl::wgpu::WgpuRuntime>(&device, d);
    assert!(
        in_planes(1000) && !in_planes(4000),
        "a plane a row up to 2,048 columns"
    );
    check("a plane a row");
    cube::force_cube_rows(true);
    assert!(!in_planes(1000));
    check("a cube a row");
}

#[test]
fn gpu_layer_norm_equals_burns() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let device = Default::default();
    // 900 rows of 200: several units per row (200 is no multiple of a plane's width), rows not a
    // multiple of a cube's, and 15 gradient chunks of 64 rows, more than the 8 units that add
    // up a column's chunks.
    in_both_row_forms(|_| {
        for bias in [true, false] {
            launching(4, || layer_norm_case::<Gpu>([3, 300, 200], bias, &device));
        }
    });
}

#[test]
fn gpu_gelu_and_the_dropout_after_it_in_one_kernel_equal_them_apart() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    launching(1, || {
        gelu_dropout_case::<Gpu>([3, 37, 29], 1e-6, 1e-6, &Default::default())
    });
}

#[test]
fn gpu_residual_addition_and_layer_norm_in_one_kernel_equal_them_apart() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let device = Default::default();
    // Rows of 200 (several units per row); the fused form alone launches one kernel forward.
    in_both_row_forms(|_| {
        launching(1, || {
            add_layer_norm_case::<Gpu>([3, 100, 200], 1e-6, &device)
        });
    });
    let x = random::<Inner, 2>([300, 200], 1, &device);
    let norm = burn::nn::LayerNormConfig::new(200).init::<Inner>(&device);
    let kept = burn::nn::DropoutConfig::new(0.0).init();
    let before = cube::launches();
    let (sum, y) = kernels::add_layer_norm(&kept, x.clone(), x, &norm, 1e-5);
    let _ = (sum.into_data(), y.into_data());
    assert_eq!(
        cube::launches() - before,
        1,
        "one launch for the sum and its LayerNorm"
    );
}

#[test]
fn gpu_cross_entropy_equals_the_composed_form() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let device = Default::default();
    in_both_row_forms(|form| {
        for (n, v, smoothing, ignore) in [
            (7, 3, 0.0, None),
            (12, 65, 0.0, None),
            (10, 1000, 0.1, Some(0)),
            (6, 17, 0.3, Some(16)),
        ] {
            let x = random::<Gpu, 2>([n, v], 8, &device).mul_scalar(3.0);
            let y = targets::<Gpu>(n, v, ignore, &device);
            let case = launching(2, || {
                compare([x], |[x]| {
                    kernels::cross_entropy(x, y.clone(), smoothing, ignore).unsqueeze_dim(1)
                })
            });
            let what = format!("cross-entropy {n}×{v}, ε {smoothing}, {form}");
            assert_close(&what, case, 1e-5);
        }
    });
}

#[test]
fn gpu_attention_equals_the_composed_form() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let device = Default::default();
    let cases: &[([usize; 5], bool, &[usize], &str)] = &[
        ([2, 3, 70, 70, 8], true, &[], "causal, three key tiles"),
        // Rows that see only padding attend to every key, past their diagonal too: the forward
        // visits those tiles only for a cube holding such a row (here all of batch item 0).
        (
            [2, 2, 70, 70, 8],
            true,
            &[70, 5],
            "causal over three tiles, one batch item all padding",
        ),
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
        (
            [2, 1, 6, 6, 3],
            true,
            &[6, 0],
            "causal, every key of one row padded",
        ),
        // The widest head here: lavapipe compiles a 64-wide one (the common GPU width, which
        // `doctor` and the cuda tests check on a real GPU) for 167 s, this one for 46 s.
        ([1, 1, 40, 40, 32], false, &[], "a 32-wide head"),
        ([1, 1, 1, 1, 1], true, &[], "one position"),
        // One query row per head (a decoding step; without dropout the decoding kernel, which
        // deals the keys out to its units): more keys than units and a fully padded row, fewer
        // keys than units, a wide head. The gradients check its log-sum-exp.
        (
            [3, 2, 1, 131, 4],
            false,
            &[0, 7, 131],
            "one query, a fully padded row",
        ),
        (
            [2, 3, 1, 20, 8],
            false,
            &[0, 5],
            "one query, fewer keys than units",
        ),
        ([1, 2, 1, 70, 32], false, &[], "one query, a 32-wide head"),
    ];
    let mask = DropoutMask::new(0.3, 77);
    for dropout in [None, Some(mask)] {
        for &(shape, causal, padded, what) in cases {
            // Lavapipe's LLVM takes minutes to compile the 64-wide kernels with the Philox
            // rounds inlined; dropout does not depend on the head width, the narrow heads test it.
            if dropout.is_some() && shape[4] > 8 {
                continue;
            }
            let case = launching(3, || {
                attention_case::<Gpu>(shape, causal, padded, dropout, &device)
            });
            assert_close(&format!("{what}, dropout {dropout:?}"), case, 2e-5);
        }
    }
}

#[test]
fn gpu_attention_in_tiles_equals_the_composed_form() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    // Heads 16, 32 or 64 wide run the tiled forward kernel (products of tiles; see
    // `attention_forward_tiles_kernel`); lavapipe compiles a 16-wide one soonest. Key counts not
    // a multiple of 4 make a unit's four keys straddle two Philox blocks.
    let device = Default::default();
    assert!(cube::attention_in_tiles::<cubecl::wgpu::WgpuRuntime>(
        &device, 16
    ));
    let cases: &[([usize; 5], bool, &[usize], &str)] = &[
        ([2, 3, 70, 70, 16], true, &[], "causal, three key tiles"),
        (
            [2, 2, 70, 70, 16],
            true,
            &[70, 5],
            "causal over three tiles, one batch item all padding",
        ),
        (
            [3, 2, 37, 131, 16],
            false,
            &[0, 7, 131],
            "cross over five key tiles, a fully padded batch item",
        ),
        (
            [2, 1, 6, 6, 16],
            true,
            &[6, 0],
            "causal, every key of one row padded",
        ),
    ];
    for dropout in [None, Some(DropoutMask::new(0.3, 77))] {
        for &(shape, causal, padded, what) in cases {
            let case = launching(3, || {
                attention_case::<Gpu>(shape, causal, padded, dropout, &device)
            });
            assert_close(&format!("{what}, dropout {dropout:?}"), case, 2e-5);
        }
    }
}

#[test]
fn gpu_attention_with_rows_shared_among_units_equals_the_composed_form() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    // The tile kernels (forward and backward) share a row among 2, 4 or 8 units where a head
    // is 32, 64 or 128 wide (each unit every split-th column, the dot products added through
    // plane shuffles); lavapipe takes minutes to compile those widths, so each split is forced
    // here on 8-wide heads. The turn keeps the other GPU tests of this process from seeing the forced split.
    struct Unforce;
    impl Drop for Unforce {
        fn drop(&mut self) {
            cube::force_attention_row_split(None);
        }
    }
    let _unforce = Unforce;
    let device = Default::default();
    let cases: &[([usize; 5], bool, &[usize], &str)] = &[
        ([2, 3, 70, 70, 8], true, &[], "causal, three key tiles"),
        (
            [2, 2, 70, 70, 8],
            true,
            &[70, 5],
            "causal over three tiles, one batch item all padding",
        ),
        (
            [3, 2, 5, 131, 8],
            false,
            &[0, 7, 131],
            "cross, a fully padded row",
        ),
        (
            [2, 1, 6, 6, 8],
            true,
            &[6, 0],
            "causal, every key of one row padded",
        ),
    ];
    for split in [2, 4, 8] {
        cube::force_attention_row_split(Some(split));
        for dropout in [None, Some(DropoutMask::new(0.3, 77))] {
            for &(shape, causal, padded, what) in cases {
                let case = launching(3, || {
                    attention_case::<Gpu>(shape, causal, padded, dropout, &device)
                });
                assert_close(
                    &format!("{split} units a row: {what}, dropout {dropout:?}"),
                    case,
                    2e-5,
                );
            }
        }
    }
}

#[test]
fn gpu_packed_self_attention_equals_the_composed_form() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    // Q, K and V read in place from one [b, t, 3·d] tensor; the output written with its heads
    // merged and the gradient into one [b, t, 3·d] buffer.
    let device = Default::default();
    let cases: &[([usize; 4], bool, &[usize], &str)] = &[
        ([2, 70, 3, 8], true, &[], "causal, three key tiles"),
        (
            [2, 37, 2, 16],
            true,
            &[0, 30],
            "causal with padding, 16-wide heads (the tiled kernels)",
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
    ];
    let cases = cases
        .iter()
        .flat_map(|&case| [(case, None), (case, Some(DropoutMask::new(0.2, 5)))]);
    for (([b, t, h, k], causal, padded, what), dropout) in cases {
        let qkv = random::<Gpu, 3>([b, t, 3 * h * k], 31, &device);
        let pad = padding::<Gpu>(b, t, padded, &device);
        let host_pad = padding(b, t, padded, &Default::default());
        let case = launching(3, || {
            compare_with_host(
                [qkv],
                |[qkv]| kernels::packed_self_attention(qkv, h, causal, pad.as_ref(), dropout),
                |[qkv]| kernels::packed_self_attention(qkv, h, causal, host_pad.as_ref(), dropout),
            )
        });
        assert_close(&format!("{what}, dropout {dropout:?}"), case, 2e-5);
    }
}

/// `max |a − b| / max |b|`: relative to the size of `b` however small (gradients here are
/// ~1e-7).
fn relative<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> f32 {
    assert_eq!(a.dtype(), DType::F32, "f32 results");
    let a: Vec<f32> = a.into_data().to_vec().unwrap();
    let b: Vec<f32> = b.into_data().to_vec().unwrap();
    // Checked before the folds: `f32::max` drops a NaN, so a NaN difference would vanish.
    assert!(
        a.iter().chain(&b).all(|x| x.is_finite()),
        "non-finite values"
    );
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let worst = a
        .iter()
        .zip(&b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(scale > 0.0);
    worst / scale
}

/// The linear layer's value and gradients `[y, dx, dw, db]` in `precision`, for the output
/// gradient `g`.
fn linear_case(
    precision: Precision,
    [x, w, g]: [&Tensor<Gpu, 2>; 3],
    b: &Tensor<Gpu, 1>,
) -> [Tensor<Inner, 2>; 4] {
    with_precision(precision, || {
        let (x, w, b) = (
            x.clone().require_grad(),
            w.clone().require_grad(),
            b.clone().require_grad(),
        );
        let y = kernels::product(x.clone(), w.clone(), Some(b.clone()));
        let grads = (y.clone() * g.clone()).sum().backward();
        [
            y.inner(),
            x.grad(&grads).unwrap(),
            w.grad(&grads).unwrap(),
            b.grad(&grads).unwrap().unsqueeze(),
        ]
    })
}

#[test]
fn gpu_half_precision_linear_is_f32_out_and_keeps_small_gradients() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let device = Default::default();
    // lavapipe has 16-bit floats (shaderFloat16), so CI tests f16.
    assert!(Inner::mixed_precision(&device, FloatDType::F16));
    let x = random::<Gpu, 2>([70, 48], 11, &device);
    let w = random::<Gpu, 2>([48, 33], 12, &device).mul_scalar(0.2);
    let b = random::<Gpu, 1>([33], 13, &device);
    // An output gradient around 1e-7, below f16's smallest normal number (6.1e-5): cast as it
    // is, it loses most of its digits (the test's gradients would fail without the scaling).
    let g = random::<Gpu, 2>([70, 33], 14, &device).mul_scalar(1e-7);
    let naive = g.clone().cast(FloatDType::F16).cast(FloatDType::F32);
    assert!(
        relative(naive, g.clone()) > 0.01,
        "the gradient is f16-small"
    );

    // Inputs rounded to the half type's significant bits (11 for f16, 8 for bf16), products
    // accumulated in f32 (f16 measured: 3e-4); the rounding shows (the products did run in the
    // half type), except in db, a sum of the f32 gradient.
    let compare = |precision: Precision, tolerance: f32| {
        let exact = linear_case(Precision::F32, [&x, &w, &g], &b);
        let half = linear_case(precision, [&x, &w, &g], &b);
        for (name, (half, exact)) in ["y", "dx", "dw", "db"]
            .iter()
            .zip(half.into_iter().zip(exact))
        {
            let diff = relative(half, exact);
            assert!(diff < tolerance, "{precision:?} {name} differs by {diff}");
            assert!(
                *name == "db" || diff > 1e-5,
                "{precision:?} {name} equals f32's: {diff}"
            );
        }
    };
    compare(Precision::F16, 2e-3);

    // bf16 where the device has it (not on lavapipe: WGSL has no bf16), else one clear error.
    if Inner::mixed_precision(&device, FloatDType::BF16) {
        compare(Precision::Bf16, 2e-2);
    } else {
        let err = kernels::use_precision::<Gpu>(Precision::Bf16, &device).unwrap_err();
        assert!(err.to_string().contains("not supported"), "{err}");
        assert_eq!(kernels::precision(), Precision::F32);
    }
}

/// Under a half precision the layer keeps the half copies its product read for the backward
/// pass (which then casts neither operand again): the kept operands are the inputs rounded to
/// f16, the output is f32 and the same as without keeping, and the gradients from the kept
/// operands equal those from the f32 ones (the backward pass rounds them the same way).
#[test]
fn gpu_half_precision_linear_keeps_the_half_operands_for_the_backward_pass() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let device = Default::default();
    let float = |t: Tensor<Inner, 2>| t.into_primitive().tensor();
    let back = |x| Tensor::<Inner, 2>::from_primitive(TensorPrimitive::Float(x));
    let x = random::<Inner, 2>([70, 48], 21, &device);
    // The weight a transposed view, as a tied output layer's is.
    let w = random::<Inner, 2>([33, 48], 22, &device)
        .mul_scalar(0.2)
        .transpose();
    let b = random::<Inner, 1>([33], 23, &device);
    let dy = random::<Inner, 2>([70, 33], 24, &device).mul_scalar(1e-3);
    with_precision(Precision::F16, || {
        let (y, x_kept, w_kept) = Inner::fused_linear_keeping(
            float(x.clone()),
            float(w.clone()),
            Some(b.clone().into_primitive().tensor()),
        );
        let (x_kept, w_kept) = (back(x_kept), back(w_kept));
        let y = back(y);
        assert_eq!(y.dtype(), DType::F32, "the output's type");
        for (name, kept, exact) in [("x", &x_kept, &x), ("w", &w_kept, &w)] {
            assert_eq!(kept.dtype(), DType::F16, "{name} kept in f16");
            let rounded = exact.clone().cast(FloatDType::F16).cast(FloatDType::F32);
            let kept = kept.clone().cast(FloatDType::F32);
            assert_eq!(kept.dims(), exact.dims(), "{name}'s shape");
            assert_eq!(rel_diff(kept, rounded), 0.0, "{name} kept is {name} in f16");
        }
        let alone = Inner::fused_linear(
            float(x.clone()),
            float(w.clone()),
            Some(b.clone().into_primitive().tensor()),
        );
        assert_eq!(rel_diff(y, back(alone)), 0.0, "y with and without keeping");
        let grads = |x, w| Inner::fused_linear_backward(x, w, float(dy.clone()), true);
        let (dx, dw, db) = grads(float(x_kept), float(w_kept));
        let (dx2, dw2, db2) = grads(float(x.clone()), float(w.clone()));
        for (name, a, b) in [("dx", dx, dx2), ("dw", dw, dw2)] {
            let diff = relative(back(a), back(b));
            assert!(
                diff < 1e-6,
                "{name} from the kept operands differs by {diff}"
            );
        }
        let to_2d = |x| back(x).reshape([1, -1]);
        assert_eq!(rel_diff(to_2d(db.unwrap()), to_2d(db2.unwrap())), 0.0, "db");
    });
}

#[test]
fn gpu_a_tiny_model_trains_in_f16_as_in_f32() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let device = Default::default();
    let config = crate::common::small_lm();
    let steps = 20;
    let exact = with_precision(Precision::F32, || {
        crate::common::losses::<Gpu>(&config, steps, &device)
    });
    let half = with_precision(Precision::F16, || {
        crate::common::losses::<Gpu>(&config, steps, &device)
    });
    let worst = exact
        .iter()
        .zip(&half)
        .map(|(e, h)| (e - h).abs() / e)
        .fold(0.0f32, f32::max);
    // Measured on lavapipe: 3e-5.
    assert!(
        worst < 1e-3 && worst > 0.0,
        "f16 losses {half:?} leave f32's {exact:?} by {worst}"
    );
    // The targets' frequencies alone give 2.56 nats.
    let targets = crate::common::batch::<Inner>(&device).targets;
    let targets: Vec<i64> = targets.into_data().convert::<i64>().to_vec().unwrap();
    let unigram = crate::common::unigram_entropy(targets);
    assert!(
        (half[steps - 1] as f64) < unigram - 1.0,
        "f16 losses {half:?}, not below the unigram {unigram:.2} − 1"
    );
}

/// The gradient of an embedding table, summed by hand: row `r` is the sum of the output
/// gradient's rows whose id is `r`, zero where no id names it.
fn embedding_gradient_by_hand(ids: &[i64], grad: &[f32], v: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; v * d];
    for (i, &id) in ids.iter().enumerate() {
        for c in 0..d {
            out[id as usize * d + c] += grad[i * d + c];
        }
    }
    out
}

#[test]
fn gpu_embedding_gradient_equals_the_sum_by_hand_and_is_the_same_every_run() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let device = Default::default();
    // 70 rows: two of the kernel's blocks of 64 table rows; 48 wide: a block and a half of 32
    // columns; 600 ids: three chunks; the last row named once, by the first id, and row 5 never
    // (its gradient must be written as zero). Then a table of 4,096 × 1,025, too large for
    // more than one chunk of partial sums: the first stage sums every id in one.
    for (v, d, b, n) in [(70, 48, 3, 200), (4096, 1025, 2, 300)] {
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(v as u64);
        let mut ids: Vec<i64> = (0..b * n)
            .map(|_| rand::RngExt::random_range(&mut rng, 0..v.min(90) as i64 - 1))
            .map(|id| if id == 5 { 6 } else { id })
            .collect();
        ids[0] = v as i64 - 1;
        let table = random::<Gpu, 2>([v, d], 20, &device).require_grad();
        let tokens =
            Tensor::<Gpu, 2, Int>::from_data(TensorData::new(ids.clone(), [b, n]), &device);
        let g = random::<Gpu, 3>([b, n, d], 21, &device);
        let run = || {
            launching(2, || {
                let y = kernels::embedding(table.clone(), tokens.clone());
                let grads = (y * g.clone()).sum().backward();
                table.grad(&grads).unwrap()
            })
        };
        let (first, second) = (run(), run());
        let grad: Vec<f32> = g.inner().into_data().to_vec().unwrap();
        let expected = Tensor::<Inner, 2>::from_data(
            TensorData::new(embedding_gradient_by_hand(&ids, &grad, v, d), [v, d]),
            &device,
        );
        let diff = rel_diff(first.clone(), expected);
        assert!(diff < 1e-5, "table {v} × {d}: gradient differs by {diff}");
        assert_eq!(
            first.into_data().to_vec::<f32>().unwrap(),
            second.into_data().to_vec::<f32>().unwrap(),
            "table {v} × {d}: two runs' gradients differ"
        );
    }
}

/// `bench matmul`'s products on lavapipe: burn's autotuned choice at every layout a step has
/// (transposed views as its gradients read them) and in `f16` (against the sums of the rounded
/// operands), and a candidate launched directly, against sums made on the host; the
/// tensor-core candidates, which lavapipe cannot run, report why instead of a time. (A unit
/// kernel takes seconds to compile in a debug build: one is launched directly.)
#[test]
fn gpu_bench_matmul_times_each_candidate_and_checks_it_against_the_host() {
    use transformer_lab::bench::matmul::{MatmulPlan, ProductShape};
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let device = Default::default();
    let shape = |name: &str, (m, n, k), a_transposed, b_transposed| ProductShape {
        name: name.into(),
        m,
        n,
        k,
        a_transposed,
        b_transposed,
        per_step: 2,
    };
    let products = vec![
        shape("forward", (37, 23, 19), false, false),
        shape("dX", (37, 19, 23), false, true),
        shape("dW", (19, 23, 37), true, false),
    ];
    let plan = |products: Vec<ProductShape>, precision, kernels: &[&str]| MatmulPlan {
        products,
        precision,
        all: !kernels.is_empty(),
        kernels: kernels.iter().map(|k| k.to_string()).collect(),
        runs: 1,
    };
    let time = |plan: &MatmulPlan| Inner::time_products(&device, plan, &mut |_| {}).unwrap();
    let ran = |timings: &[transformer_lab::bench::matmul::ProductTiming], i: usize| {
        timings
            .iter()
            .filter(|t| t.product == i && t.seconds.is_ok())
            .map(|t| (t.kernel.clone(), t.error))
            .collect::<Vec<_>>()
    };
    // Every layout, in f32, and the transposed one in f16 (lavapipe has no bf16): the host's
    // sums are of the values the device holds, so only the sums' rounding differs.
    for (precision, products) in [
        (Precision::F32, products.clone()),
        (Precision::F16, vec![products[1].clone()]),
    ] {
        let timings = time(&plan(products.clone(), precision, &[]));
        for (i, product) in products.iter().enumerate() {
            let ran = ran(&timings, i);
            assert_eq!(ran.len(), 1, "{precision:?} {}: {ran:?}", product.name);
            let (kernel, error) = &ran[0];
            assert!(
                kernel == "autotune" && *error > 0.0 && *error < 1e-5,
                "{precision:?} {}: {kernel} error {error:e}",
                product.name
            );
        }
    }
    // A candidate by name, and those lavapipe cannot run.
    let timings = time(&plan(
        vec![products[2].clone()],
        Precision::F32,
        &["double_unit_min", "cyclic_cmma"],
    ));
    let ran = ran(&timings, 0);
    let names: Vec<&str> = ran.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["autotune", "matmul_double_unit_min_tile_size"]);
    assert!(ran.iter().all(|(_, e)| *e > 0.0 && *e < 1e-5), "{ran:?}");
    let refused: Vec<_> = timings.iter().filter(|t| t.seconds.is_err()).collect();
    assert!(refused.len() >= 2, "{refused:?}");
    assert!(
        refused.iter().all(|t| t.kernel.contains("cyclic_cmma")
            && t.seconds.as_ref().unwrap_err().contains("unavailable")),
        "{refused:?}"
    );
}

/// A matmul kernel named for the products (`TRANSFORMER_LAB_MATMUL`, here through
/// `pin_matmul`) makes all three of a linear layer's products in `f32` — forward, the input's
/// gradient and the weight's — with the values and gradients of autotune's choice.
#[test]
fn gpu_a_named_matmul_kernel_makes_every_product_of_a_linear_layer() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let device = Default::default();
    let run = |pin: Option<&str>| {
        let before = kernels::pin_matmul(pin);
        let launches = cube::pinned_launches();
        let x = random::<Gpu, 2>([37, 19], 31, &device).require_grad();
        let w = random::<Gpu, 2>([19, 23], 32, &device).require_grad();
        let target = random::<Gpu, 2>([37, 23], 33, &device);
        let y = kernels::product(x.clone(), w.clone(), None);
        let grads = (y.clone() * target).sum().backward();
        let (dx, dw) = (x.grad(&grads).unwrap(), w.grad(&grads).unwrap());
        let out = (y.inner().into_data(), dx.into_data(), dw.into_data());
        kernels::pin_matmul(before.as_deref());
        (out, cube::pinned_launches() - launches)
    };
    let (tuned, none) = run(None);
    let (named, three) = run(Some("matmul_double_unit_min_tile_size"));
    assert_eq!((none, three), (0, 3), "products by the named kernel");
    for (what, a, b) in [
        ("y", &tuned.0, &named.0),
        ("dx", &tuned.1, &named.1),
        ("dw", &tuned.2, &named.2),
    ] {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        let top = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            worst <= 1e-5 * top,
            "{what} differs by {worst} (largest {top})"
        );
    }
}

/// The largest `|y − expected|` relative to the largest `|expected|` (at least 1). Every
/// output must be finite (ours start as NaN: one left unwritten shows here, where `max` would
/// drop it).
fn relative_gap(y: &[f32], expected: &[f32]) -> f32 {
    assert_eq!(y.len(), expected.len());
    assert!(y.iter().all(|v| v.is_finite()), "non-finite outputs");
    let scale = expected.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let worst = y
        .iter()
        .zip(expected)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    worst / scale
}

/// `epilogue(LN(x)·w + b)` on the host in `f64`, rows of `x` `[n, i]`, `w` `[i, o]`
/// row-major: LayerNorm with `γ` (and `β`) where given, then GELU (erf form) or the residual
/// `[n, o]` added.
fn decode_linear_by_hand(
    x: &[f32],
    norm: Option<(&[f32], Option<&[f32]>)>,
    w: &[f32],
    b: Option<&[f32]>,
    gelu: bool,
    residual: Option<&[f32]>,
    [n, i, o]: [usize; 3],
) -> Vec<f32> {
    let mut y = vec![0.0f32; n * o];
    for r in 0..n {
        let row: Vec<f64> = x[r * i..(r + 1) * i].iter().map(|&v| v as f64).collect();
        let input: Vec<f64> = match norm {
            Some((gamma, beta)) => {
                let mean = row.iter().sum::<f64>() / i as f64;
                let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / i as f64;
                let rstd = 1.0 / (var + 1e-5).sqrt();
                (0..i)
                    .map(|k| {
                        let shift = beta.map_or(0.0, |beta| beta[k] as f64);
                        (row[k] - mean) * rstd * gamma[k] as f64 + shift
                    })
                    .collect()
            }
            None => row,
        };
        for j in 0..o {
            let mut v: f64 = (0..i).map(|k| input[k] * w[k * o + j] as f64).sum();
            v += b.map_or(0.0, |b| b[j] as f64);
            if gelu {
                v *= 0.5 * (1.0 + crate::kernels::erf64(v / 2f64.sqrt()));
            }
            v += residual.map_or(0.0, |res| res[r * o + j] as f64);
            y[r * o + j] = v as f32;
        }
    }
    y
}

/// A decoding step's product with the LayerNorm before it and the GELU or the residual
/// addition after it, in one launch, against the same computed on the host in `f64`: rows
/// across cubes of 4 (1, 5, 9), an inner width no multiple of a cube's units, outputs no
/// multiple of a cube's columns, the weight row-major and read transposed (a tied output
/// layer's), with and without a bias and `β`.
#[test]
fn gpu_a_decoding_step_s_product_with_its_layer_norm_and_gelu_or_residual_equals_them_by_hand() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    use transformer_lab::kernels::After;
    let device = Default::default();
    let (i, o) = (200, 70);
    let read = |t: Tensor<Inner, 2>| -> Vec<f32> { t.into_data().to_vec().unwrap() };
    let read1 = |t: &Tensor<Inner, 1>| -> Vec<f32> { t.clone().into_data().to_vec().unwrap() };
    let mut norm = burn::nn::LayerNormConfig::new(i).init::<Inner>(&device);
    norm.gamma = burn::module::Param::from_tensor(random::<Inner, 1>([i], 1, &device) + 1.0);
    norm.beta = Some(burn::module::Param::from_tensor(random::<Inner, 1>(
        [i],
        2,
        &device,
    )));
    let mut plain = burn::nn::LayerNormConfig::new(i)
        .with_bias(false)
        .init::<Inner>(&device);
    plain.gamma = norm.gamma.clone();
    let gamma = read1(&norm.gamma.val());
    let beta = read1(&norm.beta.as_ref().unwrap().val());
    let w = random::<Inner, 2>([i, o], 3, &device) * 0.1;
    let bias = random::<Inner, 1>([o], 4, &device);
    let (w_host, bias_host) = (read(w.clone()), read1(&bias));
    let mut cases = 0;
    for n in [1, 5, 9] {
        let x = random::<Inner, 2>([n, i], 5 + n as u64, &device) * 2.0 + 1.0;
        let residual = random::<Inner, 2>([n, o], 6, &device);
        let (x_host, res_host) = (read(x.clone()), read(residual.clone()));
        for transposed in [false, true] {
            // The same numbers as `w`, held as `[o, i]` and read transposed.
            let weight = match transposed {
                true => w.clone().transpose().into_data(),
                false => w.clone().into_data(),
            };
            let weight = Tensor::<Inner, 2>::from_data(weight, &device);
            let weight = if transposed {
                weight.transpose()
            } else {
                weight
            };
            for (normed, with_beta, with_bias, after) in [
                (true, true, true, 0),
                (true, false, false, 1),
                (false, false, true, 1),
                (false, false, false, 2),
                (true, true, false, 2),
            ] {
                let layer = match with_beta {
                    true => &norm,
                    false => &plain,
                };
                let (gelu, res) = (after == 1, after == 2);
                let expected = decode_linear_by_hand(
                    &x_host,
                    normed.then(|| (gamma.as_slice(), with_beta.then_some(beta.as_slice()))),
                    &w_host,
                    with_bias.then_some(bias_host.as_slice()),
                    gelu,
                    res.then_some(res_host.as_slice()),
                    [n, i, o],
                );
                let after = match after {
                    0 => After::Nothing,
                    1 => After::Gelu,
                    _ => After::Residual(residual.clone()),
                };
                let (y, ran) = counted(|| {
                    read(kernels::decode_linear(
                        x.clone(),
                        normed.then_some((layer, 1e-5)),
                        weight.clone(),
                        with_bias.then(|| bias.clone()),
                        after,
                    ))
                });
                let case = format!("{n} rows, transposed {transposed}, LayerNorm {normed}, β {with_beta}, bias {with_bias}, gelu {gelu}, residual {res}");
                assert_eq!(ran, 1, "{case}: one launch");
                let gap = relative_gap(&y, &expected);
                assert!(gap < 1e-5, "{case}: differs by {gap} (relative)");
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 30);

    // Rows too wide for a cube's shared memory once normalised (4 × 3,000 numbers) go through
    // the LayerNorm kernel and burn's product: the same values, and our one launch is the
    // LayerNorm's.
    let (n, i, o) = (5, 3000, 40);
    let mut norm = burn::nn::LayerNormConfig::new(i).init::<Inner>(&device);
    norm.gamma = burn::module::Param::from_tensor(random::<Inner, 1>([i], 7, &device) + 1.0);
    let x = random::<Inner, 2>([n, i], 8, &device);
    let w = random::<Inner, 2>([i, o], 9, &device) * 0.05;
    let gamma = read1(&norm.gamma.val());
    let beta = read1(&norm.beta.as_ref().unwrap().val());
    let expected = decode_linear_by_hand(
        &read(x.clone()),
        Some((gamma.as_slice(), Some(beta.as_slice()))),
        &read(w.clone()),
        None,
        false,
        None,
        [n, i, o],
    );
    let (y, ran) = counted(|| {
        read(kernels::decode_linear(
            x,
            Some((&norm, 1e-5)),
            w,
            None,
            After::Nothing,
        ))
    });
    assert_eq!(ran, 1, "the LayerNorm kernel alone");
    let gap = relative_gap(&y, &expected);
    assert!(gap < 1e-5, "wide rows: differ by {gap} (relative)");
}

/// A decoding step's query, key and value product writing its keys and values straight into
/// a cache's buffers, in one launch: the queries as computed on the host in `f64`, and each
/// buffer holding what it held but for the new positions, which hold the keys and values
/// (one position a sequence, and two; a buffer read in place, another held twice and so
/// copied first).
#[test]
fn gpu_a_decoding_step_s_projections_write_their_keys_and_values_into_the_cache() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    use transformer_lab::kernels::decode_qkv;
    let device = Default::default();
    let read = |t: Tensor<Inner, 2>| -> Vec<f32> { t.into_data().to_vec().unwrap() };
    let (items, heads, capacity, width, i) = (3, 2, 7, 4, 40);
    let d = heads * width;
    let mut norm = burn::nn::LayerNormConfig::new(i).init::<Inner>(&device);
    norm.gamma = burn::module::Param::from_tensor(random::<Inner, 1>([i], 1, &device) + 1.0);
    let gamma: Vec<f32> = norm.gamma.val().into_data().to_vec().unwrap();
    let beta: Vec<f32> = norm
        .beta
        .as_ref()
        .unwrap()
        .val()
        .into_data()
        .to_vec()
        .unwrap();
    let w = random::<Inner, 2>([i, 3 * d], 2, &device) * 0.2;
    let b = random::<Inner, 1>([3 * d], 3, &device);
    let b_host: Vec<f32> = b.clone().into_data().to_vec().unwrap();
    for (per_item, at) in [(1, 4), (2, 2)] {
        let n = items * per_item;
        let x = random::<Inner, 2>([n, i], 4 + per_item as u64, &device);
        let y = decode_linear_by_hand(
            &read(x.clone()),
            Some((gamma.as_slice(), Some(beta.as_slice()))),
            &read(w.clone()),
            Some(b_host.as_slice()),
            false,
            None,
            [n, i, 3 * d],
        );
        let shape = [items, heads, capacity, width];
        let keys = random::<Inner, 4>(shape, 6, &device);
        let values = random::<Inner, 4>(shape, 7, &device);
        let before: [Vec<f32>; 2] =
            [&keys, &values].map(|t| t.clone().into_data().to_vec().unwrap());
        // The keys are held once (written in place); the values also by `held`.
        let held = values.clone();
        let ((q, keys, values), ran) = counted(|| {
            let (q, k, v) = decode_qkv(
                x,
                Some((&norm, 1e-5)),
                w.clone(),
                Some(b.clone()),
                keys,
                values,
                at,
            );
            (
                read(q),
                k.into_data().to_vec::<f32>().unwrap(),
                v.into_data().to_vec::<f32>().unwrap(),
            )
        });
        assert_eq!(ran, 1, "one launch");
        let held: Vec<f32> = held.into_data().to_vec().unwrap();
        assert_eq!(
            held, before[1],
            "a buffer held elsewhere is copied, not written"
        );
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * b.abs().max(1.0);
        for r in 0..n {
            for c in 0..d {
                assert!(close(q[r * d + c], y[r * 3 * d + c]), "q[{r}, {c}]");
            }
        }
        for (part, (buffer, before)) in [(1, (&keys, &before[0])), (2, (&values, &before[1]))] {
            for item in 0..items {
                for h in 0..heads {
                    for p in 0..capacity {
                        for e in 0..width {
                            let at_buffer = ((item * heads + h) * capacity + p) * width + e;
                            let got = buffer[at_buffer];
                            let new = p >= at && p < at + per_item;
                            let want = match new {
                                true => {
                                    let row = item * per_item + (p - at);
                                    y[row * 3 * d + part * d + h * width + e]
                                }
                                false => before[at_buffer],
                            };
                            assert!(
                                close(got, want),
                                "buffer {part}, item {item}, head {h}, position {p}, {e}: {got} against {want} ({per_item} a sequence)"
                            );
                        }
                    }
                }
            }
        }
    }
}
