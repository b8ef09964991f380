//! `bench train`: tokens/s from timed steps of the real training step, and the median.

use crate::common::{assert_clean_error, run, stderr, tiny_text_experiment};
use transformer_lab::bench::median;

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
    assert_clean_error(
        &run(
            dir.path(),
            &["bench", "train", "-e", "tiny.json", "--runs", "0"],
        ),
        "at least 1",
    );
}
