//! What each head is worth (Michel et al. 2019, "Are Sixteen Heads Really Better than One?"):
//! the held-out loss with one head gated off against the loss with every head, and the
//! gradient importance `E|∂L/∂ξ_h|` of a gate `ξ_h` on each head, read from the gradients of
//! `W^O` ([`crate::nn::MultiHeadAttention::gate_gradients`]); how the two rank the heads alike; and the
//! loss (and accuracy) as heads are removed, least important first.

use crate::kernels::{LabAutodiff, LabBackend};
use crate::nn::AttentionLayers;
use crate::plot::{line_panels_png, Panel, Series};
use anyhow::Result;
use burn::prelude::*;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// What a model's `loss` returns on one batch: the mean loss, the logits `[n, classes]` and the
/// targets `[n]`.
pub type LossOutput<B> = (Tensor<B, 1>, Tensor<B, 2>, Tensor<B, 1, Int>);

/// One held-out batch, as the loss of whichever model it is given.
pub type HeldOutBatch<'a, B, M> = Box<dyn Fn(&M) -> LossOutput<B> + 'a>;

/// The held-out data a model's heads are judged on.
pub struct HeldOut<'a, B: LabBackend, M> {
    /// What the batches hold, for people ("40 windows of 64 tokens of the validation split").
    pub what: String,
    /// The batches.
    pub batches: Vec<HeldOutBatch<'a, B, M>>,
    /// Whether accuracy means something (classifiers): reported beside the loss.
    pub accuracy: bool,
}

/// A model's loss (and accuracy) on held-out data.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Score {
    /// The mean loss over every target.
    pub loss: f64,
    /// The share of targets predicted right, for classifiers.
    pub accuracy: Option<f64>,
}

impl<B: LabBackend, M> HeldOut<'_, B, M> {
    /// `model`'s loss (and accuracy) over every batch, each batch weighted by its targets.
    ///
    /// # Panics
    /// If there are no batches.
    pub fn score(&self, model: &M) -> Score {
        assert!(!self.batches.is_empty(), "held-out data has batches");
        let (mut loss, mut correct, mut count) = (0.0, 0usize, 0usize);
        for batch in &self.batches {
            let (mean, logits, targets) = batch(model);
            let n = targets.dims()[0];
            loss += mean.into_scalar().elem::<f64>() * n as f64;
            if self.accuracy {
                let right = logits.argmax(1).squeeze::<1>().equal(targets).int().sum();
                correct += right.into_scalar().elem::<i64>() as usize;
            }
            count += n;
        }
        Score {
            loss: loss / count as f64,
            accuracy: self.accuracy.then(|| correct as f64 / count as f64),
        }
    }
}

/// One head's worth.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadImportance {
    /// The layer's name.
    pub layer: String,
    /// The head's index in its layer.
    pub head: usize,
    /// The held-out score with this head gated off.
    pub masked: Score,
    /// `masked.loss` − the loss with every head: how much worse the model is without it.
    pub delta: f64,
    /// The mean over batches of `|∂L/∂ξ_h|` at `ξ = 1`.
    pub gradient: f64,
}

/// The names and head counts of `model`'s attention layers.
fn layer_heads<B: LabBackend>(model: &mut impl AttentionLayers<B>) -> Vec<(String, usize)> {
    model
        .attention_layers()
        .into_iter()
        .map(|(name, layer)| (name, layer.n_heads()))
        .collect()
}

/// `model` with `gates` (one list per attention layer) on its heads.
fn gated<B: LabBackend, M: AttentionLayers<B> + Clone>(model: &M, gates: &[Vec<f32>]) -> M {
    let mut gated = model.clone();
    for ((_, layer), g) in gated.attention_layers().into_iter().zip(gates) {
        let on = g.iter().all(|&x| x == 1.0);
        layer.set_head_gates((!on).then(|| g.clone()));
    }
    gated
}

