//! `bench matmul`: every matrix-product kernel a GPU backend can choose, timed on the products
//! of a language model's training step. burn's matmul autotune benchmarks only its
//! highest-priority candidates for a shape and keeps the fastest of those; this times them
//! all — the autotuned choice as the step gets it, then each candidate launched directly — and
//! checks each one's output against sums computed on the host in `f64`. It says what the step's
//! products cost, which kernel is fastest at each of its shapes, and what choosing it would
//! save.

use crate::kernels::Precision;
use crate::models::LmConfig;
use anyhow::{bail, Result};

/// One product of a training step: `a·b`, `a` `[m, k]`, `b` `[k, n]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProductShape {
    /// Which layer and which of its products (`ff1 forward`, `qkv dW`, …).
    pub name: String,
    /// Rows of `a` and of the output.
    pub m: usize,
    /// Columns of `b` and of the output.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// `a` is a transposed view (`xᵀ` in a weight's gradient), its memory `[k, m]`.
    pub a_transposed: bool,
    /// `b` is a transposed view (`wᵀ` in an input's gradient, a tied output layer), its memory
    /// `[n, k]`.
    pub b_transposed: bool,
    /// How many times one training step runs it.
    pub per_step: usize,
}

impl ProductShape {
    /// Multiply-adds × 2.
    pub fn flops(&self) -> f64 {
        2.0 * (self.m * self.n * self.k) as f64
    }

    /// `m×n×k` and the transposed operands, as the table shows it.
    pub fn describe(&self) -> String {
        let t = |on: bool| if on { "ᵀ" } else { "" };
        format!(
            "[{}, {}]{} · [{}, {}]{}",
            self.m,
            self.k,
            t(self.a_transposed),
            self.k,
            self.n,
            t(self.b_transposed)
        )
    }
}

/// The products of one training step of a language model: for each linear layer its forward
/// product `x·w`, the input's gradient `dy·wᵀ` and the weight's `xᵀ·dy`, at `batch × context`
/// rows; the output layer's from the tied embedding table (`[v, d]` read transposed) where the
/// weights are tied. `only` keeps the products whose name contains one of its words.
pub fn step_products(
    lm: &LmConfig,
    batch: usize,
    vocab: usize,
    only: &[String],
) -> Vec<ProductShape> {
    let rows = batch * lm.context;
    let (d, ff, layers) = (lm.stack.d_model, lm.stack.d_ff, lm.n_layers);
    // (layer, inputs, outputs, per step, weight stored transposed)
    let linears = [
        ("qkv", d, 3 * d, layers, false),
        ("out", d, d, layers, false),
        ("ff1", d, ff, layers, false),
        ("ff2", ff, d, layers, false),
        ("head", d, vocab, 1, lm.tie_weights),
    ];
    let mut products = Vec::new();
    for (layer, i, o, per_step, tied) in linears {
        let kinds = [
            // y = x·w: [rows, i]·[i, o]
            ("forward", rows, o, i, false, tied),
            // dx = dy·wᵀ: [rows, o]·[o, i]
            ("dX", rows, i, o, false, !tied),
            // dw = xᵀ·dy: [i, rows]·[rows, o]
            ("dW", i, o, rows, true, false),
        ];
        for (kind, m, n, k, a_transposed, b_transposed) in kinds {
            let name = format!("{layer} {kind}");
            if !only.is_empty() && !only.iter().any(|w| name.contains(w.as_str())) {
                continue;
            }
            products.push(ProductShape {
                name,
                m,
                n,
                k,
                a_transposed,
                b_transposed,
                per_step,
            });
        }
    }
    products
}

/// What to time.
#[derive(Clone, Debug)]
pub struct MatmulPlan {
    /// The products.
    pub products: Vec<ProductShape>,
    /// The operands' type (`f32`, or half precision read by the products, accumulated and
    /// written in `f32`, as `--precision` trains).
    pub precision: Precision,
    /// Every candidate (`true`), or only the autotuned choice.
    pub all: bool,
    /// Only the candidates whose name contains one of these words (all where empty).
    pub kernels: Vec<String>,
    /// Timed samples per kernel (after one launch that compiles it and checks its output).
    pub runs: usize,
}

