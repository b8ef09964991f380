//! Positional encodings, chosen by config: fixed sinusoids (1-D, or 2-D for image patches), a
//! learned table, none, or relative positions applied inside attention ([`super::relative`]).

use super::relative::RelativePosition;
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
    /// 2-D sin-cos for a grid of image patches (MAE, Simple ViT): half the channels encode the
    /// row with 1-D sinusoids, half the column. Needs `grid`; leading non-patch tokens (the
    /// classification token) get zeros.
    Sincos2d,
    /// No position information: the model sees a set, not a sequence (for ablations).
    None,
    /// Rotary embeddings: queries and keys rotated by their position inside every
    /// self-attention layer (Su et al. 2021); nothing added to the embeddings.
    Rope,
    /// Attention with linear biases: each head penalises a key by its distance to the query
    /// (Press et al. 2022); nothing added to the embeddings.
    Alibi,
}

impl PositionKind {
    /// The relative positions self-attention applies for this kind (none for the kinds added
    /// to the embeddings).
    pub fn relative(self) -> RelativePosition {
        match self {
            PositionKind::Rope => RelativePosition::Rope,
            PositionKind::Alibi => RelativePosition::Alibi,
            _ => RelativePosition::None,
        }
    }

    /// Whether a model with these positions runs on sequences of any length (relative
    /// positions) rather than at most the table it was built with.
    pub fn any_length(self) -> bool {
        self.relative() != RelativePosition::None
    }
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
    /// `[rows, cols]` of the patch grid, for `sincos2d`: the last `rows · cols` of the
    /// `max_len` positions.
    #[config(default = "None")]
    pub grid: Option<[usize; 2]>,
}

/// Adds position information to token embeddings.
#[derive(Module, Debug)]
pub enum PositionEncoding<B: Backend> {
    /// A fixed table, `[max_len, d]`, not trained (sinusoids, 2-D sinusoids, or zeros).
    ///
    /// The variant's name is written into saved weights: it stays `Sinusoidal`, the name
    /// artifacts trained before the 2-D and zero tables existed carry, so they still load.
    Sinusoidal(FixedTable<B>),
    /// A learned table.
    Learned(Embedding<B>),
    /// Nothing added: positions live inside attention (RoPE, ALiBi). The table, `[max_len, 1]`
    /// zeros, only records the length the model was built for (a module variant needs a field).
    Relative(FixedTable<B>),
}

/// A fixed table, held as a constant (no gradient).
#[derive(Module, Debug)]
pub struct FixedTable<B: Backend> {
    table: Tensor<B, 2>,
}

