//! Per-head statistics: how spread out each head's attention is (row entropy), how far it looks
//! (mean distance), how much goes to the previous, the same and the first token, and whether the
//! head attends by position or by content.
//!
//! Position or content: the same input is run again with its tokens shuffled (a permutation
//! `π`: shuffled position `i` holds original token `π[i]`). A positional head keeps its pattern
//! *by position* (row `i` of the shuffled map looks like row `i` of the original); a content
//! head's pattern follows the tokens (shuffled `a'[i][k]` looks like original `a[π[i]][π[k]]`).
//! Similarity is `1 − total variation`, averaged over rows. In a causal model a row is judged
//! only on the keys its query sees in both runs, the same keys for both comparisons, each row
//! renormalised over them.

use super::AttentionGroup;
use std::fmt::Write;

/// The statistics of one head.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadStats {
    /// Layer index.
    pub layer: usize,
    /// Head index.
    pub head: usize,
    /// Mean over rows of `−Σ a·ln a`, in nats (0 = one key takes everything).
    pub entropy: f64,
    /// Mean over rows of `Σ_k a·|i − k|` in tokens, or in pixels between patch centres for a
    /// ViT (patch queries and keys only); `None` for cross-attention.
    pub distance: Option<f64>,
    /// Mean weight on the previous token (self-attention only).
    pub previous: Option<f64>,
    /// Mean weight on the token itself (self-attention only).
    pub same: Option<f64>,
    /// Mean weight on the first key.
    pub first: f64,
    /// Similarity to the shuffled input's pattern compared by position.
    pub by_position: Option<f64>,
    /// Similarity to the shuffled input's pattern compared token by token.
    pub by_content: Option<f64>,
}

impl HeadStats {
    /// `position` or `content`, when the shuffle comparison was made.
    pub fn verdict(&self) -> Option<&'static str> {
        match (self.by_position, self.by_content) {
            (Some(p), Some(c)) => Some(if p >= c { "position" } else { "content" }),
            _ => None,
        }
    }
}

/// How a shuffled run relates to the original one.
pub struct Shuffled<'a> {
    /// The same group on the shuffled input.
    pub group: &'a AttentionGroup,
    /// `query_order[i]` = the original query position now at `i`.
    pub query_order: &'a [usize],
    /// `key_order[k]` = the original key position now at `k`.
    pub key_order: &'a [usize],
}

/// Distance between positions `i` and `k` of a group: tokens apart, or pixels between patch
/// centres (`grid` patches of `patch` pixels per side, token 0 being the classification token).
#[derive(Clone, Copy, Debug)]
pub enum Geometry {
    /// Tokens in a row.
    Sequence,
    /// A ViT's patches after the classification token.
    Patches {
        /// Patches per side.
        grid: usize,
        /// Pixels per patch side.
        patch: usize,
    },
}

/// Total variation between two rows over the keys `visible`, each renormalised over them.
fn restricted_tv(visible: &[usize], a: impl Fn(usize) -> f32, b: impl Fn(usize) -> f32) -> f64 {
    let mass =
        |f: &dyn Fn(usize) -> f32| visible.iter().map(|&k| f(k) as f64).sum::<f64>().max(1e-12);
    let (ma, mb) = (mass(&a), mass(&b));
    0.5 * visible
        .iter()
        .map(|&k| (a(k) as f64 / ma - b(k) as f64 / mb).abs())
        .sum::<f64>()
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 {
        0.0
    } else {
        sum / n as f64
    }
}

