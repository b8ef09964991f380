//! A run's metrics as a table: `metrics.csv` (`step,epoch,split,metric,value`, one row per
//! logged value, validation rows at the step of their epoch's end), written as training goes;
//! read back for `curves`, or rebuilt from burn's per-epoch logs for runs older than the CSV.

use super::ArtifactDir;
use anyhow::{bail, Context, Result};
use std::fmt::Write as _;
use std::path::Path;

/// The CSV's header line.
pub const HEADER: &str = "step,epoch,split,metric,value";

/// One logged value.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// Optimizer step (1-based) the value belongs to; a validation value sits at the last step
    /// of its epoch.
    pub step: usize,
    /// Learner epoch (checkpoint number, 1-based).
    pub epoch: usize,
    /// `train` or `valid`.
    pub split: String,
    /// `loss`, `accuracy`, `perplexity` or `lr`.
    pub metric: String,
    /// The value.
    pub value: f64,
}

impl Row {
    /// The row as one CSV line (with its newline); `{}` prints the shortest text that reads
    /// back as the same `f64`, so a resumed run writes the same bytes as an uninterrupted one.
    pub fn line(&self) -> String {
        format!(
            "{},{},{},{},{}\n",
            self.step, self.epoch, self.split, self.metric, self.value
        )
    }
}

/// The name a burn metric gets in the CSV: `Loss` → `loss`, `Learning Rate` → `lr`.
pub fn metric_key(burn_name: &str) -> String {
    match burn_name {
        "Learning Rate" | "Learning_Rate" => "lr".to_string(),
        other => other.to_lowercase().replace([' ', '_'], "-"),
    }
}

/// Parses `metrics.csv`; a partly written last line (a killed run) is left out.
pub fn parse(text: &str, path: &Path) -> Result<Vec<Row>> {
    let mut lines = text.lines();
    if lines.next() != Some(HEADER) {
        bail!(
            "{} is not a metrics table (its first line is not {HEADER:?})",
            path.display()
        );
    }
    let complete = if text.ends_with('\n') {
        usize::MAX
    } else {
        text.lines().count().saturating_sub(2)
    };
    let mut rows = Vec::new();
    for (i, line) in lines.enumerate().take(complete) {
        let fields: Vec<&str> = line.split(',').collect();
        let row = (|| -> Option<Row> {
            let [step, epoch, split, metric, value] = fields[..] else {
                return None;
            };
            Some(Row {
                step: step.parse().ok()?,
                epoch: epoch.parse().ok()?,
                split: split.to_string(),
                metric: metric.to_string(),
                value: value.parse().ok()?,
            })
        })()
        .with_context(|| format!("{} line {}: malformed row {line:?}", path.display(), i + 2))?;
        rows.push(row);
    }
    Ok(rows)
}

/// The table as CSV text, header first.
pub fn to_csv(rows: &[Row]) -> String {
    let mut text = format!("{HEADER}\n");
    for row in rows {
        text.push_str(&row.line());
    }
    text
}

/// Every logged value of the run in `artifact`: its `metrics.csv`, or for a run written before
/// the CSV existed, burn's logs (`train/epoch-N/Loss.log`, one line per step; `valid/epoch-N/`,
/// one line per batch, averaged by count into the epoch's value) with `steps_per_epoch`.
pub fn read(artifact: &ArtifactDir, steps_per_epoch: usize) -> Result<Vec<Row>> {
    let csv = artifact.metrics();
    if csv.exists() {
        let text = std::fs::read_to_string(&csv)
            .with_context(|| format!("cannot read {}", csv.display()))?;
        return parse(&text, &csv);
    }
    let mut rows = Vec::new();
    for split in ["train", "valid"] {
        let dir = artifact.root().join(split);
        let Ok(epochs) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in epochs.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(epoch) = name.strip_prefix("epoch-").and_then(|n| n.parse().ok()) else {
                continue;
            };
            for log in std::fs::read_dir(entry.path())?.flatten() {
                let path = log.path();
                if path.extension().is_none_or(|e| e != "log") {
                    continue;
                }
                let stem = path.file_stem().unwrap_or_default().to_string_lossy();
                let metric = metric_key(&stem);
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                let values = burn_log_values(&text);
                let first = (epoch - 1) * steps_per_epoch;
                if split == "train" {
                    rows.extend(values.iter().enumerate().map(|(i, &(value, _))| Row {
                        step: first + i + 1,
                        epoch,
                        split: split.into(),
                        metric: metric.clone(),
                        value,
                    }));
                } else if !values.is_empty() {
                    let count: f64 = values.iter().map(|(_, n)| n).sum();
                    let sum: f64 = values.iter().map(|(v, n)| v * n).sum();
                    rows.push(Row {
                        step: epoch * steps_per_epoch,
                        epoch,
                        split: split.into(),
                        metric,
                        value: sum / count,
                    });
                }
            }
        }
    }
    rows.sort_by(|a, b| {
        (a.step, &a.split, &a.metric)
            .partial_cmp(&(b.step, &b.split, &b.metric))
            .expect("steps and names compare")
    });
    Ok(rows)
}

/// `(value, count)` of each line `value,count` of a burn metric log.
fn burn_log_values(text: &str) -> Vec<(f64, f64)> {
    text.lines()
        .filter_map(|line| {
            let (value, count) = line.split_once(',')?;
            Some((value.parse().ok()?, count.trim().parse().ok()?))
        })
        .collect()
}

/// `metric,split` pairs present in `rows`, for error messages.
pub fn available(rows: &[Row]) -> String {
    let mut names: Vec<String> = rows
        .iter()
        .map(|r| format!("{} ({})", r.metric, r.split))
        .collect();
    names.sort();
    names.dedup();
    let mut text = String::new();
    for (i, name) in names.iter().enumerate() {
        let _ = write!(text, "{}{name}", if i > 0 { ", " } else { "" });
    }
    text
}

/// The `(step, value)` points of `metric` in `split`, in step order.
pub fn series(rows: &[Row], metric: &str, split: &str) -> Vec<(f64, f64)> {
    rows.iter()
        .filter(|r| r.metric == metric && r.split == split)
        .map(|r| (r.step as f64, r.value))
        .collect()
}

/// A metric's axis label, with its unit.
pub fn axis_label(metric: &str) -> String {
    match metric {
        "loss" => "loss (cross-entropy, nats)".to_string(),
        "accuracy" => "accuracy (%)".to_string(),
        "perplexity" => "perplexity (e^loss)".to_string(),
        "lr" => "learning rate".to_string(),
        other => other.to_string(),
    }
}
