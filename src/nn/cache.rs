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
//! Keys and values live in [`Columns`]: buffers with room to grow, a token's column written in
//! place. Each layer also keeps its query, key and value projections packed side by side
//! ([`PackedLinear`]), made on its first step: a step projects with one product. A decoder with
//! cross-attention also keeps the encoder memory's keys and values ([`CrossMemory`]), projected
//! once per sentence.

use super::linear_attention::LinearState;
use crate::kernels::{self, LabBackend, PackedLinear};
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
    /// The same mask as numbers `[b, s]`, `1` = padding, as the attention kernel reads it
    /// (`None` also where the mask is more than key padding).
    pub pad: Option<Tensor<B, 2>>,
}

/// Keys and values `[b, h, ·, k]` of a stretch of consecutive positions, kept in buffers with
/// room to grow: appending a position writes its column in place, where concatenating copied
/// the whole cache at every token (and on a GPU launched two copies per tensor). A full buffer
/// is copied once into one half again as large, so appending costs amortised `O(1)` columns.
/// Columns `start..end` of the buffers are live; the others are never read.
#[derive(Clone, Debug)]
pub struct Columns<B: LabBackend> {
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    start: usize,
    end: usize,
}

impl<B: LabBackend> Columns<B> {
    /// The columns of `k` and `v` (`[b, h, s, k]` each), without room to grow yet.
    pub fn new(k: Tensor<B, 4>, v: Tensor<B, 4>) -> Self {
        let end = k.dims()[2];
        Self {
            k,
            v,
            start: 0,
            end,
        }
    }

    /// Live columns.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether no column is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Columns the buffers hold, live or not: how many [`Self::push`] can take in place.
    pub fn capacity(&self) -> usize {
        self.k.dims()[2]
    }

