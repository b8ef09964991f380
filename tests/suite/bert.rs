//! Hugging Face BERT in, against the tiny fixture `transformers` made
//! (tests/fixtures/bert-tiny/make.py): the imported model computes transformers' masked-LM
//! logits and `BertModel`'s hidden states (one text at a time and in a padded batch) on every
//! CPU backend, `fill-mask` puts transformers' top token at each `[MASK]`, `embed` gives the
//! hidden states, a bare `BertModel` imports its encoder, what BERT's stack cannot express is
//! one error line, and a classifier fine-tunes from the imported encoder.

use crate::common::{assert_clean_error, run, stderr};
use burn::backend::NdArray;
use burn::prelude::*;
use std::path::{Path, PathBuf};
use transformer_lab::artifact::ArtifactDir;
use transformer_lab::config::{ClassifierConfig, ExperimentConfig, MlmConfig};
use transformer_lab::embed::word_vectors;
use transformer_lab::kernels::LabBackend;
use transformer_lab::kinds::{load_as, ModelKind};
use transformer_lab::models::TextClassifier;

type B = NdArray<f32>;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bert-tiny")
}

/// One sentence and what transformers computed of it.
struct Case {
    text: String,
    ids: Vec<usize>,
    /// `[n, v]`.
    logits: Vec<Vec<f32>>,
    /// `[n, d]`, `BertModel`'s last hidden states.
    hidden: Vec<Vec<f32>>,
    /// Per `[MASK]`, the five most probable ids, most probable first, and their probabilities.
    top_ids: Vec<Vec<usize>>,
    top_probabilities: Vec<Vec<f32>>,
}

fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let get = |case: &serde_json::Value, key: &str| case[key].clone();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|case| Case {
            text: case["text"].as_str().unwrap().to_string(),
            ids: serde_json::from_value(get(case, "ids")).unwrap(),
            logits: serde_json::from_value(get(case, "logits")).unwrap(),
            hidden: serde_json::from_value(get(case, "hidden")).unwrap(),
            top_ids: serde_json::from_value(get(case, "top_ids")).unwrap(),
            top_probabilities: serde_json::from_value(get(case, "top_probabilities")).unwrap(),
        })
        .collect()
}

