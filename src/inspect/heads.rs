//! What each head is worth (Michel et al. 2019, "Are Sixteen Heads Really Better than One?"):
//! the held-out loss with one head gated off against the loss with every head, and the
//! gradient importance `E|∂L/∂ξ_h|` of a gate `ξ_h` on each head, read from the gradients of
//! `W^O` ([`MultiHeadAttention::gate_gradients`]); and how the two rank the heads alike.

use crate::kernels::{LabAutodiff, LabBackend};
use crate::nn::MultiHeadAttention;
use burn::prelude::*;

/// A model whose attention layers can be gated head by head.
pub trait GatedHeads<B: LabBackend> {
    /// Every attention layer, named for people ("layer 2", "decoder 1 cross"), in order.
    fn attention_layers(&mut self) -> Vec<(String, &mut MultiHeadAttention<B>)>;
}

/// One head's worth.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadImportance {
    /// The layer's name.
    pub layer: String,
    /// The head's index in its layer.
    pub head: usize,
    /// The mean held-out loss with this head gated off.
    pub masked_loss: f64,
    /// `masked_loss` − the loss with every head: how much worse the model is without it.
    pub delta: f64,
    /// The mean over batches of `|∂L/∂ξ_h|` at `ξ = 1`.
    pub gradient: f64,
}

/// The loss of `model` with every head (the mean of `loss` over `batches`) and the worth of
/// each head of each of its attention layers.
///
/// # Panics
/// If `batches` is empty.
pub fn importance<B, M, I>(
    model: &M,
    batches: &[I],
    loss: impl Fn(&M, I) -> Tensor<B, 1>,
) -> (f64, Vec<HeadImportance>)
where
    B: LabAutodiff,
    M: GatedHeads<B> + Clone,
    I: Clone,
{
    assert!(!batches.is_empty(), "importance needs held-out batches");
    let n = batches.len() as f64;
    let mean_loss = |m: &M| {
        let sum: f64 = batches
            .iter()
            .map(|b| loss(m, b.clone()).into_scalar().elem::<f64>())
            .sum();
        sum / n
    };
    let full = mean_loss(model);
    let mut reader = model.clone();
    let layers: Vec<(String, usize)> = reader
        .attention_layers()
        .into_iter()
        .map(|(name, layer)| (name, layer.n_heads()))
        .collect();
    let mut gradient: Vec<Vec<f64>> = layers.iter().map(|(_, h)| vec![0.0; *h]).collect();
    for batch in batches {
        let grads = loss(model, batch.clone()).backward();
        for (sums, (_, layer)) in gradient.iter_mut().zip(reader.attention_layers()) {
            let per_head = layer.gate_gradients(&grads).unwrap_or_default();
            for (sum, g) in sums.iter_mut().zip(per_head) {
                *sum += g.abs() as f64 / n;
            }
        }
    }
    let mut heads = Vec::new();
    for (l, (name, h)) in layers.iter().enumerate() {
        for head in 0..*h {
            let mut gated = model.clone();
            let mut gates = vec![1.0; *h];
            gates[head] = 0.0;
            gated.attention_layers()[l].1.set_head_gates(Some(gates));
            let masked_loss = mean_loss(&gated);
            heads.push(HeadImportance {
                layer: name.clone(),
                head,
                masked_loss,
                delta: masked_loss - full,
                gradient: gradient[l][head],
            });
        }
    }
    (full, heads)
}

/// Spearman's rank correlation of `a` and `b` (ties share their mean rank); `None` for fewer
/// than two values or a constant side.
pub fn spearman(a: &[f64], b: &[f64]) -> Option<f64> {
    assert_eq!(a.len(), b.len(), "paired values");
    let (ra, rb) = (ranks(a), ranks(b));
    let mean = (a.len() as f64 + 1.0) / 2.0;
    let (mut cov, mut va, mut vb) = (0.0, 0.0, 0.0);
    for (x, y) in ra.iter().zip(&rb) {
        cov += (x - mean) * (y - mean);
        va += (x - mean).powi(2);
        vb += (y - mean).powi(2);
    }
    (a.len() >= 2 && va > 0.0 && vb > 0.0).then(|| cov / (va * vb).sqrt())
}

/// The 1-based ranks of `x`, ties given their mean rank.
fn ranks(x: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&i, &j| x[i].total_cmp(&x[j]));
    let mut rank = vec![0.0; x.len()];
    let mut start = 0;
    while start < order.len() {
        let mut end = start + 1;
        while end < order.len() && x[order[end]] == x[order[start]] {
            end += 1;
        }
        let shared = (start + end + 1) as f64 / 2.0; // the mean of ranks start+1..=end
        for &i in &order[start..end] {
            rank[i] = shared;
        }
        start = end;
    }
    rank
}
