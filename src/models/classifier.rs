//! Encoder classifier (BERT-style, trained from scratch): token embedding + positions → encoder
//! stack with the padding mask → pooling (the `<s>` classification token, or the mean of the
//! non-padding tokens) → class scores.

use super::text::{embed_tokens, EncoderShape};
use crate::kernels::{self, LabBackend};
use crate::nn::{
    padding_mask, pool, Activation, AttentionLayers, AttentionMask, MultiHeadAttention, Pooling,
    PositionEncoding, PositionKind, StackConfig, TransformerStack,
};
use anyhow::{bail, Result};
use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, Embedding, LayerNorm, Linear, LinearConfig};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

/// Configuration of [`TextClassifier`] (the `model` of a `"kind": "classifier"` experiment).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClassifierConfig {
    /// Vocabulary size; `0` = from the tokenizer (the saved config has it filled).
    pub vocab_size: usize,
    /// Classes.
    pub n_classes: usize,
    /// Width, heads, feed-forward, dropout, activation, norm placement, biases and mixer.
    #[serde(flatten)]
    pub stack: StackConfig,
    /// Encoder blocks.
    pub n_layers: usize,
    /// Longest input in tokens (`<s>` included); longer texts are cut.
    pub max_len: usize,
    /// Positions: `learned`, `sinusoidal` or `none`.
    pub position: PositionKind,
    /// What the head reads: `cls` (the `<s>` token) or `mean` (of the non-padding tokens).
    pub pool: Pooling,
    /// Start training from this artifact's embeddings, encoder and tokenizer instead of a
    /// random init: a masked language model's (`mlm`: pretrain, then fine-tune; the head starts
    /// fresh) or another classifier's (all of it). The model settings must describe its
    /// encoder; `dropout` may differ.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_from: Option<std::path::PathBuf>,
    /// A LayerNorm over token embedding + positions, as BERT has (a classifier fine-tuned from
    /// an imported BERT; left out of saved configs while false).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub embedding_norm: bool,
}

impl Default for ClassifierConfig {
    fn default() -> Self {
        Self {
            vocab_size: 0,
            n_classes: 2,
            stack: StackConfig {
                d_ff: 256,
                dropout: 0.1,
                activation: Activation::Gelu,
                ..StackConfig::default()
            },
            n_layers: 2,
            max_len: 64,
            position: PositionKind::Learned,
            pool: Pooling::Cls,
            init_from: None,
            embedding_norm: false,
        }
    }
}

impl ClassifierConfig {
    /// Checks the relations between fields.
    pub fn validate(&self) -> Result<()> {
        if self.n_layers == 0 || self.max_len < 2 || self.n_classes < 2 {
            bail!("model: n_layers must be at least 1, max_len and n_classes at least 2");
        }
        if self.position == PositionKind::Sincos2d {
            bail!("model: sincos2d positions are for image patches (vit), not text");
        }
        self.stack.validate("classifier", false)?;
        self.stack.validate_position(self.position)
    }

    /// What shapes its encoder (the part a classifier and a masked language model share).
    pub(crate) fn encoder_shape(&self) -> EncoderShape<'_> {
        EncoderShape {
            vocab_size: self.vocab_size,
            stack: &self.stack,
            n_layers: self.n_layers,
            max_len: self.max_len,
            position: self.position,
            embedding_norm: self.embedding_norm,
        }
    }

    /// Builds the model. `vocab_size` must be resolved and the config validated.
    pub fn init<B: LabBackend>(&self, device: &B::Device) -> TextClassifier<B> {
        assert!(
            self.vocab_size > 0,
            "vocab_size must be resolved before init"
        );
        let (stack, d) = (&self.stack, self.stack.d_model);
        let parts = self.encoder_shape().init(device);
        TextClassifier {
            token_embedding: parts.token_embedding,
            position: parts.position,
            encoder: parts.encoder,
            embedding_norm: parts.embedding_norm,
            head: LinearConfig::new(d, self.n_classes)
                .with_bias(stack.bias)
                .init(device),
            dropout: DropoutConfig::new(stack.dropout).init(),
            pad_id: crate::data::Special::Pad.id(),
            pooling: self.pool,
            norm_epsilon: stack.norm_epsilon,
        }
    }
}

/// The encoder classifier.
#[derive(Module, Debug)]
pub struct TextClassifier<B: LabBackend> {
    /// Token embedding `[v, d]`.
    pub token_embedding: Embedding<B>,
    /// Positional encoding.
    pub position: PositionEncoding<B>,
    /// Encoder stack (self-attention with the padding mask).
    pub encoder: TransformerStack<B>,
    /// BERT's LayerNorm over token embedding + positions (fine-tuned from an imported BERT).
    pub embedding_norm: Option<LayerNorm<B>>,
    /// Pooled state → class scores.
    pub head: Linear<B>,
    dropout: Dropout,
    pad_id: usize,
    #[module(skip)]
    pooling: Pooling,
    #[module(skip)]
    norm_epsilon: f64,
}

/// Class scores, the encoder's states and every layer's attention.
#[derive(Clone, Debug)]
pub struct ClassifierOutput<B: LabBackend> {
    /// `[b, classes]`.
    pub logits: Tensor<B, 2>,
    /// `[b, n, d]`, the last layer's states (after the final norm of a pre-norm stack).
    pub states: Tensor<B, 3>,
    /// Per layer, `[b, h, n, n]`.
    pub attention: Vec<Tensor<B, 4>>,
}

impl<B: LabBackend> TextClassifier<B> {
    /// Class scores of padded token rows (`<s>` first, `<pad>` on the right).
    ///
    /// # Shapes
    /// `tokens`: `[b, n]` with `n <= max_len` → logits `[b, classes]`.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> ClassifierOutput<B> {
        let padding = padding_mask(&tokens, self.pad_id); // [b, n], true = padding
        let mask = AttentionMask::padding(padding.clone());
        let x = self.embed(tokens); // [b, n, d]
        let out = self.encoder.forward(x, Some(&mask), None);
        let pooled = pool(out.x.clone(), self.pooling, Some(padding)); // [b, d]
        ClassifierOutput {
            logits: self.head.forward(pooled),
            states: out.x,
            attention: out.self_attention,
        }
    }

    /// Token embedding + positions (+ BERT's LayerNorm, + dropout): the encoder's input,
    /// `[b, n]` → `[b, n, d]`.
    pub fn embed(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let parts = (
            &self.token_embedding,
            &self.position,
            self.embedding_norm.as_ref(),
        );
        embed_tokens(parts, self.norm_epsilon, &self.dropout, tokens)
    }

    /// Mean cross-entropy of a batch, with the logits and labels it was computed from.
    pub fn loss(
        &self,
        tokens: Tensor<B, 2, Int>,
        labels: Tensor<B, 1, Int>,
    ) -> (Tensor<B, 1>, Tensor<B, 2>, Tensor<B, 1, Int>) {
        let logits = self.forward(tokens).logits;
        let loss = kernels::cross_entropy(logits.clone(), labels.clone(), 0.0, None).mean();
        (loss, logits, labels)
    }

    /// Longest input the positions cover.
    pub fn max_len(&self) -> usize {
        self.position.max_len()
    }
}

impl<B: LabBackend> AttentionLayers<B> for TextClassifier<B> {
    fn attention_layers(&mut self) -> Vec<(String, &mut MultiHeadAttention<B>)> {
        self.encoder.named_attention("layer ")
    }
}

super::text::text_encoder!(TextClassifier);
