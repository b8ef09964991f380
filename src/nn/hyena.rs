//! The Hyena operator (Poli et al. 2023, "Hyena Hierarchy"), a causal token mixer without
//! attention: long convolutions with implicitly parametrised filters, interleaved with
//! element-wise gating.
//!
//! For an input `u` `[b, t, d]` of order `N`:
//! 1. project to `N + 1` streams `x¹…xᴺ, v` (one linear map to `(N+1)·d`), each smoothed by a
//!    short causal depthwise convolution;
//! 2. `z¹ = v`, `zⁿ⁺¹ = xⁿ ⊙ (hⁿ * zⁿ + Dⁿ ⊙ zⁿ)`: long causal convolution, skip term,
//!    gating;
//! 3. `y = zᴺ⁺¹·W_out`.
//!
//! The long filters are implicit: `hⁿ(t) = window(t) · FFN(positional features of t)`, a small
//! sine-activated network evaluated at every position, times an exponentially decaying window
//! (fast decay in some channels, slow in others). Positions are measured against the model's
//! `max_len`, so a filter tap never depends on how long the current input is — a prefix gives
//! the same outputs alone as inside a longer sequence. The convolutions run by FFT
//! ([`super::fft::fft_conv`], `O(t log t)`).

use super::fft::{causal_conv, direct_conv, fft_conv};
use crate::kernels::LabBackend;
use burn::module::{Module, Param};
use burn::nn::conv::{Conv1d, Conv1dConfig};
use burn::nn::{Initializer, Linear, LinearConfig, PaddingConfig1d};
use burn::prelude::*;
use serde::{Deserialize, Serialize};
use std::f64::consts::PI;

/// Settings of the Hyena operator (`"mixer": {"kind": "hyena", …}` in a config).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HyenaConfig {
    /// Order `N`: how many convolution-and-gate steps (2 in the paper's language models).
    pub order: usize,
    /// Hidden width of the filter network.
    pub filter_width: usize,
    /// Frequencies of the positional features the filter network reads (each a sin/cos pair,
    /// besides the position itself).
    pub filter_bands: usize,
    /// Width of the short depthwise convolution on each projected stream.
    pub short_kernel: usize,
}

impl Default for HyenaConfig {
    fn default() -> Self {
        Self {
            order: 2,
            filter_width: 64,
            filter_bands: 8,
            short_kernel: 3,
        }
    }
}

impl HyenaConfig {
    /// Builds the operator for sequences of up to `max_len` positions.
    pub fn init<B: LabBackend>(
        &self,
        d_model: usize,
        max_len: usize,
        output_initializer: Initializer,
        device: &B::Device,
    ) -> Hyena<B> {
        let streams = (self.order + 1) * d_model;
        let features = 1 + 2 * self.filter_bands;
        let linear = |d_in: usize, d_out: usize, bias: bool| {
            LinearConfig::new(d_in, d_out)
                .with_bias(bias)
                .init::<B>(device)
        };
        Hyena {
            in_proj: linear(d_model, streams, true),
            short_conv: Conv1dConfig::new(streams, streams, self.short_kernel)
                .with_groups(streams)
                .with_padding(PaddingConfig1d::Explicit(self.short_kernel - 1, 0))
                .init(device),
            filter: vec![
                linear(features, self.filter_width, true),
                linear(self.filter_width, self.filter_width, true),
                linear(self.filter_width, self.order * d_model, false),
            ],
            frequency: Param::from_tensor(Tensor::ones([self.filter_width], device)),
            skip: Param::from_tensor(Tensor::random(
                [self.order, d_model],
                burn::tensor::Distribution::Normal(0.0, 1.0),
                device,
            )),
            out_proj: LinearConfig::new(d_model, d_model)
                .with_initializer(output_initializer)
                .init(device),
            order: self.order,
            bands: self.filter_bands,
            max_len,
        }
    }
}

/// The Hyena operator; see the module docs.
#[derive(Module, Debug)]
pub struct Hyena<B: LabBackend> {
    /// `d → (N+1)·d`: the streams `x¹…xᴺ, v`.
    pub in_proj: Linear<B>,
    /// Short causal depthwise convolution over each stream.
    pub short_conv: Conv1d<B>,
    /// The implicit filter network: features → width → width → `N·d` (sine activations).
    pub filter: Vec<Linear<B>>,
    /// Frequency `ω` of the filter network's sine activations, `[width]`.
    pub frequency: Param<Tensor<B, 1>>,
    /// The skip term `D`, `[N, d]`.
    pub skip: Param<Tensor<B, 2>>,
    /// `d → d`.
    pub out_proj: Linear<B>,
    order: usize,
    bands: usize,
    max_len: usize,
}

