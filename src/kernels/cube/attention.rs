//! Flash-style attention on the GPU: a cube takes [`TILE`] consecutive query rows of one head,
//! `split` units a row (each holding every `split`-th column, their dot products added by plane
//! shuffles; see `row_split`), walks the keys [`TILE`] at a time through shared memory and keeps
//! an online softmax per row, so memory is linear in the sequence length (the `t × s` scores
//! never exist).
//! Under a causal mask without padding a cube walks only the tiles its rows can see: keys up to
//! its last query row, queries from its first key row (about half the tiles of a long sequence).
//! The backward pass recomputes the probabilities from the saved log-sum-exp: one kernel walks
//! the keys for each query row (dQ, and `D = rowsum(dO ⊙ O)`), another the queries for each key
//! row (dK and dV), so no two units ever add into the same gradient. One query row per head (a
//! decoding step) has a kernel of its own, which deals the keys out to the cube's units instead.
//!
//! For heads 16, 32 or 64 wide three more kernels (`*_tiles_kernel`) compute the same in tiles,
//! as products of matrices: a cube of [`TILES_UNITS`] units, each unit a 2 × 4 block of a tile's
//! scores and a 4 × `kd / 16` block of the products with the weights, every side read from
//! shared memory a few consecutive numbers at a time (see [`attention_forward_tiles_kernel`]).
//! Where a row kernel's unit reads a number from shared memory for each multiply-add and every
//! unit of a row pays the softmax's bookkeeping for every key, these read one for every 4 or 5
//! multiply-adds and take one exponential a score.
//!
//! The head dimension is a compile-time constant of each kernel (it sizes the registers that
//! hold a row), the masks and dropout are compile-time switches. Scores are those of the CPU
//! kernels: masked ones are [`MASKED_SCORE`], a fully masked row attends uniformly, a masked
//! score gets no gradient, and dropout multiplies element `((b·h + head)·t + i)·s + j` of the
//! Philox mask into the weights (drawn a row's tile at a time, see [`keep_bits`]).

use super::pointwise::{philox_block, philox_word, PhiloxBlock};
use cubecl::prelude::*;

/// Query rows per cube, and keys per shared-memory tile.
pub const TILE: u32 = 32;

/// The score of a masked key (as `reference::MASKED_SCORE`).
const MASKED_SCORE: f32 = -1.0e9;
/// Below this a row's log-sum-exp says every key was masked.
const REAL_SCORE: f32 = -5.0e8;
/// Below every score: keys past the end of the sequence.
const NO_SCORE: f32 = -3.0e38;

/// The shape-independent settings of one launch: the output's strides and the dropout mask.
#[derive(CubeType, CubeLaunch)]
pub struct Layout {
    /// Heads per batch item.
    pub heads: u32,
    /// The output's stride between batch items.
    pub out_batch: u32,
    /// The output's stride between heads.
    pub out_head: u32,
    /// The output's stride between positions.
    pub out_row: u32,
    /// The offset of the output's first element.
    pub out_offset: u32,
    /// A second output's offset (dV beside dK in the key kernel).
    pub out_offset_2: u32,
    /// The dropout mask's key, low word.
    pub key_lo: u32,
    /// The dropout mask's key, high word.
    pub key_hi: u32,
    /// The dropout probability as `p · 2³²`.
    pub threshold: u32,
    /// What a kept weight is multiplied by, `1/(1−p)`.
    pub drop_scale: f32,
}

/// Where a unit of the three kernels stands: the head of its cube and the row it owns.
#[derive(CubeType, Clone, Copy)]
struct Place {
    /// The head's index over batch items and heads, `b · heads + h`.
    bh: usize,
    /// The batch item.
    b: usize,
    /// The head.
    h: usize,
    /// Query positions.
    t: usize,
    /// Key positions.
    s: usize,
    /// The unit's row: a query row, or in the key kernel a key row.
    row: usize,
    /// Which of the row's `split` units this is: it holds columns `lane, lane + split, …`.
    lane: usize,
    /// Whether that row exists (the last cube's units may run past the end).
    live: bool,
    /// `1/√k`.
    scale: f32,
    /// The first of this batch item's padding flags.
    pad_row: usize,
}

/// The [`Place`] of this unit: cube `(x, y)` takes rows `x·TILE..` of head `y`, `split`
/// adjacent units a row; its rows are keys when `keys` is set, queries otherwise.
#[cube]
fn place<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    layout: &Layout,
    #[comptime] kd: usize,
    #[comptime] keys: bool,
    #[comptime] split: usize,
) -> Place {
    let bh = CUBE_POS_Y as usize;
    let heads = layout.heads as usize;
    let b = bh / heads;
    let t = q.shape(2);
    let s = k.shape(2);
    let row = CUBE_POS_X as usize * TILE as usize + UNIT_POS_X as usize / split;
    let mut rows = t;
    if keys {
        rows = s;
    }
    Place {
        bh,
        b,
        h: bh % heads,
        t,
        s,
        row,
        lane: UNIT_POS_X as usize % split,
        live: row < rows,
        scale: 1.0f32 / f32::sqrt(f32::cast_from(kd as u32)),
        pad_row: b * s,
    }
}

/// Whether key `j` is masked for query `i`.
#[cube]
fn is_masked<F: Float>(
    i: usize,
    j: usize,
    pad: &Tensor<F>,
    pad_row: usize,
    #[comptime] causal: bool,
    #[comptime] has_pad: bool,
) -> bool {
    let mut masked = false;
    if causal {
        masked = j > i;
    }
    if has_pad {
        masked = masked || f32::cast_from(pad[pad_row + j]) > 0.5f32;
    }
    masked
}

/// Where a cube's walk over the keys ends: past its last query row a causal mask hides every
/// key from all its rows, so without padding (where a fully masked row attends to every key)
/// those tiles are neither loaded nor visited; otherwise every key.
#[cube]
fn keys_end(s: usize, #[comptime] causal: bool, #[comptime] has_pad: bool) -> usize {
    let mut end = s;
    if causal && !has_pad {
        let last = (CUBE_POS_X as usize + 1) * TILE as usize;
        if last < end {
            end = last;
        }
    }
    end
}

/// Where the key kernel's walk over the queries starts: before its first key row a causal
/// mask hides its keys from every query, so without padding those query tiles are skipped.
#[cube]
fn queries_start(#[comptime] causal: bool, #[comptime] has_pad: bool) -> usize {
    let mut start = 0usize;
    if causal && !has_pad {
        start = CUBE_POS_X as usize * TILE as usize;
    }
    start
}

