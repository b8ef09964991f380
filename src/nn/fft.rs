//! Long causal convolution, by FFT in `O(L log L)` and directly in `O(L²)`.
//!
//! burn 0.21's FFT has no backward pass, so [`fft`] is a radix-2 Cooley–Tukey transform written
//! with differentiable tensor ops (reshape, slice, multiply, concatenate): `log₂ N` levels, each
//! a constant number of element-wise ops over all `N` points, with the transforms of all rows
//! batched into one tensor; the last levels (size ≤ [`BASE`]) are one matrix product with the
//! DFT matrix. Autodiff sees ordinary ops, so gradients flow through it.
//!
//! [`fft_conv`] zero-pads signal and filter to `N ≥ 2L`, so the circular convolution the FFT
//! computes equals the linear (causal) one on the first `L` outputs; [`direct_conv`] is the
//! reference it is tested against.

use burn::prelude::*;
use burn::tensor::ops::PadMode;
use std::f64::consts::PI;

/// Transforms of this size or smaller are done as one product with the DFT matrix.
const BASE: usize = 32;

/// A complex tensor as its real and imaginary parts.
pub type Complex<B, const D: usize> = (Tensor<B, D>, Tensor<B, D>);

/// The discrete Fourier transform `X_f = Σₙ xₙ·e^{−2πi·f·n/N}` of every row.
///
/// # Shapes
/// `[m, N]` real and imaginary parts → `[m, N]`; `N` must be a power of two.
///
/// # Panics
/// If `N` is not a power of two.
pub fn fft<B: Backend>((re, im): Complex<B, 2>) -> Complex<B, 2> {
    let [m, n] = re.dims();
    assert!(n.is_power_of_two(), "fft length {n} is not a power of two");
    if n <= BASE {
        return dft((re, im));
    }
    let half = n / 2;
    // Even and odd samples of each row become two rows of half length: [m, N] → [2m, N/2].
    let split = |x: Tensor<B, 2>| {
        x.reshape([m, half, 2]) // [m, N/2, 2]
            .swap_dims(1, 2) // [m, 2, N/2]
            .reshape([2 * m, half])
    };
    let (sub_re, sub_im) = fft((split(re), split(im)));
    let sub_re = sub_re.reshape([m, 2, half]);
    let sub_im = sub_im.reshape([m, 2, half]);
    let part = |x: &Tensor<B, 3>, p: usize| x.clone().slice(s![.., p]).reshape([m, half]);
    let (even_re, even_im) = (part(&sub_re, 0), part(&sub_im, 0));
    let (odd_re, odd_im) = (part(&sub_re, 1), part(&sub_im, 1));

    // X_f = E_f + w^f·O_f and X_{f+N/2} = E_f − w^f·O_f, with w = e^{−2πi/N}.
    let device = even_re.device();
    let (w_re, w_im) = twiddles::<B>(n, &device);
    let t_re = odd_re.clone() * w_re.clone() - odd_im.clone() * w_im.clone();
    let t_im = odd_re * w_im + odd_im * w_re;
    (
        Tensor::cat(vec![even_re.clone() + t_re.clone(), even_re - t_re], 1),
        Tensor::cat(vec![even_im.clone() + t_im.clone(), even_im - t_im], 1),
    )
}

/// `e^{−2πi·f/N}` for `f < N/2`, as `[1, N/2]` real and imaginary parts.
fn twiddles<B: Backend>(n: usize, device: &B::Device) -> Complex<B, 2> {
    let angles = (0..n / 2).map(|f| -2.0 * PI * f as f64 / n as f64);
    let re: Vec<f32> = angles.clone().map(|a| a.cos() as f32).collect();
    let im: Vec<f32> = angles.map(|a| a.sin() as f32).collect();
    (
        Tensor::from_data(TensorData::new(re, [1, n / 2]), device),
        Tensor::from_data(TensorData::new(im, [1, n / 2]), device),
    )
}

/// The DFT as a matrix product, `X = x·W` with `W_{nf} = e^{−2πi·f·n/N}`: `O(N²)` per row,
/// used for the small transforms at the bottom of [`fft`].
fn dft<B: Backend>((re, im): Complex<B, 2>) -> Complex<B, 2> {
    let n = re.dims()[1];
    let angle = |i: usize| -2.0 * PI * ((i / n) * (i % n) % n) as f64 / n as f64;
    let cos: Vec<f32> = (0..n * n).map(|i| angle(i).cos() as f32).collect();
    let sin: Vec<f32> = (0..n * n).map(|i| angle(i).sin() as f32).collect();
    let device = re.device();
    let cos = Tensor::<B, 2>::from_data(TensorData::new(cos, [n, n]), &device);
    let sin = Tensor::<B, 2>::from_data(TensorData::new(sin, [n, n]), &device);
    // (a + ib)(c + id) = (ac − bd) + i(ad + bc)
    (
        re.clone().matmul(cos.clone()) - im.clone().matmul(sin.clone()),
        re.matmul(sin) + im.matmul(cos),
    )
}

