//! CPU kernels over `f32` slices: both cores through rayon, loops shaped so the compiler
//! vectorises them (AVX2 + FMA chosen at run time when the CPU has them).
//!
//! Reductions are written with [`LANES`] independent accumulators (a float sum is not
//! reassociated by the compiler, so a plain `iter().sum()` stays scalar). The attention kernels
//! work on `64 × 64` tiles whose products go to the `gemm` crate (the kernel flex's own matmul
//! uses), reading heads in place through their strides.

use super::AdamWStep;
use crate::nn::attention::MASKED_SCORE;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Accumulator lanes of the vectorised reductions.
const LANES: usize = 16;
/// Elements per parallel task of the element-wise kernels.
const CHUNK: usize = 1 << 14;
/// Element-wise and row-wise passes over fewer elements run on the calling thread: handing
/// work to rayon from outside its pool wakes a worker and blocks on a latch, which costs more
/// than a pass over a `768 × 128` activation (LayerNorm's) saves by splitting.
const SPLIT: usize = 1 << 17;
/// Queries and keys per tile of the attention kernels.
const TILE: usize = 64;
/// A row whose largest score or log-sum-exp is below this saw no unmasked key.
const REAL_SCORE: f32 = MASKED_SCORE * 0.5;

/// Defines `pub fn $name` that runs the body compiled for AVX2 + FMA when the CPU has them,
/// and for the baseline target otherwise.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has the features `avx2` was compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

/// `e^x` to within 2 ulp, branch-free so it vectorises; exactly 0 below −87.3.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5·2²³: adding and subtracting it rounds to an integer
    let underflow = x < -87.3;
    let x = x.clamp(-87.3, 88.3);
    let rounded = x * LOG2E + ROUND;
    let n = rounded - ROUND;
    // The integer `n` from the bits of `ROUND + n` (its ulp is 1): a float-to-int cast would
    // saturate and check for NaN element by element, which does not vectorise.
    let n_int = rounded.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    if underflow {
        0.0
    } else {
        y * scale
    }
}

/// `erf(x)` as a rational function (odd numerator of degree 13 over an even denominator of
/// degree 8) on `[−4, 4]`, ±1 outside: a few ulp, branch-free.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = -2.726_142_3e-10;
    p = p * x2 + 2.770_681_4e-8;
    p = p * x2 - 2.101_024e-6;
    p = p * x2 - 5.692_506_4e-5;
    p = p * x2 - 7.349_906_3e-4;
    p = p * x2 - 2.954_6e-3;
    p = p * x2 - 1.609_603_3e-2;
    let mut q = -1.456_607_2e-5;
    q = q * x2 - 2.133_740_6e-4;
    q = q * x2 - 1.682_827e-3;
    q = q * x2 - 7.373_329_2e-3;
    q = q * x2 - 1.426_473_9e-2;
    x * p / q
}

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

multiversion! {
    fn gelu_chunk(x: &[f32], y: &mut [f32]) {
        for (y, &x) in y.iter_mut().zip(x) {
            *y = 0.5 * x * (1.0 + erf(x * FRAC_1_SQRT_2));
        }
    }
}

multiversion! {
    fn gelu_with_derivative_chunk(x: &[f32], y: &mut [f32], derivative: &mut [f32]) {
        for ((y, d), &x) in y.iter_mut().zip(derivative.iter_mut()).zip(x) {
            let cdf = 0.5 * (1.0 + erf(x * FRAC_1_SQRT_2));
            let pdf = FRAC_1_SQRT_2PI * exp(-0.5 * x * x);
            *y = x * cdf;
            *d = cdf + x * pdf;
        }
    }
}

/// `(GELU(x), GELU'(x))` of every element, for training's forward pass.
pub fn gelu_with_derivative(x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (mut y, mut derivative) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    if x.len() < SPLIT {
        gelu_with_derivative_chunk(x, &mut y, &mut derivative);
        return (y, derivative);
    }
    y.par_chunks_mut(CHUNK)
        .zip(derivative.par_chunks_mut(CHUNK))
        .zip(x.par_chunks(CHUNK))
        .for_each(|((y, d), x)| gelu_with_derivative_chunk(x, y, d));
    (y, derivative)
}

/// Exact GELU of every element.
pub fn gelu(x: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    if x.len() < SPLIT {
        gelu_chunk(x, &mut y);
        return y;
    }
    y.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(y, x)| gelu_chunk(x, y));
    y
}

/// Sum with [`LANES`] accumulators (vectorises).
#[inline(always)]
fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Inner product with [`LANES`] accumulators (vectorises).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Rows per parallel task of the row-wise kernels.
fn rows_per_task(d: usize) -> usize {
    (CHUNK / d.max(1)).max(1)
}