/// The dropout mask's keep bits for the [`TILE`] consecutive elements from `e0` (bit `n` for
/// element `e0 + n`), drawn together by the `split` units of a row: unit `lane` draws the
/// Philox blocks of its `TILE / split` elements — a block holds four elements' words, so that
/// is at most `TILE / (4 · split) + 1` blocks — and shuffles gather the bits. Drawing a block
/// for every weight in every unit of its row cost 4 × `split` times as many draws, each about a
/// hundred instructions: more than the weight's own arithmetic. Every unit of the cube must come
/// here together (as [`row_sum`]).
#[cube]
fn keep_bits(e0: u32, lane: usize, layout: &Layout, #[comptime] split: usize) -> u32 {
    let n = comptime!((TILE as usize / split) as u32);
    let first = lane as u32 * n;
    let start = e0 + first;
    let blocks = (start % 4u32 + n).div_ceil(4u32);
    let mut bits = 0u32;
    for k in 0..blocks {
        let block = start / 4u32 + k;
        let words = philox_block(block, layout.key_lo, layout.key_hi);
        // The element of word `w` is `4·block + w`, bit `first + (that − start)` where it is one
        // of this unit's (wrapping arithmetic: an element before `start` lands far past `n`).
        let offset = block * 4u32 - start;
        bits |= keep_bit(words, 0u32, offset, first, n, layout.threshold);
        bits |= keep_bit(words, 1u32, offset, first, n, layout.threshold);
        bits |= keep_bit(words, 2u32, offset, first, n, layout.threshold);
        bits |= keep_bit(words, 3u32, offset, first, n, layout.threshold);
    }
    row_or(bits, split)
}

/// Word `w` of `words` as a keep bit: element `offset + w` of a unit's `n` (wrapping), at bit
/// `first` + that, set where the word is at least `threshold`.
#[cube]
fn keep_bit(words: PhiloxBlock, w: u32, offset: u32, first: u32, n: u32, threshold: u32) -> u32 {
    let at = offset + w;
    let word = philox_word(words, w);
    let mut bit = 0u32;
    if at < n && word >= threshold {
        bit = 1u32 << (first + at);
    }
    bit
}

/// The dropout multiplier of bit `n` of a row's [`keep_bits`]: `1/(1−p)` or 0.
#[cube]
fn kept(bits: u32, n: usize, layout: &Layout) -> f32 {
    select((bits >> n as u32) & 1u32 == 1u32, layout.drop_scale, 0.0f32)
}

/// Rows `r0..r0 + TILE` of head `(b, h)` of `x` into `tile` (`TILE × kd`, zeros past `n`), by
/// all `units` units of the cube.
#[cube]
fn load_tile<F: Float>(
    x: &Tensor<F>,
    tile: &mut SharedMemory<f32>,
    b: usize,
    h: usize,
    r0: usize,
    #[comptime] kd: usize,
    #[comptime] units: usize,
) {
    let n = x.shape(2);
    let base = b * x.stride(0) + h * x.stride(1);
    let mut e = UNIT_POS_X as usize;
    while e < TILE as usize * kd {
        let r = r0 + e / kd;
        let c = e % kd;
        let mut value = 0.0f32;
        if r < n {
            value = f32::cast_from(x[base + r * x.stride(2) + c * x.stride(3)]);
        }
        tile[e] = value;
        e += units;
    }
}

/// Attention's forward pass: the output (at the layout's strides) and each row's log-sum-exp
/// `lse` `[b, h, t]`.
///
/// `split` units share a query row as in [`attention_backward_queries_kernel`] (each holding
/// every `split`-th column of Q and of the output). The softmax is online key by key: a score
/// above the row's maximum so far rescales what the row has summed, so no tile of scores is kept
/// (one unit a row kept 32 of them in slow local memory).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    pad: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<F>,
    layout: &Layout,
    #[comptime] kd: usize,
    #[comptime] causal: bool,
    #[comptime] has_pad: bool,
    #[comptime] has_dropout: bool,
    #[comptime] split: usize,
    #[define(F)] _dtype: StorageType,
) {
    let place = place::<F>(q, k, layout, kd, false, split);
    let (bh, b, h, t, s, i) = (place.bh, place.b, place.h, place.t, place.s, place.row);
    let (live, scale, pad_row, lane) = (place.live, place.scale, place.pad_row, place.lane);
    let cols = comptime!(kd / split);

    let mut qr = Array::<f32>::new(cols);
    let mut acc = Array::<f32>::new(cols);
    #[unroll]
    for cc in 0..cols {
        qr[cc] = 0.0f32;
        acc[cc] = 0.0f32;
    }
    if live {
        let q_base = b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
        #[unroll]
        for cc in 0..cols {
            let c = cc * split + lane;
            qr[cc] = f32::cast_from(q[q_base + c * q.stride(3)]) * scale;
        }
    }
    let mut ks = SharedMemory::<f32>::new(TILE as usize * kd);
    let mut vs = SharedMemory::<f32>::new(TILE as usize * kd);
    // Whether some row of the cube has seen only masked keys up to its diagonal (causal with
    // padding): only then do the tiles past the diagonal, all masked, change anything.
    let mut blind = SharedMemory::<u32>::new(1usize);
    if UNIT_POS_X == 0 {
        blind[0] = 0u32;
    }
    let units = comptime!(TILE as usize * split);
    let diagonal = CUBE_POS_X as usize * TILE as usize;
    let mut m = f32::new(NO_SCORE);
    let mut l = 0.0f32;

    // Every unit walks every key of every tile it visits (the shuffles need the whole plane).
    let end = keys_end(s, causal, has_pad);
    let mut j0 = 0usize;
    while j0 < end {
        load_tile::<F>(k, &mut ks, b, h, j0, kd, units);
        load_tile::<F>(v, &mut vs, b, h, j0, kd, units);
        sync_cube();
        let mut visit = true;
        if causal && has_pad {
            visit = j0 <= diagonal || blind[0] == 1u32;
        }
        if visit {
            let mut bits = 0u32;
            if has_dropout {
                bits = keep_bits(((bh * t + i) * s + j0) as u32, lane, layout, split);
            }
            for jj in 0..TILE as usize {
                let j = j0 + jj;
                let mut dot = 0.0f32;
                #[unroll]
                for cc in 0..cols {
                    dot += qr[cc] * ks[jj * kd + cc * split + lane];
                }
                let mut x = row_sum(dot, split);
                if j < s {
                    if is_masked::<F>(i, j, pad, pad_row, causal, has_pad) {
                        x = f32::new(MASKED_SCORE);
                    }
                    if x > m {
                        let correction = f32::exp(m - x);
                        l *= correction;
                        #[unroll]
                        for cc in 0..cols {
                            acc[cc] *= correction;
                        }
                        m = x;
                    }
                    let p = f32::exp(x - m);
                    l += p;
                    let mut w = p;
                    if has_dropout {
                        w *= kept(bits, jj, layout);
                    }
                    if w != 0.0f32 {
                        #[unroll]
                        for cc in 0..cols {
                            acc[cc] += w * vs[jj * kd + cc * split + lane];
                        }
                    }
                }
            }
            if causal && has_pad && live && j0 == diagonal && m <= f32::new(REAL_SCORE) {
                blind[0] = 1u32;
            }
        }
        sync_cube();
        j0 += TILE as usize;
    }
    if live {
        let o_base = layout.out_offset as usize
            + b * layout.out_batch as usize
            + h * layout.out_head as usize
            + i * layout.out_row as usize;
        #[unroll]
        for cc in 0..cols {
            out[o_base + cc * split + lane] = F::cast_from(acc[cc] / l);
        }
        if lane == 0 {
            lse[bh * t + i] = F::cast_from(m + f32::ln(l));
        }
    }
}

