//! `explain`: single-head scaled dot-product attention, step by step, on small matrices.

use crate::kernels::LabBackend;
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
pub fn walkthrough<B: LabBackend>(
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

fn to_matrix<B: LabBackend>(m: Tensor<B, 2>) -> Matrix {
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

/// One real head of a trained model, on real tokens: every intermediate of its attention.
#[derive(Clone, Debug)]
pub struct HeadWalkthrough {
    /// The labels of the tokens.
    pub tokens: Vec<String>,
    /// Layer and head shown.
    pub layer: usize,
    /// Head index within the layer.
    pub head: usize,
    /// Whether the model's mask is causal (a language model).
    pub causal: bool,
    /// What the layer's attention reads: the residual stream after the layers below, through
    /// the layer's LayerNorm in a pre-norm model, `[n, d]`.
    pub x: Matrix,
    /// This head's `Q = X·W_Q + b`, `K`, `V` (`[n, k]` each), the scores `Q·Kᵀ/√k` with masked
    /// entries `-inf`, the weights and `A·V` (this head's part of the output before `W_O`).
    pub steps: Walkthrough,
    /// The weights of this head in the model's own forward pass, for comparison.
    pub forward_weights: Matrix,
}

/// Walks through head `head` of layer `layer` of a trained text model (language model,
/// classifier, or a translator's encoder) on `text`.
pub fn model_walkthrough<B: LabBackend>(
    model: &crate::inspect::TextModel<'_, B>,
    text: &str,
    layer: usize,
    head: usize,
    device: &B::Device,
) -> Result<HeadWalkthrough> {
    let ids = model.encode(text)?;
    let n = ids.len();
    // One unpadded sentence needs no padding mask; a language model needs the causal one.
    let (stack, x0, mask) = (
        model.stack,
        (model.embed)(model.tokens(&ids, device)),
        model.mask(n, device),
    );
    let mixer = stack.blocks[0]
        .self_attention
        .as_ref()
        .map_or("hyena", |attention| attention.mixer().name());
    if mixer != "full" {
        bail!(
            "explain walks through full softmax attention, but this model's mixer is {mixer}; \
             `attention` shows what its layers do"
        );
    }
    let relative = stack.blocks[0].attention().relative();
    if relative != crate::nn::RelativePosition::None {
        bail!(
            "explain walks through attention whose positions were added to the embeddings, but \
             this model's {} positions live inside attention; `attention` shows its weights",
            if relative == crate::nn::RelativePosition::Rope {
                "rope"
            } else {
                "alibi"
            }
        );
    }
    let heads_in = |l: usize| stack.blocks[l].attention().n_heads();
    crate::inspect::check_head("this model", stack.n_layers(), heads_in, layer, head)?;
    let x = stack.self_attention_input(x0.clone(), mask.as_ref(), None, layer); // [1, n, d]
    let attention = stack.blocks[layer].attention();
    let (q, k, v) = attention.project(x.clone(), x.clone()); // [1, h, n, k]
    let one = |t: Tensor<B, 4>| t.narrow(1, head, 1); // [1, 1, n, k]
    let (q, k, v) = (one(q), one(k), one(v));
    let d_k = q.dims()[3] as f32;
    let scores = q
        .clone()
        .matmul(k.clone().transpose())
        .div_scalar(d_k.sqrt()); // [1, 1, n, n]
    let scores = match &mask {
        Some(mask) => scores.mask_fill(mask.tensor().expand([1, 1, n, n]), f32::NEG_INFINITY),
        None => scores,
    };
    let (output, weights) =
        scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), mask.as_ref());
    let forward = stack.forward(x0, mask.as_ref(), None).self_attention[layer].clone();
    let flat = |t: Tensor<B, 4>| to_matrix(t.squeeze_dims::<2>(&[0, 1]));
    Ok(HeadWalkthrough {
        tokens: model.labels(&ids),
        layer,
        head,
        causal: mask.is_some(),
        x: to_matrix(x.squeeze_dims::<2>(&[0])),
        steps: Walkthrough {
            q: flat(q),
            k: flat(k),
            v: flat(v),
            scores: flat(scores),
            weights: flat(weights),
            output: flat(output),
        },
        forward_weights: flat(one(forward)),
    })
}

