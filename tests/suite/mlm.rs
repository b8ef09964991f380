//! The masked language model: BERT's masking (its statistics, against the rule it follows), the
//! loss over masked positions only (against a composed reference), and through the binary a
//! model that learns what its sentences say, `fill-mask`, `eval`, a killed run that resumes to
//! the same bits, and a classifier that starts from the pretrained encoder.

use crate::common::{assert_clean_error, classifier_artifact, run, stderr};
use burn::backend::NdArray;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::activation::log_softmax;
use burn::tensor::Tensor;
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use transformer_lab::artifact::ArtifactDir;
use transformer_lab::config::{ClassifierConfig, ExperimentConfig, MlmConfig};
use transformer_lab::data::masked::FIRST_ORDINARY;
use transformer_lab::data::{MaskedItem, Masking, Tokenizer};
use transformer_lab::kinds::{load_as, ModelKind};
use transformer_lab::models::TextClassifier;
use transformer_lab::nn::StackConfig;

type B = NdArray<f32>;

fn masking() -> Masking {
    Masking {
        mask: 999,
        vocab: 1000,
        fraction: 0.15,
        seed: 7,
    }
}

/// A sentence `<s> t₁ … tₙ </s>` of ordinary ids.
fn sentence(n: usize, rng: &mut StdRng) -> Vec<u32> {
    use rand::RngExt;
    let mut ids = vec![1u32];
    ids.extend((0..n).map(|_| rng.random_range(FIRST_ORDINARY as u32..999)));
    ids.push(2);
    ids
}

#[test]
fn masking_chooses_fifteen_percent_of_the_inner_tokens_and_replaces_them_eighty_ten_ten() {
    let masking = masking();
    let mut data = StdRng::seed_from_u64(1);
    let (mut chosen, mut masked, mut random, mut kept) = (0usize, 0usize, 0usize, 0usize);
    let mut per_position = [0usize; 20];
    let sentences = 4000;
    for i in 0..sentences {
        let n = 1 + i % 40;
        let ids = sentence(n, &mut data);
        let out = masking.apply(&ids, &mut masking.rng(Some(i as u64), 0, 0));
        // BERT's count: round(15% of the inner tokens), at least one.
        let expected = ((0.15 * n as f64).round() as usize).clamp(1, n);
        assert_eq!(out.positions.len(), expected, "n = {n}");
        assert_eq!(out.ids.len(), ids.len());
        assert_eq!((out.ids[0], out.ids[n + 1]), (1, 2), "<s> and </s> stay");
        for (k, &p) in out.positions.iter().enumerate() {
            assert!((1..=n).contains(&p), "position {p} of {n} inner tokens");
            assert_eq!(out.targets[k], ids[p], "the target is the original token");
            if n == 20 {
                per_position[p - 1] += 1;
            }
            chosen += 1;
            match out.ids[p] {
                999 => masked += 1,
                id if id == ids[p] => kept += 1,
                id => {
                    assert!(
                        (FIRST_ORDINARY as u32..999).contains(&id),
                        "a random replacement is an ordinary token, not {id}"
                    );
                    random += 1;
                }
            }
        }
        // Positions not chosen are untouched.
        for (p, (&read, &original)) in out.ids.iter().zip(&ids).enumerate() {
            if !out.positions.contains(&p) {
                assert_eq!(read, original);
            }
        }
    }
    // Binomial shares: within 4 standard deviations of 0.8 / 0.1 / 0.1 (a random token equal
    // to the original, 1 in 995, counts as kept).
    let within = |count: usize, p: f64, what: &str| {
        let sd = (chosen as f64 * p * (1.0 - p)).sqrt();
        let off = (count as f64 - chosen as f64 * p).abs();
        assert!(
            off < 4.0 * sd,
            "{what}: {count} of {chosen}, expected {p} ± {:.4}",
            4.0 * sd / chosen as f64
        );
    };
    within(masked, 0.8, "[MASK]");
    within(random, 0.1 * 994.0 / 995.0, "random token");
    within(kept, 0.1 + 0.1 / 995.0, "unchanged");
    // Sentences of 20 inner tokens choose 3; every position equally often.
    let total: usize = per_position.iter().sum();
    let each = total as f64 / 20.0;
    for (p, &count) in per_position.iter().enumerate() {
        let sd = (total as f64 * 0.05 * 0.95).sqrt();
        assert!(
            (count as f64 - each).abs() < 4.0 * sd,
            "position {}: {count}, expected {each:.0} ± {:.0}",
            p + 1,
            4.0 * sd
        );
    }
}