impl MatmulPlan {
    /// Refuses a plan with nothing to time.
    pub fn check(&self) -> Result<()> {
        if self.products.is_empty() {
            bail!("--only matches none of the step's products (qkv, out, ff1, ff2, head; forward, dX, dW)");
        }
        if self.runs == 0 {
            bail!("--runs must be at least 1");
        }
        Ok(())
    }
}

/// One kernel on one product.
#[derive(Clone, Debug)]
pub struct ProductTiming {
    /// Index into the plan's products.
    pub product: usize,
    /// The kernel: `autotune` for burn's choice, else the candidate's name.
    pub kernel: String,
    /// Median seconds a launch, or why it did not run.
    pub seconds: Result<f64, String>,
    /// Largest difference from the host's `f64` sums over the sampled outputs, relative to the
    /// largest of those sums.
    pub error: f64,
}

impl ProductTiming {
    /// Trillions of floating-point operations a second.
    pub fn tflops(&self, shape: &ProductShape) -> Option<f64> {
        self.seconds.as_ref().ok().map(|s| shape.flops() / s / 1e12)
    }
}

/// An output that differs from the host's sums by more than this (relative) is wrong, not
/// rounded: TF32 and bfloat16 operands round at 5·10⁻⁴ and 4·10⁻³.
pub const WRONG: f64 = 5e-2;

/// The table: each product's kernels fastest first, then the step's products at the
/// autotuned choice and at the fastest correct kernel of each.
pub fn render(plan: &MatmulPlan, timings: &[ProductTiming]) -> String {
    let mut s = String::new();
    let (mut tuned_total, mut best_total) = (0.0, 0.0);
    for (i, shape) in plan.products.iter().enumerate() {
        s += &format!(
            "{} {} ({} a step)\n",
            shape.name,
            shape.describe(),
            shape.per_step
        );
        let mut rows: Vec<&ProductTiming> = timings.iter().filter(|t| t.product == i).collect();
        rows.sort_by(|a, b| match (&a.seconds, &b.seconds) {
            (Ok(x), Ok(y)) => x.total_cmp(y),
            (Ok(_), Err(_)) => std::cmp::Ordering::Less,
            (Err(_), Ok(_)) => std::cmp::Ordering::Greater,
            (Err(_), Err(_)) => a.kernel.cmp(&b.kernel),
        });
        // Those that did not run, by reason (most fail together: a missing device feature).
        let mut failed: Vec<(String, Vec<&str>)> = Vec::new();
        for t in &rows {
            match &t.seconds {
                Err(why) => {
                    let why = first_line(why, 160);
                    match failed.iter_mut().find(|(w, _)| *w == why) {
                        Some((_, names)) => names.push(&t.kernel),
                        None => failed.push((why, vec![&t.kernel])),
                    }
                }
                Ok(sec) => {
                    let verdict = if t.error > WRONG { "  WRONG" } else { "" };
                    s += &format!(
                        "  {:<44} {:>10.1} µs {:>8.2} TFLOP/s  error {:.1e}{verdict}\n",
                        t.kernel,
                        sec * 1e6,
                        t.tflops(shape).unwrap_or(0.0),
                        t.error
                    );
                }
            }
        }
        for (why, names) in failed {
            s += &format!(
                "  did not run ({}): {why}\n    {}\n",
                names.len(),
                names.join(", ")
            );
        }
        let tuned = rows
            .iter()
            .find(|t| t.kernel == "autotune")
            .and_then(|t| t.seconds.as_ref().ok().copied());
        let best = rows
            .iter()
            .filter(|t| t.error <= WRONG)
            .find_map(|t| t.seconds.as_ref().ok().copied());
        if let (Some(tuned), Some(best)) = (tuned, best) {
            tuned_total += tuned * shape.per_step as f64;
            best_total += best * shape.per_step as f64;
        }
    }
    if tuned_total > 0.0 {
        s += &format!(
            "these products, each as often as a step runs it: {:.2} ms as autotuned, {:.2} ms at the fastest correct kernel of each ({:.2}×)\n",
            tuned_total * 1e3,
            best_total * 1e3,
            tuned_total / best_total
        );
    }
    s
}

/// The first line of `text`, at most `width` characters.
fn first_line(text: &str, width: usize) -> String {
    let line = text.lines().next().unwrap_or("");
    line.chars().take(width).collect()
}
