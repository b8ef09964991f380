//! Experiment configuration: one JSON file says what model to build, on what data, trained how.
//!
//! Each layer owns its section — the model configs live beside their models (with the shared
//! [`StackConfig`] of `nn/` flattened into each), [`DataConfig`] in `data/`, [`TrainConfig`] in
//! `train/` — and this module only composes them. Every field has a default (a model kind's
//! own), unknown fields are rejected (a typo is an error, not a silently ignored setting), and
//! [`ExperimentConfig::validate`] checks the relations between fields before anything is built.
//!
//! [`ModelConfig`] is the one list of model kinds; [`ModelConfig::visit`] is the one place a
//! kind is matched. Everything that differs by kind is a visitor (a [`Visit`] implemented for
//! every [`ModelSection`]), so adding a kind is a variant here, its model, and its module in
//! `kinds/`.

pub use crate::data::{CopyTaskConfig, DataConfig, TokenizerKind};
pub use crate::models::{ClassifierConfig, ClipConfig, LmConfig, Seq2SeqConfig, VitConfig};
pub use crate::nn::StackConfig;
pub use crate::train::config::{EarlyStopping, ScheduleKind, TrainConfig};
use anyhow::{bail, Context, Result};
use serde::de::{DeserializeOwned, Deserializer, Error as _};
use serde::{Deserialize, Serialize};
use std::any::Any;
use std::marker::PhantomData;
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
    /// The model: `{"kind": "lm" | "seq2seq" | "classifier" | "vit" | "clip", …}`.
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
}

impl ModelConfig {
    /// Hands the model section, typed, to `visitor`: the one place a kind is matched.
    pub fn visit<'a, V, O>(&'a self, visitor: V) -> O
    where
        V: Visit<'a, LmConfig, Output = O>
            + Visit<'a, Seq2SeqConfig, Output = O>
            + Visit<'a, ClassifierConfig, Output = O>
            + Visit<'a, VitConfig, Output = O>
            + Visit<'a, ClipConfig, Output = O>,
    {
        match self {
            ModelConfig::Lm(section) => visitor.visit(section),
            ModelConfig::Seq2seq(section) => visitor.visit(section),
            ModelConfig::Classifier(section) => visitor.visit(section),
            ModelConfig::Vit(section) => visitor.visit(section),
            ModelConfig::Clip(section) => visitor.visit(section),
        }
    }

    /// `lm`, `seq2seq`, `classifier`, `vit` or `clip`, as written in configs.
    pub fn kind(&self) -> &'static str {
        self.visit(Kind)
    }

    /// The command that uses a trained model of this kind.
    pub fn command(&self) -> &'static str {
        self.visit(Command)
    }

    /// Whether the model reads text (and so has tokenizers in its artifact).
    pub fn reads_text(&self) -> bool {
        self.vocab_sizes() != (0, 0)
    }

    /// The vocabulary sizes `(source, target)` (both the same for single-tokenizer models;
    /// zeros for a model that reads no text). Zero also before the tokenizer resolved them.
    pub fn vocab_sizes(&self) -> (usize, usize) {
        self.visit(VocabSizes)
    }

    /// Fills in the vocabulary sizes the tokenizers resolved.
    pub fn set_vocab_sizes(&mut self, source: usize, target: usize) {
        *self = self.visit(WithVocabSizes(source, target));
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig::Lm(LmConfig::default())
    }
}

/// What differs by kind in a model section: its name, its checks against the data, its
/// vocabulary sizes. Implemented by each kind's module in `kinds/`.
pub trait ModelSection: Any + Clone + Default + Serialize + DeserializeOwned {
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
}

/// Something done with a model section of type `S` (see [`ModelConfig::visit`]).
pub trait Visit<'a, S> {
    /// What it gives back.
    type Output;
    /// Does it.
    fn visit(self, section: &'a S) -> Self::Output;
}

struct Kind;
impl<S: ModelSection> Visit<'_, S> for Kind {
    type Output = &'static str;
    fn visit(self, _: &S) -> &'static str {
        S::KIND
    }
}

struct Command;
impl<S: ModelSection> Visit<'_, S> for Command {
    type Output = &'static str;
    fn visit(self, _: &S) -> &'static str {
        S::COMMAND
    }
}

struct VocabSizes;
impl<S: ModelSection> Visit<'_, S> for VocabSizes {
    type Output = (usize, usize);
    fn visit(self, section: &S) -> (usize, usize) {
        section.vocab_sizes()
    }
}

struct WithVocabSizes(usize, usize);
impl<S: ModelSection> Visit<'_, S> for WithVocabSizes {
    type Output = ModelConfig;
    fn visit(self, section: &S) -> ModelConfig {
        section.with_vocab_sizes(self.0, self.1)
    }
}

struct Validate<'d>(&'d DataConfig);
impl<S: ModelSection> Visit<'_, S> for Validate<'_> {
    type Output = Result<()>;
    fn visit(self, section: &S) -> Result<()> {
        section.validate(self.0)
    }
}

struct Get<T>(PhantomData<T>);
impl<'a, S: ModelSection, T: 'static> Visit<'a, S> for Get<T> {
    type Output = Option<&'a T>;
    fn visit(self, section: &'a S) -> Option<&'a T> {
        (section as &dyn Any).downcast_ref::<T>()
    }
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
        self.model.visit(Validate(&self.data))?;
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
        self.model.visit(Get::<S>(PhantomData)).with_context(|| {
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