/// Columns and rows shown of a model's matrices (the rest are counted, not printed).
const SHOWN_COLUMNS: usize = 8;
const SHOWN_TOKENS: usize = 16;

fn format_labelled(title: &str, m: &Matrix, labels: &[String], columns: usize) -> String {
    let width = labels
        .iter()
        .map(|l| l.chars().count())
        .max()
        .unwrap_or(1)
        .min(12);
    let mut out = format!("{title}\n");
    for (row, label) in m.iter().zip(labels).take(SHOWN_TOKENS) {
        let label: String = label.chars().take(12).collect();
        let cells: Vec<String> = row
            .iter()
            .take(columns)
            .map(|v| {
                if v.is_infinite() {
                    format!("{:>8}", "-inf")
                } else {
                    format!("{v:>8.3}")
                }
            })
            .collect();
        let more = if row.len() > columns {
            format!("  … {} more", row.len() - columns)
        } else {
            String::new()
        };
        out += &format!("  {label:>width$} [{} ]{more}\n", cells.join(""));
    }
    if m.len() > SHOWN_TOKENS {
        out += &format!("  … {} more rows\n", m.len() - SHOWN_TOKENS);
    }
    out
}

/// The walkthrough of a real head as text.
pub fn render_model(w: &HeadWalkthrough) -> String {
    let (n, d, d_k) = (w.tokens.len(), w.x[0].len(), w.steps.q[0].len());
    let mut out = format!(
        "Layer {}, head {} on {n} tokens: {}\n",
        w.layer,
        w.head,
        w.tokens.join(" ")
    );
    out += &format!("\nStep 1. X: what the layer's attention reads, one row of d_model = {d} per token (the embeddings plus what the layers below added, through this layer's LayerNorm in a pre-norm model)\n");
    out += &format_labelled("X", &w.x, &w.tokens, SHOWN_COLUMNS);
    out += &format!("\nStep 2. This head's projections: Q = X·W_Q, K = X·W_K, V = X·W_V, each d_head = {d_k} wide (its {d_k} columns of the layer's d_model-wide W)\n");
    out += &format_labelled(
        "Q (what each token looks for)",
        &w.steps.q,
        &w.tokens,
        SHOWN_COLUMNS,
    );
    out += &format_labelled(
        "K (what each token offers to be found by)",
        &w.steps.k,
        &w.tokens,
        SHOWN_COLUMNS,
    );
    out += &format_labelled(
        "V (what each token passes on)",
        &w.steps.v,
        &w.tokens,
        SHOWN_COLUMNS,
    );
    out += &format!(
        "\nStep 3. Scores S = Q·Kᵀ / √d_head (√{d_k} = {:.3}); row = query, column = key{}\n",
        (d_k as f32).sqrt(),
        if w.causal {
            "; the causal mask sets every key after the query to -inf"
        } else {
            ""
        }
    );
    out += &format_labelled("S", &w.steps.scores, &w.tokens, SHOWN_TOKENS);
    out += "\nStep 4. Weights A = softmax(S) row by row: each row sums to 1\n";
    out += &format_labelled("A", &w.steps.weights, &w.tokens, SHOWN_TOKENS);
    let worst_sum = w
        .steps
        .weights
        .iter()
        .map(|r| (r.iter().sum::<f32>() - 1.0).abs())
        .fold(0.0f32, f32::max);
    let worst_diff = w
        .steps
        .weights
        .iter()
        .flatten()
        .zip(w.forward_weights.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    out += &format!("  every row sums to 1 within {worst_sum:.1e}; the model's own forward pass used these weights (largest difference {worst_diff:.1e})\n");
    out += "\nStep 5. Output O = A·V: each token's new vector is the weighted average of the values it attends to\n";
    out += &format_labelled("O", &w.steps.output, &w.tokens, SHOWN_COLUMNS);
    out += "\nWhere each token looks (its three largest weights):\n";
    for (label, row) in w.tokens.iter().zip(&w.steps.weights) {
        out += &format!(
            "  {label} → {}\n",
            crate::inspect::strongest_keys(row, &w.tokens)
        );
    }
    out
}