/// The weight `p` of key `j` for a query with log-sum-exp `lse` and score `x` (uniform `1/s`
/// on a fully masked row).
#[cube]
fn weight(x: f32, lse: f32, s: usize) -> f32 {
    let mut p = 1.0f32 / f32::cast_from(s as u32);
    if lse > REAL_SCORE {
        p = f32::exp(x - lse);
    }
    p
}

/// The sum of `x` over the `split` units of a row (1, 2, 4 or 8 adjacent units of one plane),
/// the same bits in each: every stage adds two partial sums, and `a + b` is `b + a`. Every
/// unit of the cube must come here together (a shuffle waits for its whole plane), so callers
/// never call it inside a branch that differs between rows.
#[cube]
fn row_sum(x: f32, #[comptime] split: usize) -> f32 {
    let mut sum = x;
    if split >= 2 {
        sum += plane_shuffle_xor(sum, 1u32);
    }
    if split >= 4 {
        sum += plane_shuffle_xor(sum, 2u32);
    }
    if split >= 8 {
        sum += plane_shuffle_xor(sum, 4u32);
    }
    sum
}

/// The bitwise or of `x` over the `split` units of a row (as [`row_sum`]).
#[cube]
fn row_or(x: u32, #[comptime] split: usize) -> u32 {
    let mut bits = x;
    if split >= 2 {
        bits |= plane_shuffle_xor(bits, 1u32);
    }
    if split >= 4 {
        bits |= plane_shuffle_xor(bits, 2u32);
    }
    if split >= 8 {
        bits |= plane_shuffle_xor(bits, 4u32);
    }
    bits
}

/// Attention's backward pass, query side: `dq` (at the layout's strides) and `delta`
/// `[b, h, t]` = `rowsum(dO ⊙ O)`, which [`attention_backward_keys_kernel`] reads.
///
/// `split` units (1, 2, 4 or 8, adjacent in a plane) share a query row, each holding columns
/// `lane, lane + split, …` of its Q, dO and dQ rows, its part of every dot product added to the
/// others' through shuffles: with 4, a unit holds 3 × 16 numbers of a 64-wide head where one
/// unit a row held 3 × 64, more than a GPU's 255 registers a unit (the kernel spilled), and four
/// times as many units share the work.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_queries_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    o: &Tensor<F>,
    d_o: &Tensor<F>,
    lse: &Tensor<F>,
    pad: &Tensor<F>,
    dq: &mut Tensor<F>,
    delta: &mut Tensor<f32>,
    layout: &Layout,
    #[comptime] kd: usize,
    #[comptime] causal: bool,
    #[comptime] has_pad: bool,
    #[comptime] has_dropout: bool,
    #[comptime] split: usize,
    #[define(F)] _dtype: StorageType,
) {
    let place = place::<F>(q, k, layout, kd, false, split);
    let (bh, b, h, t, s, i) = (place.bh, place.b, place.h, place.t, place.s, place.row);
    let (live, scale, pad_row, lane) = (place.live, place.scale, place.pad_row, place.lane);
    let cols = comptime!(kd / split);

    let mut qr = Array::<f32>::new(cols);
    let mut dor = Array::<f32>::new(cols);
    let mut acc = Array::<f32>::new(cols);
    #[unroll]
    for cc in 0..cols {
        qr[cc] = 0.0f32;
        dor[cc] = 0.0f32;
        acc[cc] = 0.0f32;
    }
    let mut d = 0.0f32;
    let mut row_lse = 0.0f32;
    if live {
        let q_base = b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
        let o_base = b * o.stride(0) + h * o.stride(1) + i * o.stride(2);
        let do_base = b * d_o.stride(0) + h * d_o.stride(1) + i * d_o.stride(2);
        #[unroll]
        for cc in 0..cols {
            let c = cc * split + lane;
            qr[cc] = f32::cast_from(q[q_base + c * q.stride(3)]) * scale;
            let g = f32::cast_from(d_o[do_base + c * d_o.stride(3)]);
            dor[cc] = g;
            d += g * f32::cast_from(o[o_base + c * o.stride(3)]);
        }
        row_lse = f32::cast_from(lse[bh * t + i]);
    }
    d = row_sum(d, split);
    let mut ks = SharedMemory::<f32>::new(TILE as usize * kd);
    let mut vs = SharedMemory::<f32>::new(TILE as usize * kd);
    let units = comptime!(TILE as usize * split);

    // Every unit walks every tile and key (the shuffles need the whole plane); a row's mask
    // decides only what it adds. Past the diagonal a causal mask hides every key from the
    // cube's rows, and a masked score passes no gradient to q, even in a fully masked row:
    // those tiles are never visited, padding or not.
    let end = keys_end(s, causal, false);
    let mut j0 = 0usize;
    while j0 < end {
        load_tile::<F>(k, &mut ks, b, h, j0, kd, units);
        load_tile::<F>(v, &mut vs, b, h, j0, kd, units);
        sync_cube();
        let mut bits = 0u32;
        if has_dropout {
            bits = keep_bits(((bh * t + i) * s + j0) as u32, lane, layout, split);
        }
        for jj in 0..TILE as usize {
            let j = j0 + jj;
            let mut x = 0.0f32;
            let mut dp = 0.0f32;
            #[unroll]
            for cc in 0..cols {
                let c = cc * split + lane;
                x += qr[cc] * ks[jj * kd + c];
                dp += dor[cc] * vs[jj * kd + c];
            }
            x = row_sum(x, split);
            dp = row_sum(dp, split);
            // A masked score is a constant: no gradient reaches q through it.
            if live && j < s && !is_masked::<F>(i, j, pad, pad_row, causal, has_pad) {
                let p = weight(x, row_lse, s);
                let mut mult = 1.0f32;
                if has_dropout {
                    mult = kept(bits, jj, layout);
                }
                let ds = p * (dp * mult - d);
                #[unroll]
                for cc in 0..cols {
                    acc[cc] += ds * ks[jj * kd + cc * split + lane];
                }
            }
        }
        sync_cube();
        j0 += TILE as usize;
    }
    if live {
        let base = layout.out_offset as usize
            + b * layout.out_batch as usize
            + h * layout.out_head as usize
            + i * layout.out_row as usize;
        #[unroll]
        for cc in 0..cols {
            dq[base + cc * split + lane] = F::cast_from(acc[cc] * scale);
        }
        if lane == 0 {
            delta[bh * t + i] = d;
        }
    }
}

