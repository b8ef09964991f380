//! One transformer layer: attention and feed-forward sublayers, each wrapped in a residual
//! connection and LayerNorm.
//!
//! Post-norm (the original paper): `x = LN(x + Sublayer(x))`.
//! Pre-norm (GPT-2 and most modern models): `x = x + Sublayer(LN(x))`.

use super::attention::{MultiHeadAttention, MultiHeadAttentionConfig, StepInput};
use super::cache::{Columns, CrossMemory, LayerCache, Rows};
use super::feedforward::{Activation, FeedForward, FeedForwardConfig};
use super::hyena::Hyena;
use super::mask::AttentionMask;
use super::mixer::Mixer;
use super::relative::RelativePosition;
use crate::kernels::{self, add_layer_norm, layer_norm, LabBackend, PackedLinear};
use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, Initializer, LayerNorm, LayerNormConfig};
use burn::prelude::*;

/// Configuration of [`TransformerBlock`]: an encoder block, or a decoder block when
/// `cross_attention` is set (masked self-attention → cross-attention → feed-forward).
#[derive(Config, Debug)]
pub struct TransformerBlockConfig {
    /// Model width.
    pub d_model: usize,
    /// Number of attention heads.
    pub n_heads: usize,
    /// Inner width of the feed-forward network.
    pub d_ff: usize,
    /// Dropout on attention weights, after the FFN activation and on each sublayer's output.
    #[config(default = 0.0)]
    pub dropout: f64,
    /// The feed-forward non-linearity.
    #[config(default = "Activation::Gelu")]
    pub activation: Activation,
    /// Pre-norm (`x + f(LN(x))`) when true, post-norm (`LN(x + f(x))`) when false.
    #[config(default = true)]
    pub norm_first: bool,
    /// Adds a cross-attention sublayer over an encoder's output (`memory`).
    #[config(default = false)]
    pub cross_attention: bool,
    /// Whether linear layers and LayerNorms carry a bias.
    #[config(default = true)]
    pub bias: bool,
    /// The LayerNorms' epsilon (BERT's is 1e-12).
    #[config(default = 1e-5)]
    pub norm_epsilon: f64,
    /// Standard deviation of the normal init of the projections that write into the residual
    /// stream (W^O and W₂). GPT-2 uses `0.02/√(2·n_layers)` so the stream's variance does not
    /// grow with depth; the other weights use 0.02.
    #[config(default = 0.02)]
    pub residual_init_std: f64,
    /// The token mixer of the self-attention sublayer (cross-attention is always full).
    #[config(default = "Mixer::Full")]
    pub mixer: Mixer,
    /// Longest sequence the block will see (the Hyena filters are laid out over it).
    #[config(default = 1024)]
    pub max_len: usize,
    /// Relative positions in the self-attention (RoPE or ALiBi); cross-attention has none.
    #[config(default = "RelativePosition::None")]
    pub relative: RelativePosition,
}

/// One transformer layer. See the module docs for the residual/LayerNorm arrangement.
#[derive(Module, Debug)]
pub struct TransformerBlock<B: LabBackend> {
    /// (Masked) self-attention: every mixer but Hyena.
    pub self_attention: Option<MultiHeadAttention<B>>,
    /// The Hyena operator, in self-attention's place when the mixer is `hyena`.
    pub hyena: Option<Hyena<B>>,
    norm_self: LayerNorm<B>,
    /// Attention over the encoder output, in decoder blocks.
    pub cross_attention: Option<MultiHeadAttention<B>>,
    norm_cross: Option<LayerNorm<B>>,
    /// The position-wise feed-forward network.
    pub feedforward: FeedForward<B>,
    norm_ff: LayerNorm<B>,
    dropout: Dropout,
    norm_first: bool,
    #[module(skip)]
    norm_epsilon: f64,
}

/// A stack's residual stream between sublayers: `x + Dropout(h)`, where a pre-norm block's
/// last addition is left pending so that it runs in one kernel with the LayerNorm that reads
/// the sum next (the next block's, or the stack's final one: [`add_layer_norm`]). Its dropout
/// mask is drawn where the sum is made, right after the sublayer, so the masks come in the
/// order they came when each addition ran on its own.
pub struct Residual<B: LabBackend> {
    x: Tensor<B, 3>,
    /// A sublayer's output not yet added, and the dropout it takes.
    pending: Option<(Tensor<B, 3>, Dropout)>,
}

