//! Helpers shared by the test files: a fixed batch and a short training loop on it.

use burn::backend::NdArray;
use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use std::path::Path;
use std::process::{Command, Output};
use transformer_lab::artifact::Tokenizers;
use transformer_lab::artifact::{ArtifactDir, ArtifactRecorder};
use transformer_lab::config::LmConfig;
use transformer_lab::config::{ExperimentConfig, TokenizerKind};
use transformer_lab::data::Tokenizer;
use transformer_lab::kernels::{LabAutodiff, LabBackend};
use transformer_lab::models::{LanguageModel, LmBatch};
use transformer_lab::nn::StackConfig;
use transformer_lab::train::ReferenceOptimizer;

/// Says on stderr that the running test skips (all or part of its checks) for want of what
/// it needs, and records it for the closing lines `cargo test` prints after the suite
/// (tests/summary), where the test would otherwise count as passed without a word.
pub fn skip(why: &str) {
    eprintln!("skipped: {why}");
    let test = std::thread::current()
        .name()
        .unwrap_or("a test")
        .to_string();
    let file = crate::skips::this_run(Path::new(env!("CARGO_TARGET_TMPDIR")));
    if let Err(err) = crate::skips::record(&file, &test, why) {
        eprintln!("cannot record the skip in {}: {err}", file.display());
    }
}

/// A tensor of standard-normal values drawn from its own seeded generator. The backend's
/// `B::seed` is one generator shared by every test thread, so draws from it race with the tests
/// running beside; comparisons that need the same numbers twice use this.
#[allow(dead_code)]
pub fn normal<B: Backend, const D: usize>(
    shape: [usize; D],
    seed: u64,
    device: &B::Device,
) -> Tensor<B, D> {
    use burn::tensor::Distribution;
    use rand::{rngs::StdRng, SeedableRng};
    let data = TensorData::random::<f32, _, _>(
        shape,
        Distribution::Normal(0.0, 1.0),
        &mut StdRng::seed_from_u64(seed),
    );
    Tensor::from_data(data, device)
}

/// The small language model the tests train: vocabulary 13, 2 layers, 4 heads, width 32.
#[allow(dead_code)]
pub fn small_lm() -> LmConfig {
    LmConfig {
        stack: StackConfig {
            d_model: 32,
            n_heads: 4,
            ..LmConfig::default().stack
        },
        vocab_size: 13,
        n_layers: 2,
        context: 16,
        ..LmConfig::default()
    }
}

/// The text [`tiny_text_experiment`] repeats.
#[allow(dead_code)]
pub const TINY_TEXT: &str = "to be or not to be, that is the question. ";

/// The entropy (nats) of the items' frequencies: the loss of the best model that ignores context
/// (a unigram model), which a model that learned to use attention goes well below.
#[allow(dead_code)]
pub fn unigram_entropy<T: std::hash::Hash + Eq>(items: impl IntoIterator<Item = T>) -> f64 {
    let mut counts = std::collections::HashMap::new();
    let mut n = 0usize;
    for item in items {
        *counts.entry(item).or_insert(0usize) += 1;
        n += 1;
    }
    counts
        .values()
        .map(|&c| {
            let p = c as f64 / n as f64;
            -p * p.ln()
        })
        .sum()
}

