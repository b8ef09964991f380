//! A stack of [`TransformerBlock`]s: the encoder and the decoder are the same stack, specialised
//! by their blocks (cross-attention or not) and by the mask the caller passes (causal or not).

use super::block::{Residual, TransformerBlock, TransformerBlockConfig};
use super::cache::{KvCache, RowsCache};
use super::mask::AttentionMask;
use super::relative::RelativePosition;
use crate::kernels::{self, After, LabBackend};
use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::prelude::*;

/// Configuration of [`TransformerStack`].
#[derive(Config, Debug)]
pub struct TransformerStackConfig {
    /// Number of layers `N`.
    pub n_layers: usize,
    /// The configuration shared by every layer.
    pub block: TransformerBlockConfig,
}

impl TransformerStackConfig {
    /// An encoder: `n_layers` blocks of self-attention (callers pass a padding mask).
    pub fn encoder(n_layers: usize, block: TransformerBlockConfig) -> Self {
        Self::new(n_layers, block.with_cross_attention(false))
    }

    /// A decoder: `n_layers` blocks of masked self-attention, with cross-attention over an
    /// encoder's output when `cross_attention` (callers pass a causal mask).
    pub fn decoder(n_layers: usize, block: TransformerBlockConfig, cross_attention: bool) -> Self {
        Self::new(n_layers, block.with_cross_attention(cross_attention))
    }

    /// The stack with relative positions (RoPE or ALiBi) in every self-attention layer.
    pub fn with_relative(mut self, relative: RelativePosition) -> Self {
        self.block.relative = relative;
        self
    }

    /// Builds the stack. Pre-norm stacks end with a LayerNorm (their blocks' outputs are
    /// un-normalised residual sums); post-norm stacks already end normalised.
    pub fn init<B: LabBackend>(&self, device: &B::Device) -> TransformerStack<B> {
        TransformerStack {
            blocks: (0..self.n_layers)
                .map(|_| self.block.init(device))
                .collect(),
            final_norm: self.block.norm_first.then(|| {
                LayerNormConfig::new(self.block.d_model)
                    .with_bias(self.block.bias)
                    .with_epsilon(self.block.norm_epsilon)
                    .init(device)
            }),
            norm_epsilon: self.block.norm_epsilon,
        }
    }
}

/// `N` transformer layers and, for pre-norm, a final LayerNorm.
#[derive(Module, Debug)]
pub struct TransformerStack<B: LabBackend> {
    /// The layers, first to last.
    pub blocks: Vec<TransformerBlock<B>>,
    final_norm: Option<LayerNorm<B>>,
    #[module(skip)]
    norm_epsilon: f64,
}

/// The output of a stack and the attention weights of every layer.
#[derive(Debug, Clone)]
pub struct StackOutput<B: LabBackend> {
    /// `[b, t, d]`.
    pub x: Tensor<B, 3>,
    /// Per layer, self-attention weights `[b, h, t, t]` — for the full mixer; empty for the
    /// others, which never build them in a forward pass ([`TransformerStack::mixer_weights`]).
    pub self_attention: Vec<Tensor<B, 4>>,
    /// Per layer, cross-attention weights `[b, h, t, s]` (empty for encoders and decoder-only).
    pub cross_attention: Vec<Tensor<B, 4>>,
}

