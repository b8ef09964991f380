//! Decoder-only language model (GPT): token embedding + positions → N causal decoder blocks →
//! final norm → projection to the vocabulary, trained with next-token cross-entropy.

pub use crate::data::LmBatch;
use crate::kernels::{self, LabBackend};
use crate::nn::{
    AttentionLayers, AttentionMask, KvCache, Mixer, MultiHeadAttention, PositionEncoding,
    PositionEncodingConfig, PositionKind, Residual, RowsCache, StackConfig, StackOutput,
    TransformerStack,
};
use anyhow::{bail, Result};
use burn::module::Module;
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer, Linear, LinearConfig,
};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

/// Configuration of [`LanguageModel`] (the `model` of a `"kind": "lm"` experiment, the default
/// kind): nanoGPT's small pre-norm GPT.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LmConfig {
    /// Vocabulary size; `0` means "take it from the tokenizer" (the saved config has it filled).
    pub vocab_size: usize,
    /// Width, heads, feed-forward, dropout, activation, norm placement, biases and mixer.
    #[serde(flatten)]
    pub stack: StackConfig,
    /// Number of decoder blocks.
    pub n_layers: usize,
    /// Context length (block size): the longest sequence the model sees.
    pub context: usize,
    /// Position encoding: `learned` or `sinusoidal` (added to the embeddings), `rope` or
    /// `alibi` (inside attention), or `none`.
    pub position: PositionKind,
    /// Share the token embedding with the output projection (Press & Wolf 2017).
    pub tie_weights: bool,
    /// Start training from the weights (and tokenizer) of this artifact — e.g. one made by
    /// `import gpt2` — instead of a random init; the model settings must describe its model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_from: Option<std::path::PathBuf>,
}

impl Default for LmConfig {
    fn default() -> Self {
        Self {
            vocab_size: 0,
            stack: StackConfig {
                bias: false,
                ..StackConfig::default()
            },
            n_layers: 4,
            context: 64,
            position: PositionKind::Learned,
            tie_weights: true,
            init_from: None,
        }
    }
}

impl LmConfig {
    /// Checks the relations between fields.
    pub fn validate(&self) -> Result<()> {
        if self.n_layers == 0 || self.context == 0 {
            bail!("model: n_layers and context must be at least 1");
        }
        if self.position == PositionKind::Sincos2d {
            bail!("model: sincos2d positions are for image patches (vit), not text");
        }
        self.stack.validate("language model", true)?;
        self.stack.validate_position(self.position)
    }
}

/// A decoder-only transformer language model.
#[derive(Module, Debug)]
pub struct LanguageModel<B: LabBackend> {
    /// Token embedding `[v, d]`; also the output projection when weights are tied.
    pub token_embedding: Embedding<B>,
    /// Positional encoding.
    pub position: PositionEncoding<B>,
    /// The causal decoder stack (no cross-attention).
    pub decoder: TransformerStack<B>,
    /// Output projection `[d, v]`, absent when tied to the embedding.
    pub head: Option<Linear<B>>,
    dropout: Dropout,
}

/// Logits and the attention weights of every layer.
#[derive(Clone, Debug)]
pub struct LmOutput<B: LabBackend> {
    /// `[b, t, v]` unnormalised next-token scores.
    pub logits: Tensor<B, 3>,
    /// Per layer, `[b, h, t, t]` causal self-attention weights.
    pub attention: Vec<Tensor<B, 4>>,
}