    /// The live keys and values, `[b, h, len, k]` each: views of the buffers, which the next
    /// [`Self::push`] writes in place once they are dropped.
    pub fn views(&self) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let n = self.len();
        (
            self.k.clone().narrow(2, self.start, n),
            self.v.clone().narrow(2, self.start, n),
        )
    }

    /// Appends `k` and `v` (`[b, h, n, k]`) to the columns in `slot` (they are the first where
    /// it is empty) and returns them.
    pub fn append(slot: &mut Option<Self>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> &mut Self {
        let columns = match slot.take() {
            Some(past) => past.push(k, v),
            None => Self::new(k, v),
        };
        slot.insert(columns)
    }

    /// These columns with those of `k` and `v` (`[b, h, n, k]`) appended.
    pub fn push(self, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Self {
        let n = k.dims()[2];
        let write = |keys, values, at| {
            let (keys, values) = kernels::write_columns_pair(keys, values, at, k, v);
            ((), keys, values)
        };
        self.push_with(n, write).1
    }

    /// These columns with `n` more a sequence written by `write(keys, values, at)` into the
    /// buffers themselves at column `at` (room made first), and what `write` returned beside
    /// them: how a decoding step's product appends its keys and values where it computes them
    /// ([`crate::kernels::decode_qkv`]).
    pub fn push_with<T>(
        self,
        n: usize,
        write: impl FnOnce(Tensor<B, 4>, Tensor<B, 4>, usize) -> (T, Tensor<B, 4>, Tensor<B, 4>),
    ) -> (T, Self) {
        let Self {
            k: keys,
            v: values,
            start,
            end,
        } = match self.end + n > self.capacity() {
            true => self.reserve(n),
            false => self,
        };
        let (out, k, v) = write(keys, values, end);
        let columns = Self {
            k,
            v,
            start,
            end: end + n,
        };
        (out, columns)
    }

    /// The live columns at the front of new buffers with room for them, `n` more, and half
    /// as many again.
    fn reserve(self, n: usize) -> Self {
        let len = self.len();
        let capacity = (len + n + (len + n) / 2).max(16);
        let (k, v) = self.views();
        let empty = |live: &Tensor<B, 4>| {
            let [b, h, _, kd] = live.dims();
            Tensor::empty([b, h, capacity, kd], &live.device())
        };
        let (keys, values) = (empty(&k), empty(&v));
        let (k, v) = kernels::write_columns_pair(keys, values, 0, k, v);
        Self {
            k,
            v,
            start: 0,
            end: len,
        }
    }

    /// Drops the first `n` live columns.
    pub fn drop_front(&mut self, n: usize) {
        self.start += n.min(self.len());
    }

    /// Keeps only the sequences `rows` of the batch, in that order.
    pub fn select(&mut self, rows: Tensor<B, 1, Int>) {
        let (k, v) = self.views();
        *self = Self::new(k.select(0, rows.clone()), v.select(0, rows));
    }
}

/// One layer's decoding state after [`LayerCache::len`] positions.
#[derive(Clone, Debug)]
pub struct LayerCache<B: LabBackend> {
    /// Cached keys and values `[b, h, kept, k]` of positions `seen − kept..seen`.
    kv: Option<Columns<B>>,
    /// The layer's query, key and value projections packed for its decoding steps.
    projection: Option<PackedLinear<B>>,
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
            projection: None,
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
        self.seen += k.dims()[2];
        Columns::append(&mut self.kv, k, v);
        self.keep(keep)
    }

    /// The cached keys and values with the new ones `(K, V, first)`, then only the last `keep`
    /// of them kept (see [`Self::append`]).
    fn keep(&mut self, keep: Option<usize>) -> (Tensor<B, 4>, Tensor<B, 4>, usize) {
        let columns = self.kv.as_mut().expect("keys and values just appended");
        let all = columns.len();
        let (k, v) = columns.views();
        if let Some(keep) = keep {
            columns.drop_front(all.saturating_sub(keep));
        }
        (k, v, self.seen - all)
    }

    /// [`Self::append`] of `n` new positions whose keys and values `write` puts into the
    /// buffers itself ([`Columns::push_with`]), with what `write` returned: `(out, K, V,
    /// first)`. Needs [`Self::has_columns`].
    ///
    /// # Panics
    /// If nothing is cached yet (the first step's keys and values make the buffers).
    pub fn append_with<T>(
        &mut self,
        n: usize,
        keep: Option<usize>,
        write: impl FnOnce(Tensor<B, 4>, Tensor<B, 4>, usize) -> (T, Tensor<B, 4>, Tensor<B, 4>),
    ) -> (T, Tensor<B, 4>, Tensor<B, 4>, usize) {
        let past = self.kv.take().expect("keys and values cached before");
        let (out, columns) = past.push_with(n, write);
        self.seen += n;
        self.kv = Some(columns);
        let (k, v, first) = self.keep(keep);
        (out, k, v, first)
    }

    /// Whether keys and values are cached (buffers [`Self::append_with`] writes into).
    pub fn has_columns(&self) -> bool {
        self.kv.is_some()
    }

    /// The layer's query, key and value projections packed for decoding (made by the layer on
    /// its first step, reused by the others).
    pub fn projection(&mut self) -> &mut Option<PackedLinear<B>> {
        &mut self.projection
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
        self.kv.as_ref().map_or(0, Columns::len)
    }

    /// Whether no position has been seen.
    pub fn is_empty(&self) -> bool {
        self.seen == 0
    }

    /// Keeps only the sequences `rows` of the batch, in that order (beam search: the cache
    /// follows the beams that survive a step).
    pub fn select(&mut self, rows: Tensor<B, 1, Int>) {
        if let Some(columns) = self.kv.as_mut() {
            columns.select(rows.clone());
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
    /// and older keys are dropped: sliding-window attention in every layer, at one row's cost
    /// per token. With relative positions (RoPE, ALiBi) the first layer sees exactly what it
    /// sees on a window of the last `window` tokens; deeper layers read keys computed when
    /// their tokens were new, so they also see, through the layers below, further back.
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
            memory.pad = memory.pad.take().map(|m| m.select(0, rows.clone()));
        }
    }
}

/// Where each sequence of a [`RowsCache`] stands: what one decoding step of the batch needs to
/// know to give every row exactly what it would see alone.
#[derive(Clone, Debug, Default)]
pub struct Rows {
    /// Per row: the position of its next token.
    pub next: Vec<usize>,
    /// Per row: the first of the cache's columns that holds one of its tokens (the columns
    /// before are padding, never attended to).
    pub from: Vec<usize>,
    /// A rolling cache's span (see [`KvCache::rolling`]): each query sees at most this many
    /// positions, itself included.
    pub window: Option<usize>,
}

impl Rows {
    /// Whether row `r`'s query at column `s − 1` of `s` may see column `j`, by `allows` on
    /// the absolute positions of the query and the key. Row `r`'s columns are right-aligned:
    /// its token at column `j` has position `next[r] − (s − 1 − j)`.
    pub fn sees(
        &self,
        r: usize,
        j: usize,
        s: usize,
        allows: impl Fn(usize, usize) -> bool,
    ) -> bool {
        let i = self.next[r];
        j >= self.from[r] && {
            let key = i - (s - 1 - j);
            allows(i, key) && self.window.is_none_or(|w| i - key < w)
        }
    }
}