/// Attention's backward pass, key side: `dk` and `dv` (at the layout's strides, dV at the second
/// offset) from the saved log-sum-exp and the query kernel's `delta`; `split` units a key row,
/// as in [`attention_backward_queries_kernel`] (with 4, a unit holds 4 × 16 numbers of a
/// 64-wide head, not 4 × 64).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_keys_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    d_o: &Tensor<F>,
    lse: &Tensor<F>,
    delta: &Tensor<f32>,
    pad: &Tensor<F>,
    dkv: &mut Tensor<F>,
    layout: &Layout,
    #[comptime] kd: usize,
    #[comptime] causal: bool,
    #[comptime] has_pad: bool,
    #[comptime] has_dropout: bool,
    #[comptime] split: usize,
    #[define(F)] _dtype: StorageType,
) {
    let place = place::<F>(q, k, layout, kd, true, split);
    let (bh, b, h, t, s, j) = (place.bh, place.b, place.h, place.t, place.s, place.row);
    let (live, scale, pad_row, lane) = (place.live, place.scale, place.pad_row, place.lane);
    let cols = comptime!(kd / split);

    let mut kr = Array::<f32>::new(cols);
    let mut vr = Array::<f32>::new(cols);
    let mut dk = Array::<f32>::new(cols);
    let mut dv = Array::<f32>::new(cols);
    #[unroll]
    for cc in 0..cols {
        kr[cc] = 0.0f32;
        vr[cc] = 0.0f32;
        dk[cc] = 0.0f32;
        dv[cc] = 0.0f32;
    }
    let mut key_masked = false;
    if live {
        let k_base = b * k.stride(0) + h * k.stride(1) + j * k.stride(2);
        let v_base = b * v.stride(0) + h * v.stride(1) + j * v.stride(2);
        #[unroll]
        for cc in 0..cols {
            let c = cc * split + lane;
            kr[cc] = f32::cast_from(k[k_base + c * k.stride(3)]) * scale;
            vr[cc] = f32::cast_from(v[v_base + c * v.stride(3)]);
        }
        if has_pad {
            key_masked = f32::cast_from(pad[pad_row + j]) > 0.5f32;
        }
    }
    let mut qs = SharedMemory::<f32>::new(TILE as usize * kd);
    let mut dos = SharedMemory::<f32>::new(TILE as usize * kd);
    let mut lses = SharedMemory::<f32>::new(TILE as usize);
    let mut deltas = SharedMemory::<f32>::new(TILE as usize);
    // Each query row's keep bits for the cube's keys, drawn by the units of the cube's rows.
    let mut keeps = SharedMemory::<u32>::new(TILE as usize);
    let units = comptime!(TILE as usize * split);
    let first_key = CUBE_POS_X as usize * TILE as usize;
    let key_bit = UNIT_POS_X as usize / split;

    // As in the query kernel, every unit walks every query of every tile.
    let mut i0 = queries_start(causal, has_pad);
    while i0 < t {
        load_tile::<F>(q, &mut qs, b, h, i0, kd, units);
        load_tile::<F>(d_o, &mut dos, b, h, i0, kd, units);
        let u = UNIT_POS_X as usize;
        if u < TILE as usize {
            let mut row_lse = 0.0f32;
            let mut row_delta = 0.0f32;
            if i0 + u < t {
                row_lse = f32::cast_from(lse[bh * t + i0 + u]);
                row_delta = delta[bh * t + i0 + u];
            }
            lses[u] = row_lse;
            deltas[u] = row_delta;
        }
        if has_dropout {
            // Units of the cube's row `key_bit` draw the bits of query row `i0 + key_bit`.
            let e0 = ((bh * t + i0 + key_bit) * s + first_key) as u32;
            let bits = keep_bits(e0, lane, layout, split);
            if lane == 0 {
                keeps[key_bit] = bits;
            }
        }
        sync_cube();
        for ii in 0..TILE as usize {
            let i = i0 + ii;
            let mut x = 0.0f32;
            let mut dp = 0.0f32;
            #[unroll]
            for cc in 0..cols {
                let c = cc * split + lane;
                x += qs[ii * kd + c] * kr[cc];
                dp += dos[ii * kd + c] * vr[cc];
            }
            x = row_sum(x, split);
            dp = row_sum(dp, split);
            let row_lse = lses[ii];
            let mut masked = key_masked;
            if causal {
                masked = masked || j > i;
            }
            // A masked key has weight 0, except in a fully masked row (uniform weights).
            if live && i < t && (!masked || row_lse <= REAL_SCORE) {
                if masked {
                    x = f32::new(MASKED_SCORE);
                }
                let p = weight(x, row_lse, s);
                let mut mult = 1.0f32;
                if has_dropout {
                    mult = kept(keeps[ii], key_bit, layout);
                }
                let w = p * mult;
                #[unroll]
                for cc in 0..cols {
                    dv[cc] += w * dos[ii * kd + cc * split + lane];
                }
                if !masked {
                    let ds = p * (dp * mult - deltas[ii]);
                    #[unroll]
                    for cc in 0..cols {
                        dk[cc] += ds * qs[ii * kd + cc * split + lane];
                    }
                }
            }
        }
        sync_cube();
        i0 += TILE as usize;
    }
    if live {
        let base = b * layout.out_batch as usize
            + h * layout.out_head as usize
            + j * layout.out_row as usize;
        let k_base = base + layout.out_offset as usize;
        let v_base = base + layout.out_offset_2 as usize;
        #[unroll]
        for cc in 0..cols {
            let c = cc * split + lane;
            dkv[k_base + c] = F::cast_from(dk[cc] * scale);
            dkv[v_base + c] = F::cast_from(dv[cc]);
        }
    }
}

/// Units per cube of [`attention_decode_kernel`].
pub const DECODE_UNITS: u32 = 32;

