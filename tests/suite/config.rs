//! Configs: every shipped experiment loads and validates; mistakes are clear errors.

use transformer_lab::config::ExperimentConfig;

#[test]
fn every_experiment_file_loads() {
    let mut n = 0;
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/experiments")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json") {
            let config = ExperimentConfig::load(&path).unwrap_or_else(|e| panic!("{e:#}"));
            assert_eq!(config.train.steps % config.train.steps_per_epoch, 0);
            n += 1;
        }
    }
    assert!(n >= 2);
}

#[test]
fn the_default_experiment_is_nanogpts_small_cpu_config() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/experiments/shakespeare-char.json"
    );
    let c = ExperimentConfig::load(path.as_ref()).unwrap();
    let lm = c.model_as::<transformer_lab::config::LmConfig>().unwrap();
    assert_eq!(
        (lm.n_layers, lm.stack.n_heads, lm.stack.d_model, lm.context),
        (4, 4, 128, 64)
    );
    assert_eq!(
        (c.train.batch_size, c.train.steps, c.train.warmup_steps),
        (12, 2000, 100)
    );
    assert_eq!(
        (
            c.train.lr,
            c.train.min_lr,
            c.train.beta2,
            c.train.weight_decay,
            c.train.grad_clip
        ),
        (1e-3, 1e-4, 0.99, 0.1, 1.0)
    );
    assert_eq!(lm.stack.dropout, 0.0);
    let built_in = ExperimentConfig::parse(transformer_lab::cli::DEFAULT_EXPERIMENT).unwrap();
    assert_eq!(built_in, c);
}

fn load_str(text: &str) -> anyhow::Result<ExperimentConfig> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.json");
    std::fs::write(&path, text).unwrap();
    ExperimentConfig::load(&path)
}

#[test]
fn mistakes_are_clear_errors() {
    let cases = [
        (
            r#"{"model": {"d_model": 130, "n_heads": 4}}"#,
            "divisible by n_heads",
        ),
        (r#"{"model": {"d_modle": 128}}"#, "unknown field `d_modle`"),
        (r#"{"model": {"position": "rotary"}}"#, "unknown variant"),
        (
            r#"{"train": {"steps": 1000, "steps_per_epoch": 300}}"#,
            "multiple of steps_per_epoch",
        ),
        (r#"{"train": {"warmup_steps": 5000}}"#, "warmup_steps"),
        (r#"{"model": {"dropout": 1.5}}"#, "dropout"),
        (
            r#"{"train": {"epsilon": -1e-8}}"#,
            "epsilon must not be negative",
        ),
        (r#"{"model": "#, "malformed config"),
        // The data must suit the model.
        (
            r#"{"model": {"kind": "seq2seq"}, "data": {"tokenizer": "bpe"}}"#,
            "needs a translation dataset",
        ),
        (
            r#"{"model": {"kind": "seq2seq"}, "data": {"dataset": "multi30k", "source": "de", "target": "en"}}"#,
            "needs the bpe tokenizer",
        ),
        (
            r#"{"data": {"dataset": "multi30k"}}"#,
            "needs a seq2seq model",
        ),
        (
            r#"{"model": {"kind": "seq2seq"}, "data": {"dataset": "multi30k", "tokenizer": "bpe", "source": "en", "target": "fr"}}"#,
            "not one of its directions",
        ),
        (
            r#"{"model": {"kind": "seq2seq", "share_embeddings": true}, "data": {"dataset": "copy", "tokenizer": "bpe", "shared_vocab": false}}"#,
            "share_embeddings needs data.shared_vocab",
        ),
        (
            r#"{"model": {"kind": "seq2seq", "max_len": 16}, "data": {"dataset": "copy", "tokenizer": "bpe", "max_tokens": 64}}"#,
            "max_tokens",
        ),
        (r#"{"model": {"kind": "gan"}}"#, "unknown variant `gan`"),
        (
            r#"{"train": {"grad_accumulation": 0}}"#,
            "grad_accumulation must be at least 1",
        ),
        (
            r#"{"data": {"train_examples": 100}}"#,
            "train_examples is for datasets of examples",
        ),
        (
            r#"{"model": {"kind": "vit"}, "data": {"dataset": "mnist", "train_examples": 0}}"#,
            "train_examples must be at least 1",
        ),
        (
            r#"{"model": {"kind": "vit"}}"#,
            "a vit needs an image dataset",
        ),
        (
            r#"{"model": {"kind": "vit", "patch_size": 5}, "data": {"dataset": "mnist"}}"#,
            "multiple of patch_size",
        ),
        (
            r#"{"model": {"kind": "vit", "image_size": 32}, "data": {"dataset": "mnist"}}"#,
            "28×28",
        ),
        (
            r#"{"model": {"kind": "classifier"}, "data": {"dataset": "sst2"}}"#,
            "needs the bpe tokenizer",
        ),
        (
            r#"{"model": {"kind": "classifier"}, "data": {"dataset": "mnist", "tokenizer": "bpe"}}"#,
            "sentence-classification dataset",
        ),
        (
            r#"{"model": {"kind": "classifier", "position": "sincos2d"}, "data": {"dataset": "sst2", "tokenizer": "bpe"}}"#,
            "sincos2d",
        ),
        (
            r#"{"data": {"dataset": "mnist"}}"#,
            "a language model needs text",
        ),
        (
            r#"{"train": {"schedule": "linear"}}"#,
            "unknown variant `linear`",
        ),
    ];
    for (text, expected) in cases {
        let err = format!("{:#}", load_str(text).unwrap_err());
        assert!(err.contains(expected), "{text}: {err}");
    }
    let missing = ExperimentConfig::load("no/such/file.json".as_ref()).unwrap_err();
    assert!(format!("{missing:#}").contains("cannot read config"));
    // Defaults fill what a config leaves out, but an empty one is a mistake, not the default.
    assert_eq!(
        load_str(r#"{"name": "x"}"#)
            .unwrap()
            .model_as::<transformer_lab::config::LmConfig>()
            .unwrap()
            .stack
            .d_model,
        128
    );
    for empty in ["{}", "[]", "3"] {
        let err = format!("{:#}", load_str(empty).unwrap_err());
        assert!(
            err.contains("an experiment is a JSON object"),
            "{empty}: {err}"
        );
    }
}
