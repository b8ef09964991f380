//! Experiment configuration: one JSON file says what model to build, on what data, trained how.
//!
//! Each layer owns its section — the model configs live beside their models (with the shared
//! [`StackConfig`] of `nn/` flattened into each), [`DataConfig`] in `data/`, [`TrainConfig`] in
//! `train/` — and this module only composes them. Every field has a default (a model kind's
//! own), unknown fields are rejected (a typo is an error, not a silently ignored setting), and
//! [`ExperimentConfig::validate`] checks the relations between fields before anything is built.
//!
//! [`ModelConfig`] is the one list of model kinds; [`each_kind!`] is the one place a kind is
//! matched, so adding a kind is a variant here and an arm there (the compiler finds both), its
//! model, and its module in `kinds/`.

pub use crate::data::{CopyTaskConfig, DataConfig, TokenizerKind};
pub use crate::models::{
    ClassifierConfig, ClipConfig, LmConfig, MlmConfig, Seq2SeqConfig, VitConfig,
};
pub use crate::nn::StackConfig;
pub use crate::train::config::{EarlyStopping, ScheduleKind, TrainConfig};
use anyhow::{bail, Context, Result};
use serde::de::{DeserializeOwned, Deserializer, Error as _};
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
    /// The model: `{"kind": "lm" | "seq2seq" | "classifier" | "vit" | "clip" | "mlm", …}`.
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

/// Which model an experiment builds: one variant per model kind.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ModelConfig {
    /// Decoder-only language model.
    #[serde(deserialize_with = "with_defaults")]
    Lm(LmConfig),
    /// Encoder–decoder translator.
    #[serde(deserialize_with = "with_defaults")]
    Seq2seq(Seq2SeqConfig),
    /// Encoder text classifier.
    #[serde(deserialize_with = "with_defaults")]
    Classifier(ClassifierConfig),
    /// Vision Transformer image classifier.
    #[serde(deserialize_with = "with_defaults")]
    Vit(VitConfig),
    /// Contrastive image–text model (CLIP).
    #[serde(deserialize_with = "with_defaults")]
    Clip(ClipConfig),
    /// Masked language model (BERT-style pretraining).
    #[serde(deserialize_with = "with_defaults")]
    Mlm(MlmConfig),
}

/// `each_kind!(model, section => expression)`: `expression` with `section` bound to the typed
/// section of whichever kind `model` (a `&ModelConfig`) is — the one place a kind is matched.
/// Each arm is compiled for its own kind, so the compiler checks that every kind provides what
/// the expression asks of it.
macro_rules! each_kind {
    ($model:expr, $section:ident => $body:expr) => {
        match $model {
            $crate::config::ModelConfig::Lm($section) => $body,
            $crate::config::ModelConfig::Seq2seq($section) => $body,
            $crate::config::ModelConfig::Classifier($section) => $body,
            $crate::config::ModelConfig::Vit($section) => $body,
            $crate::config::ModelConfig::Clip($section) => $body,
            $crate::config::ModelConfig::Mlm($section) => $body,
        }
    };
}
pub(crate) use each_kind;

impl ModelConfig {
    /// `lm`, `seq2seq`, `classifier`, `vit`, `clip` or `mlm`, as written in configs.
    pub fn kind(&self) -> &'static str {
        fn of<S: ModelSection>(_: &S) -> &'static str {
            S::KIND
        }
        each_kind!(self, section => of(section))
    }

    /// The command that uses a trained model of this kind.
    pub fn command(&self) -> &'static str {
        fn of<S: ModelSection>(_: &S) -> &'static str {
            S::COMMAND
        }
        each_kind!(self, section => of(section))
    }

    /// Whether the model reads text (and so has tokenizers in its artifact).
    pub fn reads_text(&self) -> bool {
        self.vocab_sizes() != (0, 0)
    }

    /// The vocabulary sizes `(source, target)` (both the same for single-tokenizer models;
    /// zeros for a model that reads no text). Zero also before the tokenizer resolved them.
    pub fn vocab_sizes(&self) -> (usize, usize) {
        each_kind!(self, section => section.vocab_sizes())
    }

    /// Fills in the vocabulary sizes the tokenizers resolved.
    pub fn set_vocab_sizes(&mut self, source: usize, target: usize) {
        *self = each_kind!(&*self, section => section.with_vocab_sizes(source, target));
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig::Lm(LmConfig::default())
    }
}

/// What differs by kind in a model section: its name, its checks against the data, its
/// vocabulary sizes. Implemented by each kind's module in `kinds/`.
pub trait ModelSection: Clone + Default + Serialize + DeserializeOwned + 'static {
    /// The `kind` written in configs.
    const KIND: &'static str;
    /// What the kind is, in words ("language model").
    const DESCRIPTION: &'static str;
    /// The command that uses a trained model of this kind.
    const COMMAND: &'static str;
    /// Fields a saved config leaves out while they hold their default (besides the stack's).
    const UNSERIALIZED_DEFAULTS: &'static [&'static str] = &[];
    /// Checks the section's own fields and that `data` suits it.
    fn validate(&self, data: &DataConfig) -> Result<()>;
    /// `(source, target)` vocabulary sizes; `(0, 0)` for a model that reads no text.
    fn vocab_sizes(&self) -> (usize, usize);
    /// This section with the tokenizers' vocabulary sizes filled in, as a [`ModelConfig`].
    fn with_vocab_sizes(&self, source: usize, target: usize) -> ModelConfig;
    /// The section `model` holds, if it is of this kind.
    fn of(model: &ModelConfig) -> Option<&Self>;
}

/// Reads a model section over its kind's defaults: every key present must be one of the
/// section's fields (what `deny_unknown_fields` would do, which serde cannot combine with the
/// flattened [`StackConfig`]), every key absent takes the kind's default.
fn with_defaults<'de, D: Deserializer<'de>, S: ModelSection>(
    deserializer: D,
) -> Result<S, D::Error> {
    let given = serde_json::Map::<String, serde_json::Value>::deserialize(deserializer)?;
    crate::nn::config::over_defaults(given, S::UNSERIALIZED_DEFAULTS).map_err(D::Error::custom)
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
        each_kind!(&self.model, section => ModelSection::validate(section, &self.data))?;
        self.train.validate()?;
        let data = &self.data;
        for (name, fraction) in [("valid", data.valid_fraction), ("test", data.test_fraction)] {
            if !(0.0..0.5).contains(&fraction) || fraction == 0.0 {
                bail!("data: {name}_fraction must be in (0, 0.5)");
            }
        }
        match (data.train_examples, self.model.kind()) {
            (Some(0), _) => bail!("data: train_examples must be at least 1"),
            (Some(_), "lm") => bail!(
                "data: train_examples is for datasets of examples (sentences, pairs, images); \
                 a language model trains on windows of its text"
            ),
            _ => {}
        }
        if data.tokenizer == TokenizerKind::Bpe && data.bpe_vocab_size < 300 {
            bail!(
                "data: bpe_vocab_size must be at least 300 (4 special + 256 byte tokens + merges)"
            );
        }
        Ok(())
    }

    /// The model section as a `S` (e.g. `config.model_as::<LmConfig>()`), or an error naming
    /// what this experiment is instead.
    pub fn model_as<S: ModelSection>(&self) -> Result<&S> {
        S::of(&self.model).with_context(|| {
            format!(
                "experiment {} is a {} model, not a {} ({})",
                self.name,
                self.model.kind(),
                S::DESCRIPTION,
                S::KIND
            )
        })
    }

    /// Writes the config as pretty JSON, atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        crate::files::write_atomic(path, text.as_bytes())
    }
}