impl<B: LabBackend> Residual<B> {
    /// The stream holding `x` `[b, t, d]`.
    pub fn new(x: Tensor<B, 3>) -> Self {
        Self { x, pending: None }
    }

    /// Its shape, `[b, t, d]`.
    pub fn dims(&self) -> [usize; 3] {
        self.x.dims()
    }

    /// Its device.
    pub fn device(&self) -> B::Device {
        self.x.device()
    }

    /// Its value, `x + Dropout(h)`.
    pub fn resolve(self) -> Tensor<B, 3> {
        match self.pending {
            Some((h, dropout)) => crate::kernels::dropout_add(&dropout, self.x, h),
            None => self.x,
        }
    }

    /// `(value, norm(value))`, the pending addition and the LayerNorm in one kernel.
    pub fn normalise(self, norm: &LayerNorm<B>, epsilon: f64) -> (Tensor<B, 3>, Tensor<B, 3>) {
        match self.pending {
            Some((h, dropout)) => add_layer_norm(&dropout, self.x, h, norm, epsilon),
            None => (self.x.clone(), layer_norm(norm, epsilon, self.x)),
        }
    }
}

/// What a block returns: its output and the attention weights it used.
#[derive(Debug, Clone)]
pub struct BlockOutput<B: LabBackend> {
    /// `[b, t, d]`.
    pub x: Tensor<B, 3>,
    /// Self-attention weights `[b, h, t, t]`, when the mixer computes them in its forward pass
    /// (the full mixer).
    pub self_weights: Option<Tensor<B, 4>>,
    /// Cross-attention weights `[b, h, t, s]`, in decoder blocks.
    pub cross_weights: Option<Tensor<B, 4>>,
}

impl TransformerBlockConfig {
    /// Builds the block.
    pub fn init<B: LabBackend>(&self, device: &B::Device) -> TransformerBlock<B> {
        let residual_init = Initializer::Normal {
            mean: 0.0,
            std: self.residual_init_std,
        };
        let attention = |mixer: Mixer, relative| {
            MultiHeadAttentionConfig::new(self.d_model, self.n_heads)
                .with_dropout(self.dropout)
                .with_bias(self.bias)
                .with_output_initializer(residual_init.clone())
                .with_mixer(mixer)
                .with_relative(relative)
                .init(device)
        };
        let (self_attention, hyena) = match &self.mixer {
            Mixer::Hyena(hyena) => (
                None,
                Some(hyena.init(self.d_model, self.max_len, residual_init.clone(), device)),
            ),
            mixer => (Some(attention(mixer.clone(), self.relative)), None),
        };
        let norm = || {
            LayerNormConfig::new(self.d_model)
                .with_bias(self.bias)
                .with_epsilon(self.norm_epsilon)
                .init(device)
        };
        TransformerBlock {
            self_attention,
            hyena,
            norm_self: norm(),
            cross_attention: self
                .cross_attention
                .then(|| attention(Mixer::Full, RelativePosition::None)),
            norm_cross: self.cross_attention.then(norm),
            feedforward: FeedForwardConfig::new(self.d_model, self.d_ff)
                .with_activation(self.activation)
                .with_dropout(self.dropout)
                .with_bias(self.bias)
                .with_output_initializer(residual_init.clone())
                .init(device),
            norm_ff: norm(),
            dropout: DropoutConfig::new(self.dropout).init(),
            norm_first: self.norm_first,
            norm_epsilon: self.norm_epsilon,
        }
    }
}

