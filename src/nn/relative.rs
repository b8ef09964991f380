//! Relative positions inside attention: rotary embeddings (RoPE, Su et al. 2021, "RoFormer")
//! and linear biases (ALiBi, Press et al. 2022, "Train Short, Test Long"). Neither adds
//! anything to the token embeddings; both make the score of query `i` and key `j` depend on
//! `i − j` only, so a model can run past the length it was trained on and a decoder's cache
//! can roll (see [`super::cache`]).

use crate::kernels::LabBackend;
use burn::prelude::*;
use serde::{Deserialize, Serialize};

/// How self-attention sees positions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RelativePosition {
    /// Not at all (positions, if any, were added to the embeddings).
    #[default]
    None,
    /// Queries and keys rotated by their position.
    Rope,
    /// A per-head linear penalty on the distance added to the scores.
    Alibi,
}

/// The base of RoPE's frequencies, `θ_i = BASE^(−2i/d_head)` (the paper's 10000).
pub const ROPE_BASE: f64 = 10000.0;

/// Rotates queries or keys `x` (`[b, h, t, k]`, `k` even) of positions `start..start + t`:
/// channel pairs `(c, c + k/2)` turn by the angle `pos · θ_c`, `θ_c = 10000^(−2c/k)`.
///
/// The paper pairs adjacent channels `(2c, 2c + 1)`; pairing the two halves (GPT-NeoX, Llama)
/// is the same rotation up to a fixed permutation of the channels, which the projections
/// learn, and needs no interleaving. `rope(q)·rope(k)` depends on the positions only through
/// their difference.
pub fn rope<B: LabBackend>(x: Tensor<B, 4>, start: usize) -> Tensor<B, 4> {
    let [_, _, t, k] = x.dims();
    let (cos, sin) = rope_tables::<B>(start, t, k, &x.device()); // [1, 1, t, k]
    turn(x, cos, sin)
}

