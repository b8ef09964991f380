//! Flash-style attention: `64 × 64` tiles of queries and keys with an online softmax forward,
//! and a backward pass that recomputes the probabilities tile by tile from the saved
//! log-sum-exp — the `t × s` score matrix is never stored.

use super::linear::Operand;
use super::tile::{padded, transpose, Limit, Product, UNIT};
use super::{dot, exp, multiversion, uninit, written, LANES};
use crate::kernels::reference::MASKED_SCORE;
use crate::kernels::DropoutMask;
use rayon::prelude::*;

mod lanes;
pub use lanes::{heads_in_lanes, with_tiles_only};

/// Queries and keys per tile of the attention kernels.
const TILE: usize = 64;
/// A row whose largest score or log-sum-exp is below this saw no unmasked key.
const REAL_SCORE: f32 = MASKED_SCORE * 0.5;

/// A read-only `[b, h, n, k]` tensor in any row layout: element `(b, h, i, c)` is at
/// `offset + b·strides[0] + h·strides[1] + i·strides[2] + c` (the head dimension is contiguous).
#[derive(Clone, Copy, Debug)]
pub struct Heads<'a> {
    /// The storage the strides index.
    pub data: &'a [f32],
    /// Index of element `(0, 0, 0, 0)`.
    pub offset: usize,
    /// Strides of the batch, head and position dimensions.
    pub strides: [usize; 3],
}

impl<'a> Heads<'a> {
    /// Row `i` of head `(b, h)`, `k` wide.
    #[inline(always)]
    fn row(&self, b: usize, h: usize, i: usize, k: usize) -> &'a [f32] {
        let start = self.offset + b * self.strides[0] + h * self.strides[1] + i * self.strides[2];
        &self.data[start..start + k]
    }
}

/// The shape of an attention problem: `q` `[b, h, t, k]`, keys and values `[b, h, s, k]`.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    /// Batch size.
    pub b: usize,
    /// Heads.
    pub h: usize,
    /// Query positions.
    pub t: usize,
    /// Key positions.
    pub s: usize,
    /// Head width.
    pub k: usize,
}

impl AttentionShape {
    /// Strides of a tensor laid out `[b, n, h, k]` (the order heads are split from and merged
    /// into `[b, n, d]`), seen as `[b, h, n, k]`, for `n` positions.
    pub fn interleaved(&self, n: usize) -> [usize; 3] {
        [n * self.h * self.k, self.k, self.h * self.k]
    }
}

/// A writable `[b, h, n, k]` destination, element `(b, h, i, c)` at
/// `b·strides[0] + h·strides[1] + i·strides[2] + c` from its pointer; it may cross threads
/// because each task writes only the rows of its own head.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    strides: [usize; 3],
}
// SAFETY: tasks write disjoint rows (one head each) and the buffer outlives the parallel loop.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// Writes `row` as row `i` of head `(b, h)`.
    ///
    /// # Safety
    /// The row must be in bounds and written by one task only (the destination may be
    /// uninitialised memory: no reference to it is made).
    #[inline(always)]
    unsafe fn write(&self, b: usize, h: usize, i: usize, row: &[f32]) {
        let [sb, sh, si] = self.strides;
        let dst = self.ptr.add(b * sb + h * sh + i * si);
        // Whole units as fixed-size copies (inlined as vector moves; a head's rows are short
        // and a call to `memmove` per row cost more than the copy), then the rest.
        let (n, src) = (row.len(), row.as_ptr());
        let mut c = 0;
        while c + UNIT <= n {
            std::ptr::copy_nonoverlapping(src.add(c), dst.add(c), UNIT);
            c += UNIT;
        }
        std::ptr::copy_nonoverlapping(src.add(c), dst.add(c), n - c);
    }

    /// Writes `row · scale` as row `i` of head `(b, h)`: the bits of scaling `row` in place and
    /// then [`Out::write`], without storing the scaled row and reading it straight back (that
    /// read waited for the stores: 10.6% of the samples of the forward pass's per-head
    /// function, on one core of a Zen 4).
    ///
    /// # Safety
    /// As [`Out::write`].
    #[inline(always)]
    unsafe fn write_scaled(&self, b: usize, h: usize, i: usize, row: &[f32], scale: f32) {
        let [sb, sh, si] = self.strides;
        let dst = self.ptr.add(b * sb + h * sh + i * si);
        let mut units = row.chunks_exact(UNIT);
        for (u, unit) in units.by_ref().enumerate() {
            let v: [f32; UNIT] = std::array::from_fn(|l| unit[l] * scale);
            dst.add(u * UNIT).cast::<[f32; UNIT]>().write_unaligned(v);
        }
        let done = row.len() - units.remainder().len();
        for (c, &x) in units.remainder().iter().enumerate() {
            dst.add(done + c).write(x * scale);
        }
    }
}