fn gap(ours: &[f32], theirs: &[f32]) -> f32 {
    assert_eq!(ours.len(), theirs.len());
    ours.iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

fn import(dir: &Path) -> PathBuf {
    let out = dir.join("bert");
    transformer_lab::bert::import::<B>(&fixture(), &out, &Default::default()).unwrap();
    out
}

/// The largest differences between the fixture imported on backend `Bk` and transformers: the
/// logits, the hidden states (one sentence at a time), and both again with every sentence in
/// one padded batch.
fn imported_gaps<Bk: LabBackend>(device: &Bk::Device) -> [f32; 4] {
    let dir = tempfile::tempdir().unwrap();
    let out = import(dir.path());
    let trained = load_as::<MlmConfig, Bk>(&ArtifactDir::new(&out), device).unwrap();
    let model = &trained.model;
    let cases = cases();
    let reader = MlmConfig::text_model(&trained).unwrap();
    let (mut logits, mut hidden) = (0.0f32, 0.0f32);
    for case in &cases {
        assert_eq!(
            reader.encode(&case.text).unwrap(),
            case.ids,
            "{}",
            case.text
        );
        let states = model.forward(reader.tokens(&case.ids, device)).states; // [1, n, d]
        let [_, n, d] = states.dims();
        let states = states.reshape([n, d]);
        let scores = model.scores(states.clone());
        let flat = |t: Tensor<Bk, 2>| t.into_data().convert::<f32>().to_vec::<f32>().unwrap();
        logits = logits.max(gap(&flat(scores), &case.logits.concat()));
        hidden = hidden.max(gap(&flat(states), &case.hidden.concat()));
    }
    // One padded batch: padding on the right, masked out of attention.
    let n = cases.iter().map(|c| c.ids.len()).max().unwrap();
    let mut rows = Vec::new();
    for case in &cases {
        let mut row: Vec<i64> = case.ids.iter().map(|&i| i as i64).collect();
        row.resize(n, 0);
        rows.extend(row);
    }
    let tokens = Tensor::<Bk, 1, Int>::from_ints(rows.as_slice(), device).reshape([cases.len(), n]);
    let states = model.forward(tokens).states; // [b, n, d]
    let (mut batch_logits, mut batch_hidden) = (0.0f32, 0.0f32);
    for (row, case) in cases.iter().enumerate() {
        let m = case.ids.len();
        let own = states.clone().narrow(0, row, 1).narrow(1, 0, m);
        let d = own.dims()[2];
        let own = own.reshape([m, d]);
        let flat = |t: Tensor<Bk, 2>| t.into_data().convert::<f32>().to_vec::<f32>().unwrap();
        batch_logits =
            batch_logits.max(gap(&flat(model.scores(own.clone())), &case.logits.concat()));
        batch_hidden = batch_hidden.max(gap(&flat(own), &case.hidden.concat()));
    }
    [logits, hidden, batch_logits, batch_hidden]
}

#[test]
fn imported_bert_computes_transformers_logits_and_hidden_states_on_ndarray() {
    let gaps = imported_gaps::<B>(&Default::default());
    assert!(
        gaps.iter().all(|&g| g < 1e-4),
        "gaps from transformers: {gaps:?}"
    );
}

#[cfg(feature = "flex")]
#[test]
fn imported_bert_computes_transformers_logits_and_hidden_states_on_flex() {
    let gaps = imported_gaps::<burn::backend::Flex>(&Default::default());
    assert!(
        gaps.iter().all(|&g| g < 1e-4),
        "gaps from transformers: {gaps:?}"
    );
}

#[test]
fn fill_mask_puts_transformers_top_token_at_each_mask_and_embed_gives_the_hidden_states() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        dir.path(),
        &[
            "import",
            "bert",
            fixture().to_str().unwrap(),
            "--artifact-dir",
            "a",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("token type 0 (segment A) is folded"),
        "{stdout}"
    );
    let device = Default::default();
    let trained =
        load_as::<MlmConfig, B>(&ArtifactDir::new(dir.path().join("a")), &device).unwrap();
    let tokenizer = trained.tokenizer();

    let masked: Vec<Case> = cases()
        .into_iter()
        .filter(|c| !c.top_ids.is_empty())
        .collect();
    assert!(masked.len() >= 2);
    for case in &masked {
        let filled = transformer_lab::kinds::fill_mask(&trained, &case.text, 5, &device).unwrap();
        assert_eq!(filled.len(), case.top_ids.len(), "{}", case.text);
        for (ours, (ids, probabilities)) in filled
            .iter()
            .zip(case.top_ids.iter().zip(&case.top_probabilities))
        {
            // transformers ranks every id; fill-mask leaves out the special tokens.
            let (id, p) = ids
                .iter()
                .zip(probabilities)
                .find(|(id, _)| !tokenizer.is_special(**id))
                .unwrap();
            assert_eq!(ours.tokens[0].0, tokenizer.token_text(*id), "{}", case.text);
            assert!(
                (ours.tokens[0].1 - p).abs() < 1e-5,
                "{} vs {p}",
                ours.tokens[0].1
            );
        }
    }
    // Through the binary: the top token, and one error line for a text without a mask.
    let case = &masked[0];
    let top = tokenizer.token_text(case.top_ids[0][0]);
    let out = run(
        dir.path(),
        &["fill-mask", "--artifact-dir", "a", &case.text],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("[MASK] 1: {top:?}")),
        "{stdout} lacks {top:?} first"
    );
    assert_clean_error(
        &run(
            dir.path(),
            &["fill-mask", "--artifact-dir", "a", "the river bank"],
        ),
        "has no [MASK]",
    );

    // embed: a word's vector is the mean of BertModel's states over the word's pieces.
    let case = &cases()[0];
    let reader = MlmConfig::text_model(&trained).unwrap();
    let vectors = word_vectors(&reader, &case.text, "bank", &device)
        .unwrap()
        .unwrap();
    let start = case.text.find("bank").unwrap();
    let pieces: Vec<usize> = reader
        .encode_with_offsets(&case.text)
        .unwrap()
        .iter()
        .enumerate()
        .filter(|(_, (_, (s, e)))| e > s && *s < start + 4 && *e > start)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(pieces.len(), vectors.tokens);
    let d = case.hidden[0].len();
    let mean: Vec<f32> = (0..d)
        .map(|j| pieces.iter().map(|&i| case.hidden[i][j]).sum::<f32>() / pieces.len() as f32)
        .collect();
    let g = gap(&vectors.contextual, &mean);
    assert!(g < 1e-4, "embed differs from BertModel's states by {g}");
}

