//! Flash-style attention: `64 × 64` tiles of queries and keys with an online softmax forward,
//! and a backward pass that recomputes the probabilities tile by tile from the saved
//! log-sum-exp — the `t × s` score matrix is never stored.

use super::linear::{matmul, Operand};
use super::{dot, exp, multiversion, sum, uninit, written};
use crate::kernels::reference::MASKED_SCORE;
use crate::kernels::DropoutMask;
use rayon::prelude::*;

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
        std::ptr::copy_nonoverlapping(row.as_ptr(), dst, row.len());
    }
}

/// Whether key `j` is masked for query `i`.
#[inline(always)]
fn masked(i: usize, j: usize, causal: bool, pad: Option<&[f32]>) -> bool {
    (causal && j > i) || pad.is_some_and(|pad| pad[j] > 0.5)
}

impl Heads<'_> {
    /// Rows `i0..` of head `(b, h)` as a matrix operand (row-major, `k` columns).
    #[inline(always)]
    fn rows(&self, b: usize, h: usize, i0: usize) -> Operand {
        let start = self.offset + b * self.strides[0] + h * self.strides[1] + i0 * self.strides[2];
        (self.data[start..].as_ptr(), self.strides[2], 1)
    }

    /// Rows `j0..` of head `(b, h)` transposed (a `k × n` operand).
    #[inline(always)]
    fn rows_transposed(&self, b: usize, h: usize, j0: usize) -> Operand {
        let (ptr, rs, cs) = self.rows(b, h, j0);
        (ptr, cs, rs)
    }
}