impl<B: LabBackend> TransformerStack<B> {
    /// Runs every layer.
    ///
    /// # Shapes
    /// - `x`: `[b, t, d]`; `mask`: broadcastable to `[b, 1, t, t]`, `true` = masked out
    /// - `memory`: `[b, s, d]` encoder output and its key-padding mask (decoders with
    ///   cross-attention only)
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        mask: Option<&AttentionMask<B>>,
        memory: Option<(&Tensor<B, 3>, Option<&AttentionMask<B>>)>,
    ) -> StackOutput<B> {
        let mut x = Residual::new(x);
        let mut self_attention = Vec::with_capacity(self.blocks.len());
        let mut cross_attention = Vec::new();
        for block in &self.blocks {
            let (out, self_weights, cross_weights) = block.forward_residual(x, mask, memory);
            x = out;
            self_attention.extend(self_weights);
            cross_attention.extend(cross_weights);
        }
        StackOutput {
            x: self.finish(x),
            self_attention,
            cross_attention,
        }
    }

    /// [`Self::forward`] of `n` new positions of a causal decoder that follow the positions in
    /// `cache`, every layer attending over its own cache (and reading `cache.cross` when it has
    /// cross-attention). Needs [`Self::caches`].
    ///
    /// # Shapes
    /// `x`: `[b, n, d]` → `[b, n, d]`.
    pub fn forward_cached(&self, x: Tensor<B, 3>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        self.finish(self.stream_cached(x, cache))
    }

    /// [`Self::forward_cached`] without the final LayerNorm: the last block's residual stream,
    /// for [`Self::finish_product`].
    pub fn stream_cached(&self, x: Tensor<B, 3>, cache: &mut KvCache<B>) -> Residual<B> {
        let mut x = Residual::new(x);
        let mut cross = cache.cross.iter();
        for (block, layer) in self.blocks.iter().zip(&mut cache.layers) {
            let memory = if block.cross_attention.is_some() {
                cross.next()
            } else {
                None
            };
            x = block.forward_cached(x, layer, memory);
        }
        x
    }

    /// [`Self::forward_cached`] of one new token of each sequence of a batch whose sequences
    /// are at different positions; advances every row by one. Needs [`Self::batches`].
    ///
    /// # Shapes
    /// `x`: `[b, 1, d]` → `[b, 1, d]`.
    pub fn forward_rows(&self, x: Tensor<B, 3>, cache: &mut RowsCache<B>) -> Tensor<B, 3> {
        self.finish(self.stream_rows(x, cache))
    }

    /// [`Self::forward_rows`] without the final LayerNorm (see [`Self::stream_cached`]).
    pub fn stream_rows(&self, x: Tensor<B, 3>, cache: &mut RowsCache<B>) -> Residual<B> {
        cache.trim();
        let mut x = Residual::new(x);
        let layers = cache.layers.iter_mut().zip(&mut cache.projections);
        for (block, (kv, projection)) in self.blocks.iter().zip(layers) {
            x = block.forward_rows(x, kv, projection, &cache.rows);
        }
        cache.rows.next.iter_mut().for_each(|next| *next += 1);
        x
    }

    /// The stack's output from the last block's stream `x` `[b, n, d]` through a product, as
    /// rows: `finish(x)·w + b` `[b·n, o]`. A pre-norm stack's final LayerNorm runs in the
    /// product's launch where [`kernels::folds_decode`] says so for the rows (a decoding step
    /// on a GPU: its output layer).
    pub fn finish_product(
        &self,
        x: Residual<B>,
        w: Tensor<B, 2>,
        b: Option<Tensor<B, 1>>,
    ) -> Tensor<B, 2> {
        let [batch, n, d] = x.dims();
        match &self.final_norm {
            Some(norm) if kernels::folds_decode::<B>(batch * n, &x.device()) => {
                let x = x.resolve().reshape([batch * n, d]);
                let norm = Some((norm, self.norm_epsilon));
                kernels::decode_linear(x, norm, w, b, After::Nothing)
            }
            _ => kernels::product(self.finish(x).reshape([batch * n, d]), w, b),
        }
    }

    /// The stack's output from the last block's residual stream: its final LayerNorm (with the
    /// last addition, in one kernel) in a pre-norm stack.
    fn finish(&self, x: Residual<B>) -> Tensor<B, 3> {
        match &self.final_norm {
            Some(norm) => x.normalise(norm, self.norm_epsilon).1,
            None => x.resolve(),
        }
    }

    /// Whether every layer decodes in a batch of sequences at different positions.
    pub fn batches(&self) -> bool {
        self.blocks.iter().all(TransformerBlock::batches)
    }

    /// An empty decoding cache; a decoder with cross-attention reads `memory` (the encoder's
    /// states `[b, s, d]` and their key-padding mask), projected here once for every layer.
    pub fn new_cache(
        &self,
        memory: Option<(&Tensor<B, 3>, Option<&AttentionMask<B>>)>,
    ) -> KvCache<B> {
        let cross = match memory {
            Some((states, mask)) => self
                .blocks
                .iter()
                .filter_map(|block| block.cross_memory(states, mask))
                .collect(),
            None => Vec::new(),
        };
        KvCache::with_memory(self.blocks.len(), cross)
    }

    /// Whether every layer can decode from a key–value cache.
    pub fn caches(&self) -> bool {
        self.blocks.iter().all(TransformerBlock::caches)
    }

    /// What layer `layer`'s self-attention reads (after the layers before it, and its own
    /// LayerNorm in a pre-norm stack): the `X` that `explain` projects into queries, keys and
    /// values. Arguments as in [`Self::forward`]; `layer` must be below [`Self::n_layers`].
    pub fn self_attention_input(
        &self,
        x: Tensor<B, 3>,
        mask: Option<&AttentionMask<B>>,
        memory: Option<(&Tensor<B, 3>, Option<&AttentionMask<B>>)>,
        layer: usize,
    ) -> Tensor<B, 3> {
        let x = self.blocks[..layer]
            .iter()
            .fold(x, |x, block| block.forward(x, mask, memory).x);
        self.blocks[layer].self_attention_input(x)
    }

    /// Every layer's self-attention weights `[b, h, t, t]` as dense matrices, whatever the
    /// mixer (see [`super::MultiHeadAttention::mixer_weights`]): for inspecting sparse and
    /// linear attention, which do not build them in a forward pass. `None` for Hyena, which has
    /// no attention weights. Arguments as in [`Self::forward`].
    pub fn mixer_weights(
        &self,
        x: Tensor<B, 3>,
        mask: Option<&AttentionMask<B>>,
        memory: Option<(&Tensor<B, 3>, Option<&AttentionMask<B>>)>,
    ) -> Option<Vec<Tensor<B, 4>>> {
        let mut x = x;
        let mut weights = Vec::with_capacity(self.blocks.len());
        for block in &self.blocks {
            let attention = block.self_attention.as_ref()?;
            let h = block.self_attention_input(x.clone());
            weights.push(attention.mixer_weights(h.clone(), h, mask));
            x = block.forward(x, mask, memory).x;
        }
        Some(weights)
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.blocks.len()
    }
}
