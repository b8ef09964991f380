//! Training curves: `metrics.csv` holds exactly the steps trained, a resume in the middle
//! included; `curves` overlays one series per run, reads runs older than the CSV from burn's
//! logs, and refuses what is not a run with one line.

use crate::common::{assert_clean_error, BIN};
use std::path::PathBuf;
use std::process::{Command, Output};
use transformer_lab::artifact::metrics::{self, Row};
use transformer_lab::artifact::ArtifactDir;
use transformer_lab::curves::{overlay, run_panels, Run};

/// A temp dir with a corpus and a tiny char LM of 3 epochs × 10 steps.
struct Sandbox {
    dir: tempfile::TempDir,
}

impl Sandbox {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let line = "the quick brown fox jumps over the lazy dog.\n";
        std::fs::write(dir.path().join("corpus.txt"), line.repeat(60)).unwrap();
        std::fs::write(
            dir.path().join("tiny.json"),
            r#"{"name": "tiny", "seed": 3,
               "model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 16},
               "data": {"text_file": "corpus.txt"},
               "train": {"batch_size": 8, "steps": 30, "steps_per_epoch": 10, "eval_batches": 2,
                         "warmup_steps": 3, "lr": 0.01}}"#,
        )
        .unwrap();
        Self { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn run(&self, args: &[&str], fail_checkpoint: Option<&str>) -> Output {
        let mut command = Command::new(BIN);
        command
            .args(["--backend", "ndarray"])
            .args(args)
            .current_dir(self.dir.path())
            .env("TRANSFORMER_LAB_DATA", self.path("no-data"))
            .env_remove(transformer_lab::artifact::FAIL_CHECKPOINT_ENV);
        if let Some(epoch) = fail_checkpoint {
            command.env(transformer_lab::artifact::FAIL_CHECKPOINT_ENV, epoch);
        }
        command.output().unwrap()
    }

    fn train(&self, art: &str) {
        let out = self.run(&["train", "-e", "tiny.json", "--artifact-dir", art], None);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn rows(&self, art: &str) -> Vec<Row> {
        metrics::read(&ArtifactDir::new(self.path(art)), 10).unwrap()
    }
}

fn steps(rows: &[Row], split: &str, metric: &str) -> Vec<usize> {
    rows.iter()
        .filter(|r| r.split == split && r.metric == metric)
        .map(|r| r.step)
        .collect()
}

#[test]
fn the_table_holds_exactly_the_steps_trained_across_a_resume() {
    let sandbox = Sandbox::new();
    sandbox.train("whole");
    // Epoch 2's checkpoint fails after its steps were logged: the resumed run trains them again.
    let cut = sandbox.run(
        &["train", "-e", "tiny.json", "--artifact-dir", "cut"],
        Some("2"),
    );
    assert!(!cut.status.success());
    let logged = *steps(&sandbox.rows("cut"), "train", "loss").last().unwrap();
    assert!(
        logged >= 20,
        "the failed epoch's steps were logged ({logged})"
    );
    let resumed = sandbox.run(&["train", "--artifact-dir", "cut", "--resume"], None);
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );

    let rows = sandbox.rows("cut");
    for metric in ["loss", "accuracy", "perplexity", "lr"] {
        assert_eq!(
            steps(&rows, "train", metric),
            (1..=30).collect::<Vec<_>>(),
            "{metric}"
        );
    }
    for metric in ["loss", "accuracy", "perplexity"] {
        assert_eq!(steps(&rows, "valid", metric), vec![10, 20, 30], "{metric}");
    }
    assert!(rows.iter().all(|r| r.epoch == (r.step - 1) / 10 + 1));
    let table = |art: &str| std::fs::read_to_string(sandbox.path(art).join("metrics.csv")).unwrap();
    assert_eq!(
        table("cut"),
        table("whole"),
        "resumed = uninterrupted, byte for byte"
    );
    // The table's last validation loss is the one the run reported.
    let last_valid = rows
        .iter()
        .rfind(|r| r.split == "valid" && r.metric == "loss")
        .unwrap();
    let reported = format!("validation loss {:.4}", last_valid.value);
    assert!(String::from_utf8_lossy(&resumed.stdout).contains(&reported));
    for art in ["whole", "cut"] {
        let png = image::open(sandbox.path(art).join("curves.png")).unwrap();
        assert!(
            png.width() >= 1000 && png.height() >= 800,
            "{art}: two rows of two panels"
        );
    }
    // What curves.png draws: a point per training step and one per validation, at its step,
    // the value the table holds — the resumed run's as the uninterrupted one's.
    let panels = run_panels(&rows);
    let labels: Vec<&str> = panels.iter().map(|p| p.y_label.as_str()).collect();
    assert_eq!(
        panels.len(),
        4,
        "loss, learning rate, accuracy, perplexity: {labels:?}"
    );
    let loss = &panels[0].series;
    let xs = |i: usize| {
        loss[i]
            .points
            .iter()
            .map(|p| p.0 as usize)
            .collect::<Vec<_>>()
    };
    assert_eq!(xs(0), (1..=30).collect::<Vec<_>>(), "{}", loss[0].label);
    assert_eq!(xs(1), [10, 20, 30], "{}", loss[1].label);
    assert_eq!(loss[1].points[2].1, last_valid.value);
    assert_eq!(run_panels(&sandbox.rows("whole")).len(), 4);
    assert_eq!(
        run_panels(&sandbox.rows("whole"))[0].series[0].points,
        loss[0].points
    );
}

