//! Experiment configuration: one JSON file says what model to build, on what data, trained how.
//!
//! Every field has a default, unknown fields are rejected (a typo is an error, not a silently
//! ignored setting), and [`ExperimentConfig::validate`] checks the relations between fields
//! before anything is built.

pub use crate::models::classifier::ClassifierConfig;
pub use crate::models::seq2seq::Seq2SeqConfig;
pub use crate::models::vit::VitConfig;
use crate::nn::{Activation, Mixer, PositionKind, TransformerBlockConfig, TransformerStackConfig};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The default experiment (`experiments/shakespeare-char.json`), compiled in.
pub const DEFAULT_EXPERIMENT: &str = include_str!("../experiments/shakespeare-char.json");

/// A whole experiment: model, data, training and seed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentConfig {
    /// Short name, used for the default artifact directory.
    #[serde(default = "default_name")]
    pub name: String,
    /// Seed for parameter initialisation, batch sampling and dropout.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// The model: `{"kind": "lm" | "seq2seq" | "classifier" | "vit", …}`.
    #[serde(default)]
    pub model: ModelConfig,
    /// The data.
    #[serde(default)]
    pub data: DataConfig,
    /// The optimisation.
    #[serde(default)]
    pub train: TrainConfig,
}

fn default_name() -> String {
    "experiment".into()
}
fn default_seed() -> u64 {
    1337
}

/// Which model an experiment builds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ModelConfig {
    /// Decoder-only language model.
    Lm(LmConfig),
    /// Encoder–decoder translator.
    Seq2seq(Seq2SeqConfig),
    /// Encoder text classifier.
    Classifier(ClassifierConfig),
    /// Vision Transformer image classifier.
    Vit(VitConfig),
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig::Lm(LmConfig::default())
    }
}

impl ModelConfig {
    /// `lm`, `seq2seq`, `classifier` or `vit`, as written in configs.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelConfig::Lm(_) => "lm",
            ModelConfig::Seq2seq(_) => "seq2seq",
            ModelConfig::Classifier(_) => "classifier",
            ModelConfig::Vit(_) => "vit",
        }
    }

    /// The command that uses a trained model of this kind.
    pub fn command(&self) -> &'static str {
        match self {
            ModelConfig::Lm(_) => "generate",
            ModelConfig::Seq2seq(_) => "translate",
            ModelConfig::Classifier(_) => "classify",
            ModelConfig::Vit(_) => "predict",
        }
    }

    /// Whether the model reads text (and so has tokenizers in its artifact).
    pub fn reads_text(&self) -> bool {
        !matches!(self, ModelConfig::Vit(_))
    }

    /// Fills in the vocabulary sizes the tokenizers resolved.
    pub fn set_vocab_sizes(&mut self, source: usize, target: usize) {
        match self {
            ModelConfig::Lm(lm) => lm.vocab_size = target,
            ModelConfig::Seq2seq(s2s) => {
                s2s.src_vocab_size = source;
                s2s.tgt_vocab_size = target;
            }
            ModelConfig::Classifier(c) => c.vocab_size = target,
            ModelConfig::Vit(_) => {}
        }
    }

    /// The vocabulary sizes `(source, target)` (both the same for single-tokenizer models;
    /// zeros for a ViT).
    pub fn vocab_sizes(&self) -> (usize, usize) {
        match self {
            ModelConfig::Lm(lm) => (lm.vocab_size, lm.vocab_size),
            ModelConfig::Seq2seq(s2s) => (s2s.src_vocab_size, s2s.tgt_vocab_size),
            ModelConfig::Classifier(c) => (c.vocab_size, c.vocab_size),
            ModelConfig::Vit(_) => (0, 0),
        }
    }

    fn validate(&self) -> Result<()> {
        match self {
            ModelConfig::Lm(lm) => lm.validate(),
            ModelConfig::Seq2seq(s2s) => s2s.validate(),
            ModelConfig::Classifier(c) => c.validate(),
            ModelConfig::Vit(vit) => vit.validate(),
        }
    }
}