impl Heads<'_> {
    /// Rows `i0..` of head `(b, h)` as a matrix operand (row-major, `k` columns).
    #[inline(always)]
    fn rows(&self, b: usize, h: usize, i0: usize) -> Operand {
        let start = self.offset + b * self.strides[0] + h * self.strides[1] + i0 * self.strides[2];
        (self.data[start..].as_ptr(), self.strides[2], 1)
    }

    /// Asks the processor to bring the `n` rows of head `(b, h)`, `k` wide, into its caches: a
    /// hint for each cache line the rows touch (nothing is read; the rows must be in bounds,
    /// as for [`Heads::row`]).
    #[inline(always)]
    fn prefetch(&self, b: usize, h: usize, n: usize, k: usize) {
        const LINE: usize = 64;
        let first = self.offset + b * self.strides[0] + h * self.strides[1];
        for i in 0..n {
            let row = first + i * self.strides[2];
            let span = self.data[row..row + k].as_ptr_range();
            let (start, end) = (span.start.cast::<u8>(), span.end.cast::<u8>());
            let mut line = start.wrapping_sub(start.addr() % LINE);
            while line < end {
                prefetch(line);
                line = line.wrapping_add(LINE);
            }
        }
    }
}

/// The most bytes of rows [`prefetch_next`] asks for (a ViT head's five tensors take 5.3 KiB, the
/// language model's 40 KiB).
const PREFETCH_BYTES: usize = 64 << 10;