/// The statistics of every head of `group`; the shuffle comparison when `shuffled` is given.
pub fn head_stats(
    group: &AttentionGroup,
    geometry: Geometry,
    shuffled: Option<&Shuffled<'_>>,
) -> Vec<HeadStats> {
    let mut all = Vec::new();
    for (layer, heads) in group.weights.iter().enumerate() {
        for (head, rows) in heads.iter().enumerate() {
            let entropy = mean(rows.iter().map(|row| {
                -row.iter()
                    .filter(|&&a| a > 0.0)
                    .map(|&a| a as f64 * (a as f64).ln())
                    .sum::<f64>()
            }));
            let is_self = group.is_self();
            let distance = is_self.then(|| match geometry {
                Geometry::Sequence => mean(rows.iter().enumerate().map(|(i, row)| {
                    row.iter()
                        .enumerate()
                        .map(|(k, &a)| a as f64 * i.abs_diff(k) as f64)
                        .sum::<f64>()
                })),
                Geometry::Patches { grid, patch } => {
                    let at = |t: usize| (((t - 1) / grid) as f64, ((t - 1) % grid) as f64);
                    mean(rows.iter().enumerate().skip(1).map(|(i, row)| {
                        let mass: f64 = row[1..].iter().map(|&a| a as f64).sum::<f64>().max(1e-12);
                        let (yi, xi) = at(i);
                        row.iter()
                            .enumerate()
                            .skip(1)
                            .map(|(k, &a)| {
                                let (yk, xk) = at(k);
                                a as f64
                                    * patch as f64
                                    * ((yi - yk).powi(2) + (xi - xk).powi(2)).sqrt()
                            })
                            .sum::<f64>()
                            / mass
                    }))
                }
            });
            let previous = is_self.then(|| {
                mean(
                    rows.iter()
                        .enumerate()
                        .skip(1)
                        .map(|(i, r)| r[i - 1] as f64),
                )
            });
            let same = is_self.then(|| mean(rows.iter().enumerate().map(|(i, r)| r[i] as f64)));
            let first = mean(rows.iter().map(|r| r[0] as f64));
            let (by_position, by_content) = match shuffled {
                Some(s) if !is_identity(s.query_order) || !is_identity(s.key_order) => {
                    let other = &s.group.weights[layer][head];
                    let keys = rows[0].len();
                    // Both comparisons of shuffled row i use the same keys: in a causal model
                    // those visible to the query in both runs (k <= i and the token's original
                    // position <= the query's), each row renormalised over them. Rows with a
                    // single such key agree whatever the head does and are skipped.
                    let mut by_position = Vec::new();
                    let mut by_content = Vec::new();
                    for (i, shuffled_row) in other.iter().enumerate() {
                        let qi = s.query_order[i];
                        let visible: Vec<usize> = (0..keys)
                            .filter(|&k| !group.causal || (k <= i && s.key_order[k] <= qi))
                            .collect();
                        if visible.len() < 2 {
                            continue;
                        }
                        let (same_place, same_token) = (&rows[i], &rows[qi]);
                        by_position.push(restricted_tv(
                            &visible,
                            |k| shuffled_row[k],
                            |k| same_place[k],
                        ));
                        by_content.push(restricted_tv(
                            &visible,
                            |k| shuffled_row[k],
                            |k| same_token[s.key_order[k]],
                        ));
                    }
                    let position = 1.0 - mean(by_position.into_iter());
                    let content = 1.0 - mean(by_content.into_iter());
                    (Some(position), Some(content))
                }
                _ => (None, None),
            };
            all.push(HeadStats {
                layer,
                head,
                entropy,
                distance,
                previous,
                same,
                first,
                by_position,
                by_content,
            });
        }
    }
    all
}

fn is_identity(order: &[usize]) -> bool {
    order.iter().enumerate().all(|(i, &j)| i == j)
}

/// The statistics as a table, with a summary of which heads attend by position and which by
/// content.
pub fn render(group: &AttentionGroup, geometry: Geometry, stats: &[HeadStats]) -> String {
    let dash =
        |v: Option<f64>, digits: usize| v.map_or("—".to_string(), |v| format!("{v:.digits$}"));
    let unit = match geometry {
        Geometry::Sequence => "tokens",
        Geometry::Patches { .. } => "pixels",
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} attention: {} queries × {} keys (a uniform row has entropy ln {} = {:.2} nats; distance in {unit})",
        group.name,
        group.queries.len(),
        group.keys.len(),
        group.keys.len(),
        (group.keys.len() as f64).ln()
    );
    let _ = writeln!(
        out,
        "  layer head  entropy  distance  previous  same   first  | shuffled: by position  by content  → attends by"
    );
    for s in stats {
        let _ = writeln!(
            out,
            "  {:>5} {:>4}  {:>7.3}  {:>8}  {:>8}  {:>5}  {:>5.3}  |           {:>7}     {:>7}      {}",
            s.layer,
            s.head,
            s.entropy,
            dash(s.distance, 2),
            dash(s.previous, 3),
            dash(s.same, 3),
            s.first,
            dash(s.by_position, 3),
            dash(s.by_content, 3),
            s.verdict().unwrap_or("—")
        );
    }
    let names = |verdict: &str| {
        let heads: Vec<String> = stats
            .iter()
            .filter(|s| s.verdict() == Some(verdict))
            .map(|s| format!("L{}H{}", s.layer, s.head))
            .collect();
        if heads.is_empty() {
            "none".to_string()
        } else {
            heads.join(" ")
        }
    };
    if stats.iter().any(|s| s.verdict().is_some()) {
        let _ = writeln!(out, "  by position: {}", names("position"));
        let _ = writeln!(out, "  by content:  {}", names("content"));
    }
    out
}