impl PositionEncodingConfig {
    /// Builds the module.
    ///
    /// # Panics
    /// For `sincos2d` without a `grid` that fits in `max_len`, or a `d_model` not divisible by 4.
    pub fn init<B: Backend>(&self, device: &B::Device) -> PositionEncoding<B> {
        let fixed = |table| PositionEncoding::Sinusoidal(FixedTable { table });
        match self.kind {
            PositionKind::Sinusoidal => fixed(sinusoid_table(self.max_len, self.d_model, device)),
            PositionKind::Sincos2d => {
                let [rows, cols] = self.grid.expect("sincos2d needs the patch grid");
                assert!(rows * cols <= self.max_len, "the grid must fit in max_len");
                let grid = sincos_2d_table(rows, cols, self.d_model, device);
                let leading = Tensor::zeros([self.max_len - rows * cols, self.d_model], device);
                fixed(Tensor::cat(vec![leading, grid], 0))
            }
            PositionKind::None => fixed(Tensor::zeros([self.max_len, self.d_model], device)),
            PositionKind::Rope | PositionKind::Alibi => PositionEncoding::Relative(FixedTable {
                table: Tensor::zeros([self.max_len, 1], device),
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
    /// The encodings of positions `0..t`, `[t, d]` (`None` for relative positions, which add
    /// nothing).
    ///
    /// # Panics
    /// If `t` exceeds `max_len` (callers check prompt lengths first).
    pub fn encodings(&self, t: usize) -> Option<Tensor<B, 2>> {
        match self {
            PositionEncoding::Sinusoidal(s) => Some(s.table.clone().narrow(0, 0, t)),
            PositionEncoding::Learned(e) => Some(e.weight.val().narrow(0, 0, t)),
            PositionEncoding::Relative(_) => None,
        }
    }

    /// `x + PE[start..start + t]`: positions of tokens that follow `start` earlier ones.
    ///
    /// # Shapes
    /// `x`: `[b, t, d]` → `[b, t, d]`.
    ///
    /// # Panics
    /// If `start + t` exceeds `max_len`.
    pub fn forward_from(&self, x: Tensor<B, 3>, start: usize) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        match self.encodings(start + t) {
            // [b, t·d] + [1, t·d]: one row added to every sequence (a broadcast a CPU backend
            // runs as a vector loop; over [b, t, d] + [1, t, d] flex walks strides element by
            // element, 2% of a training step).
            Some(table) => {
                let rows = table.narrow(0, start, t).reshape([1, t * d]);
                (x.reshape([b, t * d]) + rows).reshape([b, t, d])
            }
            None => x,
        }
    }

    /// `x + PE[positions[r]]` for each row `r` of one token each: sequences at different
    /// positions (continuous batching).
    ///
    /// # Shapes
    /// `x`: `[b, 1, d]` → `[b, 1, d]`.
    pub fn forward_at(&self, x: Tensor<B, 3>, positions: &[usize]) -> Tensor<B, 3> {
        let last = positions.iter().max().map_or(0, |p| p + 1);
        let Some(table) = self.encodings(last) else {
            return x;
        };
        let ids: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
        let ids =
            Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [positions.len()]), &x.device());
        x + table.select(0, ids).unsqueeze_dim::<3>(1) // [b, 1, d]
    }

    /// `x + PE[0..t]`.
    ///
    /// # Shapes
    /// `x`: `[b, t, d]` → `[b, t, d]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.forward_from(x, 0)
    }

    /// Longest sequence this encoding covers.
    pub fn max_len(&self) -> usize {
        match self {
            PositionEncoding::Sinusoidal(s) => s.table.dims()[0],
            PositionEncoding::Learned(e) => e.weight.dims()[0],
            PositionEncoding::Relative(r) => r.table.dims()[0],
        }
    }

    /// Whether positions are relative (RoPE, ALiBi): the model then runs on sequences of any
    /// length, [`Self::max_len`] being the length it was built for.
    pub fn any_length(&self) -> bool {
        matches!(self, PositionEncoding::Relative(_))
    }

    /// The learned table, if any (for weight inspection and tests).
    pub fn learned_table(&self) -> Option<&Param<Tensor<B, 2>>> {
        match self {
            PositionEncoding::Learned(e) => Some(&e.weight),
            PositionEncoding::Sinusoidal(_) | PositionEncoding::Relative(_) => None,
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

/// 2-D sin-cos encodings of a `rows × cols` patch grid, `[rows · cols, d_model]` in row-major
/// patch order: channels `0..d/2` are the 1-D sinusoids of the row, `d/2..d` of the column.
///
/// # Panics
/// If `d_model` is not divisible by 4.
pub fn sincos_2d_table<B: Backend>(
    rows: usize,
    cols: usize,
    d_model: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    assert!(
        d_model.is_multiple_of(4),
        "2-D sin-cos needs d_model divisible by 4"
    );
    let half = d_model / 2;
    let by_row = sinusoid_table::<B>(rows, half, device); // [rows, d/2]
    let by_col = sinusoid_table::<B>(cols, half, device); // [cols, d/2]
    let by_row = by_row.unsqueeze_dim::<3>(1).expand([rows, cols, half]); // [rows, cols, d/2]
    let by_col = by_col.unsqueeze_dim::<3>(0).expand([rows, cols, half]); // [rows, cols, d/2]
    Tensor::cat(vec![by_row, by_col], 2).reshape([rows * cols, d_model])
}