/// A hint to load the cache line holding `p` into every level of the caches.
#[inline(always)]
fn prefetch(p: *const u8) {
    // SAFETY: a prefetch reads nothing and cannot fault; SSE is part of x86-64.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Prefetches the rows of the head after `head` (heads numbered `b · shape.h + h`) in each of
/// `heads` (`n` rows of `k`), while this head computes. The backward pass reads activations
/// the forward pass wrote long before, and a small head's work is short next to the wait for
/// its rows once they have left the caches: a ViT's `[128, 4, 17, 16]` backward pass on 2
/// cores of a Zen 4 took 1.4 ms with every operand flushed from the caches first, against 0.6
/// with them in the caches (a 16-wide row is a cache line of its own, 768 bytes from the
/// next). The forward pass reads the projection it follows, still in the caches: no gain
/// measured there, so it does not prefetch.
///
/// Only heads whose rows together fit well inside a core's second-level cache are prefetched
/// whole ([`PREFETCH_BYTES`]): a long sequence's next head (GPT-2's 1,024 rows of 64 are
/// 1.3 MB in the five tensors) would evict the rows this head is still reading.
#[inline(always)]
fn prefetch_next(heads: &[(Heads, usize)], shape: AttentionShape, head: usize) {
    let next = head + 1;
    let bytes: usize = heads
        .iter()
        .map(|(_, n)| n * shape.k * std::mem::size_of::<f32>())
        .sum();
    if next < shape.b * shape.h && bytes <= PREFETCH_BYTES {
        let (b, h) = (next / shape.h, next % shape.h);
        for (x, n) in heads {
            x.prefetch(b, h, *n, shape.k);
        }
    }
}

/// Masks the score tile `scores` (`m × n`, rows `ld` apart; queries `i0..`, keys `j0..`): every
/// masked score is written, including those a [`Limit::Columns`] product left unwritten.
#[allow(clippy::too_many_arguments)]
fn mask_tile(
    scores: &mut [f32],
    [ld, m, n]: [usize; 3],
    i0: usize,
    j0: usize,
    causal: bool,
    pad: Option<&[f32]>,
    value: f32,
) {
    for ii in 0..m {
        let row = &mut scores[ii * ld..ii * ld + n];
        if causal {
            // Keys after query i0 + ii: from column i0 + ii + 1 − j0 on.
            let first = (i0 + ii + 1).saturating_sub(j0).min(n);
            row[first..].fill(value);
        }
        if let Some(pad) = pad {
            for (x, &p) in row.iter_mut().zip(&pad[j0..j0 + n]) {
                if p > 0.5 {
                    *x = value;
                }
            }
        }
    }
}

/// The dropout multipliers of the tile (rows of `n`) at `(i0, j0)` of a head whose mask starts at
/// element `first` and has rows of `s`: one draw when the tile spans whole rows.
fn mask_multipliers(mask: DropoutMask, first: u64, [i0, j0, n, s]: [usize; 4], out: &mut [f32]) {
    if n == s {
        mask.fill(first + (i0 * s) as u64, out);
    } else {
        for (ii, row) in out.chunks_exact_mut(n).enumerate() {
            mask.fill(first + ((i0 + ii) * s + j0) as u64, row);
        }
    }
}

/// The buffers of one task's heads, reused from head to head (allocating them for each of a
/// ViT's 512 small heads per layer cost more than the heads' products).
#[derive(Default)]
struct Scratch {
    packed: [Vec<f32>; 5],
    tiles: [Vec<f32>; 4],
    sums: [Vec<f32>; 4],
    /// Per key tile of the backward pass: whether its rows of dK and dV are still unwritten.
    fresh: Vec<bool>,
}

/// `v` as `n` zeros.
fn zeroed(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.clear();
    v.resize(n, 0.0);
    v
}

/// `n` elements of `v` holding whatever an earlier head left (zeros where it grows): for a
/// buffer whose every element read is first written, as clearing 1,088 floats per head for
/// a ViT's 512 small heads per layer was a visible part of their cost.
fn reused(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// A packed `B` operand of a tile product: row `i` at `ptr + i·ld`, read in whole 16-lane units.
#[derive(Clone, Copy)]
struct RowsB {
    ptr: *const f32,
    ld: usize,
}

impl RowsB {
    /// Row `i`.
    #[inline(always)]
    fn at(self, i: usize) -> *const f32 {
        self.ptr.wrapping_add(i * self.ld)
    }
}

/// Rows `0..n` of head `(b, h)` as a [`RowsB`]: the head's own rows where `kw` is a whole
/// number of units (nothing copied: the units cover each row exactly), else a copy in `out`,
/// `padded(kw)` apart with zeros after `kw`.
fn pack_rows(x: Heads, [b, h, n, kw]: [usize; 4], out: &mut Vec<f32>) -> RowsB {
    let ld = padded(kw);
    if ld == kw && n > 0 {
        let _ = x.row(b, h, n - 1, kw); // the last row read is in bounds
        let (ptr, ld, _) = x.rows(b, h, 0);
        return RowsB { ptr, ld };
    }
    let out = zeroed(out, n * ld);
    for (i, row) in out.chunks_exact_mut(ld).enumerate() {
        row[..kw].copy_from_slice(x.row(b, h, i, kw));
    }
    RowsB {
        ptr: out.as_ptr(),
        ld,
    }
}

/// Rows `0..n` of head `(b, h)` transposed: `kw` rows of `padded(n)` (zeros after `n`).
fn pack_transposed<'a>(x: Heads, [b, h, n, kw]: [usize; 4], out: &'a mut Vec<f32>) -> &'a [f32] {
    let ld = padded(n);
    // Every element before `n` in a row is written below: only the padding is cleared.
    let out = reused(out, kw * ld);
    if ld > n {
        out.chunks_exact_mut(ld).for_each(|row| row[n..].fill(0.0));
    }
    if n > 0 {
        let (first, rs, _) = x.rows(b, h, 0);
        // The last row read, n − 1, is in bounds (`row` checks it).
        let _ = x.row(b, h, n - 1, kw);
        // SAFETY: rows 0..n of the head, `kw` wide, are in bounds (checked above); `out`
        // holds `kw` rows of `ld ≥ n`.
        unsafe { transpose(first, rs, [n, kw], out, ld) };
    }
    out
}