/// A decoder-only (GPT-style) language model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LmConfig {
    /// Vocabulary size; `0` means "take it from the tokenizer" (the saved config has it filled).
    pub vocab_size: usize,
    /// Model width `d_model`.
    pub d_model: usize,
    /// Number of decoder blocks.
    pub n_layers: usize,
    /// Attention heads per block; must divide `d_model`.
    pub n_heads: usize,
    /// Feed-forward inner width; `0` means `4 · d_model`.
    pub d_ff: usize,
    /// Context length (block size): the longest sequence the model sees.
    pub context: usize,
    /// Dropout probability (attention weights, FFN, residual branches, embeddings).
    pub dropout: f64,
    /// Positional encoding: `learned` or `sinusoidal`.
    pub position: PositionKind,
    /// Feed-forward non-linearity: `gelu` or `relu`.
    pub activation: Activation,
    /// Pre-norm (`true`, GPT-2) or post-norm (`false`, the original paper).
    pub norm_first: bool,
    /// Whether linear layers and LayerNorms carry a bias.
    pub bias: bool,
    /// Share the token embedding with the output projection (Press & Wolf 2017).
    pub tie_weights: bool,
    /// Token mixer of the self-attention layers: `{"kind": "full"}` (default), `local`,
    /// `strided`, `linear` or `hyena` (see `nn::mixer`).
    pub mixer: Mixer,
}

impl Default for LmConfig {
    fn default() -> Self {
        Self {
            vocab_size: 0,
            d_model: 128,
            n_layers: 4,
            n_heads: 4,
            d_ff: 0,
            context: 64,
            dropout: 0.0,
            position: PositionKind::Learned,
            activation: Activation::Gelu,
            norm_first: true,
            bias: false,
            tie_weights: true,
            mixer: Mixer::Full,
        }
    }
}

impl LmConfig {
    /// The feed-forward width, with `0` resolved to `4 · d_model`.
    pub fn d_ff(&self) -> usize {
        if self.d_ff == 0 {
            4 * self.d_model
        } else {
            self.d_ff
        }
    }

    /// The decoder stack this model is built on.
    pub fn stack(&self) -> TransformerStackConfig {
        let block = TransformerBlockConfig::new(self.d_model, self.n_heads, self.d_ff())
            .with_dropout(self.dropout)
            .with_activation(self.activation)
            .with_norm_first(self.norm_first)
            .with_bias(self.bias)
            .with_residual_init_std(0.02 / ((2 * self.n_layers) as f64).sqrt())
            .with_mixer(self.mixer.clone())
            .with_max_len(self.context);
        TransformerStackConfig::decoder(self.n_layers, block, false)
    }

    /// Checks the relations between fields.
    pub fn validate(&self) -> Result<()> {
        if self.n_layers == 0 || self.context == 0 {
            bail!("model: n_layers and context must be at least 1");
        }
        if self.position == PositionKind::Sincos2d {
            bail!("model: sincos2d positions are for image patches (vit), not text");
        }
        self.mixer.validate("language model", true)?;
        validate_width(self.d_model, self.n_heads, self.dropout)
    }
}

/// Checks `d_model`, `n_heads` and `dropout`, which every model shares.
pub(crate) fn validate_width(d_model: usize, n_heads: usize, dropout: f64) -> Result<()> {
    if d_model == 0 || n_heads == 0 {
        bail!("model: d_model and n_heads must be at least 1");
    }
    if !d_model.is_multiple_of(n_heads) {
        bail!("model: d_model ({d_model}) must be divisible by n_heads ({n_heads})");
    }
    if !(0.0..1.0).contains(&dropout) {
        bail!("model: dropout must be in [0, 1), got {dropout}");
    }
    Ok(())
}

