//! Training curves: each run's `curves.png` (loss, learning rate, accuracy, perplexity against
//! step), and `curves`, which overlays one metric of several runs.

use crate::artifact::metrics::{self, axis_label, series, Row};
use crate::artifact::ArtifactDir;
use crate::config::ExperimentConfig;
use crate::plot::{line_panels_png, Panel, Series};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// One run's logged values.
#[derive(Clone, Debug)]
pub struct Run {
    /// Its legend entry: the artifact directory's name.
    pub name: String,
    /// Every logged value.
    pub rows: Vec<Row>,
}

impl Run {
    /// Reads the run in `dir`: its `metrics.csv`, or burn's epoch logs for an older run.
    pub fn load(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!("{} does not exist or is not a directory", dir.display());
        }
        let artifact = ArtifactDir::new(dir);
        if !artifact.config().exists() {
            bail!(
                "{} is not an artifact directory (no config.json): give directories written by `train`",
                dir.display()
            );
        }
        let config = ExperimentConfig::load(&artifact.config())?;
        let rows = metrics::read(&artifact, config.train.steps_per_epoch)?;
        if rows.is_empty() {
            bail!("{} has no logged metrics yet", dir.display());
        }
        // The name given (`runs/hyena`), else the directory's own (`.`).
        let name = dir
            .file_name()
            .map(PathBuf::from)
            .or_else(|| dir.canonicalize().ok()?.file_name().map(PathBuf::from))
            .map_or_else(|| dir.display().to_string(), |n| n.display().to_string());
        Ok(Self { name, rows })
    }
}

/// The panels of one run's `curves.png`: loss (training steps pale, validation bold), learning
/// rate, and accuracy and perplexity where they were logged. (burn logs a training step's
/// perplexity as the running mean over its epoch, not the step's own, so that panel shows
/// validation only.)
pub fn run_panels(rows: &[Row]) -> Vec<Panel> {
    let panel = |metric: &str| {
        let splits: &[(&str, bool, usize)] = match metric {
            "perplexity" => &[("valid", false, 1)],
            _ => &[("train", true, 0), ("valid", false, 1)],
        };
        let lines: Vec<Series> = splits
            .iter()
            .copied()
            .map(|(split, faint, colour)| Series {
                label: match split {
                    "train" => "training (each step)".to_string(),
                    _ => "validation".to_string(),
                },
                points: series(rows, metric, split),
                colour,
                faint,
            })
            .filter(|s| !s.points.is_empty())
            .collect();
        (!lines.is_empty()).then(|| Panel {
            x_label: "step".into(),
            y_label: axis_label(metric),
            series: lines,
        })
    };
    ["loss", "lr", "accuracy", "perplexity"]
        .into_iter()
        .filter_map(panel)
        .collect()
}

/// Writes `curves.png` of the run in `artifact` from its metrics.
pub fn write_run_curves(artifact: &ArtifactDir, config: &ExperimentConfig) -> Result<PathBuf> {
    let rows = metrics::read(artifact, config.train.steps_per_epoch)?;
    let data = match &config.data.text_file {
        Some(file) => file.display().to_string(),
        None => config.data.dataset.clone(),
    };
    let title = format!("{}: {} on {data}", config.name, config.model.kind());
    let path = artifact.curves();
    line_panels_png(&path, &title, &run_panels(&rows))?;
    Ok(path)
}

/// One panel with `metric` of every run in `split` (`lr` is only logged for training), one
/// series per run; a run without it is an error naming what it has.
pub fn overlay(runs: &[Run], metric: &str, split: &str) -> Result<Panel> {
    let split = if metric == "lr" { "train" } else { split };
    let series = runs
        .iter()
        .enumerate()
        .map(|(i, run)| {
            let points = series(&run.rows, metric, split);
            if points.is_empty() {
                bail!(
                    "{} has no {metric} for {split}; it has: {}",
                    run.name,
                    metrics::available(&run.rows)
                );
            }
            Ok(Series {
                label: run.name.clone(),
                points,
                colour: i,
                faint: false,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let which = if split == "valid" {
        "validation"
    } else {
        "training"
    };
    Ok(Panel {
        x_label: "step".into(),
        y_label: format!("{which} {}", axis_label(metric)),
        series,
    })
}

/// Every run's rows as one CSV table with a leading `run` column.
pub fn merged_csv(runs: &[Run]) -> String {
    let mut text = format!("run,{}\n", metrics::HEADER);
    for run in runs {
        for row in &run.rows {
            text.push_str(&format!("{},{}", run.name, row.line()));
        }
    }
    text
}

/// Where `compare` draws when not told: beside the runs, in the first run's parent directory
/// (`artifacts/` for runs under it), named by what it shows — never over a run's own
/// `curves.png`, never in the working directory unless the runs are there.
pub fn default_out(dirs: &[PathBuf], metric: &str, split: &str) -> PathBuf {
    let split = if metric == "lr" { "train" } else { split };
    let name = format!("curves-{split}-{metric}.png");
    match dirs.first().and_then(|dir| dir.parent()) {
        Some(parent) => parent.join(name),
        None => PathBuf::from(name),
    }
}

/// Reads `dirs`, draws `metric` of each in `split` to `out` (by default [`default_out`]), and
/// writes the merged table to `csv` when given.
pub fn compare(
    dirs: &[PathBuf],
    metric: &str,
    split: &str,
    out: Option<&Path>,
    csv: Option<&Path>,
) -> Result<()> {
    if !matches!(split, "train" | "valid") {
        bail!("--split is train or valid, not {split:?}");
    }
    let out = out.map_or_else(|| default_out(dirs, metric, split), Path::to_path_buf);
    let out = out.as_path();
    let runs = dirs
        .iter()
        .map(|dir| Run::load(dir))
        .collect::<Result<Vec<_>>>()?;
    let panel = overlay(&runs, metric, split)?;
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    let title = match names.join(" vs ") {
        short if short.len() <= 60 => format!("{}: {short}", panel.y_label),
        _ => format!(
            "{} of {}",
            panel.y_label,
            crate::stdio::count(runs.len(), "run")
        ),
    };
    line_panels_png(out, &title, &[panel]).context("cannot draw the curves")?;
    println!(
        "curves of {} written to {}",
        crate::stdio::count(runs.len(), "run"),
        out.display()
    );
    if let Some(csv) = csv {
        crate::files::write_atomic(csv, merged_csv(&runs).as_bytes())?;
        println!("merged table written to {}", csv.display());
    }
    Ok(())
}