/// Replaces the first `seen` scores of `row` with `exp(x − shift)` and the rest with zeros,
/// and returns the row's sum: the bits of that `exp` pass, a zero fill and [`super::sum`] of
/// the row, in one pass (the sum's read of the row just stored waited for the stores: 11.8% of
/// the samples of the forward pass's per-head function on a Zen 4). A hidden weight is `+0`,
/// and adding `+0` to a sum of exponentials leaves it as it was, so whole units past `seen`
/// are only filled.
#[inline(always)]
fn exp_sum(row: &mut [f32], seen: usize, shift: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let whole = row.len() / LANES * LANES;
    let (units, tail) = row.split_at_mut(whole);
    for (u, unit) in units.chunks_exact_mut(LANES).enumerate() {
        let first = u * LANES;
        if first >= seen {
            unit.fill(0.0);
            continue;
        }
        for l in 0..LANES {
            let e = exp(unit[l] - shift);
            let e = if first + l < seen { e } else { 0.0 };
            unit[l] = e;
            acc[l] += e;
        }
    }
    for (c, x) in tail.iter_mut().enumerate() {
        *x = if whole + c < seen {
            exp(*x - shift)
        } else {
            0.0
        };
    }
    let tail: f32 = tail.iter().sum();
    acc.iter().sum::<f32>() + tail
}

/// What a tile's products may skip: with a causal mask and no padding every row sees at least
/// its own key, so a masked weight is exactly zero; with padding a row may see no key at all
/// and then weighs every key alike (as the composed form does), so nothing is skipped.
fn limits(causal: bool, pad: Option<&[f32]>, i0: usize, j0: usize) -> Option<isize> {
    (causal && pad.is_none()).then_some(i0 as isize - j0 as isize)
}

/// How many of a tile row's `n` keys the causal mask leaves visible to row `ii` of the tile
/// whose [`limits`] are `limit` (all `n` where nothing is skipped).
#[inline(always)]
fn visible(limit: Option<isize>, ii: usize, n: usize) -> usize {
    limit.map_or(n, |o| (o + ii as isize + 1).clamp(0, n as isize) as usize)
}