multiversion! {
    fn layer_norm_rows(
        x: &[f32],
        d: usize,
        gamma: &[f32],
        beta: Option<&[f32]>,
        epsilon: f32,
        y: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) {
        for (((x, y), mean), rstd) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)).zip(mean).zip(rstd) {
            let mu = sum(x) / d as f32;
            for (y, &x) in y.iter_mut().zip(x) {
                *y = x - mu;
            }
            let r = 1.0 / (dot(y, y) / d as f32 + epsilon).sqrt();
            match beta {
                Some(beta) => {
                    for ((y, &g), &b) in y.iter_mut().zip(gamma).zip(beta) {
                        *y = *y * r * g + b;
                    }
                }
                None => {
                    for (y, &g) in y.iter_mut().zip(gamma) {
                        *y *= r * g;
                    }
                }
            }
            *mean = mu;
            *rstd = r;
        }
    }
}

/// LayerNorm of the rows of `x` (`d` wide): `(y, mean, 1/σ)`.
pub fn layer_norm(
    x: &[f32],
    d: usize,
    gamma: &[f32],
    beta: Option<&[f32]>,
    epsilon: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let n = x.len() / d;
    let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; n], vec![0.0; n]);
    if x.len() < SPLIT {
        layer_norm_rows(x, d, gamma, beta, epsilon, &mut y, &mut mean, &mut rstd);
        return (y, mean, rstd);
    }
    let rows = rows_per_task(d);
    y.par_chunks_mut(rows * d)
        .zip(mean.par_chunks_mut(rows))
        .zip(rstd.par_chunks_mut(rows))
        .zip(x.par_chunks(rows * d))
        .for_each(|(((y, mean), rstd), x)| {
            layer_norm_rows(x, d, gamma, beta, epsilon, y, mean, rstd)
        });
    (y, mean, rstd)
}

multiversion! {
    fn layer_norm_backward_rows(
        x: &[f32],
        d: usize,
        gamma: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    ) {
        let rows = x.chunks_exact(d).zip(dy.chunks_exact(d)).zip(dx.chunks_exact_mut(d));
        for (((x, dy), dx), (&mu, &r)) in rows.zip(mean.iter().zip(rstd)) {
            // dx temporarily holds x̂; dL/dx̂ = dy·γ.
            for (xh, &x) in dx.iter_mut().zip(x) {
                *xh = (x - mu) * r;
            }
            let (mut mean_g, mut mean_gx) = (0.0f32, 0.0f32);
            let mut acc_g = [0.0f32; LANES];
            let mut acc_gx = [0.0f32; LANES];
            for (i, ((&xh, &dy), &g)) in dx.iter().zip(dy).zip(gamma).enumerate() {
                let gi = dy * g;
                acc_g[i % LANES] += gi;
                acc_gx[i % LANES] += gi * xh;
            }
            for l in 0..LANES {
                mean_g += acc_g[l];
                mean_gx += acc_gx[l];
            }
            mean_g /= d as f32;
            mean_gx /= d as f32;
            for ((((dx, &dy), &g), dg), db) in dx.iter_mut().zip(dy).zip(gamma).zip(dgamma.iter_mut()).zip(dbeta.iter_mut()) {
                let xh = *dx;
                *dg += dy * xh;
                *db += dy;
                *dx = r * (dy * g - mean_g - xh * mean_gx);
            }
        }
    }
}

/// LayerNorm's gradients `(dx, dγ, dβ)` from the forward pass's statistics.
pub fn layer_norm_backward(
    x: &[f32],
    d: usize,
    gamma: &[f32],
    mean: &[f32],
    rstd: &[f32],
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut dx = vec![0.0; x.len()];
    if x.len() < SPLIT {
        let (mut dgamma, mut dbeta) = (vec![0.0f32; d], vec![0.0f32; d]);
        layer_norm_backward_rows(
            x,
            d,
            gamma,
            mean,
            rstd,
            dy,
            &mut dx,
            &mut dgamma,
            &mut dbeta,
        );
        return (dx, dgamma, dbeta);
    }
    let rows = rows_per_task(d);
    let (dgamma, dbeta) = dx
        .par_chunks_mut(rows * d)
        .zip(x.par_chunks(rows * d))
        .zip(dy.par_chunks(rows * d))
        .zip(mean.par_chunks(rows).zip(rstd.par_chunks(rows)))
        .fold(
            || (vec![0.0f32; d], vec![0.0f32; d]),
            |(mut dgamma, mut dbeta), (((dx, x), dy), (mean, rstd))| {
                layer_norm_backward_rows(x, d, gamma, mean, rstd, dy, dx, &mut dgamma, &mut dbeta);
                (dgamma, dbeta)
            },
        )
        .reduce(
            || (vec![0.0f32; d], vec![0.0f32; d]),
            |(mut g1, mut b1), (g2, b2)| {
                g1.iter_mut().zip(&g2).for_each(|(a, b)| *a += b);
                b1.iter_mut().zip(&b2).for_each(|(a, b)| *a += b);
                (g1, b1)
            },
        );
    (dx, dgamma, dbeta)
}

multiversion! {
    fn softmax_rows(x: &[f32], s: usize, y: &mut [f32]) {
        for (x, y) in x.chunks_exact(s).zip(y.chunks_exact_mut(s)) {
            let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            for (y, &x) in y.iter_mut().zip(x) {
                *y = exp(x - max);
            }
            let inv = 1.0 / sum(y);
            for y in y.iter_mut() {
                *y *= inv;
            }
        }
    }
}

