//! What `bench matmul` times on a GPU backend ([`super::LabBackend::time_products`]): the
//! products of a training step, the plan, and each kernel's timing (the step's shapes and the
//! table are `bench matmul`'s, in [`crate::bench::matmul`]).

use super::Precision;
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