impl<B: LabBackend> Hyena<B> {
    /// Mixes the sequence, causally (long convolutions by [`causal_conv`]: a Toeplitz product
    /// for short inputs, the FFT for long ones).
    ///
    /// # Shapes
    /// `x`: `[b, t, d]` with `t <= max_len` → `[b, t, d]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.forward_with(x, causal_conv)
    }

    /// [`Self::forward`] with every long convolution by FFT, whatever the length.
    pub fn forward_fft(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.forward_with(x, fft_conv)
    }

    /// [`Self::forward`] with the long convolutions done directly in `O(t²)`: the reference the
    /// FFT path is tested against.
    pub fn forward_direct(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.forward_with(x, direct_conv)
    }

    fn forward_with(
        &self,
        x: Tensor<B, 3>,
        conv: fn(Tensor<B, 3>, Tensor<B, 2>) -> Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let streams = self
            .in_proj
            .forward(x) // [b, t, (N+1)·d]
            .swap_dims(1, 2); // [b, (N+1)·d, t]
        let streams = self.short_filter(streams); // [b, (N+1)·d, t]
        let mut streams = streams.chunk(self.order + 1, 1); // N + 1 × [b, d, t]
        let mut z = streams.pop().expect("order + 1 streams"); // v
        let filters = self.filters(t); // [N, d, t]
        let skip = self.skip.val();
        for (n, gate) in streams.into_iter().enumerate() {
            let h = filters.clone().slice(s![n]).reshape([d, t]); // [d, t]
            let d_n = skip.clone().slice(s![n]).reshape([1, d, 1]);
            z = gate * (conv(z.clone(), h) + z * d_n); // [b, d, t]
        }
        self.out_proj
            .forward(z.swap_dims(1, 2)) // [b, t, d]
            .reshape([b, t, d])
    }

    /// The short causal depthwise convolution `yₜ = Σᵢ wᵢ·x_{t−(k−1)+i} + b` of every stream,
    /// as `k` shifted multiply-adds (burn's grouped `Conv1d` runs one small product per group,
    /// far slower here); its weights are the `Conv1d` module's.
    ///
    /// # Shapes
    /// `[b, c, t]` → `[b, c, t]`.
    fn short_filter(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, c, t] = x.dims();
        let weight = self.short_conv.weight.val(); // [c, 1, k]
        let k = weight.dims()[2];
        let mut y = match &self.short_conv.bias {
            Some(bias) => bias.val().reshape([1, c, 1]).expand([b, c, t]),
            None => x.zeros_like(),
        };
        for i in 0..k {
            let shift = k - 1 - i;
            if shift >= t {
                continue;
            }
            let tap = weight.clone().slice(s![.., .., i]).reshape([1, c, 1]);
            let shifted = x
                .clone()
                .slice([0..b, 0..c, 0..t - shift])
                .pad([(shift, 0)], burn::tensor::ops::PadMode::Constant(0.0));
            y = y + shifted * tap;
        }
        y
    }

    /// The long filters `hⁿ(t)` for `t < len`: `[N, d, len]`.
    pub fn filters(&self, len: usize) -> Tensor<B, 3> {
        let device = self.frequency.device();
        let time = self.time(len, &device); // [len, 1]
        let features = self.position_features(time.clone()); // [len, features]
        let omega = self.frequency.val().unsqueeze::<2>(); // [1, width]
        let hidden = (self.filter[0].forward(features) * omega.clone()).sin();
        let hidden = (self.filter[1].forward(hidden) * omega).sin();
        let h = self.filter[2].forward(hidden); // [len, N·d]
        let nd = h.dims()[1];
        let h = h * self.decay_window(time, nd); // [len, N·d]
        h.reshape([len, self.order, nd / self.order]) // [len, N, d]
            .permute([1, 2, 0]) // [N, d, len]
    }

    /// Positions measured against `max_len`, `t/max_len` for `t < len`: `[len, 1]`.
    fn time(&self, len: usize, device: &B::Device) -> Tensor<B, 2> {
        let scale = self.max_len.max(len) as f32;
        Tensor::<B, 1, Int>::arange(0..len as i64, device)
            .float()
            .div_scalar(scale)
            .reshape([len, 1])
    }

    /// `[t/max_len, cos(2π·f·t/max_len), sin(…)]` for `f = 1..=bands` (each band's cos and sin
    /// side by side): `time` `[len, 1]` → `[len, 1 + 2·bands]`.
    fn position_features(&self, time: Tensor<B, 2>) -> Tensor<B, 2> {
        let len = time.dims()[0];
        let device = time.device();
        let frequencies: Vec<f32> = (1..=self.bands)
            .map(|f| (2.0 * PI * f as f64) as f32)
            .collect();
        let frequencies =
            Tensor::<B, 2>::from_data(TensorData::new(frequencies, [1, self.bands]), &device);
        let angle = time.clone() * frequencies; // [len, bands]
        let bands = Tensor::stack::<3>(vec![angle.clone().cos(), angle.sin()], 2) // [len, bands, 2]
            .reshape([len, 2 * self.bands]);
        Tensor::cat(vec![time, bands], 1)
    }

    /// `exp(−αᶜ·t/max_len)`, `[len, channels]`, with rates spread from fast (the filter falls to
    /// 1% over 30% of `max_len`) to slow (to 1% over 150%), as in the paper's modulation.
    fn decay_window(&self, time: Tensor<B, 2>, channels: usize) -> Tensor<B, 2> {
        let (fast, slow) = (0.01f64.ln() / 0.3, 0.01f64.ln() / 1.5);
        let rates: Vec<f32> = (0..channels)
            .map(|c| {
                let share = if channels > 1 {
                    c as f64 / (channels - 1) as f64
                } else {
                    0.0
                };
                -(fast + (slow - fast) * share) as f32
            })
            .collect();
        let rates =
            Tensor::<B, 2>::from_data(TensorData::new(rates, [1, channels]), &time.device());
        (time * rates).neg().exp() // [len, channels]
    }

    /// Order `N`.
    pub fn order(&self) -> usize {
        self.order
    }
}