/// The decoding state of a batch whose sequences are at different positions: continuous
/// batching, where a sequence joins the batch between two steps and leaves when it is done.
///
/// Every layer keeps one `[b, h, s, k]` tensor of keys and of values whose columns are shared:
/// each row's sequence is right-aligned (its newest token in the last column), and the columns
/// before its first are padding that [`Rows::sees`] masks out. Positions are each row's own,
/// so a row's logits are those of decoding it alone (tested).
#[derive(Clone, Debug)]
pub struct RowsCache<B: LabBackend> {
    /// One per layer: keys and values `[b, h, s, k]`.
    pub layers: Vec<Option<Columns<B>>>,
    /// One per layer: its query, key and value projections packed for decoding (made on the
    /// layer's first step).
    pub projections: Vec<Option<PackedLinear<B>>>,
    /// Where each row stands.
    pub rows: Rows,
}

impl<B: LabBackend> RowsCache<B> {
    /// An empty batch for `n_layers` layers; `window` as [`KvCache::rolling`]'s.
    pub fn new(n_layers: usize, window: Option<usize>) -> Self {
        Self {
            layers: vec![None; n_layers],
            projections: vec![None; n_layers],
            rows: Rows {
                window,
                ..Rows::default()
            },
        }
    }

    /// Sequences in the batch.
    pub fn len(&self) -> usize {
        self.rows.next.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Columns of the shared key and value tensors.
    pub fn columns(&self) -> usize {
        self.layers
            .first()
            .and_then(|l| l.as_ref())
            .map_or(0, Columns::len)
    }

    /// Adds one sequence, as the last row, from the cache of decoding it alone (one row, every
    /// layer keeping keys and values: the attention mixers').
    ///
    /// # Panics
    /// If `single` has more than one row or a layer without keys and values.
    pub fn join(&mut self, single: &KvCache<B>) {
        let kept = single.layers.first().map_or(0, LayerCache::kept);
        let s = self.columns();
        let width = s.max(kept);
        // Pad the batch or the newcomer on the left to a common width.
        for (slot, layer) in self.layers.iter_mut().zip(&single.layers) {
            let (k, v) = (layer.kv.as_ref())
                .expect("every layer keeps keys and values")
                .views();
            assert_eq!(k.dims()[0], 1, "one sequence joins at a time");
            let (k, v) = (pad_left(k, width), pad_left(v, width));
            *slot = Some(match slot.take() {
                Some(batch) => {
                    let (bk, bv) = batch.views();
                    Columns::new(
                        Tensor::cat(vec![pad_left(bk, width), k], 0),
                        Tensor::cat(vec![pad_left(bv, width), v], 0),
                    )
                }
                None => Columns::new(k, v),
            });
        }
        for from in &mut self.rows.from {
            *from += width - s;
        }
        self.rows.from.push(width - kept);
        self.rows.next.push(single.len());
    }

    /// Keeps only the rows `rows`, in that order, and drops the columns none of them can see
    /// again.
    pub fn keep(&mut self, rows: &[usize], device: &B::Device) {
        if rows.is_empty() {
            *self = Self::new(self.layers.len(), self.rows.window);
            return;
        }
        if rows.iter().copied().ne(0..self.len()) {
            let ids: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
            let index = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [rows.len()]), device);
            self.rows.next = rows.iter().map(|&r| self.rows.next[r]).collect();
            self.rows.from = rows.iter().map(|&r| self.rows.from[r]).collect();
            for columns in self.layers.iter_mut().flatten() {
                columns.select(index.clone());
            }
        }
        self.trim();
    }

    /// Drops the columns no row's next query can see: the padding every row has, and with a
    /// rolling window the columns that fell out of it.
    pub fn trim(&mut self) {
        let s = self.columns();
        // The next query sits at column s: it sees columns ≥ s + 1 − window at most.
        let seen_from = |from: usize| match self.rows.window {
            Some(w) => from.max((s + 1).saturating_sub(w)),
            None => from,
        };
        let drop = self
            .rows
            .from
            .iter()
            .map(|&f| seen_from(f))
            .min()
            .unwrap_or(0);
        if drop == 0 {
            return;
        }
        for columns in self.layers.iter_mut().flatten() {
            columns.drop_front(drop);
        }
        for from in &mut self.rows.from {
            *from = from.saturating_sub(drop);
        }
    }
}

/// `x` `[b, h, s, k]` with zero columns before it to width `width` (≥ s).
fn pad_left<B: LabBackend>(x: Tensor<B, 4>, width: usize) -> Tensor<B, 4> {
    let [b, h, s, k] = x.dims();
    if width == s {
        return x;
    }
    let zeros = Tensor::zeros([b, h, width - s, k], &x.device());
    Tensor::cat(vec![zeros, x], 2)
}
