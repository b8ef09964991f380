//! Positional encodings, chosen by config: fixed sinusoids or a learned table.

use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, Initializer};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

/// Which positional encoding a model uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PositionKind {
    /// `PE(pos, 2i) = sin(pos / 10000^(2i/d))`, `PE(pos, 2i+1) = cos(pos / 10000^(2i/d))`.
    Sinusoidal,
    /// A trained `[max_len, d_model]` table (GPT-2 style).
    Learned,
}

/// Configuration of [`PositionEncoding`].
#[derive(Config, Debug)]
pub struct PositionEncodingConfig {
    /// Which encoding.
    pub kind: PositionKind,
    /// Longest sequence the model accepts.
    pub max_len: usize,
    /// Model width.
    pub d_model: usize,
}

/// Adds position information to token embeddings.
#[derive(Module, Debug)]
pub enum PositionEncoding<B: Backend> {
    /// Fixed sinusoids, `[max_len, d]`, not trained.
    Sinusoidal(Sinusoidal<B>),
    /// A learned table.
    Learned(Embedding<B>),
}

/// The fixed sinusoid table, held as a constant (no gradient).
#[derive(Module, Debug)]
pub struct Sinusoidal<B: Backend> {
    table: Tensor<B, 2>,
}

impl PositionEncodingConfig {
    /// Builds the module.
    pub fn init<B: Backend>(&self, device: &B::Device) -> PositionEncoding<B> {
        match self.kind {
            PositionKind::Sinusoidal => PositionEncoding::Sinusoidal(Sinusoidal {
                table: sinusoid_table(self.max_len, self.d_model, device),
            }),
            PositionKind::Learned => PositionEncoding::Learned(
                EmbeddingConfig::new(self.max_len, self.d_model)
                    .with_initializer(Initializer::Normal {
                        mean: 0.0,
                        std: 0.02,
                    })
                    .init(device),
            ),
        }
    }
}

impl<B: Backend> PositionEncoding<B> {
    /// The encodings of positions `0..t`, `[t, d]`.
    ///
    /// # Panics
    /// If `t` exceeds `max_len` (callers check prompt lengths first).
    pub fn encodings(&self, t: usize) -> Tensor<B, 2> {
        match self {
            PositionEncoding::Sinusoidal(s) => s.table.clone().narrow(0, 0, t),
            PositionEncoding::Learned(e) => e.weight.val().narrow(0, 0, t),
        }
    }

    /// `x + PE[0..t]`.
    ///
    /// # Shapes
    /// `x`: `[b, t, d]` → `[b, t, d]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [_, t, _] = x.dims();
        x + self.encodings(t).unsqueeze::<3>() // [1, t, d] broadcast over b
    }

    /// Longest sequence this encoding covers.
    pub fn max_len(&self) -> usize {
        match self {
            PositionEncoding::Sinusoidal(s) => s.table.dims()[0],
            PositionEncoding::Learned(e) => e.weight.dims()[0],
        }
    }

    /// The learned table, if any (for weight inspection and tests).
    pub fn learned_table(&self) -> Option<&Param<Tensor<B, 2>>> {
        match self {
            PositionEncoding::Learned(e) => Some(&e.weight),
            PositionEncoding::Sinusoidal(_) => None,
        }
    }
}

/// The sinusoid table of "Attention Is All You Need" §3.5, `[max_len, d_model]`:
/// `PE(pos, 2i) = sin(pos / 10000^(2i/d))`, `PE(pos, 2i+1) = cos(pos / 10000^(2i/d))`.
pub fn sinusoid_table<B: Backend>(
    max_len: usize,
    d_model: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    let mut values = Vec::with_capacity(max_len * d_model);
    for pos in 0..max_len {
        for j in 0..d_model {
            let two_i = (j - j % 2) as f64;
            let angle = pos as f64 / 10000f64.powf(two_i / d_model as f64);
            values.push(if j % 2 == 0 { angle.sin() } else { angle.cos() } as f32);
        }
    }
    Tensor::from_data(TensorData::new(values, [max_len, d_model]), device)
}