impl LmConfig {
    /// Builds the model. `vocab_size` must be resolved (non-zero) and the config validated.
    pub fn init<B: LabBackend>(&self, device: &B::Device) -> LanguageModel<B> {
        assert!(
            self.vocab_size > 0,
            "vocab_size must be resolved before init"
        );
        let init = Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        let (stack, d) = (&self.stack, self.stack.d_model);
        LanguageModel {
            token_embedding: EmbeddingConfig::new(self.vocab_size, d)
                .with_initializer(init.clone())
                .init(device),
            position: PositionEncodingConfig::new(self.position, self.context, d).init(device),
            decoder: stack
                .decoder(self.n_layers, self.context, false)
                .with_relative(self.position.relative())
                .init(device),
            head: (!self.tie_weights).then(|| {
                LinearConfig::new(d, self.vocab_size)
                    .with_bias(stack.bias)
                    .with_initializer(init)
                    .init(device)
            }),
            dropout: DropoutConfig::new(stack.dropout).init(),
        }
    }
}

impl<B: LabBackend> LanguageModel<B> {
    /// Logits and attention weights.
    ///
    /// # Shapes
    /// `tokens`: `[b, t]` with `t <= context` → logits `[b, t, v]`, weights `[b, h, t, t]`.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> LmOutput<B> {
        let [b, t] = tokens.dims();
        let out = self.states(tokens);
        let logits = self.project(out.x.reshape([b * t, self.d_model()])); // [b*t, v]
        LmOutput {
            logits: logits.reshape([b, t, self.vocab_size()]),
            attention: out.self_attention,
        }
    }

    /// The decoder's output states (after the final norm) and attention weights.
    ///
    /// # Shapes
    /// `tokens`: `[b, t]` → states `[b, t, d]`.
    pub fn states(&self, tokens: Tensor<B, 2, Int>) -> StackOutput<B> {
        let [_, t] = tokens.dims();
        let x = self.embed(tokens); // [b, t, d]
        let mask = AttentionMask::causal(t, &x.device());
        self.decoder.forward(x, Some(&mask), None)
    }

    /// Token embedding + positions (+ dropout): the decoder's input, `[b, t]` → `[b, t, d]`.
    pub fn embed(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.embed_from(tokens, 0)
    }

    /// [`Self::embed`] of tokens at positions `start..`.
    fn embed_from(&self, tokens: Tensor<B, 2, Int>, start: usize) -> Tensor<B, 3> {
        let x = crate::kernels::embedding(self.token_embedding.weight.val(), tokens); // [b, t, d]
        crate::kernels::dropout(&self.dropout, self.position.forward_from(x, start))
    }

    /// Logits of `n` new tokens that follow the positions in `cache` (which they extend): the
    /// last `n` rows of [`Self::forward`] on the whole sequence, at the cost of the new rows.
    /// Needs [`Self::caches`]; the whole sequence must fit in the context (learned positions).
    ///
    /// # Shapes
    /// `tokens`: `[b, n]` → logits `[b, n, v]`.
    pub fn forward_cached(
        &self,
        tokens: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let [b, n] = tokens.dims();
        let x = self.embed_from(tokens, cache.len()); // [b, n, d]
        let x = self.decoder.stream_cached(x, cache); // [b, n, d]
        self.project_stream(x).reshape([b, n, self.vocab_size()])
    }

    /// Logits of one new token of each sequence of a batch whose sequences are at different
    /// positions (continuous batching; see [`RowsCache`]): row `r`'s are those of decoding its
    /// sequence alone with [`Self::forward_cached`]. Needs [`Self::batches`]; with learned
    /// positions every row's position must be below the context.
    ///
    /// # Shapes
    /// `tokens`: `[b]` → logits `[b, v]`.
    pub fn forward_rows(
        &self,
        tokens: Tensor<B, 1, Int>,
        cache: &mut RowsCache<B>,
    ) -> Tensor<B, 2> {
        let [b] = tokens.dims();
        let table = self.token_embedding.weight.val();
        let x = crate::kernels::embedding(table, tokens.reshape([b, 1])); // [b, 1, d]
        let x = self.position.forward_at(x, &cache.rows.next);
        let x = crate::kernels::dropout(&self.dropout, x);
        let x = self.decoder.stream_rows(x, cache); // [b, 1, d]
        self.project_stream(x)
    }

    /// An empty batch for [`Self::forward_rows`], rolling as [`Self::new_cache`].
    pub fn new_rows_cache(&self) -> RowsCache<B> {
        RowsCache::new(
            self.decoder.n_layers(),
            self.rolls().then(|| self.context()),
        )
    }

    /// Whether the model decodes sequences at different positions in one batch
    /// ([`Self::forward_rows`]): every mixer keeps keys and values.
    pub fn batches(&self) -> bool {
        self.decoder.batches()
    }

    /// An empty key–value cache for [`Self::forward_cached`].
    ///
    /// With relative positions (RoPE, ALiBi) and full or local attention the cache rolls: each
    /// layer attends over its last `context` positions (see [`KvCache::rolling`]).
    pub fn new_cache(&self) -> KvCache<B> {
        let cache = self.decoder.new_cache(None);
        if self.rolls() {
            cache.rolling(self.context())
        } else {
            cache
        }
    }

    /// Whether [`Self::new_cache`] rolls.
    pub fn rolls(&self) -> bool {
        self.position.any_length()
            && self.decoder.blocks.iter().all(|block| {
                block.self_attention.as_ref().is_some_and(|attention| {
                    matches!(attention.mixer(), Mixer::Full | Mixer::Local { .. })
                })
            })
    }

    /// Whether the model runs on sequences longer than its context (relative positions).
    pub fn any_length(&self) -> bool {
        self.position.any_length()
    }

    /// Whether the model decodes from a cache: every attention mixer does; Hyena recomputes
    /// its window.
    pub fn caches(&self) -> bool {
        self.decoder.caches()
    }

    /// Projection to the vocabulary, `[n, d]` → `[n, v]`.
    fn project(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let (w, b) = self.head_weights();
        kernels::product(x, w, b)
    }

    /// The logits `[b·n, v]` of the decoder's last residual stream `[b, n, d]`: its final
    /// LayerNorm, then the output layer (in one launch where a decoding step folds them,
    /// [`TransformerStack::finish_product`]).
    fn project_stream(&self, x: Residual<B>) -> Tensor<B, 2> {
        let (w, b) = self.head_weights();
        self.decoder.finish_product(x, w, b)
    }

    /// The output layer's weight `[d, v]` and bias: the head's, or the embedding table read
    /// transposed where they are tied (no bias).
    fn head_weights(&self) -> (Tensor<B, 2>, Option<Tensor<B, 1>>) {
        match &self.head {
            Some(head) => (head.weight.val(), head.bias.as_ref().map(|b| b.val())),
            None => (self.token_embedding.weight.val().transpose(), None),
        }
    }

    /// Mean next-token cross-entropy of a batch, with the flattened logits `[b·t, v]` and
    /// targets `[b·t]` it was computed from.
    pub fn loss(&self, batch: LmBatch<B>) -> (Tensor<B, 1>, Tensor<B, 2>, Tensor<B, 1, Int>) {
        let [b, t] = batch.inputs.dims();
        let logits = self
            .forward(batch.inputs)
            .logits
            .reshape([b * t, self.vocab_size()]);
        let targets = batch.targets.reshape([b * t]);
        let loss = kernels::cross_entropy(logits.clone(), targets.clone(), 0.0, None).mean();
        (loss, logits, targets)
    }

    /// Vocabulary size `v`.
    pub fn vocab_size(&self) -> usize {
        self.token_embedding.weight.dims()[0]
    }

    /// Model width `d`.
    pub fn d_model(&self) -> usize {
        self.token_embedding.weight.dims()[1]
    }

    /// Longest input the positional encoding covers.
    pub fn context(&self) -> usize {
        self.position.max_len()
    }
}

impl<B: LabBackend> AttentionLayers<B> for LanguageModel<B> {
    fn attention_layers(&mut self) -> Vec<(String, &mut MultiHeadAttention<B>)> {
        self.decoder.named_attention("layer ")
    }
}
