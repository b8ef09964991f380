//! Scaled dot-product attention and multi-head attention ("Attention Is All You Need", §3.2).

use super::cache::{Columns, CrossMemory, LayerCache, Rows};
use super::linear;
use super::linear_attention::{linear_attention, linear_attention_weights};
use super::mask::{
    local_allows, local_mask, pattern_rows, strided_allows, strided_mask, AttentionMask,
};
use super::mixer::Mixer;
use super::relative::{alibi_bias, alibi_slopes, rope, rope_packed, rope_rows, RelativePosition};
use super::sparse::{local_attention, strided_attention};
use crate::kernels::reference::{merge_heads, split_packed};
use crate::kernels::{self, softmax, After, LabAutodiff, LabBackend, PackedLinear};
use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig, Initializer, LayerNorm, Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::Bool;
use std::cell::Cell;

pub use crate::kernels::reference::MASKED_SCORE;

thread_local! {
    static WEIGHTS_WANTED: Cell<bool> = const { Cell::new(true) };
}

/// Runs `f` on this thread with inference passes free not to return attention weights: full
/// attention then runs as the fused kernel (as in training), and the models' outputs carry
/// no weights. For work that reads only logits or states — `eval`, `generate`, `translate`,
/// `classify`, `predict`, training's validation step; inspection keeps the default, where the
/// weights come with the pass.
pub fn without_weights<R>(f: impl FnOnce() -> R) -> R {
    let before = WEIGHTS_WANTED.with(|c| c.replace(false));
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            WEIGHTS_WANTED.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(before);
    f()
}

/// `softmax(Q·Kᵀ/√d_k + mask)·V`, returning the context and the attention weights.
///
/// The composed form, which builds the `t × s` weights: what inspection reads. The layers
/// themselves run [`MultiHeadAttention`]'s mixer — in training and weight-free inference
/// ([`without_weights`]) the fused kernel ([`crate::kernels::attention`],
/// [`crate::kernels::packed_self_attention`]), which computes the same function without
/// storing the weights and is tested against this one.
///
/// # Shapes
/// - `q`: `[b, h, t, k]`, `k`: `[b, h, s, k]`, `v`: `[b, h, s, k]`
/// - `mask`: broadcastable to `[b, h, t, s]`, `true` = masked out
/// - returns `(context [b, h, t, k], weights [b, h, t, s])`; each row of `weights` sums to 1.
pub fn scaled_dot_product_attention<B: LabBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Option<&AttentionMask<B>>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let weights = attention_weights(q, k, mask); // [b, h, t, s]
    (weights.clone().matmul(v), weights) // [b, h, t, k]
}

/// The attention weights `A = softmax(Q·Kᵀ/√d_k + mask)`, masked entries set to exactly 0.
///
/// # Shapes
/// `q`: `[b, h, t, k]`, `k`: `[b, h, s, k]`, mask broadcastable to `[b, h, t, s]` → `[b, h, t, s]`.
pub fn attention_weights<B: LabBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    mask: Option<&AttentionMask<B>>,
) -> Tensor<B, 4> {
    masked_attention_weights(q, k, mask.map(AttentionMask::tensor))
}

/// [`attention_weights`] with a dense mask broadcastable to `[b, h, t, s]`, `true` = masked out.
pub fn masked_attention_weights<B: LabBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
) -> Tensor<B, 4> {
    biased_attention_weights(q, k, mask, None)
}

/// [`masked_attention_weights`] with `bias` (broadcastable to `[b, h, t, s]`, ALiBi's) added
/// to the scaled scores before the mask and the softmax.
pub fn biased_attention_weights<B: LabBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
    bias: Option<Tensor<B, 4>>,
) -> Tensor<B, 4> {
    let [b, h, t, d_head] = q.dims();
    let s = k.dims()[2];
    let scores = q.matmul(k.transpose()).div_scalar((d_head as f32).sqrt()); // [b, h, t, s]
    let scores = match bias {
        Some(bias) => scores + bias,
        None => scores,
    };
    let scores = match mask {
        Some(mask) => scores.mask_fill(mask.expand([b, h, t, s]), MASKED_SCORE),
        None => scores,
    };
    softmax(scores)
}

/// Fewest key–value columns a decoding step's products see on a backend that autotunes.
const DECODE_COLUMNS: usize = 16;

/// The key–value columns a decoding step's products see for `s` cached positions: `s` itself,
/// or on a backend that autotunes its products per shape ([`LabBackend::autotunes`]) the next
/// power of two from [`DECODE_COLUMNS`], the extra columns zero and masked. burn's matmul
/// autotune keys a product by its dimensions' power-of-two bucket *and* by how many times two
/// divides them and their strides: a cache that grows one column per token met a new key at
/// most steps (a 100-token decode met 40 on lavapipe; on CUDA each costs seconds of compiling
/// and timing), where the padded lengths meet one per doubling.
pub fn decode_columns<B: LabBackend>(s: usize) -> usize {
    match B::autotunes() {
        true => s.next_power_of_two().max(DECODE_COLUMNS),
        false => s,
    }
}

