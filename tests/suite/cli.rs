//! The real binary end to end on a tiny config: train → generate → eval, resume after a kill,
//! and one clear error line (never a panic) for each bad input.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_transformer-lab");

struct Sandbox {
    dir: tempfile::TempDir,
}

impl Sandbox {
    /// A temp dir with a small text corpus and a tiny experiment training on it.
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let line = "the quick brown fox jumps over the lazy dog. ";
        std::fs::write(dir.path().join("corpus.txt"), line.repeat(60)).unwrap();
        let s = Self { dir };
        s.experiment("tiny.json", 16, 40);
        s
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn experiment(&self, name: &str, d_model: usize, steps: usize) -> PathBuf {
        let corpus = self.path("corpus.txt");
        let text = format!(
            r#"{{"name": "tiny", "seed": 1,
               "model": {{"d_model": {d_model}, "n_layers": 1, "n_heads": 2, "context": 16}},
               "data": {{"text_file": {corpus:?}}},
               "train": {{"batch_size": 8, "steps": {steps}, "steps_per_epoch": 20, "eval_batches": 2,
                          "warmup_steps": 5, "lr": 0.01}}}}"#
        );
        std::fs::write(self.path(name), text).unwrap();
        self.path(name)
    }

    fn generate(&self, extra: &[&str]) -> Output {
        let mut args = vec![
            "generate",
            "--artifact-dir",
            "art",
            "--max-new-tokens",
            "30",
        ];
        args.extend_from_slice(extra);
        self.run(&args)
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .args(["--backend", "ndarray"])
            .args(args)
            .current_dir(self.dir.path())
            .env("TRANSFORMER_LAB_DATA", self.path("no-data"))
            .output()
            .unwrap()
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Asserts a clean failure: non-zero exit, one `error:` line naming `expected`, no panic.
fn assert_error(o: &Output, expected: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "expected failure, got success: {}",
        stdout(o)
    );
    assert!(!err.contains("panicked"), "panic: {err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line in {err:?}"));
    assert!(line.contains(expected), "{line:?} lacks {expected:?}");
}

#[test]
fn train_generate_eval_end_to_end() {
    let sb = Sandbox::new();
    let out = sb.run(&["train", "-e", "tiny.json", "--artifact-dir", "art"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log = stdout(&out);
    assert!(
        log.contains("step     40/40"),
        "plain log lines expected:\n{log}"
    );
    let valid = common::valid_losses(&log);
    assert_eq!(valid.len(), 2, "{log}");
    // Every validation figure says what it is over: eval_batches (2) × batch_size (8) of the
    // split's windows, the same sample each epoch; eval's is over the whole split.
    let over: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" valid ") || l.contains("validation loss"))
        .map(|l| l.split(" over ").nth(1).unwrap_or("nothing"))
        .map(|o| o.split(';').next().unwrap())
        .collect();
    assert_eq!(over.len(), 3, "{log}");
    assert!(
        over[0].starts_with("16 of ") && over[0].ends_with(" validation examples"),
        "{log}"
    );
    assert!(over.iter().all(|o| o == &over[0]), "{over:?}");
    assert!(
        valid[1] < 2.2,
        "a 40-step run on a repetitive corpus learns: {valid:?}"
    );
    for file in [
        "config.json",
        "tokenizer.json",
        "model.mpk",
        "checkpoint/model-2.mpk",
        "checkpoint/scheduler-2.mpk",
    ] {
        assert!(sb.path("art").join(file).exists(), "{file} missing");
    }

    let gen = sb.generate(&["--prompt", "the ", "--seed", "3"]);
    assert!(
        gen.status.success(),
        "{}",
        String::from_utf8_lossy(&gen.stderr)
    );
    let text = stdout(&gen);
    assert!(
        text.starts_with("the ") && text.trim_end().chars().count() >= 30,
        "{text:?}"
    );
    let again = sb.generate(&["--prompt", "the ", "--seed", "3"]);
    assert_eq!(text, stdout(&again), "same seed, same text");
    let greedy = sb.generate(&["--prompt", "the ", "--greedy"]);
    let top1 = sb.generate(&["--prompt", "the ", "--top-k", "1", "--seed", "9"]);
    assert_eq!(stdout(&greedy), stdout(&top1));

    let eval = sb.run(&["eval", "--artifact-dir", "art"]);
    assert!(
        eval.status.success(),
        "{}",
        String::from_utf8_lossy(&eval.stderr)
    );
    assert!(
        stdout(&eval).contains("over the whole validation split"),
        "{}",
        stdout(&eval)
    );
    // Shorter windows are fine; a learned table refuses windows past its end, in one line.
    let short = sb.run(&["eval", "--artifact-dir", "art", "--context", "4"]);
    assert!(
        stdout(&short).contains("in windows of 4"),
        "{}",
        stdout(&short)
    );
    assert_error(
        &sb.run(&["eval", "--artifact-dir", "art", "--context", "100000"]),
        "learned positions end there",
    );
}