/// Which data to train on, how to split it and how to tokenize it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Dataset name: one declared in `datasets/` (`tinyshakespeare`, `tatoeba-fra-eng`,
    /// `multi30k`, `mnist`, `fashion-mnist`, `sst2`, `uci-sentiment`) or the synthetic `copy`
    /// task.
    pub dataset: String,
    /// A UTF-8 text file to train a language model on instead of a declared dataset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text_file: Option<std::path::PathBuf>,
    /// Tokenizer: `char` (one token per character of the training text) or `bpe` (byte-level
    /// BPE trained on the training split; translation needs it).
    pub tokenizer: TokenizerKind,
    /// BPE vocabulary size, special tokens and the 256 byte symbols included.
    pub bpe_vocab_size: usize,
    /// Translation: one tokenizer (and vocabulary) for both languages, trained on both sides.
    pub shared_vocab: bool,
    /// Fraction held out for validation: the end of the text for a language model, a seeded
    /// share of source sentences for a translation set without an official split.
    pub valid_fraction: f64,
    /// Translation sets without an official split: the share of source sentences held out
    /// for the test split.
    pub test_fraction: f64,
    /// Translation: source language code (`en`/`fr` for Tatoeba, `de`/`en` for Multi30k).
    pub source: String,
    /// Translation: target language code.
    pub target: String,
    /// Translation: training pairs with more tokens than this on either side (start/end
    /// tokens included) are skipped; longer inputs to `translate` are cut to it.
    /// Classification: texts are cut to this many tokens (`<s>` included).
    pub max_tokens: usize,
    /// The synthetic copy task.
    pub copy: CopyTaskConfig,
    /// Images: shift each training image by up to this many pixels each way (0 = off).
    pub augment_shift: usize,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            dataset: "tinyshakespeare".into(),
            text_file: None,
            tokenizer: TokenizerKind::Char,
            bpe_vocab_size: 8000,
            shared_vocab: true,
            valid_fraction: 0.1,
            test_fraction: 0.05,
            source: "en".into(),
            target: "fr".into(),
            max_tokens: 64,
            copy: CopyTaskConfig::default(),
            augment_shift: 0,
        }
    }
}

/// The copy task: random sequences of `symbols` distinct words; the target is the source.
/// A sanity check for an encoder–decoder: it is solvable exactly, through cross-attention only.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CopyTaskConfig {
    /// Distinct symbols (words `a`, `b`, … or `s0`, `s1`, … beyond 26).
    pub symbols: usize,
    /// Shortest sequence.
    pub min_len: usize,
    /// Longest sequence.
    pub max_len: usize,
    /// Training pairs generated (validation and test get a tenth each).
    pub train_pairs: usize,
}

impl Default for CopyTaskConfig {
    fn default() -> Self {
        Self {
            symbols: 10,
            min_len: 3,
            max_len: 10,
            train_pairs: 20_000,
        }
    }
}

/// How text becomes tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    /// One token per distinct character of the training text.
    Char,
    /// Byte-level BPE (`tokenizers` crate) with `<pad> <s> </s> <unk>` at ids 0–3.
    Bpe,
}

/// The learning rate after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// Cosine decay from `lr` to `min_lr` (nanoGPT, GPT-3).
    Cosine,
    /// Inverse square root ("Noam", Vaswani et al. 2017): `lr · min(step/warmup, √(warmup/step))`.
    Noam,
}

/// Optimisation: AdamW (weight decay on matrices only), linear warmup then cosine decay,
/// global-norm gradient clipping — nanoGPT's recipe.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Sequences per batch.
    pub batch_size: usize,
    /// Total optimizer steps.
    pub steps: usize,
    /// Steps between validations and checkpoints (one Learner "epoch"); must divide `steps`.
    pub steps_per_epoch: usize,
    /// Validation batches per evaluation, sampled at random from the validation split.
    pub eval_batches: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Linear warmup steps.
    pub warmup_steps: usize,
    /// Step at which the cosine decay reaches `min_lr` (`0` = `steps`).
    pub decay_steps: usize,
    /// AdamW β₁.
    pub beta1: f32,
    /// AdamW β₂.
    pub beta2: f32,
    /// AdamW ε.
    pub epsilon: f32,
    /// AdamW decoupled weight decay, applied to matrices (not to LayerNorm gains or biases).
    pub weight_decay: f32,
    /// Clip the global gradient norm to this value (`0` = no clipping).
    pub grad_clip: f32,
    /// Learning-rate schedule after warmup: `cosine` (to `min_lr` at `decay_steps`) or `noam`
    /// (`lr · √(warmup/step)`, the paper's inverse square root, peaking at `lr`).
    pub schedule: ScheduleKind,
    /// Label smoothing ε of the cross-entropy (the paper uses 0.1).
    pub label_smoothing: f32,
    /// Data-loading threads (batches are prepared ahead of the training step; the batches
    /// are the same whatever the number).
    pub num_workers: usize,
    /// Checkpoints kept: the last `keep_checkpoints` epochs, plus the best by validation loss.
    pub keep_checkpoints: usize,
    /// Stop when the validation loss has not improved for a number of epochs (none: train all
    /// `steps`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopping>,
}