/// Attention's forward pass for one query row per head (a decoding step), where the tile
/// kernel would keep one unit of its cube busy: the cube of head `(b, h)` deals the keys out
/// to its [`DECODE_UNITS`] units, each keeping an online softmax over its own keys, and then
/// merges the units' maxima, sums and weighted values through shared memory. The scores, masks
/// and log-sum-exp are [`attention_forward_kernel`]'s (no dropout: decoding drops nothing).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_decode_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    pad: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<F>,
    layout: &Layout,
    #[comptime] kd: usize,
    #[comptime] has_pad: bool,
    #[define(F)] _dtype: StorageType,
) {
    let bh = CUBE_POS_Y as usize;
    let heads = layout.heads as usize;
    let (b, h) = (bh / heads, bh % heads);
    let s = k.shape(2);
    let u = UNIT_POS_X as usize;
    let units = DECODE_UNITS as usize;
    let scale = 1.0f32 / f32::sqrt(f32::cast_from(kd as u32));

    let mut qr = Array::<f32>::new(kd);
    let mut acc = Array::<f32>::new(kd);
    let q_base = b * q.stride(0) + h * q.stride(1);
    #[unroll]
    for c in 0..kd {
        qr[c] = f32::cast_from(q[q_base + c * q.stride(3)]) * scale;
        acc[c] = 0.0f32;
    }
    let k_base = b * k.stride(0) + h * k.stride(1);
    let v_base = b * v.stride(0) + h * v.stride(1);
    let mut m = f32::new(NO_SCORE);
    let mut l = 0.0f32;
    let mut j = u;
    while j < s {
        let mut x = f32::new(MASKED_SCORE);
        let mut masked = false;
        if has_pad {
            masked = f32::cast_from(pad[b * s + j]) > 0.5f32;
        }
        if !masked {
            let mut dot = 0.0f32;
            #[unroll]
            for c in 0..kd {
                dot += qr[c] * f32::cast_from(k[k_base + j * k.stride(2) + c * k.stride(3)]);
            }
            x = dot;
        }
        let m_new = f32::max(m, x);
        let correction = f32::exp(m - m_new);
        let p = f32::exp(x - m_new);
        l = l * correction + p;
        #[unroll]
        for c in 0..kd {
            let value = f32::cast_from(v[v_base + j * v.stride(2) + c * v.stride(3)]);
            acc[c] = acc[c] * correction + p * value;
        }
        m = m_new;
        j += units;
    }

    // Merge: every unit rescales its sums to the cube's maximum (a unit without keys has
    // nothing to add), then unit c adds up column c of the weighted values.
    let mut maxima = SharedMemory::<f32>::new(DECODE_UNITS as usize);
    let mut sums = SharedMemory::<f32>::new(DECODE_UNITS as usize);
    let mut values = SharedMemory::<f32>::new(DECODE_UNITS as usize * kd);
    maxima[u] = m;
    sync_cube();
    let mut top = f32::new(NO_SCORE);
    for w in 0..units {
        top = f32::max(top, maxima[w]);
    }
    let factor = f32::exp(m - top);
    sums[u] = l * factor;
    #[unroll]
    for c in 0..kd {
        values[u * kd + c] = acc[c] * factor;
    }
    sync_cube();
    let mut total = 0.0f32;
    for w in 0..units {
        total += sums[w];
    }
    let o_base =
        layout.out_offset as usize + b * layout.out_batch as usize + h * layout.out_head as usize;
    let mut c = u;
    while c < kd {
        let mut sum = 0.0f32;
        for w in 0..units {
            sum += values[w * kd + c];
        }
        out[o_base + c] = F::cast_from(sum / total);
        c += units;
    }
    if u == 0 {
        lse[bh] = F::cast_from(top + f32::ln(total));
    }
}

/// Units per cube of the tiled kernels ([`attention_forward_tiles_kernel`]).
pub const TILES_UNITS: u32 = 128;

/// Whether the tiled kernels are made for heads `kd` wide: 16, 32 or 64 (a unit's block of the
/// output is 4 rows by `kd / 16` columns, and the shared tiles of a 64-wide head take 32 to 46
/// KB, within the 48 KB a kernel may use without asking).
pub fn tiles_take(kd: usize) -> bool {
    matches!(kd, 16 | 32 | 64)
}

/// The row stride of the tiled kernels' shared tiles (Q, K, V and dO stored a column at a time,
/// and the weights): [`TILE`] + 4, so the coalesced loads' stores spread over 8 banks and a
/// row's reads of 4 consecutive elements stay 16-byte aligned.
const PADDED: usize = TILE as usize + 4;

/// Where a unit of the tiled kernels stands: the head of its cube, the cube's first row (a query
/// row, or in the key kernel a key row), and the unit's blocks of the scores and of the output.
#[derive(CubeType, Clone, Copy)]
struct TilePlace {
    /// The head's index over batch items and heads, `b · heads + h`.
    bh: usize,
    /// The batch item.
    b: usize,
    /// The head.
    h: usize,
    /// Query positions.
    t: usize,
    /// Key positions.
    s: usize,
    /// The cube's first row: `CUBE_POS_X · TILE`.
    first: usize,
    /// The first of this batch item's padding flags.
    pad_row: usize,
    /// `1/√k`.
    scale: f32,
    /// The scores' unit: query rows `2·sr + {0, 1}` of a tile ...
    sr: usize,
    /// ... and its keys `4·sk + {0..3}`.
    sk: usize,
    /// The output's unit: rows `4·vr + {0..3}` of the cube's tile ...
    vr: usize,
    /// ... and columns `(kd/16)·vc + {0..kd/16}`.
    vc: usize,
}

/// The [`TilePlace`] of this unit: cube `(x, y)` takes the tile of rows `x·TILE..` of head `y`.
#[cube]
fn tile_place<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    layout: &Layout,
    #[comptime] kd: usize,
) -> TilePlace {
    let bh = CUBE_POS_Y as usize;
    let heads = layout.heads as usize;
    let b = bh / heads;
    let s = k.shape(2);
    let u = UNIT_POS_X as usize;
    TilePlace {
        bh,
        b,
        h: bh % heads,
        t: q.shape(2),
        s,
        first: CUBE_POS_X as usize * TILE as usize,
        pad_row: b * s,
        scale: 1.0f32 / f32::sqrt(f32::cast_from(kd as u32)),
        sr: u / 8,
        sk: u % 8,
        vr: u / 16,
        vc: u % 16,
    }
}

/// Rows `r0..r0 + TILE` of head `(b, h)` of `x`, times `scale`, into `tile` a column at a time
/// (`tile[c · PADDED + r]`, zeros past the end), by the [`TILES_UNITS`] units of the cube: unit
/// `u` takes column `u % kd` of rows `u / kd`, `u / kd + TILES_UNITS / kd`, … (the reads of a
/// plane walk a row's columns, coalesced; each unit's addresses step by a constant).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_columns<F: Float>(
    x: &Tensor<F>,
    tile: &mut SharedMemory<f32>,
    b: usize,
    h: usize,
    r0: usize,
    scale: f32,
    #[comptime] kd: usize,
) {
    let n = x.shape(2);
    let u = UNIT_POS_X as usize;
    let c = u % kd;
    let first = u / kd;
    let step = comptime!(TILES_UNITS as usize / kd);
    let base = b * x.stride(0) + h * x.stride(1) + c * x.stride(3);
    #[unroll]
    for m in 0..TILE as usize / step {
        let r = first + m * step;
        let mut value = 0.0f32;
        if r0 + r < n {
            value = f32::cast_from(x[base + (r0 + r) * x.stride(2)]) * scale;
        }
        tile[c * PADDED + r] = value;
    }
}

/// A unit's 2 × 4 block of a tile's products of rows into `x`: `x[4·ro + kk] = Σ_c a[c·PADDED +
/// 2·sr + ro] · b[c·PADDED + 4·sk + kk]`, `a` and `b` stored a column at a time (see
/// [`load_columns`]): each step reads 2 and 4 consecutive numbers for 8 multiply-adds.
#[cube]
fn block_products(
    a: &SharedMemory<f32>,
    b: &SharedMemory<f32>,
    x: &mut Array<f32>,
    sr: usize,
    sk: usize,
    #[comptime] kd: usize,
) {
    #[unroll]
    for e in 0..8usize {
        x[e] = 0.0f32;
    }
    #[unroll]
    for c4 in 0..kd / 4 {
        #[unroll]
        for cc in 0..4usize {
            let c = c4 * 4 + cc;
            let a0 = a[c * PADDED + 2 * sr];
            let a1 = a[c * PADDED + 2 * sr + 1];
            #[unroll]
            for kk in 0..4usize {
                let bk = b[c * PADDED + 4 * sk + kk];
                x[kk] += a0 * bk;
                x[4 + kk] += a1 * bk;
            }
        }
    }
}