/// `x` `[b, h, s, k]` with zero rows after its own up to `columns`.
fn zero_padded<B: LabBackend>(x: Tensor<B, 4>, columns: usize) -> Tensor<B, 4> {
    let [b, h, s, k] = x.dims();
    match columns > s {
        true => {
            let zeros = Tensor::zeros([b, h, columns - s, k], &x.device());
            Tensor::cat(vec![x, zeros], 2)
        }
        false => x,
    }
}

/// One decoding step's attention through the attention kernel: one new query per sequence,
/// `q` `[b, h, 1, k]`, over `k`, `v` `[b, h, s, k]`, where row `r` sees column `j` unless
/// `masked(r, j)` → the context with its heads merged, `[b, 1, h·k]`. For one query any pattern
/// is a mask of columns per row, which the kernel takes as padding (see
/// [`MultiHeadAttention::decodes_with_kernel`] for where it is used).
fn decode_attention<B: LabBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    masked: impl Fn(usize, usize) -> bool,
) -> Tensor<B, 3> {
    let [b, _, n, _] = q.dims();
    debug_assert_eq!(n, 1, "one query per sequence");
    let s = k.dims()[2];
    let flags: Vec<f32> = (0..b)
        .flat_map(|r| (0..s).map(move |j| (r, j)))
        .map(|(r, j)| if masked(r, j) { 1.0 } else { 0.0 })
        .collect();
    // Where every column is seen (one sequence, or a batch at one length, under full
    // attention) there is no mask to upload: a copy to the device a layer and token fewer.
    let pad = flags
        .contains(&1.0)
        .then(|| Tensor::<B, 2>::from_data(TensorData::new(flags, [b, s]), &q.device()));
    decoded(q, k, v, pad)
}

/// One query per sequence (`q` `[b, h, 1, k]`) over `k`, `v` `[b, h, s, k]` through the
/// attention kernel, columns where `pad` (`[b, s]`, `1` = padding) says masked → the context
/// with its heads merged, `[b, 1, h·k]`.
fn decoded<B: LabBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    pad: Option<Tensor<B, 2>>,
) -> Tensor<B, 3> {
    // [b, h, 1, k]. With one row per sequence that order is already the merged layout: a
    // reshape without the copy that `merge_heads`' permutation costs.
    let context = kernels::attention_padded(q, k, v, false, pad, None);
    let [b, h, _, width] = context.dims();
    context.reshape([b, 1, h * width])
}

/// The input of a decoding step's sublayer: normalised already, or the residual stream with
/// the LayerNorm its first product applies in the same launch (a pre-norm block's, where
/// [`kernels::folds_decode`] says so).
pub enum StepInput<'a, B: LabBackend> {
    /// `[b, n, d]`, what the sublayer reads.
    Normalised(Tensor<B, 3>),
    /// The stream `x` `[b, n, d]`, read through `norm` at `epsilon`.
    Stream {
        /// The residual stream.
        x: Tensor<B, 3>,
        /// The LayerNorm before the sublayer.
        norm: &'a LayerNorm<B>,
        /// Its `ε`.
        epsilon: f64,
    },
}

impl<B: LabBackend> StepInput<'_, B> {
    /// New positions a sequence, `n` of `[b, n, d]`.
    pub fn positions(&self) -> usize {
        match self {
            StepInput::Normalised(x) | StepInput::Stream { x, .. } => x.dims()[1],
        }
    }
}

/// Configuration of [`MultiHeadAttention`].
#[derive(Config, Debug)]
pub struct MultiHeadAttentionConfig {
    /// Model width `d_model`; must be divisible by `n_heads`.
    pub d_model: usize,
    /// Number of heads `h`.
    pub n_heads: usize,
    /// Width of each head; `d_model / n_heads` when absent. A pruned layer keeps its heads'
    /// width with fewer heads, so its projections are `d_model × h·d_head`.
    #[config(default = "None")]
    pub head_dim: Option<usize>,
    /// Dropout on the attention weights (as in the paper's "attention dropout").
    #[config(default = 0.0)]
    pub dropout: f64,
    /// Whether the four projections carry a bias.
    #[config(default = true)]
    pub bias: bool,
    /// Initializer of W^Q, W^K and W^V.
    #[config(default = "Initializer::Normal { mean: 0.0, std: 0.02 }")]
    pub initializer: Initializer,
    /// Initializer of the output projection W^O, which feeds the residual stream (GPT-2 scales
    /// it down by `1/√(2·n_layers)`).
    #[config(default = "Initializer::Normal { mean: 0.0, std: 0.02 }")]
    pub output_initializer: Initializer,
    /// How queries mix the keys: full softmax attention, a sparse pattern, or linear attention
    /// (sparse and linear mixers need self-attention; see [`Mixer`]).
    #[config(default = "Mixer::Full")]
    pub mixer: Mixer,
    /// Relative positions inside attention: rotary queries and keys, or ALiBi's biases
    /// (self-attention only; see [`super::relative`]).
    #[config(default = "RelativePosition::None")]
    pub relative: RelativePosition,
}