#[test]
fn bad_inputs_get_one_clear_error_line() {
    let sb = Sandbox::new();
    assert!(sb
        .run(&["train", "-e", "tiny.json", "--artifact-dir", "art"])
        .status
        .success());

    assert_error(
        &sb.run(&["generate", "--artifact-dir", "art", "--prompt", "Zebra!"]),
        "outside the model's vocabulary",
    );
    let long = "the ".repeat(10);
    assert_error(
        &sb.run(&["generate", "--artifact-dir", "art", "--prompt", &long]),
        "context is 16",
    );
    assert_error(
        &sb.run(&["generate", "--artifact-dir", "missing"]),
        "does not exist",
    );
    std::fs::create_dir(sb.path("empty")).unwrap();
    assert_error(
        &sb.run(&["generate", "--artifact-dir", "empty"]),
        "holds no trained model",
    );
    for (flag, value) in [
        ("--top-p", "2"),
        ("--repetition-penalty", "0"),
        ("--frequency-penalty", "-2.5"),
        ("--presence-penalty", "3"),
    ] {
        assert_error(
            &sb.run(&["generate", "--artifact-dir", "art", flag, value]),
            flag,
        );
    }

    // The artifact is never overwritten without --force.
    let before = std::fs::read(sb.path("art/model.mpk")).unwrap();
    assert_error(
        &sb.run(&["train", "-e", "tiny.json", "--artifact-dir", "art"]),
        "--resume",
    );
    assert_eq!(before, std::fs::read(sb.path("art/model.mpk")).unwrap());

    // A checkpoint from a different config.
    sb.experiment("wide.json", 32, 20);
    assert!(sb
        .run(&["train", "-e", "wide.json", "--artifact-dir", "wide"])
        .status
        .success());
    std::fs::copy(sb.path("wide/model.mpk"), sb.path("art/model.mpk")).unwrap();
    assert_error(
        &sb.run(&["generate", "--artifact-dir", "art"]),
        "another shape",
    );

    // Configs and data.
    std::fs::write(
        sb.path("bad.json"),
        r#"{"model": {"d_model": 30, "n_heads": 4}}"#,
    )
    .unwrap();
    assert_error(
        &sb.run(&["train", "-e", "bad.json", "--artifact-dir", "x"]),
        "divisible by n_heads",
    );
    std::fs::write(sb.path("typo.json"), r#"{"train": {"stepz": 3}}"#).unwrap();
    assert_error(
        &sb.run(&["train", "-e", "typo.json", "--artifact-dir", "x"]),
        "unknown field",
    );
    assert_error(&sb.run(&["train", "-e", "nope.json"]), "cannot read config");
    std::fs::write(
        sb.path("nodata.json"),
        r#"{"data": {"text_file": "absent.txt"}}"#,
    )
    .unwrap();
    assert_error(
        &sb.run(&["train", "-e", "nodata.json", "--artifact-dir", "y"]),
        "absent.txt",
    );
    let corrupt = sb.path("data/tinyshakespeare/input.txt");
    std::fs::create_dir_all(corrupt.parent().unwrap()).unwrap();
    std::fs::write(&corrupt, "not the real file").unwrap();
    assert_error(
        &sb.run(&["train", "--artifact-dir", "z", "--data-dir", "data"]),
        "sha256",
    );
    assert_error(
        &sb.run(&["eval", "--artifact-dir", "art", "--batch-size", "0"]),
        "batch-size",
    );
    // Not "accuracy 0.00% on 0 sentences", which reads as a model that learned nothing.
    assert_error(
        &sb.run(&["eval", "--artifact-dir", "art", "--limit", "0"]),
        "--limit must be at least 1",
    );
    assert_error(
        &sb.run(&["explain", "--x", "1,0;0"]),
        "same number of values",
    );
}

fn wait_for(path: &Path, child: &mut std::process::Child) {
    let start = std::time::Instant::now();
    while !path.exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "training ended before {} appeared",
            path.display()
        );
        assert!(
            start.elapsed().as_secs() < 120,
            "timed out waiting for {}",
            path.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn a_killed_run_resumes_from_its_last_complete_checkpoint() {
    let sb = Sandbox::new();
    sb.experiment("long.json", 16, 200);
    let mut child = Command::new(BIN)
        .args([
            "--backend",
            "ndarray",
            "train",
            "-e",
            "long.json",
            "--artifact-dir",
            "art",
        ])
        .current_dir(sb.dir.path())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for(&sb.path("art/checkpoint/scheduler-2.mpk"), &mut child);
    child.kill().unwrap(); // SIGKILL: no chance to clean up
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        status.signal(),
        Some(9),
        "the run ended ({status}) before the kill"
    );
    // A half-written file from the killed process must be ignored.
    std::fs::write(sb.path("art/checkpoint/.model-9-partial-1.mpk"), b"garbage").unwrap();

    let out = sb.run(&["train", "--artifact-dir", "art", "--resume"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log = stdout(&out);
    assert!(log.contains("resuming after step"), "{log}");
    assert!(log.contains("step    200/200"), "{log}");
    // The LR schedule continued: the last step's rate is the cosine's end, not a restart's.
    let last_lr = log
        .lines()
        .rfind(|l| l.contains("step    200/200"))
        .unwrap();
    let expected = transformer_lab::train::WarmupSchedule::new(0.01, 1e-4, 5, 200).at(199);
    let restarted = transformer_lab::train::WarmupSchedule::new(0.01, 1e-4, 5, 200).at(199 - 40);
    assert!(
        last_lr.contains(&format!("lr {expected:.2e}")),
        "want lr {expected:.2e}: {last_lr}"
    );
    assert!(!last_lr.contains(&format!("lr {restarted:.2e}")));
    assert!(sb.path("art/checkpoint/model-10.mpk").exists());
    assert!(sb
        .run(&["generate", "--artifact-dir", "art", "--max-new-tokens", "5"])
        .status
        .success());
    // Resuming a finished run has nothing to do: it says so and succeeds (a job re-run).
    let again = sb.run(&["train", "--artifact-dir", "art", "--resume"]);
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert!(
        stdout(&again).contains("already finished"),
        "{}",
        stdout(&again)
    );
    assert!(
        stdout(&again).contains("nothing to resume"),
        "{}",
        stdout(&again)
    );
    assert_error(
        &sb.run(&["train", "--artifact-dir", "fresh", "--resume"]),
        "no run to resume",
    );
}

#[test]
fn translate_and_eval_a_seq2seq_artifact() {
    let sb = Sandbox::new();
    let experiment = r#"{"name": "copy", "seed": 3,
        "model": {"kind": "seq2seq", "d_model": 16, "n_heads": 2, "encoder_layers": 1,
                  "decoder_layers": 1, "d_ff": 32, "max_len": 12, "dropout": 0.0},
        "data": {"dataset": "copy", "tokenizer": "bpe", "bpe_vocab_size": 300, "max_tokens": 12,
                 "copy": {"symbols": 5, "min_len": 2, "max_len": 4, "train_pairs": 200}},
        "train": {"batch_size": 8, "steps": 20, "steps_per_epoch": 10, "eval_batches": 2,
                  "warmup_steps": 5}}"#;
    std::fs::write(sb.path("copy.json"), experiment).unwrap();
    let out = sb.run(&["train", "-e", "copy.json", "--artifact-dir", "s2s"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(sb.path("s2s/tokenizer.json").exists() && sb.path("s2s/model.mpk").exists());

    // Arguments: one output line each.
    let out = sb.run(&["translate", "--artifact-dir", "s2s", "a b", "c d e"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout(&out).lines().count(), 2);

    // Stdin: an empty line stays an empty line; an over-long line is cut with a warning;
    // characters never seen in training are encoded byte by byte, not refused.
    let long = vec!["a"; 40].join(" ");
    let mut child = Command::new(BIN)
        .args([
            "--backend",
            "ndarray",
            "translate",
            "--artifact-dir",
            "s2s",
            "--beam",
            "3",
        ])
        .current_dir(sb.dir.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    let input = format!("a b c\n\n{long}\nüñï ©\n");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !err.contains("panicked"), "{err}");
    let lines: Vec<String> = stdout(&out).lines().map(str::to_owned).collect();
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert_eq!(lines[1], "");
    assert!(err.contains("warning: input 3 has 41 tokens"), "{err}");

    // eval reports BLEU on the test split.
    let out = sb.run(&[
        "eval",
        "--artifact-dir",
        "s2s",
        "--beam",
        "2",
        "--limit",
        "10",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout(&out).contains("BLEU = "), "{}", stdout(&out));

    // The wrong kind of artifact for a command is one clear error.
    assert_error(
        &sb.run(&["generate", "--artifact-dir", "s2s", "--prompt", "a"]),
        "not a language model",
    );
    let out = sb.run(&["train", "-e", "tiny.json", "--artifact-dir", "lm"]);
    assert!(out.status.success());
    assert_error(
        &sb.run(&["translate", "--artifact-dir", "lm", "hello"]),
        "not a translation",
    );
    assert_error(
        &sb.run(&["translate", "--artifact-dir", "s2s", "--beam", "0", "x"]),
        "--beam",
    );
}

#[test]
fn cuda_is_one_clear_error_where_it_cannot_run() {
    let out = std::process::Command::new(crate::common::BIN)
        .args(["--backend", "cuda", "explain"])
        .output()
        .unwrap();
    if !cfg!(feature = "cuda-backend") {
        crate::common::assert_clean_error(&out, "rebuild with --features cuda");
    } else if std::env::var_os("CI_EXPECT_NO_GPU").is_some() {
        // CI has no NVIDIA driver: the driver library is asked before burn loads it.
        crate::common::assert_clean_error(&out, "--backend cuda: no CUDA driver found");
    } else if !out.status.success() {
        crate::common::assert_clean_error(&out, "--backend cuda");
    }
}
