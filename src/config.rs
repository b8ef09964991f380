//! Experiment configuration: one JSON file says what model to build, on what data, trained how.
//!
//! Every field has a default, unknown fields are rejected (a typo is an error, not a silently
//! ignored setting), and [`ExperimentConfig::validate`] checks the relations between fields
//! before anything is built.

use crate::nn::{Activation, PositionKind, TransformerBlockConfig, TransformerStackConfig};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

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
    /// The model.
    #[serde(default)]
    pub model: LmConfig,
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
            .with_residual_init_std(0.02 / ((2 * self.n_layers) as f64).sqrt());
        TransformerStackConfig::decoder(self.n_layers, block, false)
    }

    /// Checks the relations between fields.
    pub fn validate(&self) -> Result<()> {
        if self.d_model == 0 || self.n_layers == 0 || self.n_heads == 0 || self.context == 0 {
            bail!("model: d_model, n_layers, n_heads and context must all be at least 1");
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            bail!(
                "model: d_model ({}) must be divisible by n_heads ({})",
                self.d_model,
                self.n_heads
            );
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("model: dropout must be in [0, 1), got {}", self.dropout);
        }
        Ok(())
    }
}

/// Which text to train on and how to split it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Dataset name, as declared in `datasets/` (e.g. `tinyshakespeare`).
    pub dataset: String,
    /// A UTF-8 text file to train on instead of a declared dataset (your own corpus).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text_file: Option<std::path::PathBuf>,
    /// Tokenizer: `char` (one token per character of the training text).
    pub tokenizer: TokenizerKind,
    /// Fraction of the text, taken from its end, held out for validation.
    pub valid_fraction: f64,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            dataset: "tinyshakespeare".into(),
            text_file: None,
            tokenizer: TokenizerKind::Char,
            valid_fraction: 0.1,
        }
    }
}

/// How text becomes tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    /// One token per distinct character of the training text.
    Char,
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
    /// Data-loading threads (batches are prepared ahead of the training step).
    pub num_workers: usize,
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
            num_workers: 1,
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
        Ok(())
    }
}

impl ExperimentConfig {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        let config: Self = serde_json::from_str(&text)
            .with_context(|| format!("malformed config {}", path.display()))?;
        config
            .validate()
            .with_context(|| format!("invalid config {}", path.display()))?;
        Ok(config)
    }

    /// Checks every part.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        self.train.validate()?;
        if !(0.0..1.0).contains(&self.data.valid_fraction) || self.data.valid_fraction == 0.0 {
            bail!("data: valid_fraction must be in (0, 1)");
        }
        Ok(())
    }

    /// Writes the config as pretty JSON, atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        crate::artifact::write_atomic(path, text.as_bytes())
    }
}