/// Multi-head attention: `MultiHead(Q,K,V) = Concat(head_1..head_h)·W^O`,
/// `head_i = Attention(Q·W_i^Q, K·W_i^K, V·W_i^V)`.
///
/// The per-head projections are stored as one `d_model × h·k` matrix each (head `i` owns
/// columns `i·k..(i+1)·k`; `h·k = d_model` until heads are pruned, when the removed heads'
/// columns go: see [`crate::nn::remove_heads`]). Self-attention passes the same sequence as `query` and `memory`;
/// cross-attention passes the decoder state as `query` and the encoder output as `memory`.
#[derive(Module, Debug)]
pub struct MultiHeadAttention<B: LabBackend> {
    /// W^Q, `[d, h·k]`.
    pub query: Linear<B>,
    /// W^K, `[d, h·k]`.
    pub key: Linear<B>,
    /// W^V, `[d, h·k]`.
    pub value: Linear<B>,
    /// W^O, `[h·k, d]`.
    pub output: Linear<B>,
    dropout: Dropout,
    n_heads: usize,
    mixer: Mixer,
    relative: RelativePosition,
    /// Gates on the heads: head `i`'s context is multiplied by `gates[i]` before `W^O` (0
    /// removes the head, 1 keeps it). Not saved with the weights; `None`, the default, costs
    /// nothing.
    #[module(skip)]
    head_gates: Option<Vec<f32>>,
    /// After pruning: the unpruned layer's head count and the heads left, by their index there
    /// (ALiBi's slopes belong to those heads).
    #[module(skip)]
    pruned_from: Option<(usize, Vec<usize>)>,
}

/// What an attention layer returns: the projected context and the weights of every head.
#[derive(Debug, Clone)]
pub struct AttentionOutput<B: LabBackend> {
    /// `[b, t, d]`, after the output projection W^O.
    pub context: Tensor<B, 3>,
    /// `[b, h, t, s]`, the softmax weights (before attention dropout); rows sum to 1. Only the
    /// full mixer has them for free, and only outside training with fused kernels (whose
    /// attention kernel never stores them); the others never build the `t × s` matrix in a forward
    /// pass ([`MultiHeadAttention::mixer_weights`] builds it on request).
    pub weights: Option<Tensor<B, 4>>,
}

impl MultiHeadAttentionConfig {
    /// Builds the module.
    ///
    /// # Panics
    /// If `d_model` is not divisible by `n_heads` (configs are validated before this is called).
    pub fn init<B: LabBackend>(&self, device: &B::Device) -> MultiHeadAttention<B> {
        assert!(
            self.mixer.is_attention(),
            "the hyena mixer is built by the block, not as attention"
        );
        assert!(
            self.n_heads > 0
                && (self.head_dim.is_some() || self.d_model.is_multiple_of(self.n_heads)),
            "d_model ({}) must be divisible by n_heads ({})",
            self.d_model,
            self.n_heads
        );
        let inner = self.n_heads * self.head_dim.unwrap_or(self.d_model / self.n_heads);
        let linear = |[d_in, d_out]: [usize; 2], initializer: &Initializer| {
            LinearConfig::new(d_in, d_out)
                .with_bias(self.bias)
                .with_initializer(initializer.clone())
                .init(device)
        };
        let (into_heads, out_of_heads) = ([self.d_model, inner], [inner, self.d_model]);
        MultiHeadAttention {
            query: linear(into_heads, &self.initializer),
            key: linear(into_heads, &self.initializer),
            value: linear(into_heads, &self.initializer),
            output: linear(out_of_heads, &self.output_initializer),
            dropout: DropoutConfig::new(self.dropout).init(),
            n_heads: self.n_heads,
            mixer: self.mixer.clone(),
            relative: self.relative,
            head_gates: None,
            pruned_from: None,
        }
    }
}

impl<B: LabBackend> MultiHeadAttention<B> {
    /// Attends from `query` to `memory`.
    ///
    /// # Shapes
    /// - `query`: `[b, t, d]`, `memory`: `[b, s, d]` (the same tensor for self-attention)
    /// - `mask`: broadcastable to `[b, 1, t, s]`, `true` = masked out
    /// - returns context `[b, t, d]` and, for the full mixer, weights `[b, h, t, s]`
    pub fn forward(
        &self,
        query: Tensor<B, 3>,
        memory: Tensor<B, 3>,
        mask: Option<&AttentionMask<B>>,
    ) -> AttentionOutput<B> {
        let (q, k, v) = self.project(query, memory); // [b, h, t|s, k]
        self.output(self.attend(q, k, v, mask))
    }

    /// Heads `[b, h, t, k]` merged and projected by `W^O`, with the weights beside.
    fn output(
        &self,
        (context, weights): (Tensor<B, 4>, Option<Tensor<B, 4>>),
    ) -> AttentionOutput<B> {
        AttentionOutput {
            context: self.project_out(merge_heads(context)), // [b, t, d]
            weights,
        }
    }