/// The validation losses in a plain training log.
#[allow(dead_code)]
pub fn valid_losses(log: &str) -> Vec<f64> {
    log.lines()
        .filter(|l| l.contains(" valid "))
        .filter_map(|l| {
            l.split("loss ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// Four sequences of 16 tokens over a vocabulary of 13, targets shifted by one.
pub fn batch<B: LabBackend>(device: &B::Device) -> LmBatch<B> {
    let ids: Vec<i64> = (0..4 * 17).map(|i| (i * 7 + i / 5) % 13).collect();
    let rows = |offset: usize| -> Vec<i64> {
        (0..4)
            .flat_map(|r| ids[r * 17 + offset..r * 17 + offset + 16].to_vec())
            .collect()
    };
    LmBatch {
        inputs: Tensor::from_data(TensorData::new(rows(0), [4, 16]), device),
        targets: Tensor::from_data(TensorData::new(rows(1), [4, 16]), device),
    }
}

/// Trains on [`batch`] for `steps` AdamW steps (lr 3e-3, global clip 1) and returns the first
/// and the last loss.
#[allow(dead_code)]
pub fn overfit<B: LabAutodiff>(config: &LmConfig, steps: usize, device: &B::Device) -> (f32, f32) {
    let losses = losses::<B>(config, steps, device);
    (losses[0], *losses.last().unwrap())
}

/// The loss at each of `steps` AdamW steps on the fixed [`batch`], from a model whose weights
/// are a function of the config alone ([`explicit_weights`]).
pub fn losses<B: LabAutodiff>(config: &LmConfig, steps: usize, device: &B::Device) -> Vec<f32> {
    train_losses(explicit_weights(config.init::<B>(device), 7), steps, device)
}

/// `model` with each randomly initialised parameter replaced by values from a generator of its
/// own: uniform in `±1/√n`, `n` the parameter's first dimension (fan-in of a linear layer's
/// weight, rows of an embedding, length of a bias). Parameters that start constant (norms'
/// gains and shifts) are kept. Unlike `B::seed` + `init`, whose generator is one for the whole
/// process and reseeded by the tests running beside, the weights depend on `seed` alone.
pub fn explicit_weights<B: Backend, M: Module<B>>(model: M, seed: u64) -> M {
    use burn::module::{ModuleMapper, Param};
    use rand::{rngs::StdRng, RngExt, SeedableRng};
    struct Fill(StdRng);
    impl<B: Backend> ModuleMapper<B> for Fill {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let values: Vec<f32> = tensor.to_data().convert::<f32>().to_vec().unwrap();
            if values.iter().all(|&v| v == values[0]) {
                return Param::from_mapped_value(id, tensor, mapper);
            }
            let dims = tensor.dims();
            let bound = 1.0 / (dims[0] as f32).sqrt();
            let fresh: Vec<f32> = (0..values.len())
                .map(|_| self.0.random_range(-bound..bound))
                .collect();
            let require_grad = tensor.is_require_grad();
            let mut fresh = Tensor::from_data(TensorData::new(fresh, dims), &tensor.device());
            if require_grad {
                fresh = fresh.require_grad();
            }
            Param::from_mapped_value(id, fresh, mapper)
        }
    }
    model.map(&mut Fill(StdRng::seed_from_u64(seed)))
}

/// The loss at each of `steps` AdamW steps of `model` on the fixed [`batch`].
pub fn train_losses<B: LabAutodiff>(
    mut model: LanguageModel<B>,
    steps: usize,
    device: &B::Device,
) -> Vec<f32> {
    let mut optim =
        ReferenceOptimizer::new(AdamWConfig::new().with_weight_decay(0.0).init(), 0.0, 1.0);
    let mut losses = Vec::new();
    for _ in 0..steps {
        let (loss, _, _) = model.loss(batch(device));
        losses.push(loss.clone().into_scalar().elem::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
    }
    losses
}

// ---- Running the binary on artifacts written here ----

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_transformer-lab");

#[allow(dead_code)]
pub fn run(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(["--backend", "ndarray"])
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

#[allow(dead_code)]
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// Fails unless the command failed with one `error:` line and no panic.
#[allow(dead_code)]
pub fn assert_clean_error(out: &Output, needle: &str) {
    let err = stderr(out);
    assert!(!out.status.success(), "expected failure; stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "one error line expected: {err}");
    assert!(lines[0].contains(needle), "{needle:?} not in {err}");
}

/// An untrained (but complete) artifact of `model` with `config` in `dir/art`.
#[allow(dead_code)]
pub fn write_artifact<M: Module<NdArray<f32>>>(
    dir: &Path,
    config: &str,
    model: impl FnOnce(&ExperimentConfig) -> M,
    tokenizer: Option<Tokenizer>,
) {
    write_artifact_at(dir, "art", config, model, tokenizer)
}

/// An untrained (but complete) artifact of `model` with `config` in `dir/name`.
#[allow(dead_code)]
pub fn write_artifact_at<M: Module<NdArray<f32>>>(
    dir: &Path,
    name: &str,
    config: &str,
    model: impl FnOnce(&ExperimentConfig) -> M,
    tokenizer: Option<Tokenizer>,
) {
    let artifact = ArtifactDir::new(dir.join(name));
    std::fs::create_dir_all(artifact.root()).unwrap();
    let mut config = ExperimentConfig::parse(config).unwrap();
    if let Some(tokenizer) = &tokenizer {
        let v = tokenizer.vocab_size();
        config.model.set_vocab_sizes(v, v);
        Tokenizers::shared(tokenizer.clone())
            .save(&artifact)
            .unwrap();
    }
    config.validate().unwrap();
    config.save(&artifact.config()).unwrap();
    model(&config)
        .save_file(artifact.model(), &ArtifactRecorder::default())
        .unwrap();
}

#[allow(dead_code)]
pub fn classifier_artifact(dir: &Path) {
    let texts = [
        "a good movie",
        "a bad movie",
        "the bank of the river",
        "money at the bank",
    ];
    let tokenizer = Tokenizer::fit(TokenizerKind::Bpe, texts.iter().cycle().take(40), 300).unwrap();
    write_artifact(
        dir,
        r#"{"name": "clf", "model": {"kind": "classifier", "d_model": 16, "n_layers": 1,
            "n_heads": 2, "d_ff": 32, "max_len": 16},
            "data": {"dataset": "uci-sentiment", "tokenizer": "bpe", "bpe_vocab_size": 300,
                     "max_tokens": 16}}"#,
        |c| {
            c.model_as::<transformer_lab::config::ClassifierConfig>()
                .unwrap()
                .init::<NdArray<f32>>(&Default::default())
        },
        Some(tokenizer),
    );
}

#[allow(dead_code)]
pub fn vit_artifact(dir: &Path) {
    vit_artifact_seeded(dir, None)
}

/// [`vit_artifact`], every parameter drawn from `seed` (see [`explicit_weights`]) when given:
/// an untrained ViT's head starts at zero, every class equally likely.
#[allow(dead_code)]
pub fn vit_artifact_seeded(dir: &Path, seed: Option<u64>) {
    write_artifact(
        dir,
        r#"{"name": "vit", "model": {"kind": "vit", "patch_size": 7, "d_model": 16,
            "n_layers": 1, "n_heads": 2, "d_ff": 32}, "data": {"dataset": "mnist"}}"#,
        |c| {
            let model = c
                .model_as::<transformer_lab::config::VitConfig>()
                .unwrap()
                .init::<NdArray<f32>>(&Default::default());
            let Some(seed) = seed else { return model };
            let mut model = explicit_weights(model, seed);
            // The head starts at zero, which `explicit_weights` keeps: a fresh one.
            let [d, classes] = model.head.weight.dims();
            let head = burn::nn::LinearConfig::new(d, classes).init(&Default::default());
            model.head = explicit_weights(head, seed + 1);
            model
        },
        None,
    );
}

/// An untrained char-level language model artifact (2 layers, 4 heads, context 64) in
/// `dir/lm`, its vocabulary fitted on `text`.
#[allow(dead_code)]
pub fn lm_artifact(dir: &Path, text: &str) {
    let tokenizer = Tokenizer::fit(TokenizerKind::Char, std::iter::once(text), 0).unwrap();
    write_artifact_at(
        dir,
        "lm",
        r#"{"name": "lm", "model": {"kind": "lm", "d_model": 32, "n_layers": 2, "n_heads": 4,
            "context": 64}, "data": {"dataset": "tinyshakespeare", "tokenizer": "char"}}"#,
        |c| {
            c.model_as::<transformer_lab::config::LmConfig>()
                .unwrap()
                .init::<NdArray<f32>>(&Default::default())
        },
        Some(tokenizer),
    );
}

