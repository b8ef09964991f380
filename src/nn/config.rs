//! [`StackConfig`]: the settings every model's transformer stack shares, written once —
//! flattened into each model's config (`"d_model"`, `"n_heads"`, … sit beside the model's own
//! fields in an experiment's `model` section), validated here, and turned into blocks here with
//! the one residual-initialisation rule.

use super::block::TransformerBlockConfig;
use super::feedforward::Activation;
use super::mixer::Mixer;
use super::position::PositionKind;
use super::stack::TransformerStackConfig;
use anyhow::{bail, Result};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The shared settings of a transformer stack. Each model's `Default` picks its own values (a
/// language model is pre-norm GELU without biases, nanoGPT's choice; the translator is the
/// paper's ReLU with biases); the depth stays with the model (a translator has two stacks).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StackConfig {
    /// Model width `d_model`.
    pub d_model: usize,
    /// Attention heads per block; must divide `d_model`.
    pub n_heads: usize,
    /// Feed-forward inner width `d_ff`; `0` means `4 · d_model`.
    pub d_ff: usize,
    /// Dropout probability (attention weights, feed-forward, residual branches, embeddings).
    pub dropout: f64,
    /// Feed-forward non-linearity: `gelu`, `gelu_tanh` (GPT-2's) or `relu`.
    pub activation: Activation,
    /// Pre-norm (`true`, GPT-2, ViT) or post-norm (`false`, the original paper, BERT).
    pub norm_first: bool,
    /// Whether linear layers and LayerNorms carry a bias.
    pub bias: bool,
    /// Token mixer of the self-attention layers: `{"kind": "full"}` (default), `local`,
    /// `strided`, `linear` or `hyena` (see [`Mixer`]).
    pub mixer: Mixer,
    /// Heads removed by pruning (`transformer-lab heads --prune`), by attention layer name
    /// (`"layer 2"`, `"decoder 0 cross"`) → head indices in the unpruned layer. Empty (the
    /// default): every layer has `n_heads` heads.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pruned_heads: BTreeMap<String, Vec<usize>>,
    /// Every LayerNorm's epsilon: burn's 1e-5 (the default, left out of saved configs), or an
    /// imported model's (BERT's 1e-12).
    #[serde(
        default = "default_norm_epsilon",
        skip_serializing_if = "is_default_norm_epsilon"
    )]
    pub norm_epsilon: f64,
}

fn default_norm_epsilon() -> f64 {
    crate::kernels::LAYER_NORM_EPSILON
}

fn is_default_norm_epsilon(epsilon: &f64) -> bool {
    *epsilon == crate::kernels::LAYER_NORM_EPSILON
}

impl Default for StackConfig {
    /// A small pre-norm GELU stack: width 128, 4 heads, `d_ff = 4·d_model`, no dropout, biases.
    fn default() -> Self {
        Self {
            d_model: 128,
            n_heads: 4,
            d_ff: 0,
            dropout: 0.0,
            activation: Activation::Gelu,
            norm_first: true,
            bias: true,
            mixer: Mixer::Full,
            pruned_heads: BTreeMap::new(),
            norm_epsilon: crate::kernels::LAYER_NORM_EPSILON,
        }
    }
}

impl StackConfig {
    /// Fields left out of a saved config while they hold their default (a model section's
    /// reader accepts them though its default does not list them).
    pub const UNSERIALIZED_DEFAULTS: &[&str] = &["pruned_heads", "norm_epsilon"];

    /// The feed-forward width, with `0` resolved to `4 · d_model`.
    pub fn d_ff(&self) -> usize {
        if self.d_ff == 0 {
            4 * self.d_model
        } else {
            self.d_ff
        }
    }