impl<B: LabBackend> TransformerBlock<B> {
    /// Runs the layer.
    ///
    /// # Shapes
    /// - `x`: `[b, t, d]`; `mask`: self-attention mask broadcastable to `[b, 1, t, t]`
    /// - `memory`: encoder output `[b, s, d]` with its key-padding mask, for decoder blocks
    /// - returns `x` `[b, t, d]`, the self-attention weights `[b, h, t, t]` when the mixer has
    ///   them for free, and the cross-attention weights `[b, h, t, s]`
    ///
    /// # Panics
    /// If `memory` is given to a block built without cross-attention, or vice versa.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        mask: Option<&AttentionMask<B>>,
        memory: Option<(&Tensor<B, 3>, Option<&AttentionMask<B>>)>,
    ) -> BlockOutput<B> {
        let (x, self_weights, cross_weights) =
            self.forward_residual(Residual::new(x), mask, memory);
        BlockOutput {
            x: x.resolve(),
            self_weights,
            cross_weights,
        }
    }

    /// [`Self::forward`] on a stack's residual stream (the last sublayer's addition left for
    /// the next LayerNorm), with the self- and cross-attention weights.
    pub(crate) fn forward_residual(
        &self,
        x: Residual<B>,
        mask: Option<&AttentionMask<B>>,
        memory: Option<(&Tensor<B, 3>, Option<&AttentionMask<B>>)>,
    ) -> (Residual<B>, Option<Tensor<B, 4>>, Option<Tensor<B, 4>>) {
        let mut self_weights = None;
        let x = self.residual(x, &self.norm_self, |h| match &self.hyena {
            Some(hyena) => hyena.forward(h),
            None => {
                let out = self.attention().forward_self(h, mask);
                self_weights = out.weights;
                out.context
            }
        });

        let mut cross_weights = None;
        let x = match (&self.cross_attention, &self.norm_cross, memory) {
            (Some(cross), Some(norm), Some((memory, memory_mask))) => self.residual(x, norm, |h| {
                let out = cross.forward(h, memory.clone(), memory_mask);
                cross_weights = out.weights;
                out.context
            }),
            (None, None, None) => x,
            _ => panic!("memory must be given exactly to blocks built with cross_attention"),
        };

        let x = self.residual(x, &self.norm_ff, |h| self.feedforward.forward(h));
        (x, self_weights, cross_weights)
    }

    /// [`Self::forward`] of `n` new positions of a causal decoder that follow the positions in
    /// `cache` (see [`MultiHeadAttention::forward_cached`]), reading the encoder memory through
    /// `cross` when the block has cross-attention. Needs [`Self::caches`].
    ///
    /// # Shapes
    /// `x`: `[b, n, d]` → `[b, n, d]` (the residual stream's).
    ///
    /// # Panics
    /// If `cross` is given to a block built without cross-attention, or vice versa.
    pub fn forward_cached(
        &self,
        x: Residual<B>,
        cache: &mut LayerCache<B>,
        cross: Option<&CrossMemory<B>>,
    ) -> Residual<B> {
        if cross.is_none() && self.folds(&x) {
            return self.step_folded(x, |input| self.attention().context_cached(input, cache));
        }
        let x = self.residual(x, &self.norm_self, |h| {
            self.attention().forward_cached(h, cache)
        });
        let x = match (&self.cross_attention, &self.norm_cross, cross) {
            (Some(attention), Some(norm), Some(memory)) => {
                self.residual(x, norm, |h| attention.forward_memory(h, memory))
            }
            (None, None, None) => x,
            _ => panic!("cross memory must be given exactly to blocks built with cross_attention"),
        };
        self.residual(x, &self.norm_ff, |h| self.feedforward.forward(h))
    }

    /// [`Self::forward`] of one new token of each sequence of a batch at different positions
    /// (see [`MultiHeadAttention::forward_rows`]). A decoder-only block.
    ///
    /// # Shapes
    /// `x`: `[b, 1, d]` → `[b, 1, d]` (the residual stream's).
    pub fn forward_rows(
        &self,
        x: Residual<B>,
        kv: &mut Option<Columns<B>>,
        projection: &mut Option<PackedLinear<B>>,
        rows: &Rows,
    ) -> Residual<B> {
        if self.folds(&x) {
            return self.step_folded(x, |input| {
                self.attention().context_rows(input, kv, projection, rows)
            });
        }
        let x = self.residual(x, &self.norm_self, |h| {
            self.attention().forward_rows(h, kv, projection, rows)
        });
        self.residual(x, &self.norm_ff, |h| self.feedforward.forward(h))
    }

    /// Whether a decoding step of the stream `x` runs through [`Self::step_folded`]: a
    /// pre-norm block with self-attention, no cross-attention and a GELU feed-forward network,
    /// where [`kernels::folds_decode`] says so for its rows.
    fn folds(&self, x: &Residual<B>) -> bool {
        let [b, n, _] = x.dims();
        self.norm_first
            && self.self_attention.is_some()
            && self.cross_attention.is_none()
            && self.feedforward.folds()
            && kernels::folds_decode::<B>(b * n, &x.device())
    }

    /// A decoding step of a pre-norm block in four launches of products on a GPU and the
    /// attention's own ([`kernels::decode_linear`]): the self-attention's LayerNorm in the
    /// query, key and value product (`context` makes the attention's context from that
    /// input), the residual addition in the output projection, and the feed-forward network
    /// as [`FeedForward::forward_step`]. Where it ran apart: two LayerNorms (each with the
    /// addition before it), four products and a GELU.
    fn step_folded(
        &self,
        x: Residual<B>,
        context: impl FnOnce(StepInput<'_, B>) -> Tensor<B, 3>,
    ) -> Residual<B> {
        let x = x.resolve();
        let input = StepInput::Stream {
            x: x.clone(),
            norm: &self.norm_self,
            epsilon: self.norm_epsilon,
        };
        let x = self.attention().project_out_onto(context(input), x);
        let x = self
            .feedforward
            .forward_step(x, &self.norm_ff, self.norm_epsilon);
        Residual::new(x)
    }

    /// Whether the block decodes in a batch of sequences at different positions: no
    /// cross-attention, and self-attention that keeps keys and values.
    pub fn batches(&self) -> bool {
        self.cross_attention.is_none()
            && self
                .self_attention
                .as_ref()
                .is_some_and(MultiHeadAttention::keeps_keys)
    }

    /// The encoder memory's keys and values as this block's cross-attention reads them
    /// (`None` without cross-attention).
    pub fn cross_memory(
        &self,
        memory: &Tensor<B, 3>,
        mask: Option<&AttentionMask<B>>,
    ) -> Option<CrossMemory<B>> {
        self.cross_attention
            .as_ref()
            .map(|attention| attention.memory(memory.clone(), mask))
    }

    /// Whether the block can decode from a cache: its self-attention is an attention mixer
    /// (Hyena recomputes).
    pub fn caches(&self) -> bool {
        self.self_attention
            .as_ref()
            .is_some_and(MultiHeadAttention::caches)
    }

    /// Pre-norm: `x + Dropout(f(LN(x)))`, the addition left in the stream for the next
    /// LayerNorm; post-norm: `LN(x + Dropout(f(x)))`, the addition and LayerNorm in one kernel
    /// ([`add_layer_norm`]).
    fn residual(
        &self,
        x: Residual<B>,
        norm: &LayerNorm<B>,
        sublayer: impl FnOnce(Tensor<B, 3>) -> Tensor<B, 3>,
    ) -> Residual<B> {
        if self.norm_first {
            let (x, h) = x.normalise(norm, self.norm_epsilon);
            Residual {
                x,
                pending: Some((sublayer(h), self.dropout.clone())),
            }
        } else {
            let x = x.resolve();
            let h = sublayer(x.clone());
            let (_, y) = add_layer_norm(&self.dropout, x, h, norm, self.norm_epsilon);
            Residual::new(y)
        }
    }

    /// The self-attention sublayer.
    ///
    /// # Panics
    /// If the block mixes with Hyena instead (see [`Self::hyena`]).
    pub fn attention(&self) -> &MultiHeadAttention<B> {
        self.self_attention
            .as_ref()
            .expect("blocks without Hyena have self-attention")
    }

    /// The LayerNorm applied before self-attention in pre-norm blocks (identity's place in
    /// post-norm blocks, where it follows the residual instead).
    pub fn self_attention_input(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        if self.norm_first {
            layer_norm(&self.norm_self, self.norm_epsilon, x)
        } else {
            x
        }
    }
}