#[test]
fn the_overlay_has_one_series_per_run() {
    let sandbox = Sandbox::new();
    sandbox.train("a");
    sandbox.train("b");
    let runs: Vec<Run> = ["a", "b"]
        .iter()
        .map(|art| Run::load(&sandbox.path(art)).unwrap())
        .collect();
    let panel = overlay(&runs, "loss", "valid").unwrap();
    let labels: Vec<&str> = panel.series.iter().map(|s| s.label.as_str()).collect();
    assert_eq!(labels, ["a", "b"]);
    assert!(panel.series.iter().all(|s| s.points.len() == 3));
    let lr = overlay(&runs, "lr", "valid").unwrap();
    assert_eq!(
        lr.series[0].points.len(),
        30,
        "lr is a training series whatever --split"
    );

    let out = sandbox.run(
        &[
            "curves", "a", "b", "--metric", "accuracy", "--out", "both.png", "--csv", "both.csv",
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(image::open(sandbox.path("both.png")).is_ok());
    let merged = std::fs::read_to_string(sandbox.path("both.csv")).unwrap();
    let rows = merged.lines().count() - 1;
    assert_eq!(rows, 2 * (30 * 4 + 3 * 3), "every row of both runs");
    assert!(merged
        .lines()
        .skip(1)
        .all(|l| l.starts_with("a,") || l.starts_with("b,")));
}

#[test]
fn a_run_older_than_the_table_is_read_from_burns_epoch_logs() {
    let dir = tempfile::tempdir().unwrap();
    let art = dir.path().join("old");
    let write = |path: &str, text: &str| {
        let path = art.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("train/epoch-1/Loss.log", "3.0,1\n2.5,1\n");
    write("train/epoch-2/Loss.log", "2.0,1\n1.5,1\n");
    write("train/epoch-1/Learning_Rate.log", "0.001,1\n0.002,1\n");
    // Validation batches are averaged by their counts: (1.0·3 + 2.0·1) / 4.
    write("valid/epoch-1/Loss.log", "1.0,3\n2.0,1\n");
    let rows = metrics::read(&ArtifactDir::new(&art), 2).unwrap();
    assert_eq!(
        metrics::series(&rows, "loss", "train"),
        [(1.0, 3.0), (2.0, 2.5), (3.0, 2.0), (4.0, 1.5)]
    );
    assert_eq!(
        metrics::series(&rows, "lr", "train"),
        [(1.0, 0.001), (2.0, 0.002)]
    );
    assert_eq!(metrics::series(&rows, "loss", "valid"), [(2.0, 1.25)]);
}

#[test]
fn what_is_not_a_run_is_one_clear_error() {
    let sandbox = Sandbox::new();
    sandbox.train("a");
    let curves = |dirs: &[&str]| {
        let mut args = vec!["curves"];
        args.extend_from_slice(dirs);
        sandbox.run(&args, None)
    };
    assert_clean_error(&curves(&["a", "missing"]), "missing does not exist");
    std::fs::create_dir(sandbox.path("empty")).unwrap();
    assert_clean_error(&curves(&["a", "empty"]), "not an artifact directory");
    assert_clean_error(&curves(&["a", "--metric", "bleu"]), "has no bleu");
    assert_clean_error(&curves(&["a", "--split", "test"]), "--split");
    let drawn = pngs_in(sandbox.dir.path());
    assert!(drawn.is_empty(), "nothing drawn on an error: {drawn:?}");
}

#[test]
fn curves_not_told_where_draw_beside_the_runs_not_over_them() {
    let sandbox = Sandbox::new();
    sandbox.train("runs/a");
    let own = std::fs::read(sandbox.path("runs/a/curves.png")).unwrap();
    let out = sandbox.run(&["curves", "runs/a"], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "curves of 1 run written to runs/curves-valid-loss.png"
    );
    assert!(image::open(sandbox.path("runs/curves-valid-loss.png")).is_ok());
    assert_eq!(
        std::fs::read(sandbox.path("runs/a/curves.png")).unwrap(),
        own,
        "the run's own curves.png is untouched"
    );
    let out = sandbox.run(&["curves", "runs/a", "--metric", "lr"], None);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("runs/curves-train-lr.png"),
        "lr is a training series: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let in_working_dir = pngs_in(sandbox.dir.path());
    assert!(in_working_dir.is_empty(), "{in_working_dir:?}");
}

/// The PNG files directly in `dir`.
fn pngs_in(dir: &std::path::Path) -> Vec<std::ffi::OsString> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|name| name.to_string_lossy().ends_with(".png"))
        .collect()
}
