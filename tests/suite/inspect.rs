//! Attention inspection: the exported weights are the ones the forward pass used, rows sum to
//! 1, causal maps are zero above the diagonal, the statistics measure what they claim, `explain`
//! on a real head reproduces the model's weights, and bad requests name what exists.

use crate::common::{
    assert_clean_error, classifier_artifact, lm_artifact, run, stderr, translator_artifact,
    vit_artifact,
};
use burn::backend::NdArray;
use burn::prelude::*;
use std::path::Path;
use transformer_lab::artifact::ArtifactDir;
use transformer_lab::explain::model_walkthrough;
use transformer_lab::inspect::stats::{head_stats, Geometry, Shuffled};
use transformer_lab::inspect::{AttentionGroup, AttentionMaps};
use transformer_lab::kinds::{load_as, AnyTrained};

type B = NdArray<f32>;

const TEXT: &str = "to be, or not to be: that is the question";

fn load(dir: &Path, name: &str) -> AnyTrained<B> {
    transformer_lab::kinds::load(&ArtifactDir::new(dir.join(name)), &Default::default()).unwrap()
}

fn assert_rows_sum_to_one(group: &AttentionGroup) {
    for (l, layer) in group.weights.iter().enumerate() {
        for (h, head) in layer.iter().enumerate() {
            assert_eq!(head.len(), group.queries.len());
            for (q, row) in head.iter().enumerate() {
                assert_eq!(row.len(), group.keys.len());
                let sum: f32 = row.iter().sum();
                assert!(
                    (sum - 1.0).abs() < 1e-5,
                    "{} L{l}H{h} row {q} sums to {sum}",
                    group.name
                );
            }
        }
    }
}

fn assert_causal(group: &AttentionGroup) {
    for head in group.weights.iter().flatten() {
        for (q, row) in head.iter().enumerate() {
            assert!(
                row[q + 1..].iter().all(|&w| w == 0.0),
                "{}: weight above the diagonal in row {q}",
                group.name
            );
        }
    }
}

#[test]
fn exported_weights_are_the_weights_of_the_forward_pass() {
    let dir = tempfile::tempdir().unwrap();
    lm_artifact(dir.path(), TEXT);
    let model = load(dir.path(), "lm");
    let device = Default::default();
    let maps = model.attention(TEXT, None, &device).unwrap();
    let trained = load_as::<transformer_lab::config::LmConfig, B>(
        &ArtifactDir::new(dir.path().join("lm")),
        &device,
    )
    .unwrap();
    let ids: Vec<i64> = trained
        .tokenizer()
        .encode(TEXT)
        .unwrap()
        .into_iter()
        .map(|i| i as i64)
        .collect();
    let n = ids.len();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, n]), &device);
    let forward = trained.model.forward(tokens).attention;
    let group = &maps.groups[0];
    assert_eq!((group.n_layers(), group.n_heads()), (2, 4));
    assert_eq!(group.queries.len(), TEXT.chars().count());
    assert_eq!(group.queries[2], "▁", "a space is shown as ▁");
    for (l, layer) in forward.into_iter().enumerate() {
        let values: Vec<f32> = layer.into_data().to_vec().unwrap(); // [1, h, n, n]
        let exported: Vec<f32> = group.weights[l]
            .iter()
            .flatten()
            .flatten()
            .copied()
            .collect();
        assert_eq!(exported, values, "layer {l}");
    }
    assert_rows_sum_to_one(group);
    assert_causal(group);
    // The JSON export carries the same numbers and the tokens.
    let json: serde_json::Value = serde_json::from_str(&maps.to_json().unwrap()).unwrap();
    let g = &json["groups"][0];
    assert_eq!(g["queries"].as_array().unwrap().len(), n);
    for l in 0..2 {
        for h in 0..4 {
            for q in [0, n / 2, n - 1] {
                for k in 0..n {
                    let v = g["weights"][l][h][q][k].as_f64().unwrap() as f32;
                    assert_eq!(v, group.weights[l][h][q][k], "JSON [{l}][{h}][{q}][{k}]");
                }
            }
        }
    }
}

