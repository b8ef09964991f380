//! Encoder–decoder translator ("Attention Is All You Need"): source embedding + positions →
//! encoder stack (padding mask); target embedding (shifted right, `<s>` first) + positions →
//! decoder stack (causal mask + cross-attention over the encoder output, with the source
//! padding mask) → projection to the target vocabulary.

pub use crate::data::Seq2SeqBatch;
use crate::kernels::{self, LabBackend};
use crate::nn::{
    padding_mask, Activation, AttentionLayers, AttentionMask, KvCache, MultiHeadAttention,
    PositionEncoding, PositionEncodingConfig, PositionKind, StackConfig, TransformerStack,
    TransformerStackConfig,
};
use anyhow::{bail, Result};
use burn::module::Module;
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer, Linear, LinearConfig,
};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

/// Configuration of [`Seq2Seq`] (the `model` of a `"kind": "seq2seq"` experiment).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Seq2SeqConfig {
    /// Source vocabulary size; `0` = from the tokenizer (the saved config has it filled).
    pub src_vocab_size: usize,
    /// Target vocabulary size; `0` = from the tokenizer.
    pub tgt_vocab_size: usize,
    /// Width, heads, feed-forward, dropout, activation, norm placement, biases and mixer.
    #[serde(flatten)]
    pub stack: StackConfig,
    /// Encoder blocks.
    pub encoder_layers: usize,
    /// Decoder blocks.
    pub decoder_layers: usize,
    /// Longest sequence (in tokens, `<s>`/`</s>` included) the positions cover.
    pub max_len: usize,
    /// Positional encoding: `sinusoidal` (the paper) or `learned`.
    pub position: PositionKind,
    /// One embedding table for source and target (needs a shared vocabulary).
    pub share_embeddings: bool,
    /// The target embedding is also the output projection (Press & Wolf 2017).
    pub tie_weights: bool,
}

impl Default for Seq2SeqConfig {
    fn default() -> Self {
        Self {
            src_vocab_size: 0,
            tgt_vocab_size: 0,
            stack: StackConfig {
                d_model: 256,
                n_heads: 8,
                d_ff: 512,
                dropout: 0.1,
                activation: Activation::Relu,
                ..StackConfig::default()
            },
            encoder_layers: 3,
            decoder_layers: 3,
            max_len: 128,
            position: PositionKind::Sinusoidal,
            share_embeddings: true,
            tie_weights: true,
        }
    }
}

impl Seq2SeqConfig {
    /// Checks the relations between fields.
    pub fn validate(&self) -> Result<()> {
        if self.encoder_layers == 0 || self.decoder_layers == 0 {
            bail!("model: encoder_layers and decoder_layers must be at least 1");
        }
        if self.max_len < 3 {
            bail!("model: max_len must be at least 3 (<s>, a token, </s>)");
        }
        if self.position == PositionKind::Sincos2d {
            bail!("model: sincos2d positions are for image patches (vit), not text");
        }
        self.stack.validate("translator's encoder", false)?;
        self.stack.validate_position(self.position)
    }

    /// Builds the model. Vocabulary sizes must be resolved and the config validated.
    ///
    /// # Panics
    /// If a vocabulary size is 0, or embeddings are shared between vocabularies of different
    /// sizes.
    pub fn init<B: LabBackend>(&self, device: &B::Device) -> Seq2Seq<B> {
        assert!(
            self.src_vocab_size > 0 && self.tgt_vocab_size > 0,
            "vocabulary sizes must be resolved before init"
        );
        assert!(
            !self.share_embeddings || self.src_vocab_size == self.tgt_vocab_size,
            "shared embeddings need one vocabulary"
        );
        // N(0, d^-1/2) then ×√d in `embed`: unit-variance inputs, as in the paper's setup.
        let (stack, d) = (&self.stack, self.stack.d_model);
        let std = (d as f64).powf(-0.5);
        let embedding = |vocab| {
            EmbeddingConfig::new(vocab, d)
                .with_initializer(Initializer::Normal { mean: 0.0, std })
                .init(device)
        };
        let block = stack
            .block(self.encoder_layers.max(self.decoder_layers), self.max_len)
            .with_relative(self.position.relative());
        Seq2Seq {
            src_embedding: embedding(self.src_vocab_size),
            tgt_embedding: (!self.share_embeddings).then(|| embedding(self.tgt_vocab_size)),
            position: PositionEncodingConfig::new(self.position, self.max_len, d).init(device),
            // Both stacks' residual branches start as in one stack of the deeper side's depth.
            encoder: TransformerStackConfig::encoder(self.encoder_layers, block.clone())
                .init(device),
            decoder: TransformerStackConfig::decoder(self.decoder_layers, block, true).init(device),
            head: (!self.tie_weights).then(|| {
                LinearConfig::new(d, self.tgt_vocab_size)
                    .with_bias(false)
                    .with_initializer(Initializer::Normal { mean: 0.0, std })
                    .init(device)
            }),
            dropout: DropoutConfig::new(stack.dropout).init(),
            pad_id: crate::data::Special::Pad.id(),
            label_smoothing: 0.0,
        }
    }
}

