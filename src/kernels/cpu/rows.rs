//! Row-wise kernels: LayerNorm, softmax and the label-smoothed cross-entropy, each forward and
//! backward.

use super::{
    assume_init, dot, exp, init, min_tasks, multiversion, rows_per_task, sum, uninit, written,
    LANES,
};
use crate::kernels::DropoutMask;
use rayon::prelude::*;
use std::mem::MaybeUninit;

multiversion! {
    fn layer_norm_rows(
        x: &[f32],
        d: usize,
        gamma: &[f32],
        beta: Option<&[f32]>,
        epsilon: f32,
        y: &mut [MaybeUninit<f32>],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) {
        for (((x, y), mean), rstd) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)).zip(mean).zip(rstd) {
            let mu = sum(x) / d as f32;
            let y = init(y, x.iter().map(|&x| x - mu));
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
    let (mut y, mut mean, mut rstd) = (uninit(x.len()), vec![0.0; n], vec![0.0; n]);
    let ys = &mut y.spare_capacity_mut()[..x.len()];
    let rows = rows_per_task(d);
    ys.par_chunks_mut(rows * d)
        .zip(mean.par_chunks_mut(rows))
        .zip(rstd.par_chunks_mut(rows))
        .zip(x.par_chunks(rows * d))
        .with_min_len(min_tasks(x.len()))
        .for_each(|(((y, mean), rstd), x)| {
            layer_norm_rows(x, d, gamma, beta, epsilon, y, mean, rstd)
        });
    // SAFETY: the tasks cover every row, and each row is written whole.
    (unsafe { written(y, x.len()) }, mean, rstd)
}

multiversion! {
    /// `sum = x + h`.
    fn residual_sum(x: &[f32], h: &[f32], sum: &mut [MaybeUninit<f32>]) {
        init(sum, x.iter().zip(h).map(|(&x, &h)| x + h));
    }
}

multiversion! {
    /// `sum = x + h ⊙ sum` where `sum` holds the dropout multipliers.
    fn residual_sum_dropped(x: &[f32], h: &[f32], sum: &mut [f32]) {
        for ((s, &x), &h) in sum.iter_mut().zip(x).zip(h) {
            *s = x + h * *s;
        }
    }
}

/// The residual addition and the LayerNorm after it, rows of `d`: `sum = x + h ⊙ M` (the
/// dropout mask's multipliers, element for element as [`super::dropout`] draws them; `x + h`
/// without a mask) and `(y, mean, 1/σ)` of its rows, each task's rows summed and normalised
/// while they are in cache → `(sum, y, mean, 1/σ)`.
pub fn add_layer_norm(
    x: &[f32],
    h: &[f32],
    mask: Option<DropoutMask>,
    d: usize,
    gamma: &[f32],
    beta: Option<&[f32]>,
    epsilon: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (len, n) = (x.len(), x.len() / d);
    let (mut sum, mut y) = (uninit(len), uninit(len));
    let (mut mean, mut rstd) = (vec![0.0; n], vec![0.0; n]);
    let rows = rows_per_task(d);
    let task = |(task, ((((sum, y), mean), rstd), (x, h))): (usize, RowTask)| {
        let sum = match mask {
            Some(mask) => {
                let sum = init(sum, std::iter::repeat_n(0.0, x.len()));
                mask.fill((task * rows * d) as u64, sum);
                residual_sum_dropped(x, h, sum);
                sum
            }
            None => {
                residual_sum(x, h, sum);
                // SAFETY: `residual_sum` wrote every element.
                unsafe { assume_init(sum) }
            }
        };
        layer_norm_rows(sum, d, gamma, beta, epsilon, y, mean, rstd);
    };
    let (s, ys) = (
        &mut sum.spare_capacity_mut()[..len],
        &mut y.spare_capacity_mut()[..len],
    );
    s.par_chunks_mut(rows * d)
        .zip(ys.par_chunks_mut(rows * d))
        .zip(mean.par_chunks_mut(rows))
        .zip(rstd.par_chunks_mut(rows))
        .zip(x.par_chunks(rows * d).zip(h.par_chunks(rows * d)))
        .enumerate()
        .with_min_len(min_tasks(len))
        .for_each(task);
    // SAFETY: the tasks cover every row, and each writes its rows of both whole.
    unsafe { (written(sum, len), written(y, len), mean, rstd) }
}

/// One task's rows of [`add_layer_norm`]: `(((sum, y), mean), 1/σ)` to write, `(x, h)` to read.
type RowTask<'a> = (
    (
        (
            (&'a mut [MaybeUninit<f32>], &'a mut [MaybeUninit<f32>]),
            &'a mut [f32],
        ),
        &'a mut [f32],
    ),
    (&'a [f32], &'a [f32]),
);