#[test]
fn a_translator_shows_encoder_decoder_and_cross_attention() {
    let dir = tempfile::tempdir().unwrap();
    translator_artifact(dir.path());
    let model = load(dir.path(), "s2s");
    let maps = model
        .attention("the cat sat", Some("le chat"), &Default::default())
        .unwrap();
    let names: Vec<&str> = maps.groups.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, ["encoder", "decoder", "cross"]);
    let (enc, dec, cross) = (&maps.groups[0], &maps.groups[1], &maps.groups[2]);
    assert_eq!(
        enc.keys.last().map(String::as_str),
        Some("</s>"),
        "the source ends with </s>"
    );
    assert_eq!(dec.queries[0], "<s>", "the decoder reads <s> first");
    assert_eq!(
        cross.queries, dec.queries,
        "cross-attention queries are the decoder's tokens"
    );
    assert_eq!(
        cross.keys, enc.keys,
        "cross-attention keys are the source tokens"
    );
    for g in &maps.groups {
        assert_rows_sum_to_one(g);
    }
    assert_causal(dec);
    assert!(!enc.causal && dec.causal && !cross.causal);
    assert_eq!(maps.output.as_deref(), Some("le chat"));
}

fn group_of(weights: Vec<Vec<Vec<f32>>>) -> AttentionGroup {
    let n = weights[0].len();
    let labels: Vec<String> = (0..n).map(|i| i.to_string()).collect();
    AttentionGroup {
        name: "self".into(),
        causal: false,
        queries: labels.clone(),
        keys: labels,
        weights: vec![weights],
    }
}

/// Head 0 attends to the previous token (position); head 1 attends to token "0" wherever it
/// is (content).
fn synthetic(tokens: &[usize]) -> AttentionGroup {
    let n = tokens.len();
    let previous: Vec<Vec<f32>> = (0..n)
        .map(|q| {
            (0..n)
                .map(|k| if k + 1 == q.max(1) { 1.0 } else { 0.0 })
                .collect()
        })
        .collect();
    let zero_at = tokens.iter().position(|&t| t == 0).unwrap();
    let content: Vec<Vec<f32>> = (0..n)
        .map(|_| {
            (0..n)
                .map(|k| if k == zero_at { 1.0 } else { 0.0 })
                .collect()
        })
        .collect();
    group_of(vec![previous, content])
}

#[test]
fn statistics_tell_a_previous_token_head_from_a_content_head() {
    let original: Vec<usize> = (0..6).collect();
    let order = [3, 0, 5, 1, 4, 2]; // shuffled position i holds original token order[i]
    let shuffled_tokens: Vec<usize> = order.iter().map(|&i| original[i]).collect();
    let (a, b) = (synthetic(&original), synthetic(&shuffled_tokens));
    let comparison = Shuffled {
        group: &b,
        query_order: &order,
        key_order: &order,
    };
    let stats = head_stats(&a, Geometry::Sequence, Some(&comparison));
    let previous = &stats[0];
    assert!(
        previous.entropy.abs() < 1e-9,
        "one-hot rows have zero entropy"
    );
    assert!((previous.previous.unwrap() - 1.0).abs() < 1e-9);
    assert!(
        (previous.distance.unwrap() - 5.0 / 6.0).abs() < 1e-9,
        "row 0 looks at itself"
    );
    assert!((previous.by_position.unwrap() - 1.0).abs() < 1e-9);
    assert_eq!(previous.verdict(), Some("position"));
    let content = &stats[1];
    assert!(
        (content.first - 1.0).abs() < 1e-9,
        "token 0 is first in the original"
    );
    assert!((content.by_content.unwrap() - 1.0).abs() < 1e-9);
    assert!(content.by_position.unwrap() < 0.5);
    assert_eq!(content.verdict(), Some("content"));
}

#[test]
fn statistics_of_a_real_model_cover_every_head() {
    let dir = tempfile::tempdir().unwrap();
    classifier_artifact(dir.path());
    let model = load(dir.path(), "art");
    let device = Default::default();
    let maps: AttentionMaps = model
        .attention("money at the bank of the river", None, &device)
        .unwrap();
    let all = model.statistics(&maps, 7, &device).unwrap();
    assert_eq!(all.len(), 1);
    let n = maps.groups[0].keys.len() as f64;
    assert_eq!(all[0].heads.len(), 2, "1 layer × 2 heads");
    for s in &all[0].heads {
        assert!(
            s.entropy > 0.0 && s.entropy <= n.ln() + 1e-6,
            "entropy within [0, ln n]: {s:?}"
        );
        assert!(s.verdict().is_some());
    }
    assert!(all[0].text.contains("by position:"), "{}", all[0].text);
}