/// Early stopping on the validation loss.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopping {
    /// Epochs (validations) without a lower validation loss after which training stops.
    pub patience: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            batch_size: 12,
            steps: 2000,
            steps_per_epoch: 250,
            eval_batches: 20,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 100,
            decay_steps: 0,
            beta1: 0.9,
            beta2: 0.99,
            epsilon: 1e-8,
            weight_decay: 0.1,
            grad_clip: 1.0,
            schedule: ScheduleKind::Cosine,
            label_smoothing: 0.0,
            num_workers: 1,
            keep_checkpoints: 2,
            early_stopping: None,
        }
    }
}

impl TrainConfig {
    /// Number of Learner epochs (`steps / steps_per_epoch`).
    pub fn epochs(&self) -> usize {
        self.steps / self.steps_per_epoch
    }

    /// Step at which the cosine decay ends.
    pub fn decay_steps(&self) -> usize {
        if self.decay_steps == 0 {
            self.steps
        } else {
            self.decay_steps
        }
    }

    /// Checks the relations between fields.
    pub fn validate(&self) -> Result<()> {
        if self.batch_size == 0 || self.steps == 0 || self.steps_per_epoch == 0 {
            bail!("train: batch_size, steps and steps_per_epoch must all be at least 1");
        }
        if !self.steps.is_multiple_of(self.steps_per_epoch) {
            bail!(
                "train: steps ({}) must be a multiple of steps_per_epoch ({})",
                self.steps,
                self.steps_per_epoch
            );
        }
        if self.eval_batches == 0 {
            bail!("train: eval_batches must be at least 1");
        }
        if !(self.lr > 0.0 && self.lr <= 1.0 && (0.0..=self.lr).contains(&self.min_lr)) {
            bail!(
                "train: need 0 < lr <= 1 and 0 <= min_lr <= lr (lr {}, min_lr {})",
                self.lr,
                self.min_lr
            );
        }
        if self.warmup_steps >= self.decay_steps() {
            bail!(
                "train: warmup_steps ({}) must be below the decay end ({})",
                self.warmup_steps,
                self.decay_steps()
            );
        }
        for (name, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                bail!("train: {name} must be in [0, 1), got {beta}");
            }
        }
        if self.grad_clip < 0.0 || self.weight_decay < 0.0 {
            bail!("train: grad_clip and weight_decay must not be negative");
        }
        if !(0.0..1.0).contains(&self.label_smoothing) {
            bail!("train: label_smoothing must be in [0, 1)");
        }
        if self.keep_checkpoints == 0 {
            bail!("train: keep_checkpoints must be at least 1 (resuming needs a checkpoint)");
        }
        if self
            .early_stopping
            .as_ref()
            .is_some_and(|e| e.patience == 0)
        {
            bail!("train: early_stopping.patience must be at least 1");
        }
        Ok(())
    }
}