    /// Self-attention of `x` (`[b, t, d]`, `mask` broadcastable to `[b, 1, t, t]`): Q, K and V
    /// come from one product against `W^Q`, `W^K`, `W^V` side by side, and in training with fused
    /// kernels the attention kernel reads them in place from that product (with RoPE, from that
    /// product with Q and K rotated: [`rope_packed`]) and writes their gradient back into one
    /// buffer. The same result as `forward(x, x, mask)`.
    pub fn forward_self(
        &self,
        x: Tensor<B, 3>,
        mask: Option<&AttentionMask<B>>,
    ) -> AttentionOutput<B> {
        let qkv = kernels::linear_parts(&[&self.query, &self.key, &self.value], x); // [b, t, 3d]
        let qkv = match self.relative {
            RelativePosition::None if self.uses_attention_kernel(&qkv.device()) => qkv,
            RelativePosition::Rope if self.uses_attention_kernel(&qkv.device()) => {
                rope_packed(qkv, self.n_heads, 0)
            }
            _ => {
                let (q, k, v) = split_packed(qkv, self.n_heads); // views, [b, h, t, k]
                let (q, k) = self.rotate(q, k, 0);
                return self.output(self.attend(q, k, v, mask));
            }
        };
        let causal = mask.is_some_and(AttentionMask::is_causal);
        let pad = mask.and_then(AttentionMask::pad);
        let dropout = kernels::attention_dropout::<B>(self.dropout.prob, &qkv.device());
        let context = kernels::packed_self_attention(qkv, self.n_heads, causal, pad, dropout); // [b, t, d]
        AttentionOutput {
            context: self.project_out(context),
            weights: None,
        }
    }

    /// Self-attention of `n` new positions `x` (`[b, n, d]`) that follow the positions in
    /// `cache`, updating it: the last `n` rows of [`Self::forward_self`] on the whole sequence
    /// with a causal mask, at the cost of the new rows. Every attention mixer has its
    /// incremental form (see [`super::cache`]).
    ///
    /// # Shapes
    /// `x`: `[b, n, d]` → `[b, n, d]`.
    pub fn forward_cached(&self, x: Tensor<B, 3>, cache: &mut LayerCache<B>) -> Tensor<B, 3> {
        let context = self.context_cached(StepInput::Normalised(x), cache);
        self.project_out(context)
    }

    /// [`Self::forward_cached`] up to the output projection: the context `[b, n, h·k]` with
    /// its heads merged, from `x` as [`StepInput`] gives it.
    pub fn context_cached(&self, x: StepInput<'_, B>, cache: &mut LayerCache<B>) -> Tensor<B, 3> {
        let past = cache.len();
        let n = x.positions();
        // A rolling cache (relative positions) sees the last `window` positions, a local
        // mixer its window.
        let rolling = cache.window();
        let local = match &self.mixer {
            Mixer::Local { window } => Some(*window),
            _ => None,
        };
        let keep = local.into_iter().chain(rolling).min();
        let (q, k, v, first) = match x {
            // The product writes the keys and values into the cache itself.
            StepInput::Stream { x, norm, epsilon }
                if self.appends_in_product(n) && cache.has_columns() =>
            {
                let packed = self.packed(cache.projection()).clone();
                let (q, k, v, first) = cache.append_with(n, keep, |keys, values, at| {
                    packed.forward_qkv(x, (norm, epsilon), keys, values, at)
                });
                (self.split_heads(q), k, v, first)
            }
            x => {
                let qkv = self.project_step(x, cache.projection()); // [b, n, 3d]
                let qkv = match self.relative {
                    RelativePosition::Rope => rope_packed(qkv, self.n_heads, past),
                    _ => qkv,
                };
                let (q, k, v) = split_packed(qkv, self.n_heads); // views, [b, h, n, k]
                if let Mixer::Linear { .. } = self.mixer {
                    let [b, h, n, d_head] = q.dims();
                    let state = cache.linear_state(b, h, d_head, &q.device());
                    let context = state.extend(q, k, v);
                    cache.advance(n);
                    return merge_heads(context);
                }
                let (k, v, first) = cache.append(k, v, keep); // [b, h, s, k]
                (q, k, v, first)
            }
        };
        let (s, device) = (k.dims()[2], q.device());
        // New query i sits at position past + i; cached key j at first + j.
        let allows = |i: usize, j: usize| {
            let (i, j) = (past + i, first + j);
            let pattern = match &self.mixer {
                Mixer::Local { window } => local_allows(i, j, *window, true),
                Mixer::Strided { stride } => strided_allows(i, j, *stride, true),
                _ => j <= i,
            };
            j < first + s && pattern && rolling.is_none_or(|w| local_allows(i, j, w, true))
        };
        if self.decodes_with_kernel(n) {
            return decode_attention(q, k, v, |_, j| !allows(0, j));
        }
        // Columns s.. (where the backend autotunes) are zero and masked (they lie in every
        // query's future, and `allows` says so whatever the pattern).
        let columns = decode_columns::<B>(s);
        let (k, v) = (zero_padded(k, columns), zero_padded(v, columns));
        let bias = self.bias(past..past + n, first..first + columns, &device);
        // [1, 1, n, columns]
        let mask = ((0..n).any(|i| (0..columns).any(|j| !allows(i, j))))
            .then(|| pattern_rows::<B>(n, columns, allows, &device).unsqueeze::<4>());
        merge_heads(biased_attention_weights(q, k, mask, bias).matmul(v)) // [b, n, d]
    }