/// Softmax of each row (`s` wide).
pub fn softmax(x: &[f32], s: usize) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    if x.len() < SPLIT {
        softmax_rows(x, s, &mut y);
        return y;
    }
    let rows = rows_per_task(s);
    y.par_chunks_mut(rows * s)
        .zip(x.par_chunks(rows * s))
        .for_each(|(y, x)| softmax_rows(x, s, y));
    y
}

multiversion! {
    fn softmax_backward_rows(p: &[f32], dp: &[f32], s: usize, dx: &mut [f32]) {
        for ((p, dp), dx) in p.chunks_exact(s).zip(dp.chunks_exact(s)).zip(dx.chunks_exact_mut(s)) {
            let dot = dot(p, dp);
            for ((dx, &p), &dp) in dx.iter_mut().zip(p).zip(dp) {
                *dx = p * (dp - dot);
            }
        }
    }
}

/// `p ⊙ (dp − Σ p·dp)` row by row (`s` wide): the softmax's input gradient.
pub fn softmax_backward(p: &[f32], dp: &[f32], s: usize) -> Vec<f32> {
    let mut dx = vec![0.0; p.len()];
    if p.len() < SPLIT {
        softmax_backward_rows(p, dp, s, &mut dx);
        return dx;
    }
    let rows = rows_per_task(s);
    dx.par_chunks_mut(rows * s)
        .zip(p.par_chunks(rows * s).zip(dp.par_chunks(rows * s)))
        .for_each(|(dx, (p, dp))| softmax_backward_rows(p, dp, s, dx));
    dx
}

/// `Σ e^(x − shift)` with [`LANES`] accumulators (vectorises).
#[inline(always)]
fn sum_exp(x: &[f32], shift: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().map(|&x| exp(x - shift)).sum();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += exp(c[l] - shift);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// A row's target, or `None` where the row is ignored.
#[inline(always)]
fn target(y: usize, ignore: Option<usize>) -> Option<usize> {
    (Some(y) != ignore).then_some(y)
}

multiversion! {
    fn cross_entropy_rows(
        x: &[f32],
        v: usize,
        targets: &[usize],
        smoothing: f32,
        ignore: Option<usize>,
        loss: &mut [f32],
        lse: &mut [f32],
    ) {
        let rows = x.chunks_exact(v).zip(targets).zip(loss.iter_mut().zip(lse.iter_mut()));
        for ((x, &y), (loss, lse)) in rows {
            let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let l = max + sum_exp(x, max).ln();
            *lse = l;
            *loss = match target(y, ignore) {
                Some(y) => l - (1.0 - smoothing) * x[y] - smoothing * sum(x) / v as f32,
                None => 0.0,
            };
        }
    }
}

/// The label-smoothed cross-entropy of each row of `x` (`v` wide) against its target,
/// `lse − (1−ε)·x_y − ε·mean(x)` (`0` for rows whose target is `ignore`), and each row's
/// log-sum-exp: `(loss, lse)`.
pub fn cross_entropy(
    x: &[f32],
    v: usize,
    targets: &[usize],
    smoothing: f32,
    ignore: Option<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let n = targets.len();
    let (mut loss, mut lse) = (vec![0.0; n], vec![0.0; n]);
    if x.len() < SPLIT {
        cross_entropy_rows(x, v, targets, smoothing, ignore, &mut loss, &mut lse);
        return (loss, lse);
    }
    let rows = rows_per_task(v);
    x.par_chunks(rows * v)
        .zip(targets.par_chunks(rows))
        .zip(loss.par_chunks_mut(rows).zip(lse.par_chunks_mut(rows)))
        .for_each(|((x, t), (loss, lse))| {
            cross_entropy_rows(x, v, t, smoothing, ignore, loss, lse)
        });
    (loss, lse)
}

multiversion! {
    fn cross_entropy_backward_rows(
        x: &[f32],
        v: usize,
        targets: &[usize],
        lse: &[f32],
        grad: &[f32],
        smoothing: f32,
        ignore: Option<usize>,
        dx: &mut [MaybeUninit<f32>],
    ) {
        let uniform = smoothing / v as f32;
        let rows = x.chunks_exact(v).zip(dx.chunks_exact_mut(v));
        for (((x, dx), &y), (&lse, &g)) in rows.zip(targets).zip(lse.iter().zip(grad)) {
            match target(y, ignore) {
                Some(y) => {
                    for (dx, &x) in dx.iter_mut().zip(x) {
                        dx.write(g * (exp(x - lse) - uniform));
                    }
                    dx[y].write(g * (exp(x[y] - lse) - uniform - (1.0 - smoothing)));
                }
                None => {
                    for dx in dx.iter_mut() {
                        dx.write(0.0);
                    }
                }
            }
        }
    }
}

/// The gradient of [`cross_entropy`]'s row losses for their gradient `grad`:
/// `grad · (softmax(row) − (1−ε)·onehot(y) − ε/v)`, zero on ignored rows.
pub fn cross_entropy_backward(
    x: &[f32],
    v: usize,
    targets: &[usize],
    lse: &[f32],
    grad: &[f32],
    smoothing: f32,
    ignore: Option<usize>,
) -> Vec<f32> {
    let mut dx = uninit(x.len());
    let slots = &mut dx.spare_capacity_mut()[..x.len()];
    if x.len() < SPLIT {
        cross_entropy_backward_rows(x, v, targets, lse, grad, smoothing, ignore, slots);
    } else {
        let rows = rows_per_task(v);
        x.par_chunks(rows * v)
            .zip(slots.par_chunks_mut(rows * v))
            .zip(targets.par_chunks(rows))
            .zip(lse.par_chunks(rows).zip(grad.par_chunks(rows)))
            .for_each(|(((x, dx), t), (lse, g))| {
                cross_entropy_backward_rows(x, v, t, lse, g, smoothing, ignore, dx)
            });
    }
    // SAFETY: every row of `dx` was written in full above.
    unsafe { written(dx, x.len()) }
}

/// A read-only matrix in any layout: element `(r, c)` is at `offset + r·rs + c·cs` of `data`.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    /// The storage the strides index.
    pub data: &'a [f32],
    /// Index of element `(0, 0)`.
    pub offset: usize,
    /// `[rows, columns]`.
    pub shape: [usize; 2],
    /// `[row stride, column stride]`.
    pub strides: [usize; 2],
}