/// An untrained clip artifact (8 × 8 images in 4 × 4 patches, 1-layer encoders, BPE captions)
/// in `dir/clip`.
#[allow(dead_code)]
pub fn clip_artifact(dir: &Path) {
    let captions = [
        "a bar at the top",
        "a bar on the left",
        "a dot in the middle",
    ];
    let tokenizer =
        Tokenizer::fit(TokenizerKind::Bpe, captions.iter().cycle().take(30), 300).unwrap();
    write_artifact_at(
        dir,
        "clip",
        r#"{"name": "clip", "model": {"kind": "clip", "embed_dim": 8,
            "image": {"image_size": 8, "patch_size": 4, "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32},
            "text": {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32, "max_len": 12}},
            "data": {"captions_file": "captions.tsv", "tokenizer": "bpe", "bpe_vocab_size": 300,
                     "max_tokens": 12}}"#,
        |c| {
            c.model_as::<transformer_lab::config::ClipConfig>()
                .unwrap()
                .init::<NdArray<f32>>(&Default::default())
        },
        Some(tokenizer),
    );
}

/// A grey PNG of `side × side` at `path`: a bright diagonal stroke on a dark background, or
/// (`light`) a dark one on white.
#[allow(dead_code)]
pub fn stroke_png(path: &Path, side: u32, light: bool) {
    let image = image::GrayImage::from_fn(side, side, |x, y| {
        let on = x.abs_diff(y) <= side / 8 || x == side / 2;
        let value = if on { 220 } else { (x * 7 + y * 3) as u8 % 30 };
        image::Luma([if light { 255 - value } else { value }])
    });
    image.save(path).unwrap();
}

