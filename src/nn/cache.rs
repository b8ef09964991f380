//! The state of incremental decoding: what each self-attention layer keeps of the positions it
//! has seen, so that a new token costs one row of attention instead of the whole window.
//!
//! | mixer | keeps | per new token |
//! |---|---|---|
//! | `full`, `strided` | every key and value | one row over the cache |
//! | `local` | the last `window` keys and values | one row over the window |
//! | `linear` | the running sums `S = Σ φ(k)ᵀv`, `z = Σ φ(k)` | `O(k²)`, whatever the length |
//! | `hyena` | — (the model recomputes its window) | |
//!
//! A decoder with cross-attention also keeps the encoder memory's keys and values
//! ([`CrossMemory`]), projected once per sentence.

use super::linear_attention::LinearState;
use crate::kernels::LabBackend;
use burn::prelude::*;
use burn::tensor::Bool;

/// The encoder's output as one decoder layer's cross-attention reads it: its keys and values,
/// projected once per sentence instead of at every decoding step.
#[derive(Clone, Debug)]
pub struct CrossMemory<B: LabBackend> {
    /// `[b, h, s, k]`.
    pub k: Tensor<B, 4>,
    /// `[b, h, s, k]`.
    pub v: Tensor<B, 4>,
    /// Key-padding mask `[b, 1, 1, s]`, `true` = padding.
    pub mask: Option<Tensor<B, 4, Bool>>,
}

/// One layer's decoding state after [`LayerCache::len`] positions.
#[derive(Clone, Debug)]
pub struct LayerCache<B: LabBackend> {
    /// Cached keys and values `[b, h, kept, k]` of positions `seen − kept..seen`.
    kv: Option<(Tensor<B, 4>, Tensor<B, 4>)>,
    /// Linear attention's running sums.
    linear: Option<LinearState<B>>,
    /// Positions seen so far.
    seen: usize,
    /// A rolling cache's span: each query sees at most this many positions, itself included
    /// (`None`: all it has seen).
    window: Option<usize>,
}

impl<B: LabBackend> Default for LayerCache<B> {
    fn default() -> Self {
        Self {
            kv: None,
            linear: None,
            seen: 0,
            window: None,
        }
    }
}

impl<B: LabBackend> LayerCache<B> {
    /// Appends the keys and values of `n` new positions (`[b, h, n, k]`) and returns the cached
    /// ones with them and the absolute position of the first: `(K, V, first)`,
    /// `[b, h, s, k]` each. Afterwards only the last `keep` positions stay cached (`None`: all),
    /// enough for queries that see no further back than `keep` positions.
    pub fn append(
        &mut self,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        keep: Option<usize>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>, usize) {
        let n = k.dims()[2];
        let (k, v) = match self.kv.take() {
            Some((past_k, past_v)) => (
                Tensor::cat(vec![past_k, k], 2),
                Tensor::cat(vec![past_v, v], 2),
            ),
            None => (k, v),
        };
        self.seen += n;
        let all = k.dims()[2];
        self.kv = Some(match keep {
            Some(keep) if all > keep => (
                k.clone().narrow(2, all - keep, keep),
                v.clone().narrow(2, all - keep, keep),
            ),
            _ => (k.clone(), v.clone()),
        });
        (k, v, self.seen - all)
    }

    /// Linear attention's running sums, created empty on first use; call [`Self::advance`]
    /// after updating them.
    pub fn linear_state(
        &mut self,
        b: usize,
        h: usize,
        d_head: usize,
        device: &B::Device,
    ) -> &mut LinearState<B> {
        self.linear
            .get_or_insert_with(|| LinearState::new(b, h, d_head, device))
    }

    /// Counts `n` positions taken in by [`Self::linear_state`].
    pub fn advance(&mut self, n: usize) {
        self.seen += n;
    }

    /// Positions seen.
    pub fn len(&self) -> usize {
        self.seen
    }

    /// A rolling cache's span (see [`KvCache::rolling`]).
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// Positions whose keys and values are kept (a local layer keeps its window).
    pub fn kept(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, _)| k.dims()[2])
    }

    /// Whether no position has been seen.
    pub fn is_empty(&self) -> bool {
        self.seen == 0
    }

    /// Keeps only the sequences `rows` of the batch, in that order (beam search: the cache
    /// follows the beams that survive a step).
    pub fn select(&mut self, rows: Tensor<B, 1, Int>) {
        if let Some((k, v)) = self.kv.take() {
            self.kv = Some((k.select(0, rows.clone()), v.select(0, rows.clone())));
        }
        if let Some(state) = self.linear.as_mut() {
            state.kv = state.kv.clone().select(0, rows.clone());
            state.z = state.z.clone().select(0, rows);
        }
    }
}

/// The decoding state of a stack: every layer's cache and, in a decoder with cross-attention,
/// every layer's view of the encoder memory.
#[derive(Clone, Debug)]
pub struct KvCache<B: LabBackend> {
    /// One per layer, in order.
    pub layers: Vec<LayerCache<B>>,
    /// One per layer with cross-attention, in order (empty in a decoder-only model).
    pub cross: Vec<CrossMemory<B>>,
}

impl<B: LabBackend> KvCache<B> {
    /// An empty cache for `n_layers` layers without cross-attention.
    pub fn new(n_layers: usize) -> Self {
        Self::with_memory(n_layers, Vec::new())
    }

    /// An empty cache for `n_layers` layers that read `cross` (one per layer).
    pub fn with_memory(n_layers: usize, cross: Vec<CrossMemory<B>>) -> Self {
        Self {
            layers: (0..n_layers).map(|_| LayerCache::default()).collect(),
            cross,
        }
    }

    /// The cache made rolling: each query sees the last `window` positions, itself included,
    /// and older keys are dropped — with relative positions (RoPE, ALiBi), exactly what the
    /// model computes on a sliding window of `window` tokens, at one row's cost per token.
    pub fn rolling(mut self, window: usize) -> Self {
        for layer in &mut self.layers {
            layer.window = Some(window);
        }
        self
    }

    /// Whether the cache rolls (see [`Self::rolling`]).
    pub fn rolls(&self) -> bool {
        self.layers.first().is_some_and(|l| l.window.is_some())
    }

    /// Positions cached (the same in every layer).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps only the sequences `rows` of the batch, in that order (every layer's cache and
    /// its view of the memory).
    pub fn select(&mut self, rows: &[usize], device: &B::Device) {
        let ids: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
        let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [rows.len()]), device);
        for layer in &mut self.layers {
            layer.select(rows.clone());
        }
        for memory in &mut self.cross {
            memory.k = memory.k.clone().select(0, rows.clone());
            memory.v = memory.v.clone().select(0, rows.clone());
            memory.mask = memory.mask.take().map(|m| m.select(0, rows.clone()));
        }
    }
}