impl Matrix<'_> {
    /// As a product operand, checked to lie inside its storage.
    fn operand(&self) -> Operand {
        let [r, c] = self.shape;
        let [rs, cs] = self.strides;
        if r > 0 && c > 0 {
            let last = self.offset + (r - 1) * rs + (c - 1) * cs;
            assert!(last < self.data.len(), "matrix view out of bounds");
        }
        (self.data[self.offset..].as_ptr(), rs, cs)
    }

    /// The transposed view.
    fn t(self) -> Self {
        let ([r, c], [rs, cs]) = (self.shape, self.strides);
        Self {
            shape: [c, r],
            strides: [cs, rs],
            ..self
        }
    }
}

/// Products of at least this many multiply-adds are split across the cores, by rows: each
/// core runs a single-threaded product on its own block of rows. (The `gemm` crate's own
/// threading loses at these sizes: `768 × 128 × 128` took 262 µs on two cores against 230 µs
/// on one.)
const PARALLEL_PRODUCT: usize = 1 << 21;
/// Fewest rows of one block of a split product.
const PRODUCT_ROWS: usize = 64;

/// `dst (m × n, row-major) = A·B`, or `+= A·B` when `accumulate`, on one core or, when
/// `parallel` and the product is large enough, on every core by blocks of rows.
///
/// # Safety
/// `dst` must be valid for `m × n` writes (and reads when `accumulate`) and alias neither
/// operand; without `accumulate` it may be uninitialised.
unsafe fn product(dst: *mut f32, accumulate: bool, a: Matrix, b: Matrix, parallel: bool) {
    let ([m, k], n) = (a.shape, b.shape[1]);
    assert_eq!(k, b.shape[0], "inner dimensions differ");
    let (a, b) = (a.operand(), b.operand());
    let blocks = if parallel && m * n * k >= PARALLEL_PRODUCT {
        rayon::current_num_threads().min(m / PRODUCT_ROWS)
    } else {
        1
    };
    if blocks <= 1 {
        // SAFETY: the operands were checked in bounds; `dst` is the caller's promise.
        return unsafe { matmul([m, n, k], dst, n, accumulate, a, b, 1.0) };
    }
    let rows = m.div_ceil(blocks);
    let (dst, a_rows) = (SendPtr(dst), SendPtr(a.0.cast_mut()));
    let b_ptr = SendPtr(b.0.cast_mut());
    (0..m.div_ceil(rows)).into_par_iter().for_each(|block| {
        let first = block * rows;
        let count = rows.min(m - first);
        // SAFETY: the blocks are disjoint rows of `dst` and of A, all in bounds.
        unsafe {
            matmul(
                [count, n, k],
                dst.get().add(first * n),
                n,
                accumulate,
                (a_rows.get().add(first * a.1).cast_const(), a.1, a.2),
                (b_ptr.get().cast_const(), b.1, b.2),
                1.0,
            )
        }
    });
}

/// A destination pointer handed to another rayon task.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: each pointer is written by one task only, while its buffer lives.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `y = x·w + b` for `x` `n × i`, `w` `i × o`: the bias is written first and the product
/// accumulated onto it (one pass over `y`, no separate broadcast add).
pub fn linear(x: Matrix, w: Matrix, bias: Option<&[f32]>) -> Vec<f32> {
    let (n, o) = (x.shape[0], w.shape[1]);
    let mut y = uninit(n * o);
    match bias {
        Some(bias) => {
            assert_eq!(bias.len(), o, "bias width");
            for _ in 0..n {
                y.extend_from_slice(bias);
            }
            // SAFETY: `y` holds `n × o` initialised elements.
            unsafe { product(y.as_mut_ptr(), true, x, w, true) };
        }
        None => {
            // SAFETY: `y` has room for `n × o`; the product writes them all without reading.
            y = unsafe {
                product(y.as_mut_ptr(), false, x, w, true);
                written(y, n * o)
            };
        }
    }
    y
}

