//! `bench matmul`: every matrix-product kernel a GPU backend can choose, timed on the products
//! of a language model's training step. burn's matmul autotune benchmarks only its
//! highest-priority candidates for a shape and keeps the fastest of those; this times them
//! all — the autotuned choice as the step gets it, then each candidate launched directly — and
//! checks each one's output against sums computed on the host in `f64`. It says what the step's
//! products cost, which kernel is fastest at each of its shapes, and what choosing it would
//! save.

pub use crate::kernels::matmul::{MatmulPlan, ProductShape, ProductTiming, WRONG};
use crate::models::LmConfig;

/// The products of one training step of a language model: for each linear layer its forward
/// product `x·w`, the input's gradient `dy·wᵀ` and the weight's `xᵀ·dy`, at `rows` rows (a
/// step's `batch × context`; a decoding step's forward products have a row a sequence); the
/// output layer's from the tied embedding table (`[v, d]` read transposed) where the weights
/// are tied. `only` keeps the products whose name contains one of its words.
pub fn step_products(
    lm: &LmConfig,
    rows: usize,
    vocab: usize,
    only: &[String],
) -> Vec<ProductShape> {
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
