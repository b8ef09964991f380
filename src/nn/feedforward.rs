//! The position-wise feed-forward network `FFN(x) = act(x·W₁ + b₁)·W₂ + b₂` (§3.3).

use super::linear;
use crate::kernels::{decode_linear, feed_forward, gelu, After, LabBackend};
use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, Initializer, LayerNorm, Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::activation::relu;
use serde::{Deserialize, Serialize};

/// The non-linearity between the two projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `max(0, x)`, as in the original paper.
    Relu,
    /// `x·Φ(x)` (exact, erf-based), as in BERT.
    Gelu,
    /// GELU's tanh approximation `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`, as OpenAI's GPT-2 was
    /// trained (Hugging Face's `gelu_new`): what imported GPT-2 checkpoints need.
    GeluTanh,
}

impl Activation {
    /// The activation of `x`, elementwise.
    pub fn apply<B: LabBackend, const D: usize>(self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Activation::Relu => relu(x),
            Activation::Gelu => gelu(x),
            Activation::GeluTanh => gelu_tanh(x),
        }
    }
}

/// GELU's tanh approximation, composed of tensor ops (differentiable on any backend).
pub fn gelu_tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let inner = (x.clone() + x.clone().powi_scalar(3).mul_scalar(0.044715)).mul_scalar(c);
    x.mul(inner.tanh().add_scalar(1.0)).mul_scalar(0.5)
}

/// Configuration of [`FeedForward`].
#[derive(Config, Debug)]
pub struct FeedForwardConfig {
    /// Model width.
    pub d_model: usize,
    /// Inner width (the paper uses `4·d_model`).
    pub d_ff: usize,
    /// The non-linearity.
    #[config(default = "Activation::Gelu")]
    pub activation: Activation,
    /// Dropout after the non-linearity.
    #[config(default = 0.0)]
    pub dropout: f64,
    /// Whether the projections carry a bias.
    #[config(default = true)]
    pub bias: bool,
    /// Initializer of W₁.
    #[config(default = "Initializer::Normal { mean: 0.0, std: 0.02 }")]
    pub initializer: Initializer,
    /// Initializer of W₂, which feeds the residual stream.
    #[config(default = "Initializer::Normal { mean: 0.0, std: 0.02 }")]
    pub output_initializer: Initializer,
}

/// Two linear maps with a non-linearity between, applied to each position independently.
#[derive(Module, Debug)]
pub struct FeedForward<B: LabBackend> {
    /// W₁, `[d, d_ff]`.
    pub linear_inner: Linear<B>,
    /// W₂, `[d_ff, d]`.
    pub linear_outer: Linear<B>,
    dropout: Dropout,
    activation: Activation,
}

impl FeedForwardConfig {
    /// Builds the module.
    pub fn init<B: LabBackend>(&self, device: &B::Device) -> FeedForward<B> {
        let linear = |d_in, d_out, initializer: &Initializer| {
            LinearConfig::new(d_in, d_out)
                .with_bias(self.bias)
                .with_initializer(initializer.clone())
                .init(device)
        };
        FeedForward {
            linear_inner: linear(self.d_model, self.d_ff, &self.initializer),
            linear_outer: linear(self.d_ff, self.d_model, &self.output_initializer),
            dropout: DropoutConfig::new(self.dropout).init(),
            activation: self.activation,
        }
    }
}

impl<B: LabBackend> FeedForward<B> {
    /// # Shapes
    /// `x`: `[b, t, d]` → `[b, t, d]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        if let Activation::Gelu = self.activation {
            let layers = [&self.linear_inner, &self.linear_outer];
            return feed_forward(&self.dropout, layers, x);
        }
        let h = linear(&self.linear_inner, x); // [b, t, d_ff]
        let h = crate::kernels::dropout(&self.dropout, self.activation.apply(h));
        linear(&self.linear_outer, h)
    }

    /// Whether [`Self::forward_step`] takes this network: GELU's.
    pub fn folds(&self) -> bool {
        matches!(self.activation, Activation::Gelu)
    }

    /// A pre-norm block's feed-forward sublayer in a decoding step, residual addition
    /// included: `x + FFN(LN(x))`, two launches on a GPU ([`decode_linear`]: the LayerNorm and
    /// GELU in the first product's, the addition in the second's). Needs [`Self::folds`].
    ///
    /// # Shapes
    /// `x`: `[b, n, d]` → `[b, n, d]`.
    pub fn forward_step(&self, x: Tensor<B, 3>, norm: &LayerNorm<B>, epsilon: f64) -> Tensor<B, 3> {
        let [b, n, d] = x.dims();
        let x = x.reshape([b * n, d]);
        let step = |layer: &Linear<B>, x, norm, after| {
            let bias = layer.bias.as_ref().map(|bias| bias.val());
            decode_linear(x, norm, layer.weight.val(), bias, after)
        };
        let h = step(
            &self.linear_inner,
            x.clone(),
            Some((norm, epsilon)),
            After::Gelu,
        );
        let y = step(&self.linear_outer, h, None, After::Residual(x));
        y.reshape([b, n, d])
    }
}
