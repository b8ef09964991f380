//! Masked language model (BERT-style pretraining): token embedding + positions → encoder stack
//! with the padding mask → at the masked positions only, BERT's head: a transform (linear,
//! activation, LayerNorm), then scores over the vocabulary from the token embedding itself
//! (tied) plus a bias of its own.
//!
//! Its embeddings and encoder are the classifier's fields of the same names and types, so a
//! classifier starts from them as they are (`init_from`).

use super::text::{embed_tokens, EncoderShape};
use crate::data::MlmBatch;
use crate::kernels::{self, LabBackend};
use crate::nn::{
    padding_mask, Activation, AttentionLayers, AttentionMask, MultiHeadAttention, PositionEncoding,
    PositionKind, StackConfig, TransformerStack,
};
use anyhow::{bail, Result};
use burn::module::{Module, Param};
use burn::nn::{
    Dropout, DropoutConfig, Embedding, LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

/// Configuration of [`MaskedLm`] (the `model` of a `"kind": "mlm"` experiment).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MlmConfig {
    /// Vocabulary size, `[MASK]` included; `0` = from the tokenizer (the saved config has it).
    pub vocab_size: usize,
    /// Width, heads, feed-forward, dropout, activation, norm placement, biases and mixer.
    #[serde(flatten)]
    pub stack: StackConfig,
    /// Encoder blocks.
    pub n_layers: usize,
    /// Longest input in tokens (`<s>` and `</s>` included); longer sentences are cut.
    pub max_len: usize,
    /// Positions: `learned`, `sinusoidal` or `none`.
    pub position: PositionKind,
    /// Share of each sentence's tokens (`<s>` and `</s>` never) the loss predicts: BERT's 15%,
    /// at least one per sentence; of those, 80% read `[MASK]`, 10% a random token, 10% stay.
    pub mask_fraction: f64,
    /// A LayerNorm over token embedding + positions, as BERT has (imported models; left out of
    /// saved configs while false).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub embedding_norm: bool,
}

impl Default for MlmConfig {
    fn default() -> Self {
        Self {
            vocab_size: 0,
            stack: StackConfig {
                d_ff: 256,
                dropout: 0.1,
                activation: Activation::Gelu,
                ..StackConfig::default()
            },
            n_layers: 2,
            max_len: 64,
            position: PositionKind::Learned,
            mask_fraction: 0.15,
            embedding_norm: false,
        }
    }
}

impl MlmConfig {
    /// Checks the relations between fields.
    pub fn validate(&self) -> Result<()> {
        if self.n_layers == 0 || self.max_len < 3 {
            bail!("model: n_layers must be at least 1 and max_len at least 3");
        }
        if !(self.mask_fraction > 0.0 && self.mask_fraction < 1.0) {
            bail!("model: mask_fraction must be in (0, 1), BERT's is 0.15");
        }
        if self.position == PositionKind::Sincos2d {
            bail!("model: sincos2d positions are for image patches (vit), not text");
        }
        self.stack.validate("mlm", false)?;
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
    pub fn init<B: LabBackend>(&self, device: &B::Device) -> MaskedLm<B> {
        assert!(
            self.vocab_size > 0,
            "vocab_size must be resolved before init"
        );
        let (stack, d) = (&self.stack, self.stack.d_model);
        let parts = self.encoder_shape().init(device);
        MaskedLm {
            token_embedding: parts.token_embedding,
            position: parts.position,
            encoder: parts.encoder,
            embedding_norm: parts.embedding_norm,
            transform: LinearConfig::new(d, d).with_bias(stack.bias).init(device),
            transform_norm: LayerNormConfig::new(d)
                .with_epsilon(stack.norm_epsilon)
                .init(device),
            output_bias: Param::from_tensor(Tensor::zeros([self.vocab_size], device)),
            dropout: DropoutConfig::new(stack.dropout).init(),
            pad_id: crate::data::Special::Pad.id(),
            activation: stack.activation,
            norm_epsilon: stack.norm_epsilon,
        }
    }
}

/// The masked language model.
#[derive(Module, Debug)]
pub struct MaskedLm<B: LabBackend> {
    /// Token embedding `[v, d]`, also the output projection (tied).
    pub token_embedding: Embedding<B>,
    /// Positional encoding.
    pub position: PositionEncoding<B>,
    /// Encoder stack (self-attention with the padding mask).
    pub encoder: TransformerStack<B>,
    /// BERT's LayerNorm over token embedding + positions (imported models).
    pub embedding_norm: Option<LayerNorm<B>>,
    /// The head's transform `[d, d]`, before the activation and `transform_norm`.
    pub transform: Linear<B>,
    /// The head's LayerNorm.
    pub transform_norm: LayerNorm<B>,
    /// The output scores' own bias `[v]`.
    pub output_bias: Param<Tensor<B, 1>>,
    dropout: Dropout,
    pad_id: usize,
    #[module(skip)]
    activation: Activation,
    #[module(skip)]
    norm_epsilon: f64,
}

/// The encoder's states and every layer's attention.
#[derive(Clone, Debug)]
pub struct MlmOutput<B: LabBackend> {
    /// `[b, n, d]`, the last layer's states (after the final norm of a pre-norm stack).
    pub states: Tensor<B, 3>,
    /// Per layer, `[b, h, n, n]`.
    pub attention: Vec<Tensor<B, 4>>,
}

impl<B: LabBackend> MaskedLm<B> {
    /// The encoder's states of padded token rows (`<s> … </s>`, `<pad>` on the right).
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> MlmOutput<B> {
        let mask = AttentionMask::padding(padding_mask(&tokens, self.pad_id));
        let x = self.embed(tokens);
        let out = self.encoder.forward(x, Some(&mask), None);
        MlmOutput {
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

    /// Scores over the vocabulary of states `[m, d]` → `[m, v]`.
    pub fn scores(&self, states: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = self
            .activation
            .apply(kernels::linear(&self.transform, states));
        let h = kernels::layer_norm(&self.transform_norm, self.norm_epsilon, h);
        let table = self.token_embedding.weight.val().transpose(); // [d, v]
        kernels::product(h, table, None) + self.output_bias.val().unsqueeze()
    }

    /// Mean cross-entropy over the batch's masked positions, with their scores `[m, v]` and
    /// targets `[m]`.
    pub fn loss(&self, batch: MlmBatch<B>) -> (Tensor<B, 1>, Tensor<B, 2>, Tensor<B, 1, Int>) {
        let [b, n] = batch.tokens.dims();
        let states = self.forward(batch.tokens).states;
        let d = states.dims()[2];
        let picked = states.reshape([b * n, d]).select(0, batch.positions);
        let logits = self.scores(picked);
        let loss = kernels::cross_entropy(logits.clone(), batch.targets.clone(), 0.0, None).mean();
        (loss, logits, batch.targets)
    }

    /// Longest input the positions cover.
    pub fn max_len(&self) -> usize {
        self.position.max_len()
    }

    /// Vocabulary size `v`.
    pub fn vocab_size(&self) -> usize {
        self.token_embedding.weight.dims()[0]
    }
}

impl<B: LabBackend> AttentionLayers<B> for MaskedLm<B> {
    fn attention_layers(&mut self) -> Vec<(String, &mut MultiHeadAttention<B>)> {
        self.encoder.named_attention("layer ")
    }
}

super::text::text_encoder!(MaskedLm);