/// The causal convolution `yₜ = Σ_{s ≤ t} h_s·u_{t−s}` of every channel, by FFT.
///
/// # Shapes
/// `u`: `[b, d, L]` signals, `h`: `[d, L]` one filter per channel → `[b, d, L]`.
pub fn fft_conv<B: Backend>(u: Tensor<B, 3>, h: Tensor<B, 2>) -> Tensor<B, 3> {
    let [b, d, l] = u.dims();
    let n = (2 * l).next_power_of_two();
    let zeros = |x: &Tensor<B, 2>| x.zeros_like();
    let u = u
        .reshape([b * d, l])
        .pad([(0, n - l)], PadMode::Constant(0.0)); // [b·d, N]
    let h = h.pad([(0, n - l)], PadMode::Constant(0.0)); // [d, N]
    let (u_re, u_im) = fft((u.clone(), zeros(&u)));
    let (h_re, h_im) = fft((h.clone(), zeros(&h)));
    let spread = |x: Tensor<B, 2>| x.reshape([b, d, n]);
    let (u_re, u_im) = (spread(u_re), spread(u_im));
    let h_re = h_re.reshape([1, d, n]);
    let h_im = h_im.reshape([1, d, n]);
    let p_re = u_re.clone() * h_re.clone() - u_im.clone() * h_im.clone(); // [b, d, N]
    let p_im = u_re * h_im + u_im * h_re;
    // Real part of the inverse transform: ifft(P) = conj(fft(conj(P)))/N.
    let (y, _) = fft((p_re.reshape([b * d, n]), p_im.reshape([b * d, n]).neg()));
    y.div_scalar(n as f32)
        .slice([0..b * d, 0..l])
        .reshape([b, d, l])
}

/// The same convolution as [`fft_conv`] as one batched matrix product with the Toeplitz matrix
/// `T[t, s] = h_{t−s}` (`s ≤ t`): `O(L²)` work but a single matmul, faster than the FFT's many
/// small ops for short sequences.
pub fn toeplitz_conv<B: Backend>(u: Tensor<B, 3>, h: Tensor<B, 2>) -> Tensor<B, 3> {
    let [_, d, l] = u.dims();
    let device = u.device();
    let lags: Vec<i64> = (0..l * l)
        .map(|i| (i / l) as i64 - (i % l) as i64)
        .collect();
    let future = Tensor::<B, 1, Int>::from_data(TensorData::new(lags.clone(), [l * l]), &device)
        .lower_elem(0)
        .reshape([1, l, l]); // s > t
    let lags: Vec<i64> = lags.into_iter().map(|lag| lag.max(0)).collect();
    let index = Tensor::<B, 1, Int>::from_data(TensorData::new(lags, [l * l]), &device);
    let toeplitz = h
        .select(1, index) // [d, L·L]
        .reshape([d, l, l]) // [d, t, s]
        .mask_fill(future.expand([d, l, l]), 0.0);
    toeplitz
        .matmul(u.swap_dims(0, 1).swap_dims(1, 2)) // [d, t, s]·[d, s, b] = [d, t, b]
        .swap_dims(1, 2) // [d, b, t]
        .swap_dims(0, 1) // [b, d, t]
}

/// The causal convolution by whichever route is faster at this length: the Toeplitz product up
/// to [`TOEPLITZ_MAX`] positions, the FFT beyond (`O(L log L)`).
pub fn causal_conv<B: Backend>(u: Tensor<B, 3>, h: Tensor<B, 2>) -> Tensor<B, 3> {
    if u.dims()[2] <= TOEPLITZ_MAX {
        toeplitz_conv(u, h)
    } else {
        fft_conv(u, h)
    }
}

/// Longest sequence [`causal_conv`] convolves by the Toeplitz product.
pub const TOEPLITZ_MAX: usize = 128;

/// The same convolution as [`fft_conv`], term by term: `L` shifted multiply-adds, `O(L²)`.
pub fn direct_conv<B: Backend>(u: Tensor<B, 3>, h: Tensor<B, 2>) -> Tensor<B, 3> {
    let [b, d, l] = u.dims();
    let mut y = u.zeros_like();
    for shift in 0..l {
        let tap = h.clone().slice([0..d, shift..shift + 1]).reshape([1, d, 1]); // h_s
        let shifted = u
            .clone()
            .slice([0..b, 0..d, 0..l - shift])
            .pad([(shift, 0)], PadMode::Constant(0.0)); // u_{t−s}
        y = y + shifted * tap;
    }
    y
}