/// The encoder–decoder transformer.
#[derive(Module, Debug)]
pub struct Seq2Seq<B: LabBackend> {
    /// Source embedding `[v_src, d]` (also the target's when shared).
    pub src_embedding: Embedding<B>,
    /// Target embedding `[v_tgt, d]`, absent when shared with the source.
    pub tgt_embedding: Option<Embedding<B>>,
    /// Positional encoding, used by both sides.
    pub position: PositionEncoding<B>,
    /// Encoder stack (self-attention with the source padding mask).
    pub encoder: TransformerStack<B>,
    /// Decoder stack (causal self-attention + cross-attention).
    pub decoder: TransformerStack<B>,
    /// Output projection `[d, v_tgt]`, absent when tied to the target embedding.
    pub head: Option<Linear<B>>,
    dropout: Dropout,
    pad_id: usize,
    label_smoothing: f32,
}

/// The encoder's output and the mask that hides its padding from cross-attention.
#[derive(Clone, Debug)]
pub struct Memory<B: LabBackend> {
    /// `[b, s, d]`.
    pub states: Tensor<B, 3>,
    /// Key-padding mask of the source, `true` = padding.
    pub mask: AttentionMask<B>,
    /// Per encoder layer, self-attention weights `[b, h, s, s]`.
    pub attention: Vec<Tensor<B, 4>>,
}

/// Decoder logits and its attention weights.
#[derive(Clone, Debug)]
pub struct DecoderOutput<B: LabBackend> {
    /// `[b, t, v_tgt]`.
    pub logits: Tensor<B, 3>,
    /// Per decoder layer, causal self-attention weights `[b, h, t, t]`.
    pub self_attention: Vec<Tensor<B, 4>>,
    /// Per decoder layer, cross-attention weights `[b, h, t, s]`.
    pub cross_attention: Vec<Tensor<B, 4>>,
}

impl<B: LabBackend> Seq2Seq<B> {
    /// Runs the encoder.
    ///
    /// # Shapes
    /// `source`: `[b, s]` ids, `<pad>` on the right → states `[b, s, d]`.
    pub fn encode(&self, source: Tensor<B, 2, Int>) -> Memory<B> {
        let mask = AttentionMask::padding(padding_mask(&source, self.pad_id));
        let x = self.embed(&self.src_embedding, source); // [b, s, d]
        let out = self.encoder.forward(x, Some(&mask), None);
        Memory {
            states: out.x,
            mask,
            attention: out.self_attention,
        }
    }

    /// Runs the decoder over `target_in` with cross-attention to `memory`.
    ///
    /// # Shapes
    /// `target_in`: `[b, t]` → logits `[b, t, v_tgt]`.
    pub fn decode(&self, memory: &Memory<B>, target_in: Tensor<B, 2, Int>) -> DecoderOutput<B> {
        let t = target_in.dims()[1];
        let x = self.embed(self.target_embedding(), target_in); // [b, t, d]
        let causal = AttentionMask::causal(t, &x.device());
        let out =
            self.decoder
                .forward(x, Some(&causal), Some((&memory.states, Some(&memory.mask))));
        DecoderOutput {
            logits: self.project(out.x),
            self_attention: out.self_attention,
            cross_attention: out.cross_attention,
        }
    }

    /// An empty decoding cache for sentences whose encoding is `memory`: every decoder layer's
    /// cross-attention keys and values are projected here, once.
    pub fn new_cache(&self, memory: &Memory<B>) -> KvCache<B> {
        self.decoder
            .new_cache(Some((&memory.states, Some(&memory.mask))))
    }

    /// Logits of `n` new target tokens that follow the positions in `cache` (which they
    /// extend): the last `n` rows of [`Self::decode`] over the whole prefix, at the cost of the
    /// new rows. Needs [`Self::caches`].
    ///
    /// # Shapes
    /// `target_new`: `[b, n]` → logits `[b, n, v_tgt]`.
    pub fn decode_cached(
        &self,
        target_new: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let x = self.embed_from(self.target_embedding(), target_new, cache.len()); // [b, n, d]
        self.project(self.decoder.forward_cached(x, cache))
    }