#[test]
fn masks_follow_the_draw_for_training_and_the_sentence_for_held_out_batches() {
    let masking = masking();
    let mut data = StdRng::seed_from_u64(2);
    let items: Vec<MaskedItem> = (0..8)
        .map(|index| MaskedItem {
            ids: sentence(30, &mut data),
            index,
        })
        .collect();
    let device = Default::default();
    let read = |batch: transformer_lab::data::MlmBatch<B>| {
        (
            batch.tokens.into_data().to_vec::<i64>().unwrap(),
            batch.positions.into_data().to_vec::<i64>().unwrap(),
            batch.targets.into_data().to_vec::<i64>().unwrap(),
        )
    };
    let a = read(masking.batch::<B>(items.clone(), Some(11), &device));
    assert_eq!(
        a,
        read(masking.batch::<B>(items.clone(), Some(11), &device))
    );
    assert_ne!(
        a,
        read(masking.batch::<B>(items.clone(), Some(12), &device))
    );
    // The flattened positions point at the replaced tokens, the targets are the originals.
    let width = 32;
    for (&flat, &target) in a.1.iter().zip(&a.2) {
        let (row, col) = (flat as usize / width, flat as usize % width);
        assert_eq!(items[row].ids[col] as i64, target);
        assert!((1..=30).contains(&col));
    }
    // Held out: a sentence gets the same masks whatever batch it is in.
    let held = read(masking.batch::<B>(items.clone(), None, &device));
    let reversed: Vec<MaskedItem> = items.iter().rev().cloned().collect();
    let held_reversed = read(masking.batch::<B>(reversed, None, &device));
    for row in 0..8 {
        let row_of = |tokens: &[i64], r: usize| tokens[r * width..(r + 1) * width].to_vec();
        assert_eq!(row_of(&held.0, row), row_of(&held_reversed.0, 7 - row));
    }
}

#[test]
fn the_loss_is_the_cross_entropy_of_the_masked_positions_alone_with_the_tied_head() {
    let device = Default::default();
    let config = MlmConfig {
        vocab_size: 50,
        stack: StackConfig {
            d_model: 16,
            n_heads: 2,
            d_ff: 32,
            dropout: 0.0,
            ..MlmConfig::default().stack
        },
        n_layers: 2,
        max_len: 16,
        ..MlmConfig::default()
    };
    let model = crate::common::explicit_weights(config.init::<B>(&device), 3);
    let masking = Masking {
        mask: 49,
        vocab: 50,
        fraction: 0.3,
        seed: 1,
    };
    let mut data = StdRng::seed_from_u64(3);
    let items: Vec<MaskedItem> = (0..4)
        .map(|index| {
            let mut ids = sentence(6 + index * 2, &mut data);
            ids.iter_mut()
                .filter(|id| **id >= 4)
                .for_each(|id| *id = 4 + *id % 45);
            MaskedItem { ids, index }
        })
        .collect();
    let batch = masking.batch::<B>(items, Some(5), &device);
    let (loss, logits, targets) = MlmConfig::loss(&model, batch.clone());

    // The reference: every position's scores from the states with plain tensor ops, then the
    // masked ones picked.
    let states = model.forward(batch.tokens.clone()).states;
    let [b, n, d] = states.dims();
    let h = model.transform.forward(states.reshape([b * n, d]));
    let h = burn::tensor::activation::gelu(h);
    let h = model.transform_norm.forward(h);
    let all = h.matmul(model.token_embedding.weight.val().transpose())
        + model.output_bias.val().unsqueeze::<2>();
    let picked = all.select(0, batch.positions.clone());
    let m = targets.dims()[0];
    assert!(m >= 4, "one masked token per sentence at least");
    let nll = log_softmax(picked.clone(), 1)
        .gather(1, batch.targets.clone().reshape([m, 1]))
        .neg()
        .mean();
    let want = nll.into_scalar();
    let got = loss.into_scalar();
    assert!((got - want).abs() < 1e-5, "loss {got} vs reference {want}");
    let diff = (logits - picked).abs().max().into_scalar();
    assert!(diff < 1e-4, "scores differ by {diff}");
    // The tied head: the output projection is the embedding table (no separate matrix).
    let params = model.num_params();
    let untied = 50 * 16;
    let counted = params
        - model.token_embedding.num_params()
        - model.position.num_params()
        - model.encoder.num_params();
    assert_eq!(
        counted,
        16 * 16 + 16 + 2 * 16 + 50,
        "transform, its norm and the bias only ({untied} more if untied)"
    );
}

/// Sixty sentences in which the animal decides the sound: `the {adjective} {animal} says
/// {sound}`.
const ANIMALS: [(&str, &str); 6] = [
    ("cow", "moo"),
    ("dog", "woof"),
    ("cat", "meow"),
    ("duck", "quack"),
    ("sheep", "baa"),
    ("owl", "hoot"),
];
const ADJECTIVES: [&str; 10] = [
    "big", "small", "old", "young", "red", "brown", "happy", "sad", "tall", "wet",
];