/// A unit's 4 × `cw` block of `W · M` over a tile: `acc[rr·cw + cc] += Σ_j w[(4·vr + rr)·PADDED
/// + j] · m[(cw·vc + cc)·PADDED + j]`, `w` a tile of weights a row at a time and `m` stored a
/// column at a time: 4 consecutive `j` of each are read at once, 4 + `cw` reads for `16·cw`
/// multiply-adds.
#[cube]
fn add_rows_times(
    w: &SharedMemory<f32>,
    m: &SharedMemory<f32>,
    acc: &mut Array<f32>,
    vr: usize,
    vc: usize,
    #[comptime] cw: usize,
) {
    #[unroll]
    for j4 in 0..TILE as usize / 4 {
        #[unroll]
        for jj in 0..4usize {
            let j = j4 * 4 + jj;
            #[unroll]
            for cc in 0..cw {
                let value = m[(cw * vc + cc) * PADDED + j];
                #[unroll]
                for rr in 0..4usize {
                    acc[rr * cw + cc] += w[(4 * vr + rr) * PADDED + j] * value;
                }
            }
        }
    }
}

/// A unit's 4 × `cw` block of `Wᵀ · M` over a tile: `acc[rr·cw + cc] += Σ_i w[i·PADDED + 4·vr +
/// rr] · m[(cw·vc + cc)·PADDED + i]` (the key kernel's products, its rows the weights' columns).
#[cube]
fn add_columns_times(
    w: &SharedMemory<f32>,
    m: &SharedMemory<f32>,
    acc: &mut Array<f32>,
    vr: usize,
    vc: usize,
    #[comptime] cw: usize,
) {
    #[unroll]
    for i4 in 0..TILE as usize / 4 {
        #[unroll]
        for ii in 0..4usize {
            let i = i4 * 4 + ii;
            #[unroll]
            for cc in 0..cw {
                let value = m[(cw * vc + cc) * PADDED + i];
                #[unroll]
                for rr in 0..4usize {
                    acc[rr * cw + cc] += w[i * PADDED + 4 * vr + rr] * value;
                }
            }
        }
    }
}

/// The keep bits of the dropout mask's elements `e..e + 4` (bit `n` for element `e + n`): the
/// one or two Philox blocks that hold them.
#[cube]
fn keep_four(e: u32, layout: &Layout) -> u32 {
    let off = e % 4u32;
    let first = philox_block(e / 4u32, layout.key_lo, layout.key_hi);
    let mut bits = 0u32;
    #[unroll]
    for w in 0..4u32 {
        if w >= off && philox_word(first, w) >= layout.threshold {
            bits |= 1u32 << (w - off);
        }
    }
    if off > 0u32 {
        let next = philox_block(e / 4u32 + 1u32, layout.key_lo, layout.key_hi);
        #[unroll]
        for w in 0..4u32 {
            if w < off && philox_word(next, w) >= layout.threshold {
                bits |= 1u32 << (4u32 - off + w);
            }
        }
    }
    bits
}

/// The maximum of `x` over 8 adjacent units of a plane (the same in each).
#[cube]
fn max_of_eight(x: f32) -> f32 {
    let mut top = x;
    top = f32::max(top, plane_shuffle_xor(top, 1u32));
    top = f32::max(top, plane_shuffle_xor(top, 2u32));
    top = f32::max(top, plane_shuffle_xor(top, 4u32));
    top
}

/// Attention's forward pass as products of tiles, for heads 16, 32 or 64 wide: what
/// [`attention_forward_kernel`] computes (the same scores, masks, dropout mask, output and
/// log-sum-exp), with the arithmetic laid out as a matrix product's.
///
/// A cube of [`TILES_UNITS`] units takes [`TILE`] query rows of one head and walks the keys a
/// tile at a time, Q, K and V in shared memory. First each unit computes a 2 × 4 block of the
/// tile's scores (2 query rows, 4 keys: every number read from shared memory feeds 2 or 4
/// multiply-adds, where the row kernel's feed one), and the 8 units of a row (adjacent in a
/// plane) take its online softmax: the tile's maximum and the weights' sum by shuffles, one
/// exponential per score. The weights go to shared memory, and then each unit adds a 4 ×
/// `kd / 16` block of the output tile, `P · V`, rescaled by its rows' corrections first.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_tiles_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    pad: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<F>,
    layout: &Layout,
    #[comptime] kd: usize,
    #[comptime] causal: bool,
    #[comptime] has_pad: bool,
    #[comptime] has_dropout: bool,
    #[define(F)] _dtype: StorageType,
) {
    let place = tile_place::<F>(q, k, layout, kd);
    let (bh, b, h, t, s) = (place.bh, place.b, place.h, place.t, place.s);
    let (i0, pad_row, scale) = (place.first, place.pad_row, place.scale);
    let (sr, sk, vr, vc) = (place.sr, place.sk, place.vr, place.vc);
    let u = UNIT_POS_X as usize;
    let cw = comptime!(kd / 16);

    let mut qs = SharedMemory::<f32>::new_aligned(kd * PADDED, 16usize);
    let mut ks = SharedMemory::<f32>::new_aligned(kd * PADDED, 16usize);
    let mut vs = SharedMemory::<f32>::new_aligned(kd * PADDED, 16usize);
    let mut ps = SharedMemory::<f32>::new_aligned(TILE as usize * PADDED, 16usize);
    // A row's correction for the tile just weighed, and at the end its sum of weights.
    let mut factors = SharedMemory::<f32>::new(TILE as usize);
    let mut blind = SharedMemory::<u32>::new(1usize);
    if u == 0 {
        blind[0] = 0u32;
    }
    load_columns::<F>(q, &mut qs, b, h, i0, scale, kd);

    let mut m = Array::<f32>::new(2usize);
    let mut l = Array::<f32>::new(2usize);
    #[unroll]
    for ro in 0..2usize {
        m[ro] = f32::new(NO_SCORE);
        l[ro] = 0.0f32;
    }
    let mut acc = Array::<f32>::new(4 * cw);
    #[unroll]
    for e in 0..4 * cw {
        acc[e] = 0.0f32;
    }

    let end = keys_end(s, causal, has_pad);
    let mut j0 = 0usize;
    while j0 < end {
        load_columns::<F>(k, &mut ks, b, h, j0, 1.0f32, kd);
        load_columns::<F>(v, &mut vs, b, h, j0, 1.0f32, kd);
        sync_cube();
        let mut visit = true;
        if causal && has_pad {
            visit = j0 <= i0 || blind[0] == 1u32;
        }
        if visit {
            let mut x = Array::<f32>::new(8usize);
            block_products(&qs, &ks, &mut x, sr, sk, kd);
            #[unroll]
            for ro in 0..2usize {
                let r = 2 * sr + ro;
                let i = i0 + r;
                let mut bits = 0u32;
                if has_dropout {
                    bits = keep_four(((bh * t + i) * s + j0 + 4 * sk) as u32, layout);
                }
                let mut top = f32::new(NO_SCORE);
                #[unroll]
                for kk in 0..4usize {
                    let j = j0 + 4 * sk + kk;
                    let mut score = x[4 * ro + kk];
                    if j >= s {
                        score = f32::new(NO_SCORE);
                    } else if is_masked::<F>(i, j, pad, pad_row, causal, has_pad) {
                        score = f32::new(MASKED_SCORE);
                    }
                    x[4 * ro + kk] = score;
                    top = f32::max(top, score);
                }
                let m_new = f32::max(m[ro], max_of_eight(top));
                let correction = f32::exp(m[ro] - m_new);
                let mut sum = 0.0f32;
                #[unroll]
                for kk in 0..4usize {
                    let p = f32::exp(x[4 * ro + kk] - m_new);
                    sum += p;
                    let mut w = p;
                    if has_dropout {
                        w *= kept(bits, kk, layout);
                    }
                    ps[r * PADDED + 4 * sk + kk] = w;
                }
                l[ro] = l[ro] * correction + row_sum(sum, 8usize);
                m[ro] = m_new;
                if sk == 0 {
                    factors[r] = correction;
                    if causal && has_pad && j0 == i0 && i < t && m_new <= f32::new(REAL_SCORE) {
                        blind[0] = 1u32;
                    }
                }
            }
            sync_cube();
            #[unroll]
            for rr in 0..4usize {
                let f = factors[4 * vr + rr];
                #[unroll]
                for cc in 0..cw {
                    acc[rr * cw + cc] *= f;
                }
            }
            add_rows_times(&ps, &vs, &mut acc, vr, vc, cw);
        }
        sync_cube();
        j0 += TILE as usize;
    }

    // Each row's sum of weights to the units that hold its output (after the loop's last sync).
    if sk == 0 {
        #[unroll]
        for ro in 0..2usize {
            let i = i0 + 2 * sr + ro;
            factors[2 * sr + ro] = l[ro];
            if i < t {
                lse[bh * t + i] = F::cast_from(m[ro] + f32::ln(l[ro]));
            }
        }
    }
    sync_cube();
    #[unroll]
    for rr in 0..4usize {
        let i = i0 + 4 * vr + rr;
        if i < t {
            let sum = factors[4 * vr + rr];
            let o_base = layout.out_offset as usize
                + b * layout.out_batch as usize
                + h * layout.out_head as usize
                + i * layout.out_row as usize;
            #[unroll]
            for cc in 0..cw {
                out[o_base + vc * cw + cc] = F::cast_from(acc[rr * cw + cc] / sum);
            }
        }
    }
}