multiversion! {
    fn column_sums(dy: Matrix, out: &mut [f32]) {
        let [n, o] = dy.shape;
        for r in 0..n {
            let start = dy.offset + r * dy.strides[0];
            for (acc, &g) in out.iter_mut().zip(&dy.data[start..start + o]) {
                *acc += g;
            }
        }
    }
}

/// The gradients `(dx = dy·wᵀ, dw = xᵀ·dy, db = Σ_rows dy)` of [`linear`]. The two products
/// are independent and of equal size: each runs on its own core (two single-core products are
/// faster than two split ones at these sizes). `dy` must have unit column stride.
pub fn linear_backward(
    x: Matrix,
    w: Matrix,
    dy: Matrix,
    bias: bool,
) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    let ([n, i], o) = (x.shape, w.shape[1]);
    assert_eq!(dy.strides[1], 1, "dy rows must be contiguous");
    let (mut dx, mut dw) = (uninit(n * i), uninit(i * o));
    let (dx_ptr, dw_ptr) = (SendPtr(dx.as_mut_ptr()), SendPtr(dw.as_mut_ptr()));
    // With more than two cores each product may split further.
    let split = rayon::current_num_threads() > 2;
    let db = rayon::join(
        // SAFETY: each destination has room for its product, written without reading.
        || unsafe { product(dx_ptr.get(), false, dy, w.t(), split) },
        || {
            unsafe { product(dw_ptr.get(), false, x.t(), dy, split) };
            bias.then(|| {
                let mut db = vec![0.0; o];
                column_sums(dy, &mut db);
                db
            })
        },
    )
    .1;
    // SAFETY: each product wrote all of its destination's elements.
    unsafe { (written(dx, n * i), written(dw, i * o), db) }
}

/// A read-only `[b, h, n, k]` tensor in any row layout: element `(b, h, i, c)` is at
/// `offset + b·strides[0] + h·strides[1] + i·strides[2] + c` (the head dimension is contiguous).
#[derive(Clone, Copy, Debug)]
pub struct Heads<'a> {
    /// The storage the strides index.
    pub data: &'a [f32],
    /// Index of element `(0, 0, 0, 0)`.
    pub offset: usize,
    /// Strides of the batch, head and position dimensions.
    pub strides: [usize; 3],
}

impl<'a> Heads<'a> {
    /// Row `i` of head `(b, h)`, `k` wide.
    #[inline(always)]
    fn row(&self, b: usize, h: usize, i: usize, k: usize) -> &'a [f32] {
        let start = self.offset + b * self.strides[0] + h * self.strides[1] + i * self.strides[2];
        &self.data[start..start + k]
    }
}

/// The shape of an attention problem: `q` `[b, h, t, k]`, keys and values `[b, h, s, k]`.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    /// Batch size.
    pub b: usize,
    /// Heads.
    pub h: usize,
    /// Query positions.
    pub t: usize,
    /// Key positions.
    pub s: usize,
    /// Head width.
    pub k: usize,
}

impl AttentionShape {
    /// Strides of a tensor laid out `[b, n, h, k]` (the order heads are split from and merged
    /// into `[b, n, d]`), seen as `[b, h, n, k]`, for `n` positions.
    pub fn interleaved(&self, n: usize) -> [usize; 3] {
        [n * self.h * self.k, self.k, self.h * self.k]
    }
}

/// A writable `[b, h, n, k]` destination, element `(b, h, i, c)` at
/// `b·strides[0] + h·strides[1] + i·strides[2] + c` from its pointer; it may cross threads
/// because each task writes only the rows of its own head.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    strides: [usize; 3],
}
// SAFETY: tasks write disjoint rows (one head each) and the buffer outlives the parallel loop.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// Writes `row` as row `i` of head `(b, h)`.
    ///
    /// # Safety
    /// The row must be in bounds and written by one task only (the destination may be
    /// uninitialised memory: no reference to it is made).
    #[inline(always)]
    unsafe fn write(&self, b: usize, h: usize, i: usize, row: &[f32]) {
        let [sb, sh, si] = self.strides;
        let dst = self.ptr.add(b * sb + h * sh + i * si);
        std::ptr::copy_nonoverlapping(row.as_ptr(), dst, row.len());
    }
}

/// A buffer of `n` elements that a kernel fills completely before it is read.
fn uninit(n: usize) -> Vec<f32> {
    Vec::with_capacity(n)
}

/// Marks the `n` elements of `buffer` written.
///
/// # Safety
/// All `n` elements must have been written (through raw pointers).
unsafe fn written(mut buffer: Vec<f32>, n: usize) -> Vec<f32> {
    debug_assert!(buffer.capacity() >= n);
    buffer.set_len(n);
    buffer
}

/// Whether key `j` is masked for query `i`.
#[inline(always)]
fn masked(i: usize, j: usize, causal: bool, pad: Option<&[f32]>) -> bool {
    (causal && j > i) || pad.is_some_and(|pad| pad[j] > 0.5)
}

/// A matrix operand: `(pointer, row stride, column stride)` in elements.
type Operand = (*const f32, usize, usize);