    /// One new token of each sequence of a batch whose sequences are at different positions
    /// (see [`RowsCache`]): appends this layer's key and value columns to `kv` and attends
    /// each row over its own columns, at its own position. The same context as
    /// [`Self::forward_cached`] on that row alone. Needs a mixer that keeps keys and values
    /// (full, local, strided).
    ///
    /// # Shapes
    /// `x`: `[b, 1, d]` → `[b, 1, d]`.
    pub fn forward_rows(
        &self,
        x: Tensor<B, 3>,
        kv: &mut Option<Columns<B>>,
        projection: &mut Option<PackedLinear<B>>,
        rows: &Rows,
    ) -> Tensor<B, 3> {
        let context = self.context_rows(StepInput::Normalised(x), kv, projection, rows);
        self.project_out(context)
    }

    /// [`Self::forward_rows`] up to the output projection: the context `[b, 1, h·k]` with its
    /// heads merged, from `x` as [`StepInput`] gives it.
    pub fn context_rows(
        &self,
        x: StepInput<'_, B>,
        kv: &mut Option<Columns<B>>,
        projection: &mut Option<PackedLinear<B>>,
        rows: &Rows,
    ) -> Tensor<B, 3> {
        let (q, k, v) = match x {
            // The product writes the keys and values into the columns itself.
            StepInput::Stream { x, norm, epsilon }
                if self.appends_in_product(1) && kv.is_some() =>
            {
                let packed = self.packed(projection);
                let past = kv.take().expect("columns cached before");
                let (q, columns) = past.push_with(1, |keys, values, at| {
                    packed.forward_qkv(x, (norm, epsilon), keys, values, at)
                });
                let (k, v) = kv.insert(columns).views();
                (self.split_heads(q), k, v)
            }
            x => {
                let qkv = self.project_step(x, projection); // [b, 1, 3d]
                let (q, k, v) = split_packed(qkv, self.n_heads); // views, [b, h, 1, k]
                let (q, k) = match self.relative {
                    RelativePosition::Rope => (rope_rows(q, &rows.next), rope_rows(k, &rows.next)),
                    _ => (q, k),
                };
                let (k, v) = Columns::append(kv, k, v).views();
                (q, k, v)
            }
        };
        let ([b, _, s, _], device) = (k.dims(), k.device());
        let allows = |i: usize, j: usize| match &self.mixer {
            Mixer::Local { window } => local_allows(i, j, *window, true),
            Mixer::Strided { stride } => strided_allows(i, j, *stride, true),
            Mixer::Full => j <= i,
            other => panic!("the {} mixer keeps no keys and values", other.name()),
        };
        let masked = |r: usize, j: usize| j >= s || !rows.sees(r, j, s, allows);
        if self.decodes_with_kernel(1) {
            return decode_attention(q, k, v, masked);
        }
        // Columns s.. (where the backend autotunes) are zero and masked.
        let columns = decode_columns::<B>(s);
        let (k, v) = (zero_padded(k, columns), zero_padded(v, columns));
        // The distance from the query (column s − 1) to column j is s − 1 − j in every row.
        let bias = self.bias(s - 1..s, 0..columns, &device);
        let masked: Vec<bool> = (0..b)
            .flat_map(|r| (0..columns).map(move |j| (r, j)))
            .map(|(r, j)| masked(r, j))
            .collect();
        let mask =
            Tensor::<B, 4, Bool>::from_data(TensorData::new(masked, [b, 1, 1, columns]), &device);
        let context = biased_attention_weights(q, k, Some(mask), bias).matmul(v); // [b, h, 1, k]
        merge_heads(context)
    }

    /// The keys and values of `memory` (`[b, s, d]`, with its key-padding mask) as this
    /// cross-attention layer reads them: computed once, read by [`Self::forward_memory`] at
    /// every decoding step.
    pub fn memory(&self, memory: Tensor<B, 3>, mask: Option<&AttentionMask<B>>) -> CrossMemory<B> {
        let k = self.split_heads(linear(&self.key, memory.clone()));
        let v = self.split_heads(linear(&self.value, memory));
        // A key-padding mask is also kept as numbers `[b, s]`, as the attention kernel reads it
        // at each step.
        let pad = mask
            .filter(|mask| !mask.is_causal())
            .and_then(AttentionMask::pad)
            .map(|pad| pad.clone().float());
        CrossMemory {
            k,
            v,
            mask: mask.map(AttentionMask::tensor),
            pad,
        }
    }

    /// Cross-attention from `query` (`[b, n, d]`) to a memory projected by [`Self::memory`]:
    /// the same context as [`Self::forward`] on the memory's states. A decoding step (one new
    /// position) attends through the attention kernel where [`Self::decodes_with_kernel`] says
    /// so: one launch per layer and token, as in self-attention.
    pub fn forward_memory(&self, query: Tensor<B, 3>, memory: &CrossMemory<B>) -> Tensor<B, 3> {
        let n = query.dims()[1];
        let q = self.split_heads(linear(&self.query, query)); // [b, h, n, k]
        if self.decodes_with_kernel(n) && (memory.mask.is_none() || memory.pad.is_some()) {
            let (k, v) = (memory.k.clone(), memory.v.clone());
            return self.project_out(decoded(q, k, v, memory.pad.clone()));
        }
        let weights = masked_attention_weights(q, memory.k.clone(), memory.mask.clone());
        self.project_out(merge_heads(weights.matmul(memory.v.clone()))) // [b, n, d]
    }