/// The fixture's files in `dir`, `config.json` changed by `edit` and the weights kept to the
/// tensors `keep` accepts.
fn altered(dir: &Path, edit: impl Fn(&mut serde_json::Value), keep: impl Fn(&str) -> bool) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(fixture().join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let path = fixture().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> = file
        .tensors()
        .into_iter()
        .filter(|(name, _)| keep(name))
        .collect();
    let bytes = safetensors::serialize(kept, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
}

#[test]
fn a_bare_bert_model_imports_its_encoder_and_what_bert_cannot_be_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    // BertModel: no `bert.` prefix, no masked-LM head.
    let bare = dir.path().join("bare");
    altered(&bare, |_| {}, |name| !name.starts_with("cls."));
    let bytes = std::fs::read(bare.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let renamed: Vec<(String, safetensors::tensor::TensorView)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| (name.trim_start_matches("bert.").to_string(), view))
        .collect();
    let renamed = safetensors::serialize(renamed, None).unwrap();
    std::fs::write(bare.join("model.safetensors"), renamed).unwrap();
    let out = run(
        dir.path(),
        &[
            "import",
            "bert",
            bare.to_str().unwrap(),
            "--artifact-dir",
            "bare-a",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("has no masked-LM head"));
    let device = Default::default();
    let trained =
        load_as::<MlmConfig, B>(&ArtifactDir::new(dir.path().join("bare-a")), &device).unwrap();
    let case = &cases()[1];
    let reader = MlmConfig::text_model(&trained).unwrap();
    let states = reader.states(&case.ids, &device);
    let states: Vec<f32> = states.into_data().to_vec().unwrap();
    assert!(gap(&states, &case.hidden.concat()) < 1e-4);

    // What the stack cannot express, and a checkpoint that does not fit its config.
    let refused = [
        (
            "position_embedding_type",
            serde_json::json!("relative_key"),
            "position_embedding_type is relative_key",
        ),
        (
            "model_type",
            serde_json::json!("roberta"),
            "model_type is Some(\"roberta\")",
        ),
        (
            "hidden_act",
            serde_json::json!("silu"),
            "hidden_act is silu",
        ),
        (
            "hidden_size",
            serde_json::json!(64),
            "has shape [300, 32], but config.json makes it [300, 64]",
        ),
    ];
    for (name, value, needle) in refused {
        let checkpoint = dir.path().join(name);
        altered(&checkpoint, |c| c[name] = value.clone(), |_| true);
        let artifact = format!("{name}-artifact");
        let out = run(
            dir.path(),
            &[
                "import",
                "bert",
                checkpoint.to_str().unwrap(),
                "--artifact-dir",
                &artifact,
            ],
        );
        assert_clean_error(&out, needle);
        assert!(!dir.path().join(&artifact).exists());
    }
    let untokenized = dir.path().join("untokenized");
    altered(&untokenized, |_| {}, |_| true);
    std::fs::remove_file(untokenized.join("tokenizer.json")).unwrap();
    assert_clean_error(
        &run(
            dir.path(),
            &[
                "import",
                "bert",
                untokenized.to_str().unwrap(),
                "--artifact-dir",
                "u",
            ],
        ),
        "holds no tokenizer.json",
    );
}

#[test]
fn a_classifier_fine_tunes_from_an_imported_bert_starting_from_its_encoder_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let bert = import(dir.path());
    let device = Default::default();
    let imported = load_as::<MlmConfig, B>(&ArtifactDir::new(&bert), &device).unwrap();
    let mlm = imported.config.model_as::<MlmConfig>().unwrap().clone();
    let classifier = ClassifierConfig {
        vocab_size: mlm.vocab_size,
        stack: mlm.stack.clone(),
        n_layers: mlm.n_layers,
        max_len: mlm.max_len,
        position: mlm.position,
        embedding_norm: true,
        init_from: Some(bert.clone()),
        ..ClassifierConfig::default()
    };
    let fresh: TextClassifier<B> = classifier.init(&device);
    let started = classifier
        .start_from(fresh, &ArtifactDir::new(&bert), &device)
        .unwrap();
    let values = crate::mlm::values::<TextClassifier<B>>;
    let ours = values(&started);
    let encoder = |m: &transformer_lab::models::MaskedLm<B>| {
        let mut all = crate::mlm::values(&m.token_embedding);
        all.extend(crate::mlm::values(&m.position));
        all.extend(crate::mlm::values(&m.encoder));
        all.extend(crate::mlm::values(m.embedding_norm.as_ref().unwrap()));
        all
    };
    let theirs = encoder(&imported.model);
    for v in &theirs {
        assert!(
            ours.contains(v),
            "a pretrained parameter is missing from the classifier"
        );
    }

    // Through the binary: a short fine-tuning on real sentences, then classify.
    if std::env::var("TRANSFORMER_LAB_DATA").is_err() {
        crate::common::skip("fine-tuning from BERT needs uci-sentiment (TRANSFORMER_LAB_DATA)");
        return;
    }
    let mut config = ExperimentConfig::parse(
        r#"{"name": "bert-sentiment",
            "model": {"kind": "classifier", "d_model": 32, "n_heads": 4, "d_ff": 64,
                      "norm_first": false, "norm_epsilon": 1e-12, "embedding_norm": true,
                      "n_layers": 2, "max_len": 64, "init_from": "bert"},
            "data": {"dataset": "uci-sentiment", "tokenizer": "bert", "max_tokens": 32},
            "train": {"steps": 6, "steps_per_epoch": 6, "batch_size": 8, "warmup_steps": 1}}"#,
    )
    .unwrap();
    config.seed = 3;
    config.save(&dir.path().join("c.json")).unwrap();
    let out = run(
        dir.path(),
        &["train", "-e", "c.json", "--artifact-dir", "c"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let out = run(
        dir.path(),
        &[
            "classify",
            "--artifact-dir",
            "c",
            "a wonderful little phone",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("positive") || text.contains("negative"),
        "{text}"
    );
    let saved = std::fs::read_to_string(dir.path().join("c/config.json")).unwrap();
    assert!(saved.contains("\"tokenizer\": \"bert\""), "{saved}");
    // And with our own BPE named instead of BERT's, one line says so.
    config.data.tokenizer = transformer_lab::data::TokenizerKind::Bpe;
    config.save(&dir.path().join("bpe.json")).unwrap();
    assert_clean_error(
        &run(
            dir.path(),
            &["train", "-e", "bpe.json", "--artifact-dir", "bpe"],
        ),
        "data.tokenizer is bpe, but model.init_from's tokenizer is bert",
    );
}