multiversion! {
    fn attention_head(
        shape: AttentionShape,
        q: Heads,
        k: Heads,
        v: Heads,
        causal: bool,
        pad: Option<&[f32]>,
        dropout: Option<DropoutMask>,
        b: usize,
        h: usize,
        o: Out,
        lse: &mut [f32],
        scratch: &mut Scratch,
    ) {
        let AttentionShape { t, s, k: kw, .. } = shape;
        // Element (i, j) of this head's dropout mask.
        let first = ((b * shape.h + h) * t) as u64 * s as u64;
        let scale = 1.0 / (kw as f32).sqrt();
        let (kwp, lds) = (padded(kw), padded(s));
        let Scratch { packed: [kt, vp, ..], tiles: [keep, scores, acc, _], .. } = scratch;
        // A tile has at most this many rows (a short head's tiles are small: 17 rows, not 64).
        let rows = TILE.min(t);
        let keep = reused(keep, if dropout.is_some() { rows * TILE } else { 0 });
        let (kt, vp) = (pack_transposed(k, [b, h, s, kw], kt), pack_rows(v, [b, h, s, kw], vp));
        let scores = reused(scores, rows * TILE);
        let acc = reused(acc, rows * kwp);
        let (mut max, mut denom) = ([0.0f32; TILE], [0.0f32; TILE]);
        for i0 in (0..t).step_by(TILE) {
            let m = TILE.min(t - i0);
            // Not cleared: the first key tile's product writes it whole (nothing reads it
            // before: a row's first tile has nothing to rescale).
            if s == 0 {
                acc[..m * kwp].fill(0.0);
            }
            max[..m].fill(f32::NEG_INFINITY);
            denom[..m].fill(0.0);
            for j0 in (0..s).step_by(TILE) {
                if causal && j0 >= i0 + m && max[..m].iter().all(|&x| x > REAL_SCORE) {
                    break; // every later key is in the future of every row of this block
                }
                let n = TILE.min(s - j0);
                let limit = limits(causal, pad, i0, j0);
                // SAFETY (both products): the operands are rows of this head or local packed
                // copies, in bounds for whole column units; the destinations are local.
                unsafe {
                    Product {
                        m,
                        n,
                        k: kw,
                        a: q.rows(b, h, i0),
                        b: kt[j0..].as_ptr(),
                        ldb: lds,
                        c: scores.as_mut_ptr(),
                        ldc: TILE,
                        accumulate: false,
                        scale,
                        limit: limit.map_or(Limit::All, Limit::Columns),
                    }
                    .run();
                }
                // Without padding a causal mask hides only what `visible` leaves out, which the
                // loop below reads nowhere and zeroes; otherwise the masked scores are written.
                if limit.is_none() {
                    mask_tile(scores, [TILE, m, n], i0, j0, causal, pad, MASKED_SCORE);
                }
                if let Some(mask) = dropout {
                    mask_multipliers(mask, first, [i0, j0, n, s], &mut keep[..m * n]);
                }
                for ii in 0..m {
                    let row = &mut scores[ii * TILE..ii * TILE + n];
                    // Past the causal limit every score is masked and its weight exactly 0.
                    let (seen, _) = row.split_at_mut(visible(limit, ii, n));
                    let new_max = max[ii].max(super::max(seen));
                    // A row's first tile has nothing to rescale (its sum and output are zero).
                    if max[ii] != f32::NEG_INFINITY {
                        let rescale = exp(max[ii] - new_max);
                        if rescale != 1.0 {
                            denom[ii] *= rescale;
                            acc[ii * kwp..(ii + 1) * kwp].iter_mut().for_each(|x| *x *= rescale);
                        }
                    }
                    let seen = seen.len();
                    denom[ii] += exp_sum(row, seen, new_max);
                    max[ii] = new_max;
                    // Dropout after the softmax's sum: the normaliser counts every weight.
                    if dropout.is_some() {
                        let keep = &keep[ii * n..(ii + 1) * n];
                        row.iter_mut().zip(keep).for_each(|(x, &m)| *x *= m);
                    }
                }
                unsafe {
                    Product {
                        m,
                        n: kw,
                        k: n,
                        a: (scores.as_ptr(), TILE, 1),
                        b: vp.at(j0),
                        ldb: vp.ld,
                        c: acc.as_mut_ptr(),
                        ldc: kwp,
                        accumulate: j0 > 0,
                        scale: 1.0,
                        limit: limit.map_or(Limit::All, Limit::InnerUpTo),
                    }
                    .run();
                }
            }
            for ii in 0..m {
                let row = &acc[ii * kwp..ii * kwp + kw];
                // SAFETY: row i0 + ii of head (b, h) belongs to this task.
                unsafe { o.write_scaled(b, h, i0 + ii, row, 1.0 / denom[ii]) };
                lse[i0 + ii] = max[ii] + denom[ii].ln();
            }
        }
    }
}

/// Flash-style attention forward: `(output laid out [b, t, h, k], log-sum-exp [b, h, t])`.
/// `pad` is `[b, s]`, above 0.5 at padded keys.
pub fn attention_forward(
    shape: AttentionShape,
    q: Heads,
    k: Heads,
    v: Heads,
    causal: bool,
    pad: Option<&[f32]>,
    dropout: Option<DropoutMask>,
) -> (Vec<f32>, Vec<f32>) {
    let AttentionShape { b, h, t, s, k: kw } = shape;
    let mut o = uninit(b * t * h * kw);
    let mut lse = vec![0.0f32; b * h * t];
    let out = Out {
        ptr: o.as_mut_ptr(),
        strides: shape.interleaved(t),
    };
    if lanes::fits(shape, causal, pad, dropout) {
        lanes::attention_forward(shape, [q, k, v], out, &mut lse);
        // SAFETY: as below.
        return (unsafe { written(o, b * t * h * kw) }, lse);
    }
    lse.par_chunks_mut(t)
        .enumerate()
        .for_each_init(Scratch::default, |scratch, (head, lse)| {
            let (bi, hi) = (head / h, head % h);
            let pad = pad.map(|pad| &pad[bi * s..(bi + 1) * s]);
            attention_head(
                shape, q, k, v, causal, pad, dropout, bi, hi, out, lse, scratch,
            );
        });
    // SAFETY: every row of every head was written.
    (unsafe { written(o, b * t * h * kw) }, lse)
}