impl ExperimentConfig {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        let config =
            Self::parse(&text).with_context(|| format!("malformed config {}", path.display()))?;
        config
            .validate()
            .with_context(|| format!("invalid config {}", path.display()))?;
        Ok(config)
    }

    /// Parses JSON (not yet validated). A `model` without `kind` is a language model.
    pub fn parse(text: &str) -> Result<Self> {
        let mut value: serde_json::Value = serde_json::from_str(text)?;
        // Every field has a default, so `{}` (or `[]`, which serde reads as a struct too) would
        // silently be the default experiment.
        match value.as_object() {
            Some(object) if !object.is_empty() => {}
            _ => bail!(
                "an experiment is a JSON object with its name, model, data and train sections \
                 (see experiments/), not {}",
                if value.is_object() {
                    "an empty object"
                } else {
                    "a JSON array or value"
                }
            ),
        }
        if let Some(model) = value.get_mut("model").and_then(|m| m.as_object_mut()) {
            model.entry("kind").or_insert_with(|| "lm".into());
        }
        Ok(serde_json::from_value(value)?)
    }

    /// Checks every part, and that the data suits the model.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        self.train.validate()?;
        let data = &self.data;
        for (name, fraction) in [("valid", data.valid_fraction), ("test", data.test_fraction)] {
            if !(0.0..0.5).contains(&fraction) || fraction == 0.0 {
                bail!("data: {name}_fraction must be in (0, 0.5)");
            }
        }
        let translation = crate::data::translation::is_translation(&data.dataset);
        match &self.model {
            ModelConfig::Lm(_) if translation && data.text_file.is_none() => bail!(
                "data: {} is a translation dataset; it needs a seq2seq model",
                data.dataset
            ),
            ModelConfig::Seq2seq(s2s) => {
                if !translation {
                    bail!(
                        "data: a seq2seq model needs a translation dataset (tatoeba-fra-eng, multi30k or copy), not {}",
                        data.dataset
                    );
                }
                if data.tokenizer != TokenizerKind::Bpe {
                    bail!("data: a seq2seq model needs the bpe tokenizer (it uses <pad> <s> </s>)");
                }
                if s2s.share_embeddings && !data.shared_vocab {
                    bail!("model: share_embeddings needs data.shared_vocab");
                }
                if data.max_tokens < 3 || data.max_tokens > s2s.max_len {
                    bail!(
                        "data: max_tokens ({}) must be in 3..={} (the model's max_len)",
                        data.max_tokens,
                        s2s.max_len
                    );
                }
                crate::data::translation::check_languages(data)?;
            }
            ModelConfig::Classifier(c) => {
                if !crate::data::sentiment::is_sentiment(&data.dataset) {
                    bail!(
                        "data: a classifier needs a sentence-classification dataset (sst2 or uci-sentiment), not {}",
                        data.dataset
                    );
                }
                if data.tokenizer != TokenizerKind::Bpe {
                    bail!("data: a classifier needs the bpe tokenizer (it uses <pad> and <s>)");
                }
                if data.max_tokens < 2 || data.max_tokens > c.max_len {
                    bail!(
                        "data: max_tokens ({}) must be in 2..={} (the model's max_len)",
                        data.max_tokens,
                        c.max_len
                    );
                }
            }
            ModelConfig::Vit(vit) => {
                if !matches!(data.dataset.as_str(), "mnist" | "fashion-mnist") {
                    bail!(
                        "data: a vit needs an image dataset (mnist or fashion-mnist), not {}",
                        data.dataset
                    );
                }
                if vit.image_size != 28 || vit.channels != 1 || vit.n_classes != 10 {
                    bail!("model: {} images are 28×28 grey with 10 classes: set image_size 28, channels 1, n_classes 10", data.dataset);
                }
            }
            ModelConfig::Lm(_)
                if data.text_file.is_none()
                    && (crate::data::sentiment::is_sentiment(&data.dataset)
                        || matches!(data.dataset.as_str(), "mnist" | "fashion-mnist")) =>
            {
                bail!(
                    "data: {} is a classification dataset; a language model needs text",
                    data.dataset
                )
            }
            ModelConfig::Lm(_) => {}
        }
        if data.tokenizer == TokenizerKind::Bpe && data.bpe_vocab_size < 300 {
            bail!(
                "data: bpe_vocab_size must be at least 300 (4 special + 256 byte tokens + merges)"
            );
        }
        Ok(())
    }

    /// The language model config, or an error naming what this experiment is instead.
    pub fn lm(&self) -> Result<&LmConfig> {
        match &self.model {
            ModelConfig::Lm(lm) => Ok(lm),
            other => bail!(
                "experiment {} is a {} model, not a language model",
                self.name,
                other.kind()
            ),
        }
    }

    /// The translation model config, or an error naming what this experiment is instead.
    pub fn seq2seq(&self) -> Result<&Seq2SeqConfig> {
        match &self.model {
            ModelConfig::Seq2seq(s2s) => Ok(s2s),
            other => bail!(
                "experiment {} is a {} model, not a translation (seq2seq) model",
                self.name,
                other.kind()
            ),
        }
    }

    /// The text classifier config, or an error naming what this experiment is instead.
    pub fn classifier(&self) -> Result<&ClassifierConfig> {
        match &self.model {
            ModelConfig::Classifier(c) => Ok(c),
            other => bail!(
                "experiment {} is a {} model, not a text classifier",
                self.name,
                other.kind()
            ),
        }
    }

    /// The ViT config, or an error naming what this experiment is instead.
    pub fn vit(&self) -> Result<&VitConfig> {
        match &self.model {
            ModelConfig::Vit(vit) => Ok(vit),
            other => bail!(
                "experiment {} is a {} model, not a vision transformer",
                self.name,
                other.kind()
            ),
        }
    }

    /// Writes the config as pretty JSON, atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        crate::artifact::write_atomic(path, text.as_bytes())
    }
}