    /// Width `d_head = d_model / n_heads` of one head.
    pub fn d_head(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// Checks the width, heads, dropout and mixer of a `model` (named in errors) whose
    /// self-attention is `causal` or bidirectional.
    pub fn validate(&self, model: &str, causal: bool) -> Result<()> {
        let (d_model, n_heads) = (self.d_model, self.n_heads);
        if d_model == 0 || n_heads == 0 {
            bail!("model: d_model and n_heads must be at least 1");
        }
        if !d_model.is_multiple_of(n_heads) {
            bail!("model: d_model ({d_model}) must be divisible by n_heads ({n_heads})");
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("model: dropout must be in [0, 1), got {}", self.dropout);
        }
        if !(self.norm_epsilon > 0.0 && self.norm_epsilon < 1.0) {
            bail!(
                "model: norm_epsilon must be in (0, 1), got {}",
                self.norm_epsilon
            );
        }
        self.mixer.validate(model, causal)
    }

    /// Checks that the mixer can carry `position`: RoPE rotates the queries and keys of any
    /// attention mixer (pairs of channels: an even head width); ALiBi's biases need the full
    /// softmax scores; Hyena has no attention to carry either.
    pub fn validate_position(&self, position: PositionKind) -> Result<()> {
        let name = match position {
            PositionKind::Rope => "rope",
            PositionKind::Alibi => "alibi",
            _ => return Ok(()),
        };
        if !self.mixer.is_attention() {
            bail!("model: {name} positions live inside attention, and the hyena mixer has none; use learned or sinusoidal");
        }
        if position == PositionKind::Alibi && self.mixer != Mixer::Full {
            bail!("model: alibi positions bias the full attention scores; use mixer full, or rope with mixer {}", self.mixer.name());
        }
        if position == PositionKind::Rope && !self.d_head().is_multiple_of(2) {
            bail!("model: rope rotates pairs of channels and needs an even head width; d_model / n_heads is {}", self.d_head());
        }
        Ok(())
    }

    /// Floats `n_layers` blocks keep per example of `t` tokens for the backward pass: per
    /// layer ~10 values of width `d_model` and two of width `d_ff` per token, and the attention
    /// weights (`h·t²`). A lower bound, for the memory check before training.
    pub fn activation_floats(&self, n_layers: usize, t: usize) -> f64 {
        let per_token = 10 * self.d_model + 2 * self.d_ff();
        n_layers as f64 * (t as f64 * per_token as f64 + (self.n_heads * t * t) as f64)
    }

    /// One block of a model `depth` blocks deep whose sequences are at most `max_len` long.
    ///
    /// The projections into the residual stream start at `N(0, 0.02/√(2·depth))` (GPT-2: each
    /// block adds two such branches, so the stream's variance stays ~1 whatever the depth).
    pub fn block(&self, depth: usize, max_len: usize) -> TransformerBlockConfig {
        TransformerBlockConfig::new(self.d_model, self.n_heads, self.d_ff())
            .with_dropout(self.dropout)
            .with_activation(self.activation)
            .with_norm_first(self.norm_first)
            .with_bias(self.bias)
            .with_norm_epsilon(self.norm_epsilon)
            .with_residual_init_std(0.02 / ((2 * depth) as f64).sqrt())
            .with_mixer(self.mixer.clone())
            .with_max_len(max_len)
    }

    /// An encoder of `n_layers` bidirectional blocks.
    pub fn encoder(&self, n_layers: usize, max_len: usize) -> TransformerStackConfig {
        TransformerStackConfig::encoder(n_layers, self.block(n_layers, max_len))
    }

    /// A decoder of `n_layers` causal blocks (callers pass the causal mask), with
    /// cross-attention over an encoder's output when `cross_attention`.
    pub fn decoder(
        &self,
        n_layers: usize,
        max_len: usize,
        cross_attention: bool,
    ) -> TransformerStackConfig {
        TransformerStackConfig::decoder(n_layers, self.block(n_layers, max_len), cross_attention)
    }
}

/// Reads a config section over `T::default()` from the JSON object `given`: every key present
/// must be one of the section's fields (or in `optional`, fields left out of saved configs
/// while at their default) — what `deny_unknown_fields` would do, which serde cannot combine
/// with a flattened [`StackConfig`] — and every key absent takes the default.
pub fn over_defaults<T: Default + Serialize + DeserializeOwned>(
    given: serde_json::Map<String, serde_json::Value>,
    optional: &[&str],
) -> std::result::Result<T, String> {
    over_defaults_of(&T::default(), given, optional)
}

/// [`over_defaults`] over `defaults` instead of `T::default()` (a clip model's towers have
/// defaults of their own).
pub fn over_defaults_of<T: Serialize + DeserializeOwned>(
    defaults: &T,
    given: serde_json::Map<String, serde_json::Value>,
    optional: &[&str],
) -> std::result::Result<T, String> {
    let serde_json::Value::Object(mut fields) =
        serde_json::to_value(defaults).map_err(|e| e.to_string())?
    else {
        return Err("a config section serializes to an object".into());
    };
    for (key, value) in given {
        let known = StackConfig::UNSERIALIZED_DEFAULTS
            .iter()
            .chain(optional)
            .any(|field| *field == key);
        if !fields.contains_key(&key) && !known {
            let expected: Vec<String> = fields.keys().map(|k| format!("`{k}`")).collect();
            return Err(format!(
                "unknown field `{key}`, expected one of {}",
                expected.join(", ")
            ));
        }
        fields.insert(key, value);
    }
    serde_json::from_value(serde_json::Value::Object(fields)).map_err(|e| e.to_string())
}