multiversion! {
    fn attention_head_backward(
        shape: AttentionShape,
        q: Heads,
        k: Heads,
        v: Heads,
        o: Heads,
        lse: &[f32],
        d_o: Heads,
        causal: bool,
        pad: Option<&[f32]>,
        dropout: Option<DropoutMask>,
        b: usize,
        h: usize,
        grads: [Out; 3],
        scratch: &mut Scratch,
    ) {
        let AttentionShape { t, s, k: kw, .. } = shape;
        let first = ((b * shape.h + h) * t) as u64 * s as u64;
        let Scratch { packed: [kt, vt, kp, qp, dop], tiles: [keep, dropped, p, ds], sums: [delta, dq, dk, dv], fresh } = scratch;
        // The dropout multipliers of a tile (rows of n) and the dropped weights P⊙M.
        // A tile has at most `rows` rows (a short head's tiles are small: 17 rows, not 64).
        let rows = TILE.min(t);
        let tile = if dropout.is_some() { rows * TILE } else { 0 };
        let (keep, dropped) = (reused(keep, tile), reused(dropped, tile));
        let scale = 1.0 / (kw as f32).sqrt();
        let [dq_out, dk_out, dv_out] = grads;
        let delta = reused(delta, t);
        for (i, x) in delta.iter_mut().enumerate() {
            *x = dot(d_o.row(b, h, i, kw), o.row(b, h, i, kw));
        }
        let (kwp, lds) = (padded(kw), padded(s));
        // Packed operands: Kᵀ for S = Q·Kᵀ, Vᵀ for dP = dO·Vᵀ, K, Q and dO as the right-hand
        // sides of dQ = dS·K, dK = dSᵀ·Q and dV = Pᵀ·dO.
        let (kt, vt) = (pack_transposed(k, [b, h, s, kw], kt), pack_transposed(v, [b, h, s, kw], vt));
        let (kp, qp, dop) = (
            pack_rows(k, [b, h, s, kw], kp),
            pack_rows(q, [b, h, t, kw], qp),
            pack_rows(d_o, [b, h, t, kw], dop),
        );
        // This head's gradients, rows `kwp` apart; written out at the end. Not cleared: the
        // first product into each tile of rows writes it whole (dQ's at the first key tile,
        // which every query tile reaches; dK's and dV's where `fresh` says), and a sum started
        // by a write has the bits of one started from zeros (an accumulator that starts at +0
        // never holds −0, so adding it to +0 gives it back).
        let (dq, dk, dv) = (reused(dq, t * kwp), reused(dk, s * kwp), reused(dv, s * kwp));
        fresh.clear();
        fresh.resize(s.div_ceil(TILE), true);
        let (p, ds) = (reused(p, rows * TILE), reused(ds, rows * TILE));
        for i0 in (0..t).step_by(TILE) {
            let m = TILE.min(t - i0);
            let lse = &lse[i0..i0 + m];
            for j0 in (0..s).step_by(TILE) {
                if causal && j0 >= i0 + m && lse.iter().all(|&x| x > REAL_SCORE) {
                    break;
                }
                let n = TILE.min(s - j0);
                let limit = limits(causal, pad, i0, j0);
                let first_visit = std::mem::replace(&mut fresh[j0 / TILE], false);
                // The tile's products; each reads rows of this head or local packed copies, in
                // bounds for whole column units, and writes a local buffer.
                let product = |a: Operand, [m, n, k]: [usize; 3], b: *const f32, ldb: usize, c: *mut f32, ldc: usize, accumulate: bool, scale: f32, limit: Limit| {
                    // SAFETY: as above.
                    unsafe {
                        Product { m, n, k, a, b, ldb, c, ldc, accumulate, scale, limit }.run()
                    }
                };
                let columns = limit.map_or(Limit::All, Limit::Columns);
                product(q.rows(b, h, i0), [m, n, kw], kt[j0..].as_ptr(), lds, p.as_mut_ptr(), TILE, false, scale, columns);
                // As in the forward pass: with `limit` every row sees a key (its own), and the
                // weights past it are zeroed below without reading the scores.
                if limit.is_none() {
                    mask_tile(p, [TILE, m, n], i0, j0, causal, pad, MASKED_SCORE);
                }
                for (ii, &l) in lse.iter().enumerate() {
                    let row = &mut p[ii * TILE..ii * TILE + n];
                    if l > REAL_SCORE {
                        // Past the causal limit every score is masked and its weight exactly 0.
                        let (seen, hidden) = row.split_at_mut(visible(limit, ii, n));
                        seen.iter_mut().for_each(|x| *x = exp(*x - l));
                        hidden.fill(0.0);
                    } else {
                        // Every key masked: uniform weights (lse = −10⁹ + ln s rounds to −10⁹).
                        row.fill(1.0 / s as f32);
                    }
                }
                // With dropout M the output read P⊙M: dV = (P⊙M)ᵀ·dO and dP = (dO·Vᵀ)⊙M.
                let weights = match dropout {
                    Some(mask) => {
                        let keep = &mut keep[..m * n];
                        mask_multipliers(mask, first, [i0, j0, n, s], keep);
                        for ii in 0..m {
                            let at = ii * TILE..ii * TILE + n;
                            for ((x, &pj), &mj) in dropped[at.clone()].iter_mut().zip(&p[at]).zip(&keep[ii * n..]) {
                                *x = pj * mj;
                            }
                        }
                        &dropped
                    }
                    None => &p,
                };
                // dV += Pᵀ·dO: key row jj reads queries ii ≥ jj + j0 − i0 only.
                let from = limit.map_or(Limit::All, |o| Limit::InnerFrom(-o));
                let dv_tile = dv[j0 * kwp..].as_mut_ptr();
                product((weights.as_ptr(), 1, TILE), [n, kw, m], dop.at(i0), dop.ld, dv_tile, kwp, !first_visit, 1.0, from);
                // dP = dO·Vᵀ.
                product(d_o.rows(b, h, i0), [m, n, kw], vt[j0..].as_ptr(), lds, ds.as_mut_ptr(), TILE, false, 1.0, columns);
                if dropout.is_some() {
                    for ii in 0..m {
                        let row = &mut ds[ii * TILE..ii * TILE + n];
                        row.iter_mut().zip(&keep[ii * n..]).for_each(|(x, &mj)| *x *= mj);
                    }
                }
                // dS = P ⊙ (dP − D)·scale; a masked score is a constant: no gradient. With
                // `limit` the masked part is what a row cannot see (left unwritten by dP's
                // product) and is zeroed here; otherwise `mask_tile` zeroes it.
                for ii in 0..m {
                    let d = delta[i0 + ii];
                    let row = &mut ds[ii * TILE..ii * TILE + n];
                    let (seen, hidden) = row.split_at_mut(visible(limit, ii, n));
                    for (x, &pj) in seen.iter_mut().zip(&p[ii * TILE..]) {
                        *x = pj * (*x - d) * scale;
                    }
                    hidden.fill(0.0);
                }
                if limit.is_none() {
                    mask_tile(ds, [TILE, m, n], i0, j0, causal, pad, 0.0);
                }
                // dQ += dS·K; dK += dSᵀ·Q.
                let dq_blk = dq[i0 * kwp..].as_mut_ptr();
                let up_to = limit.map_or(Limit::All, Limit::InnerUpTo);
                product((ds.as_ptr(), TILE, 1), [m, kw, n], kp.at(j0), kp.ld, dq_blk, kwp, j0 > 0, 1.0, up_to);
                let dk_tile = dk[j0 * kwp..].as_mut_ptr();
                product((ds.as_ptr(), 1, TILE), [n, kw, m], qp.at(i0), qp.ld, dk_tile, kwp, !first_visit, 1.0, from);
            }
        }
        // Key tiles no query tile reached (none, unless causal rows end before the keys do),
        // and queries when there are no keys at all, have zero gradients.
        for (tile, _) in fresh.iter().enumerate().filter(|(_, &f)| f) {
            let rows = tile * TILE * kwp..((tile + 1) * TILE).min(s) * kwp;
            dk[rows.clone()].fill(0.0);
            dv[rows].fill(0.0);
        }
        if s == 0 {
            dq.fill(0.0);
        }
        // SAFETY: rows of head (b, h) belong to this task.
        for (i, row) in dq.chunks_exact(kwp).enumerate() {
            unsafe { dq_out.write(b, h, i, &row[..kw]) };
        }
        for (j, (dk_row, dv_row)) in dk.chunks_exact(kwp).zip(dv.chunks_exact(kwp)).enumerate() {
            unsafe {
                dk_out.write(b, h, j, &dk_row[..kw]);
                dv_out.write(b, h, j, &dv_row[..kw]);
            }
        }
    }
}