fn animal_experiment(dir: &Path, steps: usize, every: &str) {
    let mut text = String::new();
    for adjective in ADJECTIVES {
        for (animal, sound) in ANIMALS {
            text.push_str(&format!("the {adjective} {animal} says {sound}\n"));
        }
    }
    std::fs::write(dir.join("animals.txt"), text).unwrap();
    std::fs::write(
        dir.join("mlm.json"),
        format!(
            r#"{{"name": "animals", "seed": 5,
                "model": {{"kind": "mlm", "d_model": 32, "n_layers": 2, "n_heads": 2,
                           "d_ff": 64, "max_len": 12, "dropout": 0.0}},
                "data": {{"text_file": "animals.txt", "tokenizer": "bpe",
                          "bpe_vocab_size": 400, "max_tokens": 12, "valid_fraction": 0.1}},
                "train": {{"batch_size": 32, "steps": {steps}, "steps_per_epoch": 50,
                           "eval_batches": 1, "lr": 0.003, "warmup_steps": 20,
                           "num_workers": 1{every}}}}}"#
        ),
    )
    .unwrap();
}

#[test]
fn a_masked_language_model_learns_its_sentences_and_fills_in_the_sound_each_animal_makes() {
    let dir = tempfile::tempdir().unwrap();
    animal_experiment(dir.path(), 400, "");
    let out = run(
        dir.path(),
        &["train", "-e", "mlm.json", "--artifact-dir", "mlm"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let tokenizer = Tokenizer::load(&dir.path().join("mlm/tokenizer.json")).unwrap();
    for (_, sound) in ANIMALS {
        assert_eq!(
            tokenizer.encode(&format!(" {sound}")).unwrap().len(),
            1,
            "precondition: {sound:?} is one token of the fitted vocabulary"
        );
    }
    // Training logged masked-token accuracy and perplexity.
    let metrics = std::fs::read_to_string(dir.path().join("mlm/metrics.csv")).unwrap();
    for name in ["accuracy", "perplexity"] {
        assert!(
            metrics
                .lines()
                .any(|l| l.contains(",valid,") && l.contains(name)),
            "no validation {name} in metrics.csv:\n{metrics}"
        );
    }
    let texts: Vec<String> = ANIMALS
        .iter()
        .map(|(animal, _)| format!("the tall {animal} says [MASK]"))
        .collect();
    let mut args = vec!["fill-mask", "--artifact-dir", "mlm", "--top", "3"];
    args.extend(texts.iter().map(String::as_str));
    let out = run(dir.path(), &args);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let answers: Vec<&str> = stdout.lines().filter(|l| l.contains("[MASK] 1:")).collect();
    assert_eq!(answers.len(), ANIMALS.len(), "{stdout}");
    for ((animal, sound), line) in ANIMALS.iter().zip(&answers) {
        let top = line.split(": ").nth(1).unwrap();
        assert!(
            top.starts_with(&format!("\" {sound}\" ")),
            "the {animal} says {sound}, the model says: {line}"
        );
        // Probabilities in descending order, each in (0, 1].
        let ps: Vec<f64> = top
            .split("  ")
            .map(|t| t.rsplit(' ').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(ps.len(), 3, "{line}");
        assert!(
            ps.windows(2).all(|w| w[0] >= w[1]) && ps[0] <= 1.0,
            "{line}"
        );
    }
    // Two masks in one text: two answers, the animal first.
    let out = run(
        dir.path(),
        &[
            "fill-mask",
            "--artifact-dir",
            "mlm",
            "the big [MASK] says [MASK]",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("[MASK] 1:") && stdout.contains("[MASK] 2:"),
        "{stdout}"
    );

    let out = run(dir.path(), &["eval", "--artifact-dir", "mlm"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("masked-token accuracy"), "{stdout}");

    // The other commands read it as the encoder it is.
    for args in [
        vec!["attention", "--artifact-dir", "mlm", "the big cow says moo"],
        vec![
            "embed",
            "--artifact-dir",
            "mlm",
            "--word",
            "cow",
            "the big cow says moo",
            "the sad cow says moo",
        ],
    ] {
        let out = run(dir.path(), &args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    }

    // Bad inputs: one line each.
    assert_clean_error(
        &run(
            dir.path(),
            &["fill-mask", "--artifact-dir", "mlm", "no blank here"],
        ),
        "has no [MASK]",
    );
    classifier_artifact(dir.path());
    assert_clean_error(
        &run(
            dir.path(),
            &["fill-mask", "--artifact-dir", "art", "a [MASK] movie"],
        ),
        "not a masked language model",
    );
}

#[test]
fn a_masked_language_model_killed_mid_run_resumes_to_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    animal_experiment(dir.path(), 600, "");
    let bin = crate::common::BIN;
    let command = |args: &[&str]| {
        let mut c = Command::new(bin);
        c.args(["--backend", "ndarray"])
            .args(args)
            .current_dir(dir.path());
        c
    };
    let out = command(&["train", "-e", "mlm.json", "--artifact-dir", "whole"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let mut child = command(&["train", "-e", "mlm.json", "--artifact-dir", "cut"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let marker = dir.path().join("cut/checkpoint/scheduler-2.mpk");
    let start = Instant::now();
    while !marker.exists() {
        assert!(child.try_wait().unwrap().is_none(), "the run ended first");
        assert!(start.elapsed() < Duration::from_secs(120), "timed out");
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !dir.path().join("cut/model.mpk").exists(),
        "the kill landed after the run finished"
    );
    let out = command(&["train", "--artifact-dir", "cut", "--resume"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let weights = |art: &str| {
        let artifact = ArtifactDir::new(dir.path().join(art));
        values(
            &load_as::<MlmConfig, B>(&artifact, &Default::default())
                .unwrap()
                .model,
        )
    };
    assert!(
        weights("whole") == weights("cut"),
        "the resumed run's weights differ"
    );
    let table =
        |art: &str| std::fs::read_to_string(dir.path().join(art).join("metrics.csv")).unwrap();
    assert_eq!(table("whole"), table("cut"));
}

#[test]
fn a_classifier_starts_from_the_pretrained_encoder_bit_for_bit_and_a_mismatch_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    animal_experiment(dir.path(), 50, "");
    let out = run(
        dir.path(),
        &["train", "-e", "mlm.json", "--artifact-dir", "mlm"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let device = Default::default();
    let mlm_artifact = ArtifactDir::new(dir.path().join("mlm"));
    let pretrained = load_as::<MlmConfig, B>(&mlm_artifact, &device).unwrap();
    let mlm = pretrained.config.model_as::<MlmConfig>().unwrap().clone();
    let classifier = ClassifierConfig {
        vocab_size: mlm.vocab_size,
        stack: StackConfig {
            dropout: 0.3,
            ..mlm.stack.clone()
        },
        n_layers: mlm.n_layers,
        max_len: mlm.max_len,
        position: mlm.position,
        init_from: Some(dir.path().join("mlm")),
        ..ClassifierConfig::default()
    };
    let fresh: TextClassifier<B> = classifier.init(&device);
    let head = fresh.head.weight.val().into_data();
    let started = classifier
        .start_from(fresh, &mlm_artifact, &device)
        .unwrap();
    let (ours, theirs) = (&started, &pretrained.model);
    assert!(values(&ours.token_embedding) == values(&theirs.token_embedding));
    assert!(values(&ours.position) == values(&theirs.position));
    let encoder = values(&ours.encoder);
    assert!(encoder.len() > 8 && encoder == values(&theirs.encoder));
    assert_eq!(
        started.head.weight.val().into_data(),
        head,
        "the head starts fresh"
    );

    // Through the binary: a classifier whose encoder differs is refused with one line.
    let mut config = ExperimentConfig::parse(
        r#"{"name": "c", "model": {"kind": "classifier", "d_model": 48, "n_heads": 2,
            "n_layers": 2, "max_len": 12, "init_from": "mlm"},
            "data": {"dataset": "uci-sentiment", "tokenizer": "bpe", "max_tokens": 12},
            "train": {"steps": 2, "steps_per_epoch": 2, "batch_size": 4, "warmup_steps": 1}}"#,
    )
    .unwrap();
    config.seed = 1;
    config.save(&dir.path().join("c.json")).unwrap();
    let data = std::env::var("TRANSFORMER_LAB_DATA").ok();
    if data.is_none() {
        crate::common::skip(
            "the init_from mismatch line needs uci-sentiment (TRANSFORMER_LAB_DATA)",
        );
        return;
    }
    assert_clean_error(
        &run(
            dir.path(),
            &["train", "-e", "c.json", "--artifact-dir", "c"],
        ),
        "its encoder is not the one this config describes: d_ff 256 here, 64 there; d_model 48 \
         here, 32 there",
    );
}

/// Every float parameter of `module`, exactly, in visiting order.
pub fn values<M: Module<B>>(module: &M) -> Vec<Vec<f32>> {
    struct Values(Vec<Vec<f32>>);
    impl ModuleVisitor<B> for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.val().into_data().to_vec().unwrap());
        }
    }
    let mut out = Values(Vec::new());
    module.visit(&mut out);
    out.0
}