/// `E|∂L/∂ξ_h|` over the held-out batches for a gate `ξ_h = 1` on every head of every
/// attention layer of `model` (one list per layer): one backward pass per batch.
pub fn gate_gradients<B, M>(model: &M, held_out: &HeldOut<'_, B, M>) -> Vec<Vec<f64>>
where
    B: LabAutodiff,
    M: AttentionLayers<B> + Clone,
{
    let mut reader = model.clone();
    let layers = layer_heads(&mut reader);
    let n = held_out.batches.len() as f64;
    let mut gradient: Vec<Vec<f64>> = layers.iter().map(|(_, h)| vec![0.0; *h]).collect();
    for batch in &held_out.batches {
        let grads = batch(model).0.backward();
        for (sums, (_, layer)) in gradient.iter_mut().zip(reader.attention_layers()) {
            let per_head = layer.gate_gradients(&grads).unwrap_or_default();
            for (sum, g) in sums.iter_mut().zip(per_head) {
                *sum += g.abs() as f64 / n;
            }
        }
    }
    gradient
}

/// The score of `model` with every head and the worth of each head of each of its attention
/// layers on `held_out`: its masked score here, its gradient importance from `gradients`
/// ([`gate_gradients`] of the same model).
pub fn importance<B, M>(
    model: &M,
    held_out: &HeldOut<'_, B, M>,
    gradients: &[Vec<f64>],
) -> (Score, Vec<HeadImportance>)
where
    B: LabBackend,
    M: AttentionLayers<B> + Clone,
{
    let full = held_out.score(model);
    let mut reader = model.clone();
    let layers = layer_heads(&mut reader);
    let all_on: Vec<Vec<f32>> = layers.iter().map(|(_, h)| vec![1.0; *h]).collect();
    let mut heads = Vec::new();
    for (l, (name, h)) in layers.iter().enumerate() {
        for head in 0..*h {
            let mut gates = all_on.clone();
            gates[l][head] = 0.0;
            let masked = held_out.score(&gated(model, &gates));
            heads.push(HeadImportance {
                layer: name.clone(),
                head,
                masked,
                delta: masked.loss - full.loss,
                gradient: gradients[l][head],
            });
        }
    }
    (full, heads)
}

/// One point of a pruning curve: the score once `removed` heads are gone.
#[derive(Clone, Debug, PartialEq)]
pub struct PruneStep {
    /// The head removed at this step (`None` for the starting point), as (layer, head).
    pub head: Option<(String, usize)>,
    /// Heads removed so far.
    pub removed: usize,
    /// Their share of every head.
    pub fraction: f64,
    /// The held-out score without them.
    pub score: Score,
}

/// The state of a pruning: which heads of which layers are still on.
struct Pruning {
    /// Each attention layer's name.
    names: Vec<String>,
    /// Per layer, one gate per head: 1 on, 0 removed.
    gates: Vec<Vec<f32>>,
    /// Heads of the whole model.
    total: usize,
}

impl Pruning {
    fn new<B: LabBackend, M: AttentionLayers<B> + Clone>(model: &M) -> Self {
        let mut reader = model.clone();
        let layers = layer_heads(&mut reader);
        Self {
            total: layers.iter().map(|(_, h)| h).sum(),
            gates: layers.iter().map(|(_, h)| vec![1.0; *h]).collect(),
            names: layers.into_iter().map(|(name, _)| name).collect(),
        }
    }

    /// Whether layer `l` has a head to spare (each layer keeps one).
    fn can_lose(&self, l: usize) -> bool {
        self.gates[l].iter().filter(|&&g| g == 1.0).count() >= 2
    }

    /// Removes head `h` of layer `l` and scores what is left: the curve's next point.
    fn remove<B: LabBackend, M: AttentionLayers<B> + Clone>(
        &mut self,
        (l, h): (usize, usize),
        removed: usize,
        model: &M,
        held_out: &HeldOut<'_, B, M>,
    ) -> PruneStep {
        self.gates[l][h] = 0.0;
        PruneStep {
            head: Some((self.names[l].clone(), h)),
            removed,
            fraction: removed as f64 / self.total as f64,
            score: held_out.score(&gated(model, &self.gates)),
        }
    }
}

/// The curve's starting point: every head on.
fn start<B: LabBackend, M>(model: &M, held_out: &HeldOut<'_, B, M>) -> PruneStep {
    PruneStep {
        head: None,
        removed: 0,
        fraction: 0.0,
        score: held_out.score(model),
    }
}

/// Removes heads one at a time, each time the one whose removal hurts the held-out loss least
/// **given those already removed** (every remaining head re-evaluated at each step), until
/// `steps` heads are gone or each layer keeps one. `on_step` sees each point as it is made.
pub fn prune_greedily<B, M>(
    model: &M,
    held_out: &HeldOut<'_, B, M>,
    steps: usize,
    mut on_step: impl FnMut(&PruneStep),
) -> Vec<PruneStep>
where
    B: LabBackend,
    M: AttentionLayers<B> + Clone,
{
    let mut pruning = Pruning::new(model);
    let mut curve = vec![start(model, held_out)];
    on_step(&curve[0]);
    for removed in 1..=steps {
        let mut best: Option<((usize, usize), f64)> = None;
        for l in (0..pruning.gates.len()).filter(|&l| pruning.can_lose(l)) {
            for h in 0..pruning.gates[l].len() {
                if pruning.gates[l][h] == 0.0 {
                    continue;
                }
                let mut trial = pruning.gates.clone();
                trial[l][h] = 0.0;
                let loss = held_out.score(&gated(model, &trial)).loss;
                if best.is_none_or(|(_, b)| loss < b) {
                    best = Some(((l, h), loss));
                }
            }
        }
        let Some((head, _)) = best else { break };
        let step = pruning.remove(head, removed, model, held_out);
        on_step(&step);
        curve.push(step);
    }
    curve
}

/// The curve of removing heads in a fixed `order` (least important first, as ranked once),
/// skipping a head whose layer would be left with none.
pub fn prune_in_order<B, M>(
    model: &M,
    held_out: &HeldOut<'_, B, M>,
    order: &[(String, usize)],
    steps: usize,
) -> Vec<PruneStep>
where
    B: LabBackend,
    M: AttentionLayers<B> + Clone,
{
    let mut pruning = Pruning::new(model);
    let mut curve = vec![start(model, held_out)];
    for (name, h) in order {
        if curve.len() > steps {
            break;
        }
        let Some(l) = pruning.names.iter().position(|n| n == name) else {
            continue;
        };
        if pruning.can_lose(l) {
            let removed = curve.len();
            curve.push(pruning.remove((l, *h), removed, model, held_out));
        }
    }
    curve
}

/// Heads a model can lose: all but one per attention layer.
pub fn prunable<B: LabBackend>(model: &mut impl AttentionLayers<B>) -> usize {
    layer_heads(model).iter().map(|(_, h)| h - 1).sum()
}

/// The heads the first `n` steps of `curve` removed, by layer (sorted indices).
pub fn removed_by_layer(curve: &[PruneStep], n: usize) -> BTreeMap<String, Vec<usize>> {
    let mut removed: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (layer, head) in curve.iter().filter_map(|s| s.head.clone()).take(n) {
        removed.entry(layer).or_default().push(head);
    }
    for heads in removed.values_mut() {
        heads.sort_unstable();
    }
    removed
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

/// The heads least important first by `key` (ties in layer order).
pub fn order_by(
    heads: &[HeadImportance],
    key: impl Fn(&HeadImportance) -> f64,
) -> Vec<(String, usize)> {
    let mut sorted: Vec<&HeadImportance> = heads.iter().collect();
    sorted.sort_by(|a, b| key(a).total_cmp(&key(b)));
    sorted.iter().map(|h| (h.layer.clone(), h.head)).collect()
}

/// The importance table: one row per head, and the rank correlation of the two measures.
pub fn render_table(full: Score, heads: &[HeadImportance]) -> String {
    let mut out = String::new();
    let accuracy = |s: Score| {
        s.accuracy
            .map(|a| format!("  {:>8.2}%", 100.0 * a))
            .unwrap_or_default()
    };
    let _ = writeln!(
        out,
        "with every head: loss {:.4}{}",
        full.loss,
        accuracy(full)
    );
    let width = heads
        .iter()
        .map(|h| h.layer.len())
        .max()
        .unwrap_or(5)
        .max(5);
    let acc_head = if full.accuracy.is_some() {
        "   accuracy"
    } else {
        ""
    };
    let _ = writeln!(
        out,
        "{:<width$}  head  masked loss         Δ loss  |∂L/∂ξ|{acc_head}",
        "layer"
    );
    let deltas: Vec<f64> = heads.iter().map(|h| h.delta).collect();
    let gradients: Vec<f64> = heads.iter().map(|h| h.gradient).collect();
    let rank = ranks(&deltas);
    for (h, r) in heads.iter().zip(&rank) {
        let _ = writeln!(
            out,
            "{:<width$}  {:>4}  {:>11.4}  {:>+13.5}  {:>7.4}{}   rank {}",
            h.layer,
            h.head,
            h.masked.loss,
            h.delta,
            h.gradient,
            accuracy(h.masked),
            (heads.len() as f64 + 1.0 - r) as usize, // 1 = most important
        );
    }
    match spearman(&deltas, &gradients) {
        Some(rho) => {
            let _ = writeln!(
                out,
                "Spearman rank correlation of Δ loss and |∂L/∂ξ| over {} heads: {rho:.3}",
                heads.len()
            );
        }
        None => {
            let _ = writeln!(out, "Spearman rank correlation: undefined (fewer than two heads, or one measure constant)");
        }
    }
    out
}

/// The pruning curves as a table: heads removed, share, loss (and accuracy) of each order.
pub fn render_curves(curves: &[(&str, &[PruneStep])]) -> String {
    let mut out = String::new();
    let with_accuracy = curves
        .first()
        .and_then(|(_, c)| c.first())
        .is_some_and(|s| s.score.accuracy.is_some());
    let _ = write!(out, "removed  share");
    for (name, _) in curves {
        let _ = write!(out, "  {:>22}", format!("loss ({name})"));
        if with_accuracy {
            let _ = write!(out, "  {:>10}", "accuracy");
        }
    }
    let _ = writeln!(
        out,
        "  removed by {}",
        curves.first().map(|c| c.0).unwrap_or("")
    );
    let rows = curves.iter().map(|(_, c)| c.len()).max().unwrap_or(0);
    for i in 0..rows {
        let Some(first) = curves.iter().find_map(|(_, c)| c.get(i)) else {
            continue;
        };
        let _ = write!(
            out,
            "{:>7}  {:>4.0}%",
            first.removed,
            100.0 * first.fraction
        );
        for (_, curve) in curves {
            match curve.get(i) {
                Some(s) => {
                    let _ = write!(out, "  {:>22.4}", s.score.loss);
                    if let Some(a) = s.score.accuracy {
                        let _ = write!(out, "  {:>9.2}%", 100.0 * a);
                    }
                }
                None => {
                    let _ = write!(out, "  {:>22}", "");
                }
            }
        }
        if let Some((layer, head)) = curves[0].1.get(i).and_then(|s| s.head.clone()) {
            let _ = write!(out, "  {layer} head {head}");
        }
        let _ = writeln!(out);
    }
    out
}

/// Draws the pruning curves (loss, and accuracy for classifiers, against the share of heads
/// removed) to `path`.
pub fn write_curves_png(path: &Path, title: &str, curves: &[(&str, &[PruneStep])]) -> Result<()> {
    let series = |value: &dyn Fn(&PruneStep) -> Option<f64>| -> Vec<Series> {
        curves
            .iter()
            .enumerate()
            .map(|(colour, (name, curve))| Series {
                label: name.to_string(),
                points: curve
                    .iter()
                    .filter_map(|s| value(s).map(|v| (100.0 * s.fraction, v)))
                    .collect(),
                colour,
                faint: false,
            })
            .collect()
    };
    let mut panels = vec![Panel {
        x_label: "heads removed (%)".into(),
        y_label: "held-out loss".into(),
        series: series(&|s| Some(s.score.loss)),
    }];
    if curves
        .iter()
        .any(|(_, c)| c.iter().any(|s| s.score.accuracy.is_some()))
    {
        panels.push(Panel {
            x_label: "heads removed (%)".into(),
            y_label: "held-out accuracy (%)".into(),
            series: series(&|s| s.score.accuracy.map(|a| 100.0 * a)),
        });
    }
    line_panels_png(path, title, &panels)
}