/// `dst = scale·A·B` (`accumulate`: `dst += scale·A·B`) for `A` `m × k` and `B` `k × n`, with
/// `dst` row-major (`ld` apart): one single-threaded call of the `gemm` crate, the product
/// kernel flex itself uses (the parallelism is across heads or blocks of rows).
///
/// # Safety
/// Every operand must be valid for its extent, and `dst` not alias them.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn matmul(
    [m, n, k]: [usize; 3],
    dst: *mut f32,
    ld: usize,
    accumulate: bool,
    (a, a_rs, a_cs): Operand,
    (b, b_rs, b_cs): Operand,
    scale: f32,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        ld as isize,
        accumulate,
        a,
        a_cs as isize,
        a_rs as isize,
        b,
        b_cs as isize,
        b_rs as isize,
        1.0,
        scale,
        false,
        false,
        false,
        gemm::Parallelism::None,
    )
}

impl Heads<'_> {
    /// Rows `i0..` of head `(b, h)` as a matrix operand (row-major, `k` columns).
    #[inline(always)]
    fn rows(&self, b: usize, h: usize, i0: usize) -> Operand {
        let start = self.offset + b * self.strides[0] + h * self.strides[1] + i0 * self.strides[2];
        (self.data[start..].as_ptr(), self.strides[2], 1)
    }

    /// Rows `j0..` of head `(b, h)` transposed (a `k × n` operand).
    #[inline(always)]
    fn rows_transposed(&self, b: usize, h: usize, j0: usize) -> Operand {
        let (ptr, rs, cs) = self.rows(b, h, j0);
        (ptr, cs, rs)
    }
}

/// Masks the score tile `scores` (`rows × n`, queries `i0..`, keys `j0..`).
fn mask_tile(
    scores: &mut [f32],
    n: usize,
    i0: usize,
    j0: usize,
    causal: bool,
    pad: Option<&[f32]>,
) {
    if !causal && pad.is_none() {
        return;
    }
    for (ii, row) in scores.chunks_exact_mut(n).enumerate() {
        for (jj, x) in row.iter_mut().enumerate() {
            if masked(i0 + ii, j0 + jj, causal, pad) {
                *x = MASKED_SCORE;
            }
        }
    }
}

multiversion! {
    fn attention_head(
        shape: AttentionShape,
        q: Heads,
        k: Heads,
        v: Heads,
        causal: bool,
        pad: Option<&[f32]>,
        b: usize,
        h: usize,
        o: Out,
        lse: &mut [f32],
    ) {
        let AttentionShape { t, s, k: kw, .. } = shape;
        let scale = 1.0 / (kw as f32).sqrt();
        let mut scores = vec![0.0f32; TILE * TILE];
        let mut acc = vec![0.0f32; TILE * kw];
        let (mut max, mut denom) = ([0.0f32; TILE], [0.0f32; TILE]);
        for i0 in (0..t).step_by(TILE) {
            let m = TILE.min(t - i0);
            let acc = &mut acc[..m * kw];
            acc.fill(0.0);
            max[..m].fill(f32::NEG_INFINITY);
            denom[..m].fill(0.0);
            for j0 in (0..s).step_by(TILE) {
                if causal && j0 >= i0 + m && max[..m].iter().all(|&x| x > REAL_SCORE) {
                    break; // every later key is in the future of every row of this block
                }
                let n = TILE.min(s - j0);
                let scores = &mut scores[..m * n];
                // SAFETY: operands are rows of this head, in bounds; `scores` is local.
                unsafe {
                    let (qr, kt) = (q.rows(b, h, i0), k.rows_transposed(b, h, j0));
                    matmul([m, n, kw], scores.as_mut_ptr(), n, false, qr, kt, scale);
                }
                mask_tile(scores, n, i0, j0, causal, pad);
                for (ii, row) in scores.chunks_exact_mut(n).enumerate() {
                    let tile_max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                    let new_max = max[ii].max(tile_max);
                    let rescale = exp(max[ii] - new_max);
                    if rescale != 1.0 {
                        denom[ii] *= rescale;
                        acc[ii * kw..(ii + 1) * kw].iter_mut().for_each(|x| *x *= rescale);
                    }
                    for x in row.iter_mut() {
                        *x = exp(*x - new_max);
                    }
                    denom[ii] += sum(row);
                    max[ii] = new_max;
                }
                // SAFETY: as above; `acc` is local.
                unsafe {
                    let p = (scores.as_ptr(), n, 1);
                    matmul([m, kw, n], acc.as_mut_ptr(), kw, true, p, v.rows(b, h, j0), 1.0);
                }
            }
            for (ii, row) in acc.chunks_exact_mut(kw).enumerate() {
                let inv = 1.0 / denom[ii];
                row.iter_mut().for_each(|a| *a *= inv);
                // SAFETY: row i0 + ii of head (b, h) belongs to this task.
                unsafe { o.write(b, h, i0 + ii, row) };
                lse[i0 + ii] = max[ii] + denom[ii].ln();
            }
        }
    }
}