/// Flash-style attention backward: `(dq [b, t, h, k], dk [b, s, h, k], dv [b, s, h, k])`,
/// the probabilities recomputed tile by tile from the saved log-sum-exp.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    shape: AttentionShape,
    q: Heads,
    k: Heads,
    v: Heads,
    o: Heads,
    lse: &[f32],
    d_o: Heads,
    causal: bool,
    pad: Option<&[f32]>,
    dropout: Option<DropoutMask>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let AttentionShape { b, h, t, s, k: kw } = shape;
    let (q_len, kv_len) = (b * t * h * kw, b * s * h * kw);
    let (mut dq, mut dk, mut dv) = (uninit(q_len), uninit(kv_len), uninit(kv_len));
    let (q_strides, kv_strides) = (shape.interleaved(t), shape.interleaved(s));
    let grads = [
        Out {
            ptr: dq.as_mut_ptr(),
            strides: q_strides,
        },
        Out {
            ptr: dk.as_mut_ptr(),
            strides: kv_strides,
        },
        Out {
            ptr: dv.as_mut_ptr(),
            strides: kv_strides,
        },
    ];
    backward_into(shape, [q, k, v, o, d_o], lse, (causal, pad, dropout), grads);
    // SAFETY: every row of every head of the three was written.
    unsafe { (written(dq, q_len), written(dk, kv_len), written(dv, kv_len)) }
}

