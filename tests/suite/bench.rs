//! `bench train`: tokens/s from timed steps of the real training step, and the median.

use crate::common::{assert_clean_error, run, stderr, tiny_text_experiment};
use transformer_lab::bench::{median, BenchReport, RunTimes};
use transformer_lab::kernels::profile::{OpTime, Phase};

#[test]
fn median_of_odd_and_even_counts() {
    assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
    assert!(median(&[]).is_nan());
}

#[test]
fn bench_train_times_every_phase_of_real_steps() {
    let dir = tempfile::tempdir().unwrap();
    tiny_text_experiment(dir.path(), r#"{"batch_size": 4}"#);
    let out = run(
        dir.path(),
        &[
            "bench",
            "train",
            "-e",
            "tiny.json",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--runs",
            "2",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("tiny on "), "{text}");
    assert!(text.contains("(median of 2 runs: "), "{text}");
    assert!(
        text.contains("64 tokens per step"),
        "batch 4 × context 16: {text}"
    );
    let speed: f64 = text
        .split(": ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(speed > 0.0, "{text}");
    for phase in ["forward", "backward", "optimizer"] {
        assert!(text.contains(phase), "{text}");
    }
    // What a data-parallel step all-reduces: every parameter's f32 gradient, the parameters
    // `train` counts.
    tiny_text_experiment(
        dir.path(),
        r#"{"batch_size": 4, "steps": 2, "steps_per_epoch": 2, "eval_batches": 1,
            "warmup_steps": 1}"#,
    );
    let train = run(
        dir.path(),
        &[
            "train",
            "-e",
            "tiny.json",
            "--artifact-dir",
            "art",
            "--plain",
        ],
    );
    let log = String::from_utf8_lossy(&train.stdout);
    let count: f64 = log
        .split(" parameters)")
        .next()
        .and_then(|head| head.rsplit('(').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no parameter count in {log}"));
    let line = format!(
        "{:.2} M parameters: a data-parallel step (--devices) all-reduces {:.1} MB",
        count / 1e6,
        count * 4.0 / 1e6
    );
    assert!(text.contains(&line), "{line:?} not in {text}");
    assert_clean_error(
        &run(
            dir.path(),
            &["bench", "train", "-e", "tiny.json", "--runs", "0"],
        ),
        "at least 1",
    );
    // Refused before anything is loaded or announced: the error is all it prints, and a
    // missing artifact is not even looked for.
    let args = [
        "bench",
        "generate",
        "--artifact-dir",
        "absent",
        "--tokens",
        "0",
    ];
    let bad = run(dir.path(), &args);
    assert_clean_error(&bad, "--tokens and --runs must be at least 1");
    assert_eq!(stderr(&bad).lines().count(), 1, "{}", stderr(&bad));
    // A prompt past the learned positions is refused, as `generate` refuses it, not timed cut
    // down to the context under its own length.
    assert_clean_error(
        &run(
            dir.path(),
            &[
                "bench",
                "generate",
                "--artifact-dir",
                "art",
                "--prompt-len",
                "100",
            ],
        ),
        "the prompt has 100 tokens but the model's context is",
    );
}

#[test]
fn growth_exponents_and_crossovers() {
    use transformer_lab::bench::mixers::{crossover, growth_exponent};
    let quadratic: Vec<(f64, f64)> = [128.0, 256.0, 512.0]
        .iter()
        .map(|&l| (l, 3.0 * l * l))
        .collect();
    assert!((growth_exponent(&quadratic).unwrap() - 2.0).abs() < 1e-9);
    assert_eq!(growth_exponent(&quadratic[..1]), None);
    let full = [(128, 1.0), (256, 4.0), (512, 16.0), (1024, 64.0)];
    // Faster from 512 on (a win at 128 followed by a loss does not count).
    let variant = [(128, 0.5), (256, 5.0), (512, 10.0), (1024, 20.0)];
    assert_eq!(crossover(&variant, &full), Some(512));
    assert_eq!(crossover(&[(128, 2.0), (256, 8.0)], &full), None);
    assert_eq!(crossover(&[(128, 0.1)], &full), Some(128));
}

#[test]
fn bench_mixers_measures_every_mixer_and_writes_csv_and_png() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        dir.path(),
        &[
            "bench",
            "mixers",
            "--lengths",
            "16,32",
            "--runs",
            "1",
            "--window",
            "8",
            "--stride",
            "4",
            "--d-model",
            "16",
            "--heads",
            "2",
            "--out",
            "b",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for mixer in ["full", "local", "strided", "linear", "hyena"] {
        assert!(
            stdout.contains(&format!("{mixer:<8} time ~ t^")),
            "{stdout}"
        );
    }
    let csv = std::fs::read_to_string(dir.path().join("b/mixers.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(
        rows[0],
        "mixer,length,forward_ms,forward_backward_ms,peak_mib"
    );
    assert_eq!(rows.len(), 1 + 5 * 2);
    // The binary counts heap bytes: every row has a positive peak.
    for row in &rows[1..] {
        let peak: f64 = row.rsplit(',').next().unwrap().parse().unwrap();
        assert!(peak > 0.0, "{row}");
    }
    let png = std::fs::read(dir.path().join("b/mixers.png")).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");

    let bad = run(dir.path(), &["bench", "mixers", "--mixers", "full,sparse"]);
    assert_clean_error(&bad, "unknown mixer \"sparse\"");
}

#[test]
#[cfg(feature = "flex")]
fn bench_kernels_times_each_fused_kernel_against_the_composed_ops() {
    let dir = tempfile::tempdir().unwrap();
    tiny_text_experiment(dir.path(), r#"{"batch_size": 4}"#);
    let out = std::process::Command::new(crate::common::BIN)
        .args([
            "--backend",
            "flex",
            "bench",
            "kernels",
            "-e",
            "tiny.json",
            "--reps",
            "2",
        ])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    for kernel in [
        "GELU",
        "LayerNorm",
        "causal attention",
        "masked softmax",
        "cross-entropy",
    ] {
        let row = text
            .lines()
            .find(|l| l.starts_with(kernel))
            .unwrap_or_else(|| panic!("no {kernel} row: {text}"));
        let speedup = row.split_whitespace().last().unwrap().trim_end_matches('×');
        let speedup: f64 = speedup.parse().unwrap_or_else(|_| panic!("{row}"));
        assert!(speedup > 0.0, "{row}");
    }
    assert!(text.contains("per training step"), "{text}");
    // A missing experiment file: one clear error line.
    let bad = run(dir.path(), &["bench", "kernels", "-e", "missing.json"]);
    assert_clean_error(&bad, "missing.json");
}

#[test]
fn bench_train_measures_a_translator_in_target_tokens_with_its_padding() {
    // Any model kind: a tiny copy-task translator with dropout (the fused attention with its
    // dropout in self- and cross-attention), grouped by length or not.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("copy.json"),
        r#"{"name": "copy", "seed": 3,
            "model": {"kind": "seq2seq", "d_model": 16, "n_heads": 2, "encoder_layers": 1,
                      "decoder_layers": 1, "d_ff": 32, "max_len": 16, "dropout": 0.1},
            "data": {"dataset": "copy", "tokenizer": "bpe", "bpe_vocab_size": 300,
                     "shared_vocab": true, "max_tokens": 16,
                     "copy": {"symbols": 6, "min_len": 2, "max_len": 12, "train_pairs": 400}},
            "train": {"batch_size": 8, "steps": 10, "steps_per_epoch": 10, "warmup_steps": 2,
                      "batch_by_length": true}}"#,
    )
    .unwrap();
    for by_length in ["on", "off"] {
        let args = [
            "bench",
            "train",
            "-e",
            "copy.json",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--runs",
            "1",
            "--by-length",
            by_length,
        ];
        let out = run(dir.path(), &args);
        assert!(out.status.success(), "{}", stderr(&out));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(" target tokens/s (median of 1 runs: "),
            "{text}"
        );
        assert!(
            text.contains("padding (positions that are padding, epoch 1): source "),
            "{text}"
        );
        let grouped = text.contains("timed batches grouped by length");
        assert_eq!(grouped, by_length == "on", "{text}");
    }
    assert_clean_error(
        &run(
            dir.path(),
            &["bench", "train", "-e", "copy.json", "--by-length", "maybe"],
        ),
        "expected on or off",
    );
}

#[test]
fn the_profile_sets_each_products_rate_and_all_of_them_beside_the_peak() {
    // Two steps; the forward linear calls did 0.8 GFLOP of products in 4 ms (200 GFLOP/s,
    // 400 MFLOP a step), the backward ones 1.6 GFLOP in 6 ms (266.7 GFLOP/s); attention's work
    // is not counted, so it has no rate. Together 2.4 GFLOP in 10 ms: 240 GFLOP/s, 48% of a
    // 500 GFLOP/s peak.
    let op = |phase, name, calls, seconds, flops| OpTime {
        phase,
        name,
        calls,
        seconds,
        flops,
    };
    let report = BenchReport {
        unit: "tokens",
        units_per_run: 128,
        runs: vec![RunTimes {
            forward: vec![0.01, 0.01],
            backward: vec![0.02, 0.02],
            optimizer: vec![0.001, 0.001],
            warmup: Vec::new(),
        }],
        notes: Vec::new(),
        parameters: 0,
        profile: vec![
            op(Phase::Forward, "linear", 6, 0.004, 8e8),
            op(Phase::Forward, "attention", 2, 0.002, 0.0),
            op(Phase::Backward, "linear", 6, 0.006, 1.6e9),
        ],
        peak: Some(5e11),
    };
    let text = report.render("flex");
    let row = |phase, op| profile_row(&text, phase, op).join(" ");
    assert_eq!(row("forward", "linear"), "3.0 2.00 20.0% 400.0 200.0");
    assert_eq!(row("backward", "linear"), "3.0 3.00 15.0% 800.0 266.7");
    assert_eq!(row("forward", "attention"), "1.0 1.00 10.0%");
    let threads = rayon::current_num_threads();
    let last = format!(
        "the linear layers ran at 240.0 GFLOP/s over their calls: 48% of the 500.0 GFLOP/s \
         this machine's {threads} threads reach on f32 multiply-adds alone (measured now)"
    );
    assert!(text.contains(&last), "{last:?} not in {text}");
    // No peak measured (a GPU backend is not profiled call by call): no such line.
    let text = BenchReport {
        peak: None,
        ..report
    }
    .render("flex");
    assert!(!text.contains("the linear layers ran at"), "{text}");
}

#[test]
fn bench_train_profile_counts_each_products_work() {
    // A step of 8 × 32 tokens through 2 layers 64 wide (feed-forward 256): the feed-forward's
    // first product, GELU merged, does 2·256·64·256 multiply-add FLOPs a layer forward and
    // twice that backward (its two gradients); every other linear call's gradients, the tied
    // head's included, twice its forward work too.
    let dir = tempfile::tempdir().unwrap();
    let text = profile_lm(
        dir.path(),
        r#"{"d_model": 64, "n_layers": 2, "n_heads": 2, "context": 32}"#,
        8,
        &["--steps", "2", "--warmup", "1", "--runs", "1"],
    );
    let work = |phase, op| -> f64 {
        let fields = profile_row(&text, phase, op);
        assert_eq!(fields.len(), 5, "{phase} {op}: {fields:?}");
        fields[3].parse().unwrap()
    };
    let gelu: f64 = 2.0 * 2.0 * 256.0 * 64.0 * 256.0 / 1e6;
    assert_eq!(
        work("forward", "linear (GELU merged)"),
        (gelu * 10.0).round() / 10.0
    );
    let backward = work("backward", "linear (GELU derivative merged)");
    assert_eq!(backward, (2.0 * gelu * 10.0).round() / 10.0);
    let (forward, backward) = (work("forward", "linear"), work("backward", "linear"));
    assert!(
        (backward - 2.0 * forward).abs() <= 0.15,
        "{forward} → {backward} in {text}"
    );
    assert!(
        text.contains("threads reach on f32 multiply-adds alone"),
        "{text}"
    );
}

#[test]
fn bench_train_profile_counts_each_kernel_call_of_each_phase() {
    // Two pre-norm layers. Forward, per layer: the linear layer 3 times (Q/K/V packed, the
    // output projection, the feed-forward's second), its first with GELU as the epilogue once,
    // attention once; then the tied output head once more, and LayerNorm 2 × 2 + 1 times: the
    // first block's first norm on its own, every other one merged with the residual addition
    // before it (the final norm with the last block's). Backward, per layer: the linear layer's
    // gradients 3 times plus once merged with GELU's derivative, attention once; the head's once
    // more, LayerNorm 2 × 2 + 1 times. The optimizer: AdamW and clipping's sum of squares once. A
    // call counted twice, or in the wrong phase, changes these counts.
    let dir = tempfile::tempdir().unwrap();
    let steps = ["--steps", "3", "--warmup", "1", "--runs", "2"];
    let text = profile_lm(
        dir.path(),
        r#"{"d_model": 16, "n_layers": 2, "n_heads": 2, "context": 16}"#,
        4,
        &steps,
    );
    assert!(text.contains("means over 2 runs × 3 steps"), "{text}");
    let calls = |phase, op| -> f64 { profile_row(&text, phase, op)[0].parse().unwrap() };
    let expected =
        "forward: linear 7, linear (GELU merged) 2, attention 2, residual + LayerNorm 4, \
                    LayerNorm 1, cross-entropy 1\n\
                    backward: linear 7, linear (GELU derivative merged) 2, attention 2, \
                    LayerNorm 5, cross-entropy 1\n\
                    optimizer: AdamW 1, clipping (sum of squares) 1";
    for line in expected.lines() {
        let (phase, ops) = line.split_once(": ").unwrap();
        for op in ops.split(", ") {
            let (op, count) = op.rsplit_once(' ').unwrap();
            let count: f64 = count.parse().unwrap();
            assert_eq!(calls(phase, op), count, "{phase} {op} in {text}");
        }
        let rest = format!("{phase:<10} outside the fused kernels");
        assert!(text.contains(&rest), "{rest:?} not in {text}");
    }
    // Timed call by call only where a call returns when its work is done.
    let args = [
        &["bench", "train", "-e", "lm.json"],
        &steps[..],
        &["--profile"],
    ]
    .concat();
    let refused = run(dir.path(), &args);
    assert_clean_error(&refused, "use --backend flex");
}

/// `bench train --profile` on flex (with `args`) of a language model whose `model` settings
/// are given, trained at `batch`, on a small corpus; the experiment is `lm.json` in `dir`.
/// What it printed.
fn profile_lm(dir: &std::path::Path, model: &str, batch: usize, args: &[&str]) -> String {
    std::fs::write(dir.join("corpus.txt"), "the quick brown fox. ".repeat(400)).unwrap();
    std::fs::write(
        dir.join("lm.json"),
        format!(
            r#"{{"name": "lm", "model": {model}, "data": {{"text_file": "corpus.txt"}},
                "train": {{"batch_size": {batch}}}}}"#
        ),
    )
    .unwrap();
    let out = std::process::Command::new(crate::common::BIN)
        .args([
            "--backend",
            "flex",
            "bench",
            "train",
            "-e",
            "lm.json",
            "--profile",
        ])
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The fields after the operation of the profile's row for exactly `op` (not an operation whose
/// name it begins) in `phase`: calls, ms/step, share and, for the linear layers, MFLOP/step and
/// GFLOP/s.
fn profile_row<'a>(text: &'a str, phase: &str, op: &str) -> Vec<&'a str> {
    let row = text
        .lines()
        .find(|line| {
            line.starts_with(phase)
                && line[10..]
                    .trim_start()
                    .strip_prefix(op)
                    .is_some_and(|rest| rest.starts_with("  "))
        })
        .unwrap_or_else(|| panic!("no {phase} {op} row in {text}"));
    row[10 + 33..].split_whitespace().collect()
}

