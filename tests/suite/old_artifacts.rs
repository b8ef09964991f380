//! Artifacts written by an earlier version (commit 6d97af9, before the model kinds were
//! gathered into `kinds/`) still load, and every command that uses them answers exactly as it
//! did then: the same greedy text, translations, classes and probabilities.

use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_transformer-lab");

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/artifacts")
}

/// Runs the binary on ndarray in the fixtures directory and returns its stdout, failing the test
/// on a non-zero exit.
fn run(args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(["--backend", "ndarray"])
        .args(args)
        .current_dir(fixtures())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// What the earlier version printed (`expected-COMMAND.txt`) or wrote (`.json`).
fn expected(artifact: &str, name: &str) -> String {
    let name = if name.contains('.') {
        name.to_string()
    } else {
        format!("expected-{name}.txt")
    };
    let path = fixtures().join(artifact).join(name);
    std::fs::read_to_string(path).unwrap()
}

#[test]
fn an_old_language_model_generates_the_same_greedy_text() {
    let generate = |extra: &[&str]| {
        let args = [
            &["generate", "--artifact-dir", "lm", "--greedy"],
            &["--prompt", "the quick ", "--max-new-tokens", "60"],
            extra,
        ];
        run(&args.concat())
    };
    // The earlier version recomputed the sliding window for every token.
    let expected = expected("lm", "generate");
    assert_eq!(generate(&["--no-cache"]), expected);
    // With the cache the text is the same as long as it fits the context (24 characters: the
    // 10 of the prompt and 15 new ones), and goes on from a refilled cache after that.
    let cached = generate(&[]);
    let within: String = expected.chars().take(10 + 15).collect();
    assert!(
        cached.starts_with(&within),
        "{cached:?} does not start with {within:?}"
    );
    assert_eq!(cached.chars().count(), expected.chars().count());
}

#[test]
fn an_old_translator_translates_the_same() {
    let text = run(&[
        "translate",
        "--artifact-dir",
        "seq2seq",
        "a b c d",
        "f e d c b a",
        "c c a",
    ]);
    assert_eq!(text, expected("seq2seq", "translate"));
}

#[test]
fn an_old_vit_predicts_the_same_classes() {
    let text = run(&[
        "predict",
        "--artifact-dir",
        "vit",
        "../images/digit-7.png",
        "../images/digit-2.png",
        "--top",
        "3",
    ]);
    assert_eq!(text, expected("vit", "predict"));
}

#[test]
fn an_old_classifier_classifies_the_same() {
    let text = run(&[
        "classify",
        "--artifact-dir",
        "classifier",
        "I loved this phone, it works great",
        "terrible food and rude staff",
    ]);
    assert_eq!(text, expected("classifier", "classify"));
}

#[test]
fn old_artifacts_show_the_same_attention_weights() {
    // The weights themselves, not only an argmax: every group, layer and head to 1e-6.
    for (artifact, input) in [("lm", "the dog"), ("seq2seq", "a b c")] {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("attention.json");
        run(&[
            "attention",
            "--artifact-dir",
            artifact,
            input,
            "--json",
            json.to_str().unwrap(),
        ]);
        let now: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let then: serde_json::Value =
            serde_json::from_str(&expected(artifact, "expected-attention.json")).unwrap();
        assert_eq!(now["output"], then["output"], "{artifact}");
        let (now, then) = (numbers(&now["groups"]), numbers(&then["groups"]));
        assert_eq!(now.len(), then.len(), "{artifact}");
        for (a, b) in now.iter().zip(&then) {
            assert!((a - b).abs() < 1e-6, "{artifact}: {a} vs {b}");
        }
    }
}

/// Every number in `v`, depth first.
fn numbers(v: &serde_json::Value) -> Vec<f64> {
    match v {
        serde_json::Value::Array(items) => items.iter().flat_map(numbers).collect(),
        serde_json::Value::Object(map) => map.values().flat_map(numbers).collect(),
        serde_json::Value::Number(n) => vec![n.as_f64().unwrap()],
        _ => Vec::new(),
    }
}
