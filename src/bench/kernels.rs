//! `bench kernels`: each fused operation against the composed ops it replaces, forward +
//! backward at a language-model experiment's shapes — the per-operation profile of a training
//! step, the loss included.

use super::median;
use crate::config::LmConfig;
use crate::kernels::{self, with_fused, LabAutodiff};
use crate::nn::attention::scaled_dot_product_attention;
use crate::nn::AttentionMask;
use anyhow::{anyhow, Result};
use burn::nn::{LayerNormConfig, LinearConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use std::time::Instant;

/// One operation's time, composed and fused.
#[derive(Clone, Debug)]
pub struct KernelTiming {
    /// What was timed.
    pub name: &'static str,
    /// Its input shape.
    pub shape: String,
    /// How many times one training step runs it.
    pub per_step: usize,
    /// Median seconds of forward + backward, composed.
    pub composed: f64,
    /// Median seconds of forward + backward, fused.
    pub fused: f64,
}

/// Times forward + backward of `f` (on fresh leaves from `inputs`, output gradient random)
/// `reps` times after two warm-ups; the median seconds.
fn time<B: LabAutodiff, const D: usize, const E: usize>(
    inputs: &[Tensor<B, D>],
    reps: usize,
    device: &B::Device,
    f: &dyn Fn(Vec<Tensor<B, D>>) -> Tensor<B, E>,
) -> Result<f64> {
    let mut times = Vec::with_capacity(reps);
    for rep in 0..reps + 2 {
        let leaves: Vec<Tensor<B, D>> = inputs.iter().map(|x| x.clone().require_grad()).collect();
        let start = Instant::now();
        let y = f(leaves);
        let _grads = y.sum().backward();
        B::sync(device).map_err(|e| anyhow!("the backend failed: {e:?}"))?;
        if rep >= 2 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    Ok(median(&times))
}

fn random<B: Backend, const D: usize>(shape: [usize; D], device: &B::Device) -> Tensor<B, D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

/// Both timings of `f`.
fn both<B: LabAutodiff, const D: usize, const E: usize>(
    inputs: &[Tensor<B, D>],
    reps: usize,
    device: &B::Device,
    f: &dyn Fn(Vec<Tensor<B, D>>) -> Tensor<B, E>,
) -> Result<(f64, f64)> {
    let composed = with_fused(false, || time(inputs, reps, device, f))?;
    let fused = with_fused(true, || time(inputs, reps, device, f))?;
    Ok((composed, fused))
}

/// Times every fused operation at the shapes of `lm` with `batch` sequences.
pub fn bench_kernels<B: LabAutodiff>(
    lm: &LmConfig,
    batch: usize,
    vocab: usize,
    reps: usize,
    device: &B::Device,
) -> Result<Vec<KernelTiming>> {
    let stack = &lm.stack;
    let (b, t, d, h) = (batch, lm.context, stack.d_model, stack.n_heads);
    let d_ff = stack.d_ff();
    let (n, k, layers) = (b * t, d / h, lm.n_layers);
    B::seed(device, 0);
    let mut rows = Vec::new();

    let x = [random::<B, _>([n, d_ff], device)];
    let (composed, fused) = both(&x, reps, device, &|x| kernels::gelu(x[0].clone()))?;
    rows.push(KernelTiming {
        name: "GELU",
        shape: format!("[{n}, {d_ff}]"),
        per_step: layers,
        composed,
        fused,
    });

    let norm = LayerNormConfig::new(d)
        .with_bias(stack.bias)
        .init::<B>(device);
    let x = [random::<B, _>([n, d], device)];
    let (composed, fused) = both(&x, reps, device, &|x| {
        kernels::layer_norm(&norm, kernels::LAYER_NORM_EPSILON, x[0].clone())
    })?;
    rows.push(KernelTiming {
        name: "LayerNorm",
        shape: format!("[{n}, {d}]"),
        per_step: 2 * layers + usize::from(stack.norm_first),
        composed,
        fused,
    });

    let mask = AttentionMask::<B>::causal(t, device);
    let qkv: Vec<Tensor<B, 4>> = (0..3)
        .map(|_| random::<B, 4>([b, h, t, k], device))
        .collect();
    let composed = with_fused(false, || {
        time(&qkv, reps, device, &|x| {
            scaled_dot_product_attention(x[0].clone(), x[1].clone(), x[2].clone(), Some(&mask)).0
        })
    })?;
    let fused = with_fused(true, || {
        time(&qkv, reps, device, &|x| {
            kernels::attention(x[0].clone(), x[1].clone(), x[2].clone(), true, None, None)
        })
    })?;
    rows.push(KernelTiming {
        name: "causal attention",
        shape: format!("[{b}, {h}, {t}, {k}]"),
        per_step: layers,
        composed,
        fused,
    });

    let causal = mask.tensor().expand([b, h, t, t]);
    let scores = [random::<B, _>([b, h, t, t], device)];
    let (composed, fused) = both(&scores, reps, device, &|x| {
        kernels::softmax(
            x[0].clone()
                .mask_fill(causal.clone(), crate::nn::attention::MASKED_SCORE),
        )
    })?;
    rows.push(KernelTiming {
        name: "masked softmax",
        shape: format!("[{b}, {h}, {t}, {t}]"),
        per_step: 0,
        composed,
        fused,
    });

    let linear = LinearConfig::new(d, d_ff)
        .with_bias(stack.bias)
        .init::<B>(device);
    let x = [random::<B, _>([b, t, d], device)];
    let (composed, fused) = both(&x, reps, device, &|x| {
        crate::nn::linear(&linear, x[0].clone())
    })?;
    rows.push(KernelTiming {
        name: "linear",
        shape: format!("[{b}, {t}, {d}]→{d_ff}"),
        // A layer's four d×d and two d×4d products cost three of these.
        per_step: 3 * layers,
        composed,
        fused,
    });

    let targets = Tensor::<B, 1, Int>::from_data(
        TensorData::new(
            (0..n).map(|i| (i * 7 % vocab) as i64).collect::<Vec<_>>(),
            [n],
        ),
        device,
    );
    let x = [random::<B, _>([n, vocab], device)];
    let (composed, fused) = both(&x, reps, device, &|x| {
        kernels::cross_entropy(x[0].clone(), targets.clone(), 0.0, None).mean()
    })?;
    rows.push(KernelTiming {
        name: "cross-entropy",
        shape: format!("[{n}, {vocab}]"),
        per_step: 1,
        composed,
        fused,
    });
    Ok(rows)
}

/// The timings as a table, with each operation's share of a step (`per_step` times).
pub fn render(rows: &[KernelTiming]) -> String {
    let mut out = format!(
        "{:<26} {:<22} {:>5} {:>12} {:>12} {:>8}\n",
        "forward + backward", "shape", "×step", "composed ms", "fused ms", "speedup"
    );
    let (mut before, mut after) = (0.0, 0.0);
    for r in rows {
        before += r.composed * r.per_step as f64;
        after += r.fused * r.per_step as f64;
        out += &format!(
            "{:<26} {:<22} {:>5} {:>12.3} {:>12.3} {:>7.2}×\n",
            r.name,
            r.shape,
            r.per_step,
            r.composed * 1e3,
            r.fused * 1e3,
            r.composed / r.fused,
        );
    }
    out += &format!(
        "per training step (these operations × their count): {:.1} ms composed, {:.1} ms fused\n",
        before * 1e3,
        after * 1e3
    );
    out
}
