//! `bench generate`: how fast a language model generates — tokens per second with the
//! key–value cache and with the recomputing path, at several batch sizes, with the prompt's
//! forward pass (prefill) timed apart from the per-token steps.
//!
//! Decoding is greedy (the argmax taken on the host, as `generate` does), so every run
//! produces the same tokens; the backend is synchronised by reading each step's logits.

use super::median;
use crate::generate::{Decoder, Decoding};
use crate::kernels::LabBackend;
use crate::models::LanguageModel;
use anyhow::{bail, Result};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::time::Instant;

/// What to measure.
#[derive(Clone, Debug)]
pub struct GeneratePlan {
    /// Prompt tokens per sequence (random ids).
    pub prompt_len: usize,
    /// Tokens generated per sequence.
    pub new_tokens: usize,
    /// Batch sizes.
    pub batches: Vec<usize>,
    /// Decodings to compare.
    pub decodings: Vec<Decoding>,
    /// Timed runs per point (after one warm-up); medians are reported.
    pub runs: usize,
}

impl GeneratePlan {
    /// Refuses a plan with nothing to measure.
    pub fn check(&self) -> Result<()> {
        if self.prompt_len == 0 || self.new_tokens == 0 || self.runs == 0 {
            bail!("--prompt-len, --tokens and --runs must be at least 1");
        }
        if self.batches.contains(&0) {
            bail!("--batch sizes must be at least 1");
        }
        Ok(())
    }
}

/// One measured point.
#[derive(Clone, Debug)]
pub struct GenerateTiming {
    /// Cached or recomputing.
    pub decoding: Decoding,
    /// Sequences decoded together.
    pub batch: usize,
    /// Median seconds of the prompt's forward pass (first token's logits).
    pub prefill_s: f64,
    /// Median seconds of one later step (one token for every sequence).
    pub per_token_s: f64,
    /// Median seconds of the whole generation.
    pub total_s: f64,
    /// Generated tokens per second over all sequences: `batch · new_tokens / total_s`.
    pub tokens_per_s: f64,
}

/// Times greedy generation of `plan.new_tokens` tokens after random prompts.
pub fn bench_generate<B: LabBackend>(
    model: &LanguageModel<B>,
    plan: &GeneratePlan,
    device: &B::Device,
    mut progress: impl FnMut(&GenerateTiming),
) -> Result<Vec<GenerateTiming>> {
    plan.check()?;
    let mut rng = StdRng::seed_from_u64(0);
    let mut out = Vec::new();
    for &batch in &plan.batches {
        let prompts: Vec<Vec<usize>> = (0..batch)
            .map(|_| {
                (0..plan.prompt_len)
                    .map(|_| rng.random_range(0..model.vocab_size()))
                    .collect()
            })
            .collect();
        for &decoding in &plan.decodings {
            let mut runs: Vec<(f64, f64, f64)> = (0..=plan.runs)
                .map(|_| run(model, &prompts, plan.new_tokens, decoding, device))
                .collect::<Result<_>>()?;
            runs.remove(0); // warm-up
            let median =
                |f: fn(&(f64, f64, f64)) -> f64| median(&runs.iter().map(f).collect::<Vec<f64>>());
            let total_s = median(|r| r.2);
            let timing = GenerateTiming {
                decoding,
                batch,
                prefill_s: median(|r| r.0),
                per_token_s: median(|r| r.1),
                total_s,
                tokens_per_s: (batch * plan.new_tokens) as f64 / total_s,
            };
            progress(&timing);
            out.push(timing);
        }
    }
    Ok(out)
}

/// One generation: `(prefill s, median step s, total s)`.
fn run<B: LabBackend>(
    model: &LanguageModel<B>,
    prompts: &[Vec<usize>],
    new_tokens: usize,
    decoding: Decoding,
    device: &B::Device,
) -> Result<(f64, f64, f64)> {
    let v = model.vocab_size();
    let start = Instant::now();
    let mut decoder = Decoder::new(model, prompts.to_vec(), decoding, device);
    let mut steps = Vec::with_capacity(new_tokens);
    let mut last = start;
    for _ in 0..new_tokens {
        let logits: Vec<f32> = decoder
            .next_logits()
            .into_data()
            .convert::<f32>()
            .to_vec()
            .map_err(|e| anyhow::anyhow!("cannot read logits: {e:?}"))?;
        let next: Vec<usize> = logits
            .chunks(v)
            .map(|row| {
                (0..v)
                    .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
                    .unwrap_or(0)
            })
            .collect();
        decoder.push(&next);
        let now = Instant::now();
        steps.push((now - last).as_secs_f64());
        last = now;
    }
    let total = start.elapsed().as_secs_f64();
    let prefill = steps[0];
    let per_token = if steps.len() > 1 {
        median(&steps[1..])
    } else {
        prefill
    };
    Ok((prefill, per_token, total))
}

/// The table `bench generate` prints.
pub fn render(timings: &[GenerateTiming]) -> String {
    let mut s = format!(
        "{:<10} {:>5} {:>12} {:>14} {:>10} {:>10}\n",
        "decoding", "batch", "prefill ms", "per-token ms", "total s", "tokens/s"
    );
    for t in timings {
        let name = match t.decoding {
            Decoding::Cached => "cached",
            Decoding::Recompute => "recompute",
        };
        s += &format!(
            "{:<10} {:>5} {:>12.2} {:>14.3} {:>10.3} {:>10.1}\n",
            name,
            t.batch,
            t.prefill_s * 1e3,
            t.per_token_s * 1e3,
            t.total_s,
            t.tokens_per_s
        );
    }
    s
}