/// Attention's backward pass, query side, as products of tiles (heads 16, 32 or 64 wide): what
/// [`attention_backward_queries_kernel`] computes, `dq` and `delta`, laid out as
/// [`attention_forward_tiles_kernel`] lays out the forward.
///
/// The cube's Q and dO rows stay in shared memory; for each tile of keys each unit computes a
/// 2 × 4 block of the scores and of `dP = dO · Vᵀ`, then its block's `dS = P ⊙ (dP − D)` from
/// the saved log-sum-exp (no reduction across units), and after those are in shared memory a 4
/// × `kd / 16` block of `dQ += dS · K`. `D = rowsum(dO ⊙ O)` is added up first, 4 units a row.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_queries_tiles_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    o: &Tensor<F>,
    d_o: &Tensor<F>,
    lse: &Tensor<F>,
    pad: &Tensor<F>,
    dq: &mut Tensor<F>,
    delta: &mut Tensor<f32>,
    layout: &Layout,
    #[comptime] kd: usize,
    #[comptime] causal: bool,
    #[comptime] has_pad: bool,
    #[comptime] has_dropout: bool,
    #[define(F)] _dtype: StorageType,
) {
    let place = tile_place::<F>(q, k, layout, kd);
    let (bh, b, h, t, s) = (place.bh, place.b, place.h, place.t, place.s);
    let (i0, pad_row, scale) = (place.first, place.pad_row, place.scale);
    let (sr, sk, vr, vc) = (place.sr, place.sk, place.vr, place.vc);
    let u = UNIT_POS_X as usize;
    let cw = comptime!(kd / 16);

    let mut qs = SharedMemory::<f32>::new_aligned(kd * PADDED, 16usize);
    let mut dos = SharedMemory::<f32>::new_aligned(kd * PADDED, 16usize);
    let mut ks = SharedMemory::<f32>::new_aligned(kd * PADDED, 16usize);
    let mut vs = SharedMemory::<f32>::new_aligned(kd * PADDED, 16usize);
    let mut dss = SharedMemory::<f32>::new_aligned(TILE as usize * PADDED, 16usize);
    let mut lses = SharedMemory::<f32>::new(TILE as usize);
    let mut deltas = SharedMemory::<f32>::new(TILE as usize);
    load_columns::<F>(q, &mut qs, b, h, i0, scale, kd);
    load_columns::<F>(d_o, &mut dos, b, h, i0, 1.0f32, kd);

    // D of row u / 4, each of its 4 units adding a quarter of its columns.
    let row = u / 4;
    let part = u % 4;
    let i = i0 + row;
    let mut d = 0.0f32;
    let mut row_lse = 0.0f32;
    if i < t {
        let o_base = b * o.stride(0) + h * o.stride(1) + i * o.stride(2);
        let do_base = b * d_o.stride(0) + h * d_o.stride(1) + i * d_o.stride(2);
        #[unroll]
        for cc in 0..kd / 4 {
            let c = part * (kd / 4) + cc;
            d += f32::cast_from(d_o[do_base + c * d_o.stride(3)])
                * f32::cast_from(o[o_base + c * o.stride(3)]);
        }
        row_lse = f32::cast_from(lse[bh * t + i]);
    }
    d = row_sum(d, 4usize);
    if part == 0 {
        deltas[row] = d;
        lses[row] = row_lse;
        if i < t {
            delta[bh * t + i] = d;
        }
    }

    let mut acc = Array::<f32>::new(4 * cw);
    #[unroll]
    for e in 0..4 * cw {
        acc[e] = 0.0f32;
    }
    // Past the diagonal a causal mask hides every key from the cube's rows, and a masked score
    // passes no gradient to q, even in a fully masked row: those tiles are never visited.
    let end = keys_end(s, causal, false);
    let mut j0 = 0usize;
    while j0 < end {
        load_columns::<F>(k, &mut ks, b, h, j0, 1.0f32, kd);
        load_columns::<F>(v, &mut vs, b, h, j0, 1.0f32, kd);
        sync_cube();
        let mut x = Array::<f32>::new(8usize);
        let mut dp = Array::<f32>::new(8usize);
        block_products(&qs, &ks, &mut x, sr, sk, kd);
        block_products(&dos, &vs, &mut dp, sr, sk, kd);
        #[unroll]
        for ro in 0..2usize {
            let r = 2 * sr + ro;
            let i = i0 + r;
            let mut bits = 0u32;
            if has_dropout {
                bits = keep_four(((bh * t + i) * s + j0 + 4 * sk) as u32, layout);
            }
            #[unroll]
            for kk in 0..4usize {
                let j = j0 + 4 * sk + kk;
                let mut ds = 0.0f32;
                // A masked score is a constant: no gradient reaches q through it.
                if i < t && j < s && !is_masked::<F>(i, j, pad, pad_row, causal, has_pad) {
                    let p = weight(x[4 * ro + kk], lses[r], s);
                    let mut mult = 1.0f32;
                    if has_dropout {
                        mult = kept(bits, kk, layout);
                    }
                    ds = p * (dp[4 * ro + kk] * mult - deltas[r]);
                }
                dss[r * PADDED + 4 * sk + kk] = ds;
            }
        }
        sync_cube();
        add_rows_times(&dss, &ks, &mut acc, vr, vc, cw);
        sync_cube();
        j0 += TILE as usize;
    }
    #[unroll]
    for rr in 0..4usize {
        let i = i0 + 4 * vr + rr;
        if i < t {
            let base = layout.out_offset as usize
                + b * layout.out_batch as usize
                + h * layout.out_head as usize
                + i * layout.out_row as usize;
            #[unroll]
            for cc in 0..cw {
                dq[base + vc * cw + cc] = F::cast_from(acc[rr * cw + cc] * scale);
            }
        }
    }
}