/// Masks the score tile `scores` (`rows × n`, queries `i0..`, keys `j0..`).
fn mask_tile(
    scores: &mut [f32],
    n: usize,
    i0: usize,
    j0: usize,
    causal: bool,
    pad: Option<&[f32]>,
) {
    if !causal && pad.is_none() {
        return;
    }
    for (ii, row) in scores.chunks_exact_mut(n).enumerate() {
        for (jj, x) in row.iter_mut().enumerate() {
            if masked(i0 + ii, j0 + jj, causal, pad) {
                *x = MASKED_SCORE;
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
    ) {
        let AttentionShape { t, s, k: kw, .. } = shape;
        // Element (i, j) of this head's dropout mask.
        let first = ((b * shape.h + h) * t) as u64 * s as u64;
        let mut keep = vec![0.0f32; if dropout.is_some() { TILE * TILE } else { 0 }];
        let scale = 1.0 / (kw as f32).sqrt();
        let mut scores = vec![0.0f32; TILE * TILE];
        let mut acc = vec![0.0f32; TILE * kw];
        let (mut max, mut denom) = ([0.0f32; TILE], [0.0f32; TILE]);
        for i0 in (0..t).step_by(TILE) {
            let m = TILE.min(t - i0);
            let acc = &mut acc[..m * kw];
            acc.fill(0.0);
            max[..m].fill(f32::NEG_INFINITY);
            denom[..m].fill(0.0);
            for j0 in (0..s).step_by(TILE) {
                if causal && j0 >= i0 + m && max[..m].iter().all(|&x| x > REAL_SCORE) {
                    break; // every later key is in the future of every row of this block
                }
                let n = TILE.min(s - j0);
                let scores = &mut scores[..m * n];
                // SAFETY: operands are rows of this head, in bounds; `scores` is local.
                unsafe {
                    let (qr, kt) = (q.rows(b, h, i0), k.rows_transposed(b, h, j0));
                    matmul([m, n, kw], scores.as_mut_ptr(), n, false, qr, kt, scale);
                }
                mask_tile(scores, n, i0, j0, causal, pad);
                if let Some(mask) = dropout {
                    mask_multipliers(mask, first, [i0, j0, n, s], &mut keep[..m * n]);
                }
                for (ii, row) in scores.chunks_exact_mut(n).enumerate() {
                    let tile_max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                    let new_max = max[ii].max(tile_max);
                    let rescale = exp(max[ii] - new_max);
                    if rescale != 1.0 {
                        denom[ii] *= rescale;
                        acc[ii * kw..(ii + 1) * kw].iter_mut().for_each(|x| *x *= rescale);
                    }
                    for x in row.iter_mut() {
                        *x = exp(*x - new_max);
                    }
                    denom[ii] += sum(row);
                    max[ii] = new_max;
                    // Dropout after the softmax's sum: the normaliser counts every weight.
                    if dropout.is_some() {
                        let keep = &keep[ii * n..(ii + 1) * n];
                        row.iter_mut().zip(keep).for_each(|(x, &m)| *x *= m);
                    }
                }
                // SAFETY: as above; `acc` is local.
                unsafe {
                    let p = (scores.as_ptr(), n, 1);
                    matmul([m, kw, n], acc.as_mut_ptr(), kw, true, p, v.rows(b, h, j0), 1.0);
                }
            }
            for (ii, row) in acc.chunks_exact_mut(kw).enumerate() {
                let inv = 1.0 / denom[ii];
                row.iter_mut().for_each(|a| *a *= inv);
                // SAFETY: row i0 + ii of head (b, h) belongs to this task.
                unsafe { o.write(b, h, i0 + ii, row) };
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
    lse.par_chunks_mut(t).enumerate().for_each(|(head, lse)| {
        let (bi, hi) = (head / h, head % h);
        let pad = pad.map(|pad| &pad[bi * s..(bi + 1) * s]);
        attention_head(shape, q, k, v, causal, pad, dropout, bi, hi, out, lse);
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
    ) {
        let AttentionShape { t, s, k: kw, .. } = shape;
        let first = ((b * shape.h + h) * t) as u64 * s as u64;
        // The dropout multipliers of a tile and the dropped weights P⊙M.
        let (mut keep, mut dropped) = match dropout {
            Some(_) => (vec![0.0f32; TILE * TILE], vec![0.0f32; TILE * TILE]),
            None => (Vec::new(), Vec::new()),
        };
        let scale = 1.0 / (kw as f32).sqrt();
        let [dq_out, dk_out, dv_out] = grads;
        let delta: Vec<f32> = (0..t)
            .map(|i| dot(d_o.row(b, h, i, kw), o.row(b, h, i, kw)))
            .collect();
        // This head's gradients, row-major; written out at the end.
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; t * kw], vec![0.0f32; s * kw], vec![0.0f32; s * kw]);
        let mut p = vec![0.0f32; TILE * TILE];
        let mut ds = vec![0.0f32; TILE * TILE];
        for i0 in (0..t).step_by(TILE) {
            let m = TILE.min(t - i0);
            let lse = &lse[i0..i0 + m];
            for j0 in (0..s).step_by(TILE) {
                if causal && j0 >= i0 + m && lse.iter().all(|&x| x > REAL_SCORE) {
                    break;
                }
                let n = TILE.min(s - j0);
                let (p, ds) = (&mut p[..m * n], &mut ds[..m * n]);
                // SAFETY (every product): operands are rows of this head or local buffers, in
                // bounds, and each destination is local.
                unsafe {
                    let (qr, kt) = (q.rows(b, h, i0), k.rows_transposed(b, h, j0));
                    matmul([m, n, kw], p.as_mut_ptr(), n, false, qr, kt, scale);
                }
                mask_tile(p, n, i0, j0, causal, pad);
                for (row, &l) in p.chunks_exact_mut(n).zip(lse) {
                    if l > REAL_SCORE {
                        row.iter_mut().for_each(|x| *x = exp(*x - l));
                    } else {
                        // Every key masked: uniform weights (lse = −10⁹ + ln s rounds to −10⁹).
                        row.fill(1.0 / s as f32);
                    }
                }
                // With dropout M the output read P⊙M: dV = (P⊙M)ᵀ·dO and dP = (dO·Vᵀ)⊙M.
                let weights = match dropout {
                    Some(mask) => {
                        let (keep, dropped) = (&mut keep[..m * n], &mut dropped[..m * n]);
                        mask_multipliers(mask, first, [i0, j0, n, s], keep);
                        for ((x, &pj), &mj) in dropped.iter_mut().zip(p.iter()).zip(keep.iter()) {
                            *x = pj * mj;
                        }
                        &dropped[..m * n]
                    }
                    None => &p[..],
                };
                unsafe {
                    // dV += Pᵀ·dO; dP = dO·Vᵀ.
                    let pt = (weights.as_ptr(), 1, n);
                    let dv_tile = dv[j0 * kw..].as_mut_ptr();
                    matmul([n, kw, m], dv_tile, kw, true, pt, d_o.rows(b, h, i0), 1.0);
                    let (dor, vt) = (d_o.rows(b, h, i0), v.rows_transposed(b, h, j0));
                    matmul([m, n, kw], ds.as_mut_ptr(), n, false, dor, vt, 1.0);
                }
                if dropout.is_some() {
                    ds.iter_mut().zip(&keep[..m * n]).for_each(|(x, &mj)| *x *= mj);
                }
                // dS = P ⊙ (dP − D)·scale; a masked score is a constant: no gradient.
                for (ii, (ds_row, p_row)) in ds.chunks_exact_mut(n).zip(p.chunks_exact(n)).enumerate() {
                    let d = delta[i0 + ii];
                    for (x, &pj) in ds_row.iter_mut().zip(p_row) {
                        *x = pj * (*x - d) * scale;
                    }
                    if causal || pad.is_some() {
                        for (jj, x) in ds_row.iter_mut().enumerate() {
                            if masked(i0 + ii, j0 + jj, causal, pad) {
                                *x = 0.0;
                            }
                        }
                    }
                }
                unsafe {
                    // dQ += dS·K; dK += dSᵀ·Q.
                    let dq_blk = dq[i0 * kw..].as_mut_ptr();
                    matmul([m, kw, n], dq_blk, kw, true, (ds.as_ptr(), n, 1), k.rows(b, h, j0), 1.0);
                    let dk_tile = dk[j0 * kw..].as_mut_ptr();
                    matmul([n, kw, m], dk_tile, kw, true, (ds.as_ptr(), 1, n), q.rows(b, h, i0), 1.0);
                }
            }
        }
        // SAFETY: rows of head (b, h) belong to this task.
        for (i, row) in dq.chunks_exact(kw).enumerate() {
            unsafe { dq_out.write(b, h, i, row) };
        }
        for (j, (dk_row, dv_row)) in dk.chunks_exact(kw).zip(dv.chunks_exact(kw)).enumerate() {
            unsafe {
                dk_out.write(b, h, j, dk_row);
                dv_out.write(b, h, j, dv_row);
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
    lse.par_chunks(t).enumerate().for_each(|(head, lse)| {
        let (bi, hi) = (head / h, head % h);
        let pad = pad.map(|pad| &pad[bi * s..(bi + 1) * s]);
        attention_head_backward(
            shape, q, k, v, o, lse, d_o, causal, pad, dropout, bi, hi, grads,
        );
    });
}