/// Flash-style attention forward: `(output laid out [b, t, h, k], log-sum-exp [b, h, t])`.
/// `pad` is `[b, s]`, above 0.5 at padded keys.
pub fn attention_forward(
    shape: AttentionShape,
    q: Heads,
    k: Heads,
    v: Heads,
    causal: bool,
    pad: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>) {
    let AttentionShape { b, h, t, s, k: kw } = shape;
    let mut o = uninit(b * t * h * kw);
    let mut lse = vec![0.0f32; b * h * t];
    let out = Out {
        ptr: o.as_mut_ptr(),
        strides: shape.interleaved(t),
    };
    lse.par_chunks_mut(t).enumerate().for_each(|(head, lse)| {
        let (bi, hi) = (head / h, head % h);
        let pad = pad.map(|pad| &pad[bi * s..(bi + 1) * s]);
        attention_head(shape, q, k, v, causal, pad, bi, hi, out, lse);
    });
    // SAFETY: every row of every head was written.
    (unsafe { written(o, b * t * h * kw) }, lse)
}

multiversion! {
    fn attention_head_backward(
        shape: AttentionShape,
        q: Heads,
        k: Heads,
        v: Heads,
        o: Heads,
        lse: &[f32],
        d_o: Heads,
        causal: bool,
        pad: Option<&[f32]>,
        b: usize,
        h: usize,
        grads: [Out; 3],
    ) {
        let AttentionShape { t, s, k: kw, .. } = shape;
        let scale = 1.0 / (kw as f32).sqrt();
        let [dq_out, dk_out, dv_out] = grads;
        let delta: Vec<f32> = (0..t)
            .map(|i| dot(d_o.row(b, h, i, kw), o.row(b, h, i, kw)))
            .collect();
        // This head's gradients, row-major; written out at the end.
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; t * kw], vec![0.0f32; s * kw], vec![0.0f32; s * kw]);
        let mut p = vec![0.0f32; TILE * TILE];
        let mut ds = vec![0.0f32; TILE * TILE];
        for i0 in (0..t).step_by(TILE) {
            let m = TILE.min(t - i0);
            let lse = &lse[i0..i0 + m];
            for j0 in (0..s).step_by(TILE) {
                if causal && j0 >= i0 + m && lse.iter().all(|&x| x > REAL_SCORE) {
                    break;
                }
                let n = TILE.min(s - j0);
                let (p, ds) = (&mut p[..m * n], &mut ds[..m * n]);
                // SAFETY (every product): operands are rows of this head or local buffers, in
                // bounds, and each destination is local.
                unsafe {
                    let (qr, kt) = (q.rows(b, h, i0), k.rows_transposed(b, h, j0));
                    matmul([m, n, kw], p.as_mut_ptr(), n, false, qr, kt, scale);
                }
                mask_tile(p, n, i0, j0, causal, pad);
                for (row, &l) in p.chunks_exact_mut(n).zip(lse) {
                    if l > REAL_SCORE {
                        row.iter_mut().for_each(|x| *x = exp(*x - l));
                    } else {
                        // Every key masked: uniform weights (lse = −10⁹ + ln s rounds to −10⁹).
                        row.fill(1.0 / s as f32);
                    }
                }
                unsafe {
                    // dV += Pᵀ·dO; dP = dO·Vᵀ.
                    let pt = (p.as_ptr(), 1, n);
                    let dv_tile = dv[j0 * kw..].as_mut_ptr();
                    matmul([n, kw, m], dv_tile, kw, true, pt, d_o.rows(b, h, i0), 1.0);
                    let (dor, vt) = (d_o.rows(b, h, i0), v.rows_transposed(b, h, j0));
                    matmul([m, n, kw], ds.as_mut_ptr(), n, false, dor, vt, 1.0);
                }
                // dS = P ⊙ (dP − D)·scale; a masked score is a constant: no gradient.
                for (ii, (ds_row, p_row)) in ds.chunks_exact_mut(n).zip(p.chunks_exact(n)).enumerate() {
                    let d = delta[i0 + ii];
                    for (x, &pj) in ds_row.iter_mut().zip(p_row) {
                        *x = pj * (*x - d) * scale;
                    }
                    if causal || pad.is_some() {
                        for (jj, x) in ds_row.iter_mut().enumerate() {
                            if masked(i0 + ii, j0 + jj, causal, pad) {
                                *x = 0.0;
                            }
                        }
                    }
                }
                unsafe {
                    // dQ += dS·K; dK += dSᵀ·Q.
                    let dq_blk = dq[i0 * kw..].as_mut_ptr();
                    matmul([m, kw, n], dq_blk, kw, true, (ds.as_ptr(), n, 1), k.rows(b, h, j0), 1.0);
                    let dk_tile = dk[j0 * kw..].as_mut_ptr();
                    matmul([n, kw, m], dk_tile, kw, true, (ds.as_ptr(), 1, n), q.rows(b, h, i0), 1.0);
                }
            }
        }
        // SAFETY: rows of head (b, h) belong to this task.
        for (i, row) in dq.chunks_exact(kw).enumerate() {
            unsafe { dq_out.write(b, h, i, row) };
        }
        for (j, (dk_row, dv_row)) in dk.chunks_exact(kw).zip(dv.chunks_exact(kw)).enumerate() {
            unsafe {
                dk_out.write(b, h, j, dk_row);
                dv_out.write(b, h, j, dv_row);
            }
        }
    }
}

