//! Hugging Face GPT-2 in and out, against the tiny fixture `transformers` made
//! (tests/fixtures/gpt2-tiny/make.py): the imported model computes transformers' logits and
//! greedy continuation, export → import gives back every weight bit for bit, and the exported
//! files hold the tensors transformers expects.

use crate::common::{assert_clean_error, run};
use burn::backend::NdArray;
use burn::prelude::*;
use burn_store::ModuleSnapshot;
use std::path::{Path, PathBuf};
use transformer_lab::artifact::ArtifactDir;
use transformer_lab::config::LmConfig;
use transformer_lab::kernels::LabBackend;
use transformer_lab::kinds::load_as;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2-tiny")
}

struct Expected {
    prompt: String,
    ids: Vec<i64>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<usize>,
}

fn expected() -> Expected {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ints = |key: &str| -> Vec<i64> {
        v[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect()
    };
    Expected {
        prompt: v["prompt"].as_str().unwrap().to_string(),
        ids: ints("ids"),
        logits: serde_json::from_value(v["logits"].clone()).unwrap(),
        greedy: ints("greedy").into_iter().map(|x| x as usize).collect(),
    }
}

/// The largest difference between the logits of the fixture imported on backend `B` and the
/// logits transformers computed.
pub fn imported_logit_gap<B: LabBackend>(device: &B::Device) -> f32 {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gpt2");
    transformer_lab::gpt2::import::<B>(&fixture(), &out, device).unwrap();
    let trained = load_as::<LmConfig, B>(&ArtifactDir::new(&out), device).unwrap();
    let e = expected();
    let tokens = Tensor::<B, 1, Int>::from_ints(e.ids.as_slice(), device).reshape([1, e.ids.len()]);
    let logits = trained.model.forward(tokens).logits; // [1, t, v]
    let ours: Vec<f32> = logits.into_data().to_vec().unwrap();
    let theirs: Vec<f32> = e.logits.concat();
    assert_eq!(ours.len(), theirs.len());
    ours.iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

#[test]
fn imported_gpt2_computes_transformers_logits_on_ndarray() {
    let gap = imported_logit_gap::<NdArray<f32>>(&Default::default());
    assert!(gap < 1e-4, "logits differ from transformers' by {gap}");
}

#[cfg(feature = "flex")]
#[test]
fn imported_gpt2_computes_transformers_logits_on_flex() {
    let gap = imported_logit_gap::<burn::backend::Flex>(&Default::default());
    assert!(gap < 1e-4, "logits differ from transformers' by {gap}");
}

#[test]
fn imported_gpt2_continues_greedily_as_transformers_does_and_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = fixture();
    let out = run(
        dir.path(),
        &[
            "import",
            "gpt2",
            fixture.to_str().unwrap(),
            "--artifact-dir",
            "a",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The greedy continuation, token for token: our generate prints the prompt and then the
    // decoded continuation.
    let e = expected();
    let device = Default::default();
    let a = load_as::<LmConfig, NdArray<f32>>(&ArtifactDir::new(dir.path().join("a")), &device)
        .unwrap();
    let prompt_ids: Vec<usize> = e.ids.iter().map(|&i| i as usize).collect();
    assert_eq!(
        a.tokenizer().encode(&e.prompt).unwrap(),
        prompt_ids,
        "the tokenizer reads GPT-2's"
    );
    let continuation = a.tokenizer().decode(&e.greedy);
    let n = e.greedy.len().to_string();
    let generate = run(
        dir.path(),
        &[
            "generate",
            "--artifact-dir",
            "a",
            "--prompt",
            &e.prompt,
            "--max-new-tokens",
            &n,
            "--greedy",
        ],
    );
    assert!(
        generate.status.success(),
        "{}",
        String::from_utf8_lossy(&generate.stderr)
    );
    let text = String::from_utf8_lossy(&generate.stdout);
    assert!(
        text.contains(&format!("{}{continuation}", e.prompt)),
        "{text:?} lacks transformers' continuation {continuation:?}"
    );

    // Export → import: every weight bit for bit.
    let out = run(dir.path(), &["export", "--artifact-dir", "a", "--to", "hf"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let hf = dir.path().join("hf");
    let out = run(
        dir.path(),
        &[
            "import",
            "gpt2",
            hf.to_str().unwrap(),
            "--artifact-dir",
            "b",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let b = load_as::<LmConfig, NdArray<f32>>(&ArtifactDir::new(dir.path().join("b")), &device)
        .unwrap();
    let weights = |m: &transformer_lab::models::LanguageModel<NdArray<f32>>| {
        m.collect(None, None, false)
            .into_iter()
            .map(|s| (s.full_path(), s.to_data().unwrap().to_vec::<f32>().unwrap()))
            .collect::<Vec<_>>()
    };
    assert_eq!(weights(&a.model), weights(&b.model));

    // The exported file holds transformers' tensors: its names (without the `transformer.`
    // prefix `save_pretrained` adds, as the Hub's gpt2 file), shapes and dtype, and the same
    // values as the fixture.
    let read = |path: &Path| std::fs::read(path).unwrap();
    let (ours, theirs) = (
        read(&hf.join("model.safetensors")),
        read(&fixture.join("model.safetensors")),
    );
    let ours = safetensors::SafeTensors::deserialize(&ours).unwrap();
    let theirs = safetensors::SafeTensors::deserialize(&theirs).unwrap();
    let mut names: Vec<String> = theirs
        .names()
        .iter()
        .map(|n| n.trim_start_matches("transformer.").to_string())
        .collect();
    names.sort();
    let mut exported: Vec<String> = ours.names().iter().map(|n| n.to_string()).collect();
    exported.sort();
    assert_eq!(exported, names);
    for name in &exported {
        let mine = ours.tensor(name).unwrap();
        let orig = theirs.tensor(&format!("transformer.{name}")).unwrap();
        assert_eq!(mine.dtype(), safetensors::Dtype::F32, "{name}");
        assert_eq!(mine.shape(), orig.shape(), "{name}");
        assert_eq!(mine.data(), orig.data(), "{name}");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(config["architectures"][0], "GPT2LMHeadModel");
    assert_eq!(config["activation_function"], "gelu_new");
}

#[test]
fn bad_checkpoints_and_exports_get_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let copy = |name: &str, edit: &dyn Fn(&Path)| {
        let to = dir.path().join(name);
        std::fs::create_dir_all(&to).unwrap();
        for file in ["config.json", "model.safetensors", "tokenizer.json"] {
            std::fs::copy(fixture().join(file), to.join(file)).unwrap();
        }
        edit(&to);
    };
    let set = |key: &'static str, value: serde_json::Value| {
        move |d: &Path| {
            let path = d.join("config.json");
            let mut c: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            c[key] = value.clone();
            std::fs::write(&path, c.to_string()).unwrap();
        }
    };
    copy("bert", &set("model_type", "bert".into()));
    copy("wide", &set("n_embd", 64.into()));
    copy("nomodel", &|d: &Path| {
        std::fs::remove_file(d.join("model.safetensors")).unwrap()
    });
    copy("notok", &|d: &Path| {
        std::fs::remove_file(d.join("tokenizer.json")).unwrap()
    });
    for (name, needle) in [
        ("bert", "model_type"),
        ("wide", "has shape"),
        ("nomodel", "no model.safetensors"),
        ("notok", "no tokenizer"),
        ("absent", "cannot read"),
    ] {
        let path = dir.path().join(name);
        let out = run(
            dir.path(),
            &[
                "import",
                "gpt2",
                path.to_str().unwrap(),
                "--artifact-dir",
                "x",
            ],
        );
        assert_clean_error(&out, needle);
        assert!(
            !dir.path().join("x").exists(),
            "{name}: nothing half-written"
        );
    }
    // A model GPT-2 cannot express: a char-level LM without biases.
    crate::common::lm_artifact(dir.path(), "to be or not to be");
    let out = run(
        dir.path(),
        &["export", "--artifact-dir", "lm", "--to", "hf"],
    );
    assert_clean_error(&out, "GPT-2 cannot express this model");
}

#[test]
fn training_starts_from_an_imported_artifact() {
    let dir = tempfile::tempdir().unwrap();
    let device = Default::default();
    transformer_lab::gpt2::import::<NdArray<f32>>(&fixture(), &dir.path().join("gpt2"), &device)
        .unwrap();
    let line = "ROMEO: But soft, what light through yonder window breaks? ";
    std::fs::write(dir.path().join("corpus.txt"), line.repeat(40)).unwrap();
    let experiment = |d_model: usize| {
        format!(
            r#"{{"name": "ft", "seed": 1,
               "model": {{"kind": "lm", "init_from": "gpt2", "d_model": {d_model}, "n_layers": 2,
                          "n_heads": 2, "d_ff": 128, "context": 64, "activation": "gelu_tanh",
                          "bias": true, "dropout": 0.0}},
               "data": {{"text_file": "corpus.txt", "tokenizer": "gpt2"}},
               "train": {{"batch_size": 2, "steps": 2, "steps_per_epoch": 2, "eval_batches": 1,
                          "lr": 1e-30, "min_lr": 1e-30, "warmup_steps": 0, "weight_decay": 0.0}}}}"#
        )
    };
    std::fs::write(dir.path().join("ft.json"), experiment(32)).unwrap();
    let out = run(
        dir.path(),
        &["train", "-e", "ft.json", "--artifact-dir", "ft"],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("starting from the weights of"), "{stdout}");
    // With a learning rate of 1e-30 no weight moves: the run began from the imported ones, and
    // read the text with GPT-2's tokenizer.
    let load = |name: &str| {
        load_as::<LmConfig, NdArray<f32>>(&ArtifactDir::new(dir.path().join(name)), &device)
            .unwrap()
    };
    let (start, trained) = (load("gpt2"), load("ft"));
    let weights = |m: &transformer_lab::models::LanguageModel<NdArray<f32>>| {
        m.collect(None, None, false)
            .into_iter()
            .map(|s| s.to_data().unwrap().to_vec::<f32>().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(weights(&start.model), weights(&trained.model));
    assert_eq!(trained.tokenizer().vocab_size(), 300);

    // A config describing another model is one clear line.
    std::fs::write(dir.path().join("wide.json"), experiment(64)).unwrap();
    let out = run(
        dir.path(),
        &["train", "-e", "wide.json", "--artifact-dir", "wide"],
    );
    assert_clean_error(&out, "init_from");
    // GPT-2's tokenizer is imported, never fitted.
    let fitted = experiment(32).replace(r#""init_from": "gpt2", "#, "");
    std::fs::write(dir.path().join("fit.json"), fitted).unwrap();
    let out = run(
        dir.path(),
        &["train", "-e", "fit.json", "--artifact-dir", "fit"],
    );
    assert_clean_error(&out, "not fitted");
}