/// `bench matmul`'s products are a step's: each linear layer's forward product and both
/// gradients, at the layer's sizes, with the operands a step reads transposed marked so.
#[test]
fn bench_matmul_takes_the_products_of_a_training_step() {
    use transformer_lab::bench::matmul::step_products;
    let mut lm = transformer_lab::config::LmConfig::default();
    lm.stack.d_model = 8;
    lm.stack.d_ff = 32;
    lm.n_layers = 3;
    lm.context = 4;
    let all = step_products(&lm, 2 * 4, 5, &[]);
    assert_eq!(all.len(), 15);
    let dims = |p: &transformer_lab::bench::matmul::ProductShape| {
        (p.m, p.n, p.k, p.a_transposed, p.b_transposed)
    };
    // The feed-forward's second layer, 8 rows of 32 → 8: y = x·w, dx = dy·wᵀ, dw = xᵀ·dy.
    let ff2: Vec<_> = all.iter().filter(|p| p.name.starts_with("ff2")).collect();
    assert_eq!(dims(ff2[0]), (8, 8, 32, false, false));
    assert_eq!(dims(ff2[1]), (8, 32, 8, false, true));
    assert_eq!(dims(ff2[2]), (32, 8, 8, true, false));
    assert!(ff2.iter().all(|p| p.per_step == 3));
    assert_eq!(ff2[0].flops(), 2.0 * 8.0 * 8.0 * 32.0);
    // Tied weights: the output layer reads the [v, d] table transposed, its input's gradient
    // reads it as it is; once a step.
    let head: Vec<_> = all.iter().filter(|p| p.name.starts_with("head")).collect();
    assert_eq!(dims(head[0]), (8, 5, 8, false, true));
    assert_eq!(dims(head[1]), (8, 8, 5, false, false));
    assert!(head.iter().all(|p| p.per_step == 1));
    let only = step_products(&lm, 8, 5, &["dW".into(), "qkv".into()]);
    let names: Vec<_> = only.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "qkv forward",
            "qkv dX",
            "qkv dW",
            "out dW",
            "ff1 dW",
            "ff2 dW",
            "head dW"
        ]
    );
}