    /// Whether this layer keeps keys and values to decode from, as [`Self::forward_rows`]
    /// needs (full, local, strided; not linear attention's running sums).
    pub fn keeps_keys(&self) -> bool {
        matches!(
            self.mixer,
            Mixer::Full | Mixer::Local { .. } | Mixer::Strided { .. }
        )
    }

    /// Whether this layer can decode from a [`LayerCache`]: every attention mixer can.
    pub fn caches(&self) -> bool {
        self.mixer.is_attention()
    }

    /// Whether a decoding step of `n` new positions per sequence attends through the attention
    /// kernel ([`decode_attention`]): on a backend that autotunes ([`LabBackend::autotunes`]: a
    /// GPU) with the fused attention on, for one new position, without ALiBi (whose bias the
    /// kernel does not add). One launch per layer and token instead of the composed form's
    /// products, scaling, mask and softmax; and as the kernel is compiled for every length at
    /// once, the keys and values need no padding to a few lengths ([`decode_columns`]).
    fn decodes_with_kernel(&self, n: usize) -> bool {
        B::autotunes()
            && n == 1
            && self.relative != RelativePosition::Alibi
            && kernels::uses(kernels::Op::Attention)
    }

    /// Queries and keys of positions `start..` rotated when the layer uses RoPE.
    fn rotate(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        start: usize,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        match self.relative {
            RelativePosition::Rope => (rope(q, start), rope(k, start)),
            _ => (q, k),
        }
    }

    /// ALiBi's biases `[1, h, t, s]` for queries at positions `queries` and keys at `keys`,
    /// when the layer uses ALiBi.
    fn bias(
        &self,
        queries: std::ops::Range<usize>,
        keys: std::ops::Range<usize>,
        device: &B::Device,
    ) -> Option<Tensor<B, 4>> {
        (self.relative == RelativePosition::Alibi)
            .then(|| alibi_bias(&self.alibi_slopes(), queries, keys, device))
    }

    /// ALiBi's slope of each head: the geometric series of the unpruned layer, for the heads
    /// that are left.
    fn alibi_slopes(&self) -> Vec<f64> {
        match &self.pruned_from {
            Some((n_heads, kept)) => {
                let all = alibi_slopes(*n_heads);
                kept.iter().map(|&h| all[h]).collect()
            }
            None => alibi_slopes(self.n_heads),
        }
    }

    /// How this layer sees positions.
    pub fn relative(&self) -> RelativePosition {
        self.relative
    }

    /// Whether this layer's attention runs as the fused kernel, which never builds the
    /// weights: full softmax attention without ALiBi's bias, with fused kernels on, in training
    /// (attention dropout drawn inside the kernel) or at inference inside [`without_weights`].
    /// Elsewhere (inspection) the composed form runs, whose weights come for free.
    fn uses_attention_kernel(&self, device: &B::Device) -> bool {
        matches!(self.mixer, Mixer::Full)
            && self.relative != RelativePosition::Alibi
            && kernels::fused()
            && (B::ad_enabled(device) || !WEIGHTS_WANTED.with(Cell::get))
    }

    /// The heads' queries, keys and values for `query` attending to `memory`, before attention:
    /// what `explain --artifact-dir` shows. Shapes `[b, h, t|s, k]`.
    pub fn project(
        &self,
        query: Tensor<B, 3>,
        memory: Tensor<B, 3>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
        let q = self.split_heads(linear(&self.query, query));
        let k = self.split_heads(linear(&self.key, memory.clone()));
        let v = self.split_heads(linear(&self.value, memory));
        (q, k, v)
    }

    /// `x` (`[b, n, d]`) through the query, key and value projections as one product, `[b, n,
    /// 3d]`, against their weights packed into `projection` on first use: a decode packs them
    /// once and reuses them at every step (one product a step where there were three, and no
    /// copy of the weights per step as [`kernels::linear_parts`] makes).
    fn project_step(
        &self,
        x: StepInput<'_, B>,
        projection: &mut Option<PackedLinear<B>>,
    ) -> Tensor<B, 3> {
        let projection = self.packed(projection);
        match x {
            StepInput::Normalised(x) => projection.forward(x),
            StepInput::Stream { x, norm, epsilon } => {
                projection.forward_step(x, Some((norm, epsilon)), After::Nothing)
            }
        }
    }