/// An untrained translator artifact (1+1 layers, 2 heads, shared BPE) in `dir/s2s`.
#[allow(dead_code)]
pub fn translator_artifact(dir: &Path) {
    let texts = [
        "the cat sat on the mat",
        "le chat est sur le tapis",
        "a dog",
        "un chien",
    ];
    let tokenizer = Tokenizer::fit(TokenizerKind::Bpe, texts.iter().cycle().take(40), 300).unwrap();
    write_artifact_at(
        dir,
        "s2s",
        r#"{"name": "s2s", "model": {"kind": "seq2seq", "d_model": 16, "n_heads": 2,
            "encoder_layers": 1, "decoder_layers": 1, "d_ff": 32, "max_len": 24},
            "data": {"dataset": "copy", "tokenizer": "bpe", "bpe_vocab_size": 300, "max_tokens": 24}}"#,
        |c| {
            c.model_as::<transformer_lab::config::Seq2SeqConfig>()
                .unwrap()
                .init::<NdArray<f32>>(&Default::default())
        },
        Some(tokenizer),
    );
}

/// Writes `dir/corpus.txt` (a repeated line) and `dir/tiny.json`: a one-layer, width-16 char LM
/// experiment on it with the given `"train"` section (a JSON object).
#[allow(dead_code)]
pub fn tiny_text_experiment(dir: &Path, train: &str) {
    std::fs::write(dir.join("corpus.txt"), TINY_TEXT.repeat(40)).unwrap();
    std::fs::write(
        dir.join("tiny.json"),
        format!(
            r#"{{"name": "tiny", "model": {{"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 16}},
                "data": {{"text_file": "corpus.txt"}}, "train": {train}}}"#
        ),
    )
    .unwrap();
}

/// The largest difference between [`small_lm`]'s logits on [`batch`] computed on ndarray and
/// the same weights (saved and reloaded) on backend `B`.
#[allow(dead_code)]
pub fn logit_difference_from_ndarray<B: LabBackend>(device: &B::Device) -> f32 {
    let model = small_lm().init::<NdArray<f32>>(&Default::default());
    let expected = model
        .forward(batch::<NdArray<f32>>(&Default::default()).inputs)
        .logits;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model");
    model
        .save_file(path.clone(), &ArtifactRecorder::default())
        .unwrap();
    let other =
        transformer_lab::artifact::load_weights(small_lm().init::<B>(device), &path, device)
            .unwrap();
    let actual = other.forward(batch::<B>(device).inputs).logits;
    let a: Vec<f32> = expected.into_data().to_vec().unwrap();
    let b: Vec<f32> = actual.into_data().convert::<f32>().to_vec().unwrap();
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The largest difference, over every attention mixer × position kind × norm placement,
/// between a language model's logits decoded from its cache (a 4-token prefill, then one token
/// at a time up to the context) and the rows of one uncached pass over the whole sequence;
/// with the configuration where it occurs.
#[allow(dead_code)]
pub fn cached_logit_difference<B: LabBackend>(device: &B::Device) -> (f32, String) {
    let (b, t, vocab) = (2, 24, 11);
    let ids: Vec<i64> = (0..b * t)
        .map(|i| ((i * 7 + i / 5) % vocab) as i64)
        .collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, t]), device);
    let mut worst = (0.0f32, String::new());
    each_decoder_lm::<B>(vocab, t, device, |name, model| {
        assert!(model.caches(), "{name} decodes from a cache");
        let whole = model.forward(tokens.clone()).logits; // [b, t, v]
        let mut cache = model.new_cache();
        let mut rows = vec![model.forward_cached(tokens.clone().slice([0..b, 0..4]), &mut cache)];
        for i in 4..t {
            rows.push(model.forward_cached(tokens.clone().slice([0..b, i..i + 1]), &mut cache));
        }
        assert_eq!(cache.len(), t);
        let cached = Tensor::cat(rows, 1);
        let diff: f32 = (cached - whole).abs().max().into_scalar().elem();
        if diff.is_nan() || diff >= worst.0 {
            worst = (diff, name);
        }
    });
    worst
}