#[test]
fn explain_walks_through_the_heads_real_weights() {
    let dir = tempfile::tempdir().unwrap();
    lm_artifact(dir.path(), TEXT);
    let model = load(dir.path(), "lm");
    let w = model_walkthrough(
        &model.text_model().unwrap(),
        "not to be",
        1,
        3,
        &Default::default(),
    )
    .unwrap();
    assert!(w.causal);
    assert_eq!(w.tokens.len(), 9);
    assert_eq!(w.steps.q[0].len(), 8, "d_head = 32 / 4");
    for (q, (row, forward)) in w.steps.weights.iter().zip(&w.forward_weights).enumerate() {
        for (k, (a, b)) in row.iter().zip(forward).enumerate() {
            assert!(
                (a - b).abs() < 1e-6,
                "[{q}][{k}]: {a} vs the forward pass's {b}"
            );
            if k > q {
                assert_eq!(*a, 0.0);
                assert_eq!(w.steps.scores[q][k], f32::NEG_INFINITY);
            }
        }
    }
    // The scores are Q·Kᵀ/√d_k of the matrices shown.
    let s01: f32 = w.steps.q[1]
        .iter()
        .zip(&w.steps.k[0])
        .map(|(a, b)| a * b)
        .sum::<f32>()
        / 8f32.sqrt();
    assert!((w.steps.scores[1][0] - s01).abs() < 1e-5);
}

#[test]
fn attention_command_writes_every_format_and_names_what_exists() {
    let dir = tempfile::tempdir().unwrap();
    lm_artifact(dir.path(), TEXT);
    let out = run(
        dir.path(),
        &[
            "attention",
            "--artifact-dir",
            "lm",
            "to be or not",
            "--layer",
            "1",
            "--head",
            "2",
            "--out",
            "view",
            "--stats",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("self attention, layer 1, head 2"),
        "{stdout}"
    );
    assert!(stdout.contains("by position:"), "{stdout}");
    // A causal query's candidates are the keys it sees: 1, 2, then 3 of them; never a masked one.
    let strongest: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("strongest keys of each query"))
        .skip(1)
        .take_while(|l| l.contains('→'))
        .collect();
    assert_eq!(strongest.len(), 12, "{stdout}");
    for (query, line) in strongest.iter().enumerate() {
        let listed = line.split('→').nth(1).unwrap().split(", ").count();
        assert_eq!(listed, (query + 1).min(3), "query {query}: {line}");
    }
    let png = image::open(dir.path().join("view/attention.png")).unwrap();
    assert!(png.width() > 400 && png.height() > 300);
    let page = std::fs::read_to_string(dir.path().join("view/attention.html")).unwrap();
    for outside in ["src=\"http", "href=\"http", "<script src", "@import"] {
        assert!(
            !page.contains(outside),
            "the page is self-contained: {outside}"
        );
    }
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("view/attention.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(json["groups"][0]["weights"].as_array().unwrap().len(), 2);

    assert_clean_error(
        &run(
            dir.path(),
            &["attention", "--artifact-dir", "lm", "to be", "--layer", "2"],
        ),
        "layers 0–1",
    );
    assert_clean_error(
        &run(
            dir.path(),
            &["attention", "--artifact-dir", "lm", "to be", "--head", "4"],
        ),
        "heads 0–3",
    );
    assert_clean_error(
        &run(
            dir.path(),
            &[
                "attention",
                "--artifact-dir",
                "lm",
                "to be",
                "--group",
                "cross",
            ],
        ),
        "it has: self",
    );
    assert_clean_error(
        &run(dir.path(), &["attention", "--artifact-dir", "lm", "zebra"]),
        "outside the model's vocabulary",
    );
    assert_clean_error(
        &run(
            dir.path(),
            &["explain", "--artifact-dir", "lm", "to be", "--layer", "5"],
        ),
        "layers 0–1",
    );
}

#[test]
fn a_vit_attention_picture_lays_the_class_token_over_the_image() {
    let dir = tempfile::tempdir().unwrap();
    vit_artifact(dir.path());
    let digit = image::GrayImage::from_fn(28, 28, |x, y| {
        image::Luma([if (10..18).contains(&x) && y > 4 && y < 24 {
            255
        } else {
            0
        }])
    });
    digit.save(dir.path().join("one.png")).unwrap();
    let model = load(dir.path(), "art");
    let maps = model
        .attention(
            &dir.path().join("one.png").display().to_string(),
            None,
            &Default::default(),
        )
        .unwrap();
    let group = &maps.groups[0];
    assert_eq!(group.queries.len(), 1 + 16, "CLS + 4×4 patches of 7 pixels");
    assert_eq!(group.queries[0], "CLS");
    assert_rows_sum_to_one(group);
    let out = run(
        dir.path(),
        &[
            "attention",
            "--artifact-dir",
            "art",
            "one.png",
            "--png",
            "vit.png",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let png = image::open(dir.path().join("vit.png")).unwrap();
    assert!(
        png.width() >= 3 * 112,
        "a panel per head and the mean, 4 px per pixel"
    );
    assert_clean_error(
        &run(dir.path(), &["explain", "--artifact-dir", "art", "a text"]),
        "for a ViT use `attention`",
    );
    assert_clean_error(
        &run(
            dir.path(),
            &["attention", "--artifact-dir", "art", "missing.png"],
        ),
        "missing.png",
    );
}

/// An untrained char LM artifact with `mixer` (a JSON object) in `dir/name`.
fn mixer_lm_artifact(dir: &Path, name: &str, mixer: &str) {
    use transformer_lab::config::TokenizerKind;
    use transformer_lab::data::Tokenizer;
    let tokenizer = Tokenizer::fit(TokenizerKind::Char, std::iter::once(TEXT), 0).unwrap();
    let config = format!(
        r#"{{"name": "{name}", "model": {{"kind": "lm", "d_model": 32, "n_layers": 2,
            "n_heads": 4, "context": 64, "mixer": {mixer}}},
            "data": {{"dataset": "tinyshakespeare", "tokenizer": "char"}}}}"#
    );
    crate::common::write_artifact_at(
        dir,
        name,
        &config,
        |c| {
            c.model_as::<transformer_lab::config::LmConfig>()
                .unwrap()
                .init::<B>(&Default::default())
        },
        Some(tokenizer),
    );
}