    /// The query, key and value projections packed into `projection` on first use.
    fn packed<'a>(&self, projection: &'a mut Option<PackedLinear<B>>) -> &'a PackedLinear<B> {
        projection.get_or_insert_with(|| PackedLinear::new(&[&self.query, &self.key, &self.value]))
    }

    /// Whether a folded decoding step of `n` new positions has its query–key–value product
    /// write the keys and values into the cache ([`kernels::decode_qkv`]: the append's launch
    /// saved): one position through the attention kernel, a mixer that keeps keys and values,
    /// and no rotary positions (which turn the keys after the product).
    fn appends_in_product(&self, n: usize) -> bool {
        self.decodes_with_kernel(n) && self.keeps_keys() && self.relative != RelativePosition::Rope
    }

    /// The output projection of a decoding step with the residual stream `x` `[b, n, d]` added
    /// in the same launch ([`kernels::decode_linear`]): `x + W^O·context`, what a pre-norm
    /// block's residual addition makes of [`Self::project_out`].
    pub fn project_out_onto(&self, context: Tensor<B, 3>, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let context = self.gated(context);
        let [b, n, d] = x.dims();
        let rows = |t: Tensor<B, 3>| {
            let width = t.dims()[2];
            t.reshape([b * n, width])
        };
        let bias = self.output.bias.as_ref().map(|bias| bias.val());
        let y = kernels::decode_linear(
            rows(context),
            None,
            self.output.weight.val(),
            bias,
            After::Residual(rows(x)),
        );
        y.reshape([b, n, d])
    }

    /// The mixer's attention, with dropout on the weights (between the softmax and the product
    /// with V; linear attention has no weights to drop). The full mixer also returns its
    /// undropped weights for inspection.
    fn attend(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        mask: Option<&AttentionMask<B>>,
    ) -> (Tensor<B, 4>, Option<Tensor<B, 4>>) {
        let causal = mask.is_some_and(AttentionMask::is_causal);
        let pad = mask.and_then(AttentionMask::pad);
        let dropout = Some(&self.dropout);
        let context = match &self.mixer {
            // The fused kernel never builds the `t × s` weights.
            Mixer::Full if self.uses_attention_kernel(&q.device()) => {
                let dropout = kernels::attention_dropout::<B>(self.dropout.prob, &q.device());
                kernels::attention(q, k, v, causal, pad, dropout)
            }
            Mixer::Full => {
                let (t, s) = (q.dims()[2], k.dims()[2]);
                let bias = self.bias(0..t, 0..s, &q.device());
                let mask = mask.map(AttentionMask::tensor);
                let weights = biased_attention_weights(q, k, mask, bias); // [b, h, t, s]
                let context = crate::kernels::dropout(&self.dropout, weights.clone()).matmul(v); // [b, h, t, k]
                return (context, Some(weights));
            }
            Mixer::Local { window } => local_attention(q, k, v, *window, causal, pad, dropout),
            Mixer::Strided { stride } => strided_attention(q, k, v, *stride, causal, pad, dropout),
            Mixer::Linear { chunk } => linear_attention(q, k, v, causal, pad, *chunk),
            Mixer::Hyena(_) => unreachable!("init refuses the hyena mixer"),
        };
        (context, None)
    }

    /// The dense weights `[b, h, t, s]` of this layer's mixer for `query` attending to `memory`:
    /// softmax weights restricted to the sparse pattern, or linear attention's normalised
    /// `φ(q)·φ(k)` — each row sums to 1 and `weights·V` is what the forward pass computes.
    /// `O(t·s)` memory: for inspection, not training.
    pub fn mixer_weights(
        &self,
        query: Tensor<B, 3>,
        memory: Tensor<B, 3>,
        mask: Option<&AttentionMask<B>>,
    ) -> Tensor<B, 4> {
        let (q, k, _) = self.project(query, memory);
        let (q, k) = self.rotate(q, k, 0);
        let (t, s) = (q.dims()[2], k.dims()[2]);
        let device = q.device();
        let causal = mask.is_some_and(AttentionMask::is_causal);
        let pattern = match &self.mixer {
            Mixer::Local { window } => Some(local_mask::<B>(t, *window, causal, &device)),
            Mixer::Strided { stride } => Some(strided_mask::<B>(t, *stride, causal, &device)),
            _ => None,
        }
        .map(|pattern| pattern.unsqueeze::<4>()); // [1, 1, t, t]
        let dense = match (mask.map(AttentionMask::tensor), pattern) {
            (Some(mask), Some(pattern)) => {
                let [b, _, _, s] = mask.dims();
                let shape = [b, 1, t, s];
                Some(mask.expand(shape).bool_or(pattern.expand(shape)))
            }
            (mask, pattern) => mask.or(pattern),
        };
        match &self.mixer {
            Mixer::Linear { .. } => linear_attention_weights(q, k, dense),
            _ => {
                let bias = self.bias(0..t, 0..s, &device);
                biased_attention_weights(q, k, dense, bias)
            }
        }
    }

    /// The mixer this layer uses.
    pub fn mixer(&self) -> &Mixer {
        &self.mixer
    }

    /// `[b, n, d]` → `[b, h, n, k]`.
    fn split_heads(&self, x: Tensor<B, 3>) -> Tensor<B, 4> {
        let [b, n, d] = x.dims();
        x.reshape([b, n, self.n_heads, d / self.n_heads]) // [b, n, h, k]
            .swap_dims(1, 2) // [b, h, n, k]
    }

    /// Number of heads.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }

    /// Sets the gates on the heads (one per head: 0 removes a head's contribution, 1 keeps
    /// it), or removes them (`None`). Every forward form reads them: training, inference,
    /// cached decoding, cross-attention.
    ///
    /// # Panics
    /// If `gates` does not hold one value per head.
    pub fn set_head_gates(&mut self, gates: Option<Vec<f32>>) {
        if let Some(gates) = &gates {
            assert_eq!(gates.len(), self.n_heads, "one gate per head");
        }
        self.head_gates = gates;
    }

    /// The heads pruning removed from this layer, by their index in the unpruned layer.
    pub fn removed_heads(&self) -> Vec<usize> {
        match &self.pruned_from {
            Some((n_heads, kept)) => (0..*n_heads).filter(|h| !kept.contains(h)).collect(),
            None => Vec::new(),
        }
    }

    /// The gates on the heads, if any.
    pub fn head_gates(&self) -> Option<&[f32]> {
        self.head_gates.as_deref()
    }

    /// The heads' merged context `[b, n, d]` (head `i` in columns `i·k..(i+1)·k`) projected by
    /// `W^O`, each head scaled by its gate.
    fn project_out(&self, context: Tensor<B, 3>) -> Tensor<B, 3> {
        linear(&self.output, self.gated(context))
    }

    /// `context` `[b, n, h·k]` with each head's columns scaled by its gate, where the layer
    /// has gates.
    fn gated(&self, context: Tensor<B, 3>) -> Tensor<B, 3> {
        let Some(gates) = &self.head_gates else {
            return context;
        };
        let d = context.dims()[2];
        let width = d / self.n_heads;
        let scale: Vec<f32> = gates
            .iter()
            .flat_map(|&g| std::iter::repeat_n(g, width))
            .collect();
        let scale = Tensor::<B, 1>::from_floats(scale.as_slice(), &context.device());
        context * scale.reshape([1, 1, d])
    }
}

