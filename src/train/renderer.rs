//! Plain log lines for training outside a terminal (CI, pipes, files): one line every few
//! seconds with the step, loss, learning rate and throughput, and one line per validation.
//! In a terminal, burn's TUI dashboard is used instead.

use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Seconds between two training lines.
const LINE_EVERY: Duration = Duration::from_secs(5);

/// What a training step consumes, for speed reports: `per_step` items of `unit` ("tok",
/// "img", "sent").
#[derive(Clone, Copy, Debug)]
pub struct Throughput {
    /// Items per optimizer step.
    pub per_step: usize,
    /// Short name of an item.
    pub unit: &'static str,
    /// What `bench train` counts, in words ("tokens", "target tokens", "images").
    pub units: &'static str,
}

/// Writes readable progress lines to stdout.
pub struct PlainRenderer {
    names: HashMap<MetricId, String>,
    train: Averages,
    valid: Averages,
    steps_per_epoch: usize,
    total_steps: usize,
    throughput: Throughput,
    last_line: Option<(Instant, usize)>,
    /// What the validation means are over ("1280 of 111284 validation examples").
    valid_over: String,
}

/// Per-metric means over the current epoch (weighted by each entry's count), and the last
/// value (for metrics such as perplexity whose value is already an epoch aggregate).
#[derive(Default)]
struct Averages {
    sums: HashMap<String, (f64, f64, f64)>,
}

impl Averages {
    fn add(&mut self, name: &str, entry: &NumericEntry) {
        let (value, count) = match entry {
            NumericEntry::Value(v) => (*v, 1.0),
            NumericEntry::Aggregated {
                aggregated_value,
                count,
            } => (*aggregated_value, *count as f64),
        };
        let slot = self.sums.entry(name.to_string()).or_default();
        slot.0 += value * count;
        slot.1 += count;
        slot.2 = value;
    }

    fn last(&self, name: &str) -> Option<f64> {
        self.sums.get(name).map(|s| s.2)
    }

    fn mean(&self, name: &str) -> Option<f64> {
        self.sums.get(name).filter(|s| s.1 > 0.0).map(|s| s.0 / s.1)
    }
}

impl PlainRenderer {
    /// A renderer for a run of `total_steps` steps in epochs of `steps_per_epoch`, each step
    /// consuming `throughput.per_step` items (tokens, images, sentences), whose validation is
    /// over `valid_over`.
    pub fn new(
        steps_per_epoch: usize,
        total_steps: usize,
        throughput: Throughput,
        valid_over: String,
    ) -> Self {
        Self {
            names: HashMap::new(),
            train: Averages::default(),
            valid: Averages::default(),
            steps_per_epoch,
            total_steps,
            throughput,
            last_line: None,
            valid_over,
        }
    }

    fn record(&mut self, state: MetricState, valid: bool) {
        if let MetricState::Numeric(entry, numeric) = state {
            let name = self
                .names
                .get(&entry.metric_id)
                .cloned()
                .unwrap_or_default();
            let averages = if valid {
                &mut self.valid
            } else {
                &mut self.train
            };
            averages.add(&name, &numeric);
        }
    }

    fn step_of(&self, item: &TrainingProgress) -> usize {
        let epoch = item.global_progress.items_processed.max(1);
        (epoch - 1) * self.steps_per_epoch + item.iteration.unwrap_or(0)
    }
}

impl MetricsRendererTraining for PlainRenderer {
    fn update_train(&mut self, state: MetricState) {
        self.record(state, false);
    }

    fn update_valid(&mut self, state: MetricState) {
        self.record(state, true);
    }

    fn render_train(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
        let step = self.step_of(&item);
        let now = Instant::now();
        let (since, first_step) = *self.last_line.get_or_insert((now, step));
        let epoch_end = item.iteration == Some(self.steps_per_epoch);
        if now - since < LINE_EVERY && !epoch_end && step != 1 {
            return;
        }
        let elapsed = (now - since).as_secs_f64();
        let throughput = if step > first_step && elapsed > 0.0 {
            format!(
                "{:>8.0} {}/s",
                (step - first_step) as f64 * self.throughput.per_step as f64 / elapsed,
                self.throughput.unit
            )
        } else {
            String::new()
        };
        println!(
            "epoch {:>2}/{}  step {:>6}/{}  loss {:.4}  lr {:.2e}  {throughput}",
            item.global_progress.items_processed,
            item.global_progress.items_total,
            step,
            self.total_steps,
            self.train.last("Loss").unwrap_or(f64::NAN),
            self.train.last("Learning Rate").unwrap_or(f64::NAN),
        );
        self.last_line = Some((now, step));
        if epoch_end {
            self.train = Averages::default();
        }
    }

    fn render_valid(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
        let done = item
            .progress
            .as_ref()
            .is_some_and(|p| p.items_processed >= p.items_total);
        if !done {
            return;
        }
        let perplexity = self
            .valid
            .last("Perplexity")
            .map(|p| format!("  perplexity {p:.3}"))
            .unwrap_or_default();
        println!(
            "epoch {:>2}/{}  valid  loss {:.4}  accuracy {:.2}%{perplexity}  over {}",
            item.global_progress.items_processed,
            item.global_progress.items_total,
            self.valid.mean("Loss").unwrap_or(f64::NAN),
            self.valid.mean("Accuracy").unwrap_or(f64::NAN),
            self.valid_over,
        );
        self.valid = Averages::default();
        // Validation time is not training throughput.
        self.last_line = None;
    }

    fn on_train_end(
        &mut self,
        _summary: Option<burn::train::LearnerSummary>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for PlainRenderer {
    fn update_test(&mut self, _name: EvaluationName, state: MetricState) {
        self.record(state, true);
    }

    fn render_test(&mut self, _item: EvaluationProgress, _: Vec<ProgressType>) {}
}

impl MetricsRenderer for PlainRenderer {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names.insert(definition.metric_id, definition.name);
    }
}
