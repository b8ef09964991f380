//! `heads` end to end: a pruned artifact computes what the model with those heads gated off
//! computes, loads in every command, and bad requests get one clear error line.

use crate::common::{assert_clean_error, run, write_artifact_at};
use burn::backend::NdArray;
use burn::prelude::*;
use std::path::Path;
use transformer_lab::artifact::ArtifactDir;
use transformer_lab::config::LmConfig;
use transformer_lab::data::{Tokenizer, TokenizerKind};
use transformer_lab::kinds::load_as;
use transformer_lab::nn::AttentionLayers;

type B = NdArray<f32>;

const CORPUS: &str = "to be or not to be, that is the question; whether 'tis nobler in the mind. ";

/// An untrained 2-layer, 4-head char LM reading `dir/corpus.txt`, in `dir/lm`.
fn lm_on_a_text(dir: &Path) {
    std::fs::write(dir.join("corpus.txt"), CORPUS.repeat(30)).unwrap();
    let tokenizer = Tokenizer::fit(TokenizerKind::Char, std::iter::once(CORPUS), 0).unwrap();
    write_artifact_at(
        dir,
        "lm",
        r#"{"name": "lm", "seed": 3, "model": {"kind": "lm", "d_model": 16, "n_layers": 2,
            "n_heads": 4, "context": 16}, "data": {"text_file": "corpus.txt"}}"#,
        |c| {
            c.model_as::<LmConfig>()
                .unwrap()
                .init::<B>(&Default::default())
        },
        Some(tokenizer),
    );
}

/// `heads` on the artifact `dir/artifact` with small held-out batches, and `extra` options.
fn heads(dir: &Path, artifact: &str, extra: &[&str]) -> std::process::Output {
    let args = [
        "heads",
        "--artifact-dir",
        artifact,
        "--batch-size",
        "4",
        "--batches",
        "2",
    ];
    run(dir, &[&args[..], extra].concat())
}

fn logits(model: &transformer_lab::models::LanguageModel<B>) -> Tensor<B, 3> {
    let ids: Vec<i64> = (0..24).map(|i| (i * 7 % 20) as i64).collect();
    let tokens = Tensor::<B, 1, Int>::from_ints(ids.as_slice(), &Default::default());
    model.forward(tokens.reshape([2, 12])).logits
}