#[test]
fn sparse_and_linear_mixers_show_their_own_weights_and_hyena_says_it_has_none() {
    let dir = tempfile::tempdir().unwrap();
    let device = Default::default();
    let n = TEXT.chars().count();
    for (name, mixer, window) in [
        ("local", r#"{"kind": "local", "window": 4}"#, Some(4)),
        ("linear", r#"{"kind": "linear"}"#, None),
    ] {
        mixer_lm_artifact(dir.path(), name, mixer);
        let maps = load(dir.path(), name)
            .attention(TEXT, None, &device)
            .unwrap();
        let weights = &maps.groups[0].weights;
        assert_eq!((weights.len(), weights[0].len()), (2, 4));
        for row in weights.iter().flatten().flatten() {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-4);
        }
        for (i, row) in weights[1][2].iter().enumerate() {
            for (j, &w) in row.iter().enumerate() {
                let visible = j <= i && window.is_none_or(|w| i - j < w);
                assert!(visible || w == 0.0, "{name}: query {i} key {j} weight {w}");
            }
        }
        assert_eq!(weights[0][0].len(), n);
        let out = run(dir.path(), &["explain", "--artifact-dir", name, TEXT]);
        assert_clean_error(&out, &format!("this model's mixer is {name}"));
    }
    mixer_lm_artifact(dir.path(), "hyena", r#"{"kind": "hyena"}"#);
    let out = run(dir.path(), &["attention", "--artifact-dir", "hyena", TEXT]);
    assert_clean_error(&out, "no attention weights to show");
}

#[test]
fn explain_refuses_positions_that_live_inside_attention() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = transformer_lab::data::Tokenizer::fit(
        transformer_lab::config::TokenizerKind::Char,
        std::iter::once(TEXT),
        0,
    )
    .unwrap();
    crate::common::write_artifact_at(
        dir.path(),
        "rope",
        r#"{"name": "rope", "model": {"kind": "lm", "d_model": 32, "n_layers": 1, "n_heads": 4,
            "context": 16, "position": "rope"}, "data": {"dataset": "tinyshakespeare", "tokenizer": "char"}}"#,
        |c| {
            c.model_as::<transformer_lab::config::LmConfig>()
                .unwrap()
                .init::<burn::backend::NdArray<f32>>(&Default::default())
        },
        Some(tokenizer),
    );
    let model = load(dir.path(), "rope");
    let err = model_walkthrough(
        &model.text_model().unwrap(),
        "to be",
        0,
        0,
        &Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("rope positions live inside attention"),
        "{err}"
    );
}