/// The table ranks a product's kernels by time, marks one whose output is wrong, counts the
/// step's products at the fastest correct kernel (not at a wrong one) and at autotune's choice.
#[test]
fn bench_matmul_table_skips_a_wrong_kernel_when_it_counts_the_fastest() {
    use transformer_lab::bench::matmul::{render, MatmulPlan, ProductShape, ProductTiming};
    let product = ProductShape {
        name: "ff1 forward".into(),
        m: 1000,
        n: 1000,
        k: 1000,
        a_transposed: false,
        b_transposed: false,
        per_step: 2,
    };
    let plan = MatmulPlan {
        products: vec![product],
        precision: transformer_lab::kernels::Precision::F32,
        all: true,
        kernels: vec![],
        runs: 1,
    };
    let timing = |kernel: &str, seconds: Result<f64, String>, error| ProductTiming {
        product: 0,
        kernel: kernel.into(),
        seconds,
        error,
    };
    let timings = vec![
        timing("autotune", Ok(4e-3), 1e-6),
        timing("fast_but_wrong", Ok(1e-3), 0.3),
        timing("right", Ok(2e-3), 1e-6),
        timing("missing_a", Err("no cmma here".into()), 0.0),
        timing("missing_b", Err("no cmma here".into()), 0.0),
    ];
    let table = render(&plan, &timings);
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[1].contains("fast_but_wrong") && lines[1].ends_with("WRONG"),
        "{table}"
    );
    assert!(
        lines[2].contains("right") && lines[2].contains("1.00 TFLOP/s"),
        "{table}"
    );
    assert!(
        lines[3].contains("autotune") && !lines[3].contains("WRONG"),
        "{table}"
    );
    assert!(
        lines[4].contains("did not run (2): no cmma here"),
        "{table}"
    );
    assert!(lines[5].contains("missing_a, missing_b"), "{table}");
    assert!(
        table.contains(
            "8.00 ms as autotuned, 4.00 ms at the fastest correct kernel of each (2.00×)"
        ),
        "{table}"
    );
}

#[test]
fn bench_matmul_refuses_a_cpu_backend_and_an_empty_selection() {
    let dir = tempfile::tempdir().unwrap();
    // `run` names the ndarray backend.
    let cpu = run(dir.path(), &["bench", "matmul"]);
    assert_clean_error(
        &cpu,
        "bench matmul times a GPU backend's matrix-product kernels",
    );
    let none = run(dir.path(), &["bench", "matmul", "--only", "nothing"]);
    assert_clean_error(&none, "--only matches none of the step's products");
    let no_rows = run(dir.path(), &["bench", "matmul", "--rows", "0"]);
    assert_clean_error(&no_rows, "--vocab and --rows must be at least 1");
}