#[test]
fn a_pruned_artifact_computes_what_the_gated_model_computes() {
    let dir = tempfile::tempdir().unwrap();
    lm_on_a_text(dir.path());
    let out = heads(dir.path(), "lm", &["--prune", "3", "--out", "pruned"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for expected in [
        "layer 1     3",
        "Spearman",
        "removed by greedy",
        "pruned artifact written",
    ] {
        assert!(stdout.contains(expected), "{expected:?} missing:\n{stdout}");
    }
    assert!(dir.path().join("lm/heads.png").exists());

    // The pruned artifact's weights are the gated model's, with smaller projections.
    let device = Default::default();
    let full = load_as::<LmConfig, B>(&ArtifactDir::new(dir.path().join("lm")), &device).unwrap();
    let pruned =
        load_as::<LmConfig, B>(&ArtifactDir::new(dir.path().join("pruned")), &device).unwrap();
    let removed = pruned
        .config
        .model_as::<LmConfig>()
        .unwrap()
        .stack
        .pruned_heads
        .clone();
    assert_eq!(
        removed.values().map(Vec::len).sum::<usize>(),
        3,
        "{removed:?}"
    );
    assert!(full.model.num_params() > pruned.model.num_params());
    let mut gated = full.model.clone();
    for (name, layer) in gated.attention_layers() {
        let mut gates = vec![1.0; 4];
        for &h in removed.get(&name).into_iter().flatten() {
            gates[h] = 0.0;
        }
        layer.set_head_gates(Some(gates));
    }
    let (a, b) = (logits(&gated), logits(&pruned.model));
    let gap = (a.clone() - b).abs().max().into_scalar();
    assert!(gap < 1e-5, "pruned and gated logits differ by {gap}");
    // And the heads removed mattered for something: the full model differs.
    let gap_full = (logits(&full.model) - a).abs().max().into_scalar();
    assert!(gap_full > 1e-6, "{gap_full}");

    // Every command loads it.
    let eval = run(dir.path(), &["eval", "--artifact-dir", "pruned"]);
    assert!(
        eval.status.success(),
        "{}",
        String::from_utf8_lossy(&eval.stderr)
    );
    let generate = run(
        dir.path(),
        &[
            "generate",
            "--artifact-dir",
            "pruned",
            "--prompt",
            "to",
            "--max-new-tokens",
            "5",
        ],
    );
    assert!(
        generate.status.success(),
        "{}",
        String::from_utf8_lossy(&generate.stderr)
    );
    let attention = run(
        dir.path(),
        &[
            "attention",
            "--artifact-dir",
            "pruned",
            "to be",
            "--png",
            "a.png",
        ],
    );
    assert!(
        attention.status.success(),
        "{}",
        String::from_utf8_lossy(&attention.stderr)
    );
    // Its renumbered heads are checked layer by layer.
    let (layer, gone) = removed.iter().next().unwrap();
    let layer: usize = layer.trim_start_matches("layer ").parse().unwrap();
    let missing = (4 - gone.len()).to_string();
    let args = [
        "attention",
        "--artifact-dir",
        "pruned",
        "to be",
        "--layer",
        &layer.to_string(),
    ];
    let out = run(dir.path(), &[&args[..], &["--head", &missing]].concat());
    assert_clean_error(&out, "does not exist");

    // Pruning further counts heads in the unpruned layer.
    let out = heads(dir.path(), "pruned", &["--prune", "1", "--out", "again"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let again =
        load_as::<LmConfig, B>(&ArtifactDir::new(dir.path().join("again")), &device).unwrap();
    let removed_again = &again
        .config
        .model_as::<LmConfig>()
        .unwrap()
        .stack
        .pruned_heads;
    assert_eq!(removed_again.values().map(Vec::len).sum::<usize>(), 4);
    for (layer, heads) in &removed {
        assert!(
            heads.iter().all(|h| removed_again[layer].contains(h)),
            "{removed_again:?}"
        );
    }
}

#[test]
fn bad_heads_requests_get_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    lm_on_a_text(dir.path());
    let with = |extra: &[&str]| heads(dir.path(), "lm", extra);
    assert_clean_error(
        &with(&["--prune", "7", "--out", "p"]),
        "can lose 1 to 6 heads",
    );
    assert_clean_error(&with(&["--prune", "2"]), "--prune needs --out");
    std::fs::create_dir_all(dir.path().join("full")).unwrap();
    std::fs::write(dir.path().join("full/keep.txt"), "mine").unwrap();
    assert_clean_error(&with(&["--prune", "2", "--out", "full"]), "already exists");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("full/keep.txt")).unwrap(),
        "mine"
    );
    let zero = ["heads", "--artifact-dir", "lm", "--batches", "0"];
    assert_clean_error(&run(dir.path(), &zero), "at least 1");

    // A config naming a layer the model lacks, or emptying one, is refused on load.
    let config = dir.path().join("lm/config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let edited = |pruned: &str| {
        text.replacen(
            "\"n_heads\": 4,",
            &format!("\"n_heads\": 4, \"pruned_heads\": {pruned},"),
            1,
        )
    };
    for (pruned, needle) in [
        (r#"{"layer 9": [0]}"#, "lacks"),
        (r#"{"layer 0": [0, 1, 2, 3]}"#, "keep at least one"),
        (r#"{"layer 0": [4]}"#, "no head 4"),
    ] {
        std::fs::write(dir.path().join("lm/config.json"), edited(pruned)).unwrap();
        let out = run(dir.path(), &["eval", "--artifact-dir", "lm"]);
        assert_clean_error(&out, needle);
    }
    // A pruned config is not trained from scratch.
    std::fs::write(dir.path().join("p.json"), edited(r#"{"layer 0": [1]}"#)).unwrap();
    let out = run(
        dir.path(),
        &["train", "-e", "p.json", "--artifact-dir", "t"],
    );
    assert_clean_error(&out, "pruned");
}