/// Attention's backward pass, key side, as products of tiles (heads 16, 32 or 64 wide): what
/// [`attention_backward_keys_kernel`] computes, `dk` and `dv` (dV at the second offset).
///
/// A cube takes [`TILE`] keys (their K and V in shared memory) and walks the queries a tile at
/// a time. Each unit computes the same 2 × 4 blocks as the query kernel (2 query rows, 4 of the
/// cube's keys: a query row's keep bits for 4 consecutive keys come from one or two Philox
/// blocks), writes its weights `P` (dropped) and `dS`, and then adds a 4 × `kd / 16` block of
/// `dV += Pᵀ · dO` and of `dK += dSᵀ · Q`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_keys_tiles_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    d_o: &Tensor<F>,
    lse: &Tensor<F>,
    delta: &Tensor<f32>,
    pad: &Tensor<F>,
    dkv: &mut Tensor<F>,
    layout: &Layout,
    #[comptime] kd: usize,
    #[comptime] causal: bool,
    #[comptime] has_pad: bool,
    #[comptime] has_dropout: bool,
    #[define(F)] _dtype: StorageType,
) {
    let place = tile_place::<F>(q, k, layout, kd);
    let (bh, b, h, t, s) = (place.bh, place.b, place.h, place.t, place.s);
    let (j0, pad_row, scale) = (place.first, place.pad_row, place.scale);
    let (sr, sk, vr, vc) = (place.sr, place.sk, place.vr, place.vc);
    let u = UNIT_POS_X as usize;
    let cw = comptime!(kd / 16);

    let mut ks = SharedMemory::<f32>::new_aligned(kd * PADDED, 16usize);
    let mut vs = SharedMemory::<f32>::new_aligned(kd * PADDED, 16usize);
    let mut qs = SharedMemory::<f32>::new_aligned(kd * PADDED, 16usize);
    let mut dos = SharedMemory::<f32>::new_aligned(kd * PADDED, 16usize);
    let mut ws = SharedMemory::<f32>::new_aligned(TILE as usize * PADDED, 16usize);
    let mut dss = SharedMemory::<f32>::new_aligned(TILE as usize * PADDED, 16usize);
    let mut lses = SharedMemory::<f32>::new(TILE as usize);
    let mut deltas = SharedMemory::<f32>::new(TILE as usize);
    load_columns::<F>(k, &mut ks, b, h, j0, 1.0f32, kd);
    load_columns::<F>(v, &mut vs, b, h, j0, 1.0f32, kd);

    let mut dk = Array::<f32>::new(4 * cw);
    let mut dv = Array::<f32>::new(4 * cw);
    #[unroll]
    for e in 0..4 * cw {
        dk[e] = 0.0f32;
        dv[e] = 0.0f32;
    }
    let mut i0 = queries_start(causal, has_pad);
    while i0 < t {
        load_columns::<F>(q, &mut qs, b, h, i0, scale, kd);
        load_columns::<F>(d_o, &mut dos, b, h, i0, 1.0f32, kd);
        if u < TILE as usize {
            let mut row_lse = 0.0f32;
            let mut row_delta = 0.0f32;
            if i0 + u < t {
                row_lse = f32::cast_from(lse[bh * t + i0 + u]);
                row_delta = delta[bh * t + i0 + u];
            }
            lses[u] = row_lse;
            deltas[u] = row_delta;
        }
        sync_cube();
        let mut x = Array::<f32>::new(8usize);
        let mut dp = Array::<f32>::new(8usize);
        block_products(&qs, &ks, &mut x, sr, sk, kd);
        block_products(&dos, &vs, &mut dp, sr, sk, kd);
        #[unroll]
        for ro in 0..2usize {
            let r = 2 * sr + ro;
            let i = i0 + r;
            let row_lse = lses[r];
            let mut bits = 0u32;
            if has_dropout {
                bits = keep_four(((bh * t + i) * s + j0 + 4 * sk) as u32, layout);
            }
            #[unroll]
            for kk in 0..4usize {
                let j = j0 + 4 * sk + kk;
                let mut w = 0.0f32;
                let mut ds = 0.0f32;
                let masked = is_masked::<F>(i, j, pad, pad_row, causal, has_pad);
                // A masked key has weight 0, except in a fully masked row (uniform weights).
                if i < t && j < s && (!masked || row_lse <= REAL_SCORE) {
                    let mut score = x[4 * ro + kk];
                    if masked {
                        score = f32::new(MASKED_SCORE);
                    }
                    let p = weight(score, row_lse, s);
                    let mut mult = 1.0f32;
                    if has_dropout {
                        mult = kept(bits, kk, layout);
                    }
                    w = p * mult;
                    if !masked {
                        ds = p * (dp[4 * ro + kk] * mult - deltas[r]);
                    }
                }
                ws[r * PADDED + 4 * sk + kk] = w;
                dss[r * PADDED + 4 * sk + kk] = ds;
            }
        }
        sync_cube();
        add_columns_times(&ws, &dos, &mut dv, vr, vc, cw);
        add_columns_times(&dss, &qs, &mut dk, vr, vc, cw);
        sync_cube();
        i0 += TILE as usize;
    }
    #[unroll]
    for rr in 0..4usize {
        let j = j0 + 4 * vr + rr;
        if j < s {
            let base = b * layout.out_batch as usize
                + h * layout.out_head as usize
                + j * layout.out_row as usize;
            #[unroll]
            for cc in 0..cw {
                let c = vc * cw + cc;
                dkv[base + layout.out_offset as usize + c] = F::cast_from(dk[rr * cw + cc]);
                dkv[base + layout.out_offset_2 as usize + c] = F::cast_from(dv[rr * cw + cc]);
            }
        }
    }
}