/// Flash-style attention backward: `(dq [b, t, h, k], dk [b, s, h, k], dv [b, s, h, k])`,
/// the probabilities recomputed tile by tile from the saved log-sum-exp.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    shape: AttentionShape,
    q: Heads,
    k: Heads,
    v: Heads,
    o: Heads,
    lse: &[f32],
    d_o: Heads,
    causal: bool,
    pad: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let AttentionShape { b, h, t, s, k: kw } = shape;
    let (q_len, kv_len) = (b * t * h * kw, b * s * h * kw);
    let (mut dq, mut dk, mut dv) = (uninit(q_len), uninit(kv_len), uninit(kv_len));
    let (q_strides, kv_strides) = (shape.interleaved(t), shape.interleaved(s));
    let grads = [
        Out {
            ptr: dq.as_mut_ptr(),
            strides: q_strides,
        },
        Out {
            ptr: dk.as_mut_ptr(),
            strides: kv_strides,
        },
        Out {
            ptr: dv.as_mut_ptr(),
            strides: kv_strides,
        },
    ];
    backward_into(shape, [q, k, v, o, d_o], lse, causal, pad, grads);
    // SAFETY: every row of every head of the three was written.
    unsafe { (written(dq, q_len), written(dk, kv_len), written(dv, kv_len)) }
}

/// Self-attention on packed projections `qkv` `[b, t, 3·h·k]` (Q, K, V side by side): the
/// gradient of `qkv`, written in place of its three parts. `o` and `d_o` are `[b, t, h·k]`.
pub fn packed_attention_backward(
    shape: AttentionShape,
    qkv: &[f32],
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    causal: bool,
    pad: Option<&[f32]>,
) -> Vec<f32> {
    let AttentionShape { b, h, t, k: kw, .. } = shape;
    let d = h * kw;
    assert_eq!(qkv.len(), b * t * 3 * d, "packed projections' size");
    let mut dqkv = uninit(qkv.len());
    let packed = [t * 3 * d, kw, 3 * d];
    let part = |i: usize| Heads {
        data: qkv,
        offset: i * d,
        strides: packed,
    };
    let merged = |data| Heads {
        data,
        offset: 0,
        strides: shape.interleaved(t),
    };
    let ptr = dqkv.as_mut_ptr();
    // SAFETY: the three parts start inside the buffer; every row written is in bounds.
    let grads = [0, 1, 2].map(|i| Out {
        ptr: unsafe { ptr.add(i * d) },
        strides: packed,
    });
    backward_into(
        shape,
        [part(0), part(1), part(2), merged(o), merged(d_o)],
        lse,
        causal,
        pad,
        grads,
    );
    // SAFETY: every row of the three parts, which tile the buffer, was written.
    unsafe { written(dqkv, qkv.len()) }
}

/// Runs the backward kernel over every head, in parallel, writing `[dq, dk, dv]`.
fn backward_into(
    shape: AttentionShape,
    [q, k, v, o, d_o]: [Heads; 5],
    lse: &[f32],
    causal: bool,
    pad: Option<&[f32]>,
    grads: [Out; 3],
) {
    let AttentionShape { h, t, s, .. } = shape;
    lse.par_chunks(t).enumerate().for_each(|(head, lse)| {
        let (bi, hi) = (head / h, head % h);
        let pad = pad.map(|pad| &pad[bi * s..(bi + 1) * s]);
        attention_head_backward(shape, q, k, v, o, lse, d_o, causal, pad, bi, hi, grads);
    });
}

multiversion! {
    fn adamw_chunk(
        param: &mut [f32],
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        first: bool,
        step: AdamWStep,
    ) {
        let AdamWStep { lr, beta_1, beta_2, epsilon, weight_decay, time } = step;
        let (c1, c2) = (1.0 - beta_1.powi(time), 1.0 - beta_2.powi(time));
        let (b1, b2) = if first { (0.0, 0.0) } else { (beta_1, beta_2) };
        let keep = 1.0 - lr * weight_decay;
        for (((p, &g), m), v) in param.iter_mut().zip(grad).zip(m.iter_mut()).zip(v.iter_mut()) {
            *m = *m * b1 + g * (1.0 - beta_1);
            *v = *v * b2 + g * g * (1.0 - beta_2);
            let delta = (*m / c1) / ((*v / c2).sqrt() + epsilon);
            *p = *p * keep - delta * lr;
        }
    }
}

/// One AdamW step (see [`AdamWStep`]) over `param`, its moments updated in place (`first`:
/// they hold zeros and this is step 1's initialisation).
pub fn adamw(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    first: bool,
    step: AdamWStep,
) {
    if param.len() < SPLIT {
        return adamw_chunk(param, grad, m, v, first, step);
    }
    param
        .par_chunks_mut(CHUNK)
        .zip(grad.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
        .for_each(|((p, g), (m, v))| adamw_chunk(p, g, m, v, first, step));
}