/// Self-attention on packed projections `qkv` `[b, t, 3·h·k]` (Q, K, V side by side): the
/// gradient of `qkv`, written in place of its three parts. `o` and `d_o` are `[b, t, h·k]`.
#[allow(clippy::too_many_arguments)]
pub fn packed_attention_backward(
    shape: AttentionShape,
    qkv: &[f32],
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    causal: bool,
    pad: Option<&[f32]>,
    dropout: Option<DropoutMask>,
) -> Vec<f32> {
    let AttentionShape { b, h, t, k: kw, .. } = shape;
    let d = h * kw;
    assert_eq!(qkv.len(), b * t * 3 * d, "packed projections' size");
    let mut dqkv = uninit(qkv.len());
    let packed = [t * 3 * d, kw, 3 * d];
    let part = |i: usize| Heads {
        data: qkv,
        offset: i * d,
        strides: packed,
    };
    let merged = |data| Heads {
        data,
        offset: 0,
        strides: shape.interleaved(t),
    };
    let ptr = dqkv.as_mut_ptr();
    // SAFETY: the three parts start inside the buffer; every row written is in bounds.
    let grads = [0, 1, 2].map(|i| Out {
        ptr: unsafe { ptr.add(i * d) },
        strides: packed,
    });
    backward_into(
        shape,
        [part(0), part(1), part(2), merged(o), merged(d_o)],
        lse,
        (causal, pad, dropout),
        grads,
    );
    // SAFETY: every row of the three parts, which tile the buffer, was written.
    unsafe { written(dqkv, qkv.len()) }
}

/// Runs the backward kernel over every head, in parallel, writing `[dq, dk, dv]`.
fn backward_into(
    shape: AttentionShape,
    [q, k, v, o, d_o]: [Heads; 5],
    lse: &[f32],
    (causal, pad, dropout): (bool, Option<&[f32]>, Option<DropoutMask>),
    grads: [Out; 3],
) {
    let AttentionShape { h, t, s, .. } = shape;
    lse.par_chunks(t)
        .enumerate()
        .for_each_init(Scratch::default, |scratch, (head, lse)| {
            let (bi, hi) = (head / h, head % h);
            let pad = pad.map(|pad| &pad[bi * s..(bi + 1) * s]);
            prefetch_next(&[(q, t), (k, s), (v, s), (o, t), (d_o, t)], shape, head);
            attention_head_backward(
                shape, q, k, v, o, lse, d_o, causal, pad, dropout, bi, hi, grads, scratch,
            );
        });
}
