//! The training perplexity of the epoch so far, as burn's `PerplexityMetric` reports it
//! (`exp` of the summed negative log-likelihood over the tokens seen this epoch), with its
//! running sums readable and settable: a checkpoint taken mid-epoch keeps them, and the run
//! resumed from it continues the epoch's value where the stopped run left it.

use burn::prelude::*;
use burn::tensor::TensorData;
use burn::train::metric::{
    Adaptor, Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes,
    NumericEntry, SerializedEntry,
};
use burn::train::ClassificationOutput;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};

/// The epoch's running sums: negative log-likelihood and tokens (padding excluded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NllSums {
    /// Σ −log p(target) (as text: serde_json's own reading of a number may be off in the last
    /// bit, and a resumed run must continue from exactly this sum).
    #[serde(with = "exact")]
    pub nll: f64,
    /// Tokens counted.
    pub tokens: usize,
}

impl NllSums {
    fn perplexity(&self) -> f64 {
        if self.tokens == 0 {
            f64::INFINITY
        } else {
            (self.nll / self.tokens as f64).exp()
        }
    }
}

/// An `f64` written as the shortest text that Rust reads back as the same bits.
mod exact {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&value.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
        String::deserialize(deserializer)?
            .parse()
            .map_err(D::Error::custom)
    }
}

/// A batch's logits `[n, classes]` and targets `[n]`, on the host.
pub struct NllInput {
    logits: TensorData,
    targets: TensorData,
}

impl<B: Backend> Adaptor<NllInput> for ClassificationOutput<B> {
    fn adapt(&self) -> NllInput {
        NllInput {
            logits: self.output.to_data(),
            targets: self.targets.to_data(),
        }
    }
}

/// The epoch's perplexity; [`Self::sums`] is shared with whoever checkpoints the run.
#[derive(Clone)]
pub struct EpochPerplexity {
    name: MetricName,
    pad: Option<usize>,
    sums: Arc<Mutex<NllSums>>,
}

impl EpochPerplexity {
    /// A metric that skips targets equal to `pad`, starting from `start` (what the epoch had
    /// summed before a resumed run's first step; zero otherwise).
    pub fn new(pad: Option<usize>, start: NllSums) -> Self {
        Self {
            name: Arc::new("Perplexity".to_string()),
            pad,
            sums: Arc::new(Mutex::new(start)),
        }
    }

    /// The running sums, as the last processed step left them.
    pub fn sums(&self) -> Arc<Mutex<NllSums>> {
        self.sums.clone()
    }

    fn current(&self) -> NllSums {
        *self.sums.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Σ −log softmax(row)[target] over the rows whose target is not `pad`, and their count.
fn batch_nll(input: &NllInput, pad: Option<usize>) -> NllSums {
    let logits: Vec<f32> = input
        .logits
        .clone()
        .convert::<f32>()
        .into_vec()
        .unwrap_or_default();
    let targets: Vec<i64> = input
        .targets
        .clone()
        .convert::<i64>()
        .into_vec()
        .unwrap_or_default();
    let classes = input.logits.shape.last().copied().unwrap_or(1).max(1);
    let mut sums = NllSums::default();
    for (row, &target) in logits.chunks(classes).zip(&targets) {
        let target = target as usize;
        if Some(target) == pad || target >= row.len() {
            continue;
        }
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let log_sum: f64 = row
            .iter()
            .map(|&v| (v as f64 - max).exp())
            .sum::<f64>()
            .ln();
        sums.nll += log_sum + max - row[target] as f64;
        sums.tokens += 1;
    }
    sums
}

impl Metric for EpochPerplexity {
    type Input = NllInput;

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: None,
            higher_is_better: false,
        }
        .into()
    }

    fn update(&mut self, input: &NllInput, _: &MetricMetadata) -> SerializedEntry {
        let batch = batch_nll(input, self.pad);
        let sums = {
            let mut sums = self.sums.lock().unwrap_or_else(|e| e.into_inner());
            sums.nll += batch.nll;
            sums.tokens += batch.tokens;
            *sums
        };
        let entry = NumericEntry::Aggregated {
            aggregated_value: sums.perplexity(),
            count: sums.tokens,
        };
        SerializedEntry::new(
            format!(
                "epoch {:.2} - batch {:.2}",
                sums.perplexity(),
                batch.perplexity()
            ),
            entry.serialize(),
        )
    }

    fn clear(&mut self) {
        *self.sums.lock().unwrap_or_else(|e| e.into_inner()) = NllSums::default();
    }
}

impl Numeric for EpochPerplexity {
    fn value(&self) -> NumericEntry {
        let sums = self.current();
        NumericEntry::Aggregated {
            aggregated_value: sums.perplexity(),
            count: sums.tokens,
        }
    }

    fn running_value(&self) -> NumericEntry {
        self.value()
    }
}
