//! `explain`: single-head scaled dot-product attention, step by step, on small matrices.

use crate::nn::scaled_dot_product_attention;
use anyhow::{bail, Context, Result};
use burn::prelude::*;

/// The textbook example: three 2-d tokens and 2×2 projections (row vectors, `Q = X·W_Q`).
pub const DEFAULT_X: &str = "1,0; 0,1; 1,1";
/// Default `W_Q`.
pub const DEFAULT_WQ: &str = "1,1; 0,1";
/// Default `W_K`.
pub const DEFAULT_WK: &str = "1,0; 1,1";
/// Default `W_V`.
pub const DEFAULT_WV: &str = "0.5,1; 1,0";

/// A dense row-major matrix.
pub type Matrix = Vec<Vec<f32>>;

/// Every intermediate of one attention head.
#[derive(Clone, Debug, PartialEq)]
pub struct Walkthrough {
    /// `Q = X·W_Q`, `[n, d_k]`.
    pub q: Matrix,
    /// `K = X·W_K`, `[n, d_k]`.
    pub k: Matrix,
    /// `V = X·W_V`, `[n, d_v]`.
    pub v: Matrix,
    /// `S = Q·Kᵀ/√d_k`, `[n, n]`.
    pub scores: Matrix,
    /// `A = softmax(S)` row-wise, `[n, n]`.
    pub weights: Matrix,
    /// `O = A·V`, `[n, d_v]`.
    pub output: Matrix,
}

/// Parses `"1,0; 0,1"` (rows separated by `;`, values by `,`) into a matrix.
pub fn parse_matrix(name: &str, text: &str) -> Result<Matrix> {
    let rows: Matrix = text
        .split(';')
        .map(|row| {
            row.split(',')
                .map(|v| {
                    v.trim()
                        .parse::<f32>()
                        .with_context(|| format!("{name}: {:?} is not a number", v.trim()))
                })
                .collect::<Result<Vec<f32>>>()
        })
        .collect::<Result<_>>()?;
    if rows.is_empty() || rows[0].is_empty() || rows.iter().any(|r| r.len() != rows[0].len()) {
        bail!(
            "{name}: every row needs the same number of values (rows split by ';', values by ',')"
        );
    }
    Ok(rows)
}

/// Runs X through W_Q, W_K, W_V and [`scaled_dot_product_attention`] on backend `B`.
pub fn walkthrough<B: Backend>(
    x: &Matrix,
    wq: &Matrix,
    wk: &Matrix,
    wv: &Matrix,
    device: &B::Device,
) -> Result<Walkthrough> {
    let d_in = x[0].len();
    for (name, w) in [("W_Q", wq), ("W_K", wk), ("W_V", wv)] {
        if w.len() != d_in {
            bail!(
                "{name} has {} rows but the tokens of X have {d_in} values",
                w.len()
            );
        }
    }
    if wq[0].len() != wk[0].len() {
        bail!("W_Q and W_K must have the same number of columns (d_k)");
    }
    let tensor = |m: &Matrix| {
        let data = TensorData::new(m.concat(), [m.len(), m[0].len()]);
        Tensor::<B, 2>::from_data(data, device)
    };
    let x = tensor(x);
    let q = x.clone().matmul(tensor(wq)); // [n, d_k]
    let k = x.clone().matmul(tensor(wk)); // [n, d_k]
    let v = x.matmul(tensor(wv)); // [n, d_v]
    let d_k = q.dims()[1] as f32;
    let scores = q
        .clone()
        .matmul(k.clone().transpose())
        .div_scalar(d_k.sqrt());
    let as4 = |m: Tensor<B, 2>| m.unsqueeze::<4>(); // [1, 1, n, d]
    let (output, weights) =
        scaled_dot_product_attention(as4(q.clone()), as4(k.clone()), as4(v.clone()), None);
    Ok(Walkthrough {
        q: to_matrix(q),
        k: to_matrix(k),
        v: to_matrix(v),
        scores: to_matrix(scores),
        weights: to_matrix(weights.squeeze_dims(&[0, 1])),
        output: to_matrix(output.squeeze_dims(&[0, 1])),
    })
}

fn to_matrix<B: Backend>(m: Tensor<B, 2>) -> Matrix {
    let [_, cols] = m.dims();
    let values: Vec<f32> = m.into_data().convert::<f32>().to_vec().expect("f32 matrix");
    values.chunks(cols).map(<[f32]>::to_vec).collect()
}

/// Renders one matrix with a title and row labels.
pub fn format_matrix(title: &str, m: &Matrix, row_label: &str) -> String {
    let mut out = format!("{title}\n");
    for (i, row) in m.iter().enumerate() {
        let cells: Vec<String> = row.iter().map(|v| format!("{v:>8.4}")).collect();
        out += &format!("  {row_label}{} [{} ]\n", i + 1, cells.join(""));
    }
    out
}

/// The whole walkthrough as text.
pub fn render(w: &Walkthrough, x: &Matrix) -> String {
    let d_k = w.q[0].len();
    let mut out = String::new();
    out += &format_matrix("X — the input tokens, one row each", x, "x");
    out += "\nStep 1. Project every token into a query, a key and a value: Q = X·W_Q, K = X·W_K, V = X·W_V\n";
    out += &format_matrix("Q", &w.q, "q");
    out += &format_matrix("K", &w.k, "k");
    out += &format_matrix("V", &w.v, "v");
    out += &format!("\nStep 2. Score every query against every key: S = Q·Kᵀ / √d_k  (d_k = {d_k}, √d_k = {:.4})\n", (d_k as f32).sqrt());
    out += &format_matrix("S (row i = query i, column j = key j)", &w.scores, "q");
    out += "\nStep 3. Turn each row of scores into weights: A = softmax(S), row by row\n";
    out += &format_matrix("A", &w.weights, "q");
    for (i, row) in w.weights.iter().enumerate() {
        out += &format!("  row {} sums to {:.6}\n", i + 1, row.iter().sum::<f32>());
    }
    out += "\nStep 4. Mix the values with those weights: O = A·V (each output row is a weighted average of V's rows)\n";
    out += &format_matrix("O", &w.output, "o");
    out
}