multiversion! {
    fn layer_norm_backward_rows(
        x: &[f32],
        d: usize,
        gamma: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dy: &[f32],
        residual: &[f32],
        dx: &mut [MaybeUninit<f32>],
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    ) {
        let rows = x.chunks_exact(d).zip(dy.chunks_exact(d)).zip(dx.chunks_exact_mut(d));
        for (i, (((x, dy), dx), (&mu, &r))) in rows.zip(mean.iter().zip(rstd)).enumerate() {
            // dx temporarily holds x̂; dL/dx̂ = dy·γ.
            let dx = init(dx, x.iter().map(|&x| (x - mu) * r));
            let (mut mean_g, mut mean_gx) = (0.0f32, 0.0f32);
            let mut acc_g = [0.0f32; LANES];
            let mut acc_gx = [0.0f32; LANES];
            // Element i goes to lane i mod LANES: whole chunks, then the tail. Each sum in a
            // pass of its own: in one loop the compiler vectorised across the two sums (pairs
            // of lanes) and did the sixteen lanes one by one.
            let ((xh_c, xh_t), (dy_c, dy_t), (g_c, g_t)) =
                (dx.as_chunks::<LANES>(), dy.as_chunks::<LANES>(), gamma.as_chunks::<LANES>());
            for (dy, g) in dy_c.iter().zip(g_c) {
                for l in 0..LANES {
                    acc_g[l] += dy[l] * g[l];
                }
            }
            for ((xh, dy), g) in xh_c.iter().zip(dy_c).zip(g_c) {
                for l in 0..LANES {
                    acc_gx[l] += dy[l] * g[l] * xh[l];
                }
            }
            for (l, ((&xh, &dy), &g)) in xh_t.iter().zip(dy_t).zip(g_t).enumerate() {
                let gi = dy * g;
                acc_g[l] += gi;
                acc_gx[l] += gi * xh;
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
            if !residual.is_empty() {
                for (dx, &g) in dx.iter_mut().zip(&residual[i * d..(i + 1) * d]) {
                    *dx += g;
                }
            }
        }
    }
}

/// LayerNorm's gradients `(dx, dγ, dβ)` from the forward pass's statistics; with `residual`
/// (the gradient the input already has from its other readers), `dx` plus it, added to each row
/// as it is made. dγ and dβ are sums over rows: each task of [`rows_per_task`] rows sums its
/// own, and those are added in task order — the same bits on one thread or several.
pub fn layer_norm_backward(
    x: &[f32],
    d: usize,
    gamma: &[f32],
    mean: &[f32],
    rstd: &[f32],
    dy: &[f32],
    residual: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let len = x.len();
    let mut dx = uninit(len);
    let residual = residual.unwrap_or(&[]);
    let rows = rows_per_task(d);
    // Each task's partial sums, added in task order afterwards: a rayon `fold`/`reduce` would
    // group them by how the work was stolen, and the weights would differ run to run.
    let partials: Vec<(Vec<f32>, Vec<f32>)> = dx.spare_capacity_mut()[..len]
        .par_chunks_mut(rows * d)
        .enumerate()
        .zip(x.par_chunks(rows * d))
        .zip(dy.par_chunks(rows * d))
        .zip(mean.par_chunks(rows).zip(rstd.par_chunks(rows)))
        .with_min_len(min_tasks(len))
        .map(|((((task, dx), x), dy), (mean, rstd))| {
            let residual = match residual.is_empty() {
                true => residual,
                false => &residual[task * rows * d..][..dx.len()],
            };
            let (mut dgamma, mut dbeta) = (vec![0.0f32; d], vec![0.0f32; d]);
            layer_norm_backward_rows(
                x,
                d,
                gamma,
                mean,
                rstd,
                dy,
                residual,
                dx,
                &mut dgamma,
                &mut dbeta,
            );
            (dgamma, dbeta)
        })
        .collect();
    let (mut dgamma, mut dbeta) = (vec![0.0f32; d], vec![0.0f32; d]);
    for (g, b) in &partials {
        dgamma.iter_mut().zip(g).for_each(|(a, v)| *a += v);
        dbeta.iter_mut().zip(b).for_each(|(a, v)| *a += v);
    }
    // SAFETY: the tasks cover every row, and each row is written whole.
    (unsafe { written(dx, len) }, dgamma, dbeta)
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
    let rows = rows_per_task(s);
    y.par_chunks_mut(rows * s)
        .zip(x.par_chunks(rows * s))
        .with_min_len(min_tasks(x.len()))
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
    let rows = rows_per_task(s);
    dx.par_chunks_mut(rows * s)
        .zip(p.par_chunks(rows * s).zip(dp.par_chunks(rows * s)))
        .with_min_len(min_tasks(p.len()))
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
    let rows = rows_per_task(v);
    x.par_chunks(rows * v)
        .zip(targets.par_chunks(rows))
        .zip(loss.par_chunks_mut(rows).zip(lse.par_chunks_mut(rows)))
        .with_min_len(min_tasks(x.len()))
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
    let rows = rows_per_task(v);
    x.par_chunks(rows * v)
        .zip(slots.par_chunks_mut(rows * v))
        .zip(targets.par_chunks(rows))
        .zip(lse.par_chunks(rows).zip(grad.par_chunks(rows)))
        .with_min_len(min_tasks(x.len()))
        .for_each(|(((x, dx), t), (lse, g))| {
            cross_entropy_backward_rows(x, v, t, lse, g, smoothing, ignore, dx)
        });
    // SAFETY: every row of `dx` was written in full above.
    unsafe { written(dx, x.len()) }
}