    /// Whether the decoder decodes from a cache (every attention mixer does; Hyena
    /// recomputes).
    pub fn caches(&self) -> bool {
        self.decoder.caches()
    }

    /// The output projection, `[b, t, d]` → `[b, t, v_tgt]`.
    fn project(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let x = x.reshape([b * t, d]);
        let logits = match &self.head {
            Some(head) => kernels::linear(head, x),
            None => kernels::product(x, self.target_embedding().weight.val().transpose(), None),
        };
        logits.reshape([b, t, self.tgt_vocab_size()])
    }

    /// Teacher-forced logits of a batch, `[b, t, v_tgt]`.
    pub fn forward(&self, batch: &Seq2SeqBatch<B>) -> DecoderOutput<B> {
        let memory = self.encode(batch.source.clone());
        self.decode(&memory, batch.target_in.clone())
    }

    /// Mean label-smoothed cross-entropy over the non-padding target positions, with the
    /// flattened logits `[b·t, v]` and targets `[b·t]` it was computed from.
    ///
    /// Per position: `−(1−ε)·log p(y) − ε·mean_v log p(v)`; padding positions count for nothing
    /// (burn's `CrossEntropyLoss` would average them in as zeros).
    pub fn loss(
        &self,
        batch: &Seq2SeqBatch<B>,
        smoothing: f32,
    ) -> (Tensor<B, 1>, Tensor<B, 2>, Tensor<B, 1, Int>) {
        let [b, t] = batch.target_out.dims();
        let v = self.tgt_vocab_size();
        let logits = self.forward(batch).logits.reshape([b * t, v]);
        let targets = batch.target_out.clone().reshape([b * t]);
        let per_token = kernels::cross_entropy(
            logits.clone(),
            targets.clone(),
            smoothing,
            Some(self.pad_id),
        ); // [b*t], 0 at padding
        let count = targets
            .clone()
            .not_equal_elem(self.pad_id as i64)
            .float()
            .sum()
            .clamp_min(1.0);
        let loss = per_token.sum() / count;
        (loss, logits, targets)
    }

    /// The label smoothing ε its train and validation steps use (a training setting, not
    /// saved with the weights).
    pub fn with_label_smoothing(mut self, epsilon: f32) -> Self {
        self.label_smoothing = epsilon;
        self
    }

    /// See [`Seq2Seq::with_label_smoothing`].
    pub fn label_smoothing(&self) -> f32 {
        self.label_smoothing
    }

    /// `√d · E[token] + PE`, then dropout: `[b, n]` → `[b, n, d]`.
    /// Source embedding (scaled by `√d`) + positions: the encoder's input, `[b, s]` → `[b, s, d]`.
    pub fn embed_source(&self, source: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.embed(&self.src_embedding, source)
    }

    /// Target embedding + positions: the decoder's input, `[b, t]` → `[b, t, d]`.
    pub fn embed_target(&self, target_in: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.embed(self.target_embedding(), target_in)
    }

    fn embed(&self, table: &Embedding<B>, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.embed_from(table, tokens, 0)
    }

    /// Scaled embeddings of tokens at positions `start..`, with their positions added.
    fn embed_from(
        &self,
        table: &Embedding<B>,
        tokens: Tensor<B, 2, Int>,
        start: usize,
    ) -> Tensor<B, 3> {
        let scale = (self.d_model() as f64).sqrt();
        let x = crate::kernels::embedding(table.weight.val(), tokens).mul_scalar(scale);
        crate::kernels::dropout(&self.dropout, self.position.forward_from(x, start))
    }

    fn target_embedding(&self) -> &Embedding<B> {
        self.tgt_embedding.as_ref().unwrap_or(&self.src_embedding)
    }

    /// Model width `d`.
    pub fn d_model(&self) -> usize {
        self.src_embedding.weight.dims()[1]
    }

    /// Target vocabulary size.
    pub fn tgt_vocab_size(&self) -> usize {
        self.target_embedding().weight.dims()[0]
    }

    /// Longest sequence the positions cover.
    pub fn max_len(&self) -> usize {
        self.position.max_len()
    }
}

impl<B: LabBackend> AttentionLayers<B> for Seq2Seq<B> {
    fn attention_layers(&mut self) -> Vec<(String, &mut MultiHeadAttention<B>)> {
        let mut layers = self.encoder.named_attention("encoder ");
        layers.extend(self.decoder.named_attention("decoder "));
        layers
    }
}