impl<B: LabBackend> MultiHeadAttention<B> {
    /// This layer without the heads in `removed`: the same outputs as the layer with those
    /// heads gated off, from smaller projections (`W^Q`, `W^K`, `W^V` lose the heads' columns,
    /// `W^O` their rows). Gates of the kept heads stay.
    ///
    /// # Panics
    /// If `removed` names a head the layer lacks or every head.
    pub fn without_heads(&self, removed: &[usize]) -> Self {
        let h = self.n_heads;
        assert!(removed.iter().all(|&i| i < h), "a head this layer lacks");
        let kept: Vec<usize> = (0..h).filter(|i| !removed.contains(i)).collect();
        assert!(!kept.is_empty(), "a layer keeps at least one head");
        let width = self.query.weight.dims()[1] / h;
        // The rows or columns (`dim`) of head `i`, for every kept head, side by side: new
        // parameters (untracked first, so an autodiff backend makes them leaves of their own).
        let pick = |x: Tensor<B, 2>, dim: usize| {
            let x = x.set_require_grad(false);
            let parts = kept
                .iter()
                .map(|&i| x.clone().narrow(dim, i * width, width))
                .collect();
            Tensor::cat(parts, dim)
        };
        let into_heads = |l: &Linear<B>| Linear {
            weight: Param::from_tensor(pick(l.weight.val(), 1)),
            bias: l.bias.as_ref().map(|b| {
                let b = pick(b.val().unsqueeze::<2>(), 1);
                Param::from_tensor(b.squeeze::<1>())
            }),
        };
        MultiHeadAttention {
            query: into_heads(&self.query),
            key: into_heads(&self.key),
            value: into_heads(&self.value),
            output: Linear {
                weight: Param::from_tensor(pick(self.output.weight.val(), 0)),
                bias: self
                    .output
                    .bias
                    .as_ref()
                    .map(|b| Param::from_tensor(b.val().set_require_grad(false))),
            },
            dropout: self.dropout.clone(),
            n_heads: kept.len(),
            mixer: self.mixer.clone(),
            relative: self.relative,
            head_gates: self
                .head_gates
                .as_ref()
                .map(|g| kept.iter().map(|&i| g[i]).collect()),
            pruned_from: Some(match &self.pruned_from {
                Some((n, before)) => (*n, kept.iter().map(|&i| before[i]).collect()),
                None => (h, kept.clone()),
            }),
        }
    }
}

impl<B: LabAutodiff> MultiHeadAttention<B> {
    /// `∂L/∂ξ_h` for a gate `ξ_h` on each head at `ξ = 1` (Michel et al. 2019), from the
    /// gradients of a loss `L` of this layer's ungated output: the layer computes
    /// `Σ_h ξ_h·c_h·W^O_h`, so `∂L/∂ξ_h = ⟨c_h·W^O_h, ∂L/∂y⟩ = ⟨W^O_h, ∂L/∂W^O_h⟩` — the rows of
    /// `W^O` that read head `h`, times their gradient. `None` when `W^O` has no gradient.
    pub fn gate_gradients(&self, grads: &B::Gradients) -> Option<Vec<f32>> {
        let weight = self.output.weight.val(); // [d, d], row = input feature
        let grad = weight.grad(grads)?;
        let [d, out] = grad.dims();
        let per_head = (weight.inner() * grad)
            .reshape([self.n_heads, d / self.n_heads * out])
            .sum_dim(1);
        Some(per_head.into_data().to_vec::<f32>().expect("f32 gradients"))
    }
}