/// `x·cos + [-x₂, x₁]·sin` for `x = [x₁, x₂]` (two halves of the last axis), the tables
/// broadcast over `x`.
fn turn<B: LabBackend>(x: Tensor<B, 4>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 4> {
    let half = x.dims()[3] / 2;
    let first = x.clone().narrow(3, 0, half);
    let second = x.clone().narrow(3, half, half);
    let rotated = Tensor::cat(vec![second.neg(), first], 3); // [-x₂, x₁]
    x * cos + rotated * sin
}

/// [`rope`] on the queries and keys of `qkv` (`[b, t, 3·h·k]`: Q, K and V side by side, as one
/// product against `W^Q`, `W^K`, `W^V` gives them) at positions `start..start + t`; V is left as
/// it is. The same rotation, value for value, computed on the contiguous packed tensor so that
/// the packed attention kernel reads it in place: on the CPU backends the element-wise products
/// on strided heads that [`rope`] sees cost several times the whole layer.
///
/// The swap of the halves is a product with [`half_turn`] (one ±1 per column: exact).
pub fn rope_packed<B: LabBackend>(qkv: Tensor<B, 3>, heads: usize, start: usize) -> Tensor<B, 3> {
    let [b, t, width] = qkv.dims();
    let k = width / 3 / heads;
    let device = qkv.device();
    let (cos, sin) = rope_tables::<B>(start, t, k, &device); // [1, 1, t, k]
                                                             // Rows (batch, position, head of Q, K or V), each k wide: Q's and K's heads turn, V's keep
                                                             // cos 1 and sin 0.
    let table = |angles: Tensor<B, 4>, v: f32| {
        let turned = angles.reshape([t, 1, k]).repeat_dim(1, 2 * heads);
        let kept = Tensor::full([t, heads, k], v, &device);
        Tensor::cat(vec![turned, kept], 1)
            .reshape([t * 3 * heads, k])
            .repeat_dim(0, b)
    };
    let rows = qkv.reshape([b * t * 3 * heads, k]);
    let swapped = rows.clone().matmul(half_turn::<B>(k, &device)); // [-x₂, x₁]
    (rows * table(cos, 1.0) + swapped * table(sin, 0.0)).reshape([b, t, width])
}

/// The `k × k` matrix `R` with `x·R = [-x₂, x₁]` for a row `x = [x₁, x₂]` of two halves.
fn half_turn<B: LabBackend>(k: usize, device: &B::Device) -> Tensor<B, 2> {
    let half = k / 2;
    let mut r = vec![0.0f32; k * k];
    for c in 0..half {
        r[(c + half) * k + c] = -1.0; // output c (first half) is -x₂[c]
        r[c * k + c + half] = 1.0; // output c + k/2 is x₁[c]
    }
    Tensor::from_data(TensorData::new(r, [k, k]), device)
}

/// `cos(pos · θ)` and `sin(pos · θ)` for positions `start..start + t`, each frequency written
/// twice (once per half), `[1, 1, t, k]`.
fn rope_tables<B: LabBackend>(
    start: usize,
    t: usize,
    k: usize,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let positions: Vec<usize> = (start..start + t).collect();
    let (cos, sin) = rope_tables_at::<B>(&positions, k, device);
    (cos.unsqueeze::<4>(), sin.unsqueeze::<4>())
}

/// [`rope`] of a batch of single positions, each row at its own: `x` `[b, h, 1, k]`, row `r` at
/// position `positions[r]` (continuous batching, where every sequence is at its own length).
pub fn rope_rows<B: LabBackend>(x: Tensor<B, 4>, positions: &[usize]) -> Tensor<B, 4> {
    let [b, _, t, k] = x.dims();
    assert!(
        t == 1 && positions.len() == b,
        "one position per row of one token"
    );
    let (cos, sin) = rope_tables_at::<B>(positions, k, &x.device());
    turn(x, cos.reshape([b, 1, 1, k]), sin.reshape([b, 1, 1, k]))
}

/// `cos(pos · θ)` and `sin(pos · θ)` for each of `positions`, each frequency written twice
/// (once per half), `[positions.len(), k]`.
fn rope_tables_at<B: LabBackend>(
    positions: &[usize],
    k: usize,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let (half, t) = (k / 2, positions.len());
    let mut cos = Vec::with_capacity(t * k);
    let mut sin = Vec::with_capacity(t * k);
    for &pos in positions {
        for c in 0..k {
            let theta = ROPE_BASE.powf(-2.0 * (c % half) as f64 / k as f64);
            let angle = pos as f64 * theta;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let table = |values| Tensor::<B, 2>::from_data(TensorData::new(values, [t, k]), device);
    (table(cos), table(sin))
}

/// ALiBi's head slopes `m_1..m_n`: for `n` a power of two the geometric sequence starting at
/// and multiplied by `2^(−8/n)`; otherwise the slopes of the nearest smaller power of two `p`
/// followed by every other slope of `2p` (the paper's reference implementation).
pub fn alibi_slopes(n_heads: usize) -> Vec<f64> {
    fn power_of_two(n: usize) -> Vec<f64> {
        let ratio = 2f64.powf(-8.0 / n as f64);
        (1..=n).map(|i| ratio.powi(i as i32)).collect()
    }
    if n_heads.is_power_of_two() {
        return power_of_two(n_heads);
    }
    let p = 1 << n_heads.ilog2();
    let mut slopes = power_of_two(p);
    slopes.extend(power_of_two(2 * p).into_iter().step_by(2).take(n_heads - p));
    slopes
}

/// ALiBi's biases `−m_h · |i − j|` for the heads' `slopes` ([`alibi_slopes`]), queries at
/// positions `queries` and keys at `keys` (absolute positions of one sequence), `[1, h, t, s]`. Keys after a query get a bias too;
/// a causal mask removes them in a decoder, and an encoder sees both sides penalised alike.
pub fn alibi_bias<B: LabBackend>(
    slopes: &[f64],
    queries: std::ops::Range<usize>,
    keys: std::ops::Range<usize>,
    device: &B::Device,
) -> Tensor<B, 4> {
    let (t, s, n_heads) = (queries.len(), keys.len(), slopes.len());
    let mut values = Vec::with_capacity(n_heads * t * s);
    for &m in slopes {
        for i in queries.clone() {
            for j in keys.clone() {
                values.push((-m * i.abs_diff(j) as f64) as f32);
            }
        }
    }
    Tensor::<B, 3>::from_data(TensorData::new(values, [n_heads, t, s]), device).unsqueeze::<4>()
}