/// Calls `f` with a name and a small decoder-only LM (two layers, width 16, `vocab`,
/// `context`) for every mixer with an incremental form (full, local 3, strided 3, linear),
/// every position encoding it allows, pre- and post-norm.
#[allow(dead_code)]
pub fn each_decoder_lm<B: LabBackend>(
    vocab: usize,
    context: usize,
    device: &B::Device,
    mut f: impl FnMut(String, LanguageModel<B>),
) {
    use transformer_lab::nn::{Mixer, PositionKind};
    for mixer in [
        Mixer::Full,
        Mixer::Local { window: 3 },
        Mixer::Strided { stride: 3 },
        Mixer::Linear { chunk: 4 },
    ] {
        for position in [
            PositionKind::Learned,
            PositionKind::Sinusoidal,
            PositionKind::Rope,
            PositionKind::Alibi,
        ] {
            for norm_first in [true, false] {
                let name = format!("{} {position:?} norm_first={norm_first}", mixer.name());
                let config = LmConfig {
                    stack: StackConfig {
                        d_model: 16,
                        n_heads: 2,
                        norm_first,
                        mixer: mixer.clone(),
                        ..LmConfig::default().stack
                    },
                    vocab_size: vocab,
                    n_layers: 2,
                    context,
                    position,
                    ..LmConfig::default()
                };
                if config.validate().is_err() {
                    continue; // alibi needs the full mixer
                }
                f(name, config.init::<B>(device));
            }
        }
    }
}

/// A two-layer language model of width 16 and vocabulary 11 with `mixer` and `context`.
#[allow(dead_code)]
pub fn mixer_lm(mixer: transformer_lab::nn::Mixer, context: usize) -> LanguageModel<NdArray<f32>> {
    LmConfig {
        stack: StackConfig {
            d_model: 16,
            n_heads: 2,
            mixer,
            ..LmConfig::default().stack
        },
        vocab_size: 11,
        n_layers: 2,
        context,
        ..LmConfig::default()
    }
    .init(&Default::default())
}

/// Every float parameter of the language model in `dir/model.mpk`, exactly.
#[allow(dead_code)]
pub fn lm_weights(dir: &Path) -> Vec<Vec<f32>> {
    lm_weights_of(dir, &dir.join("model"))
}

/// Every float parameter of the language model whose config is in `dir`, read from `file`.
#[allow(dead_code)]
pub fn lm_weights_of(dir: &Path, file: &Path) -> Vec<Vec<f32>> {
    struct Values(Vec<Vec<f32>>);
    impl burn::module::ModuleVisitor<NdArray> for Values {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<NdArray, D>>) {
            self.0.push(param.val().into_data().to_vec().unwrap());
        }
    }
    let config = ExperimentConfig::load(&dir.join("config.json")).unwrap();
    let device = Default::default();
    let model = config
        .model_as::<LmConfig>()
        .unwrap()
        .init::<NdArray>(&device);
    let model = transformer_lab::artifact::load_weights(model, file, &device).unwrap();
    let mut values = Values(Vec::new());
    model.visit(&mut values);
    values.0
}
