//! Attention's forward pass for many small heads at once: sixteen heads side by side, one in
//! each lane of a vector. A ViT's heads are small (`vit-mnist`: 17 positions, 16 wide, 512
//! heads a layer), and one at a time their tiles are mostly overhead: 17 keys fill one 16-lane
//! unit and one lane of a second, and every row's maximum, sum and scaling, every packing and
//! every call is paid 512 times a layer. Here a vector holds one element of sixteen heads, so
//! each operation of a head is one lane of a vector operation and nothing is padded, whatever
//! the head's length and width.
//!
//! Each lane computes what the tiled kernels compute for its head, in the same order — every
//! product the same chain of fused multiply-adds from zero, every row's maximum and sum with
//! the same accumulators added in the same order — so the two forms give the same bits and
//! either may run. This form covers what the ViT's encoder needs: no causal
//! mask, no padding and no dropout, and short heads: a group's buffers hold its whole `t × s`
//! weights, so past a few dozen positions the tiled kernels are the faster.
//!
//! The backward pass stays with the tiles: written this way too (five products a group, the
//! gradients scattered back), it measured 10% faster than the tiles on a ViT's heads alone with
//! its operands in the caches, and no faster inside the training step, where it waits on
//! memory either way (its operands were written long before).

use super::{reused, AttentionShape, Heads, Out, TILE};
use crate::kernels::cpu::tile::{gather_transposed, scatter_transposed, Portable, Simd, UNIT};
#[cfg(target_arch = "x86_64")]
use crate::kernels::cpu::tile::{Avx2, Avx512};
use crate::kernels::cpu::{exp, isa, Isa, LANES};
use crate::kernels::DropoutMask;
use rayon::prelude::*;
use std::cell::Cell;

/// Heads computed together, one a lane.
const G: usize = UNIT;
/// The widest head this form takes (its rows of zeros and of dropped lanes).
const MAX_WIDTH: usize = 32;
/// The most queries or keys this form takes. Its buffers hold a group's whole `t × s` weights:
/// past a few dozen positions they outgrow the core's first-level cache and one head at a time
/// is the faster (measured on one core of a Zen 4: at 50 positions of 32 the forward pass took
/// 2.5–2.7 ms where the tiles took 2.1–2.5).
const MAX_POSITIONS: usize = 32;
// One tile of queries and of keys: the tiled kernel's sums, which this form repeats, have no
// second tile to rescale.
const _: () = assert!(MAX_POSITIONS <= TILE);

thread_local! {
    /// Whether this thread's calls keep to the tiled kernels ([`with_tiles_only`]).
    static TILES_ONLY: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with the attention kernels it calls from this thread in their tiled form only, one
/// head at a time: for comparing the two forms, which give the same bits.
pub fn with_tiles_only<R>(f: impl FnOnce() -> R) -> R {
    let before = TILES_ONLY.with(|t| t.replace(true));
    let out = f();
    TILES_ONLY.with(|t| t.set(before));
    out
}

/// Whether this form takes the problem: no mask, no dropout, at least one group of [`G`] heads,
/// and queries, keys and heads small enough ([`MAX_POSITIONS`], [`MAX_WIDTH`]).
pub(super) fn fits(
    shape: AttentionShape,
    causal: bool,
    pad: Option<&[f32]>,
    dropout: Option<DropoutMask>,
) -> bool {
    let AttentionShape { b, h, t, s, k } = shape;
    !causal
        && pad.is_none()
        && dropout.is_none()
        && (1..=MAX_POSITIONS).contains(&t)
        && (1..=MAX_POSITIONS).contains(&s)
        && (1..=MAX_WIDTH).contains(&k)
        && b * h >= G
        && !TILES_ONLY.with(Cell::get)
}

/// Whether attention's forward pass of this shape, without a mask or dropout, runs its heads
/// in lanes (this form; outside [`with_tiles_only`]).
pub fn heads_in_lanes(shape: AttentionShape) -> bool {
    fits(shape, false, None, None)
}

/// One task's buffers, reused from group to group.
#[derive(Default)]
struct Scratch {
    /// Q, K and V of the group's heads, element `(i, c)` a vector of lanes.
    packed: [Vec<f32>; 3],
    /// The scores, then the weights, `(i, j)` a vector of lanes.
    scores: Vec<f32>,
    /// The output.
    acc: Vec<f32>,
}

/// `C[r][c] = scale · Σ_p A[r][p] ⊙ B[c][p]`, each element a vector of [`G`] lanes, each
/// lane's sum the chain of fused multiply-adds from zero over `p` ascending that the tiled
/// products make. Strides in floats.
#[derive(Clone, Copy)]
struct Product {
    /// Rows, columns, inner dimension.
    size: [usize; 3],
    /// `A`: pointer, row stride, inner stride.
    a: (*const f32, usize, usize),
    /// `B`: pointer, column stride, inner stride.
    b: (*const f32, usize, usize),
    /// `C`: pointer, row stride, column stride.
    c: (*mut f32, usize, usize),
    scale: f32,
}

/// One register block of `R × C` elements of a [`Product`], from row `r0` and column `c0`.
#[inline(always)]
unsafe fn block<S: Simd, const R: usize, const C: usize>(p: &Product, r0: usize, c0: usize) {
    let ((a, ar, ap), (b, bc, bp), (c, cr, cc)) = (p.a, p.b, p.c);
    let (a, b) = (a.add(r0 * ar), b.add(c0 * bc));
    let mut acc = [[S::zero(); C]; R];
    for k in 0..p.size[2] {
        let mut bv = [S::zero(); C];
        for (j, v) in bv.iter_mut().enumerate() {
            *v = S::load(b.add(j * bc + k * bp));
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            let x = S::load(a.add(i * ar + k * ap));
            for (acc, &y) in acc.iter_mut().zip(&bv) {
                *acc = S::fma(x, y, *acc);
            }
        }
    }
    let scale = S::splat(p.scale);
    for (i, acc) in acc.iter().enumerate() {
        for (j, &acc) in acc.iter().enumerate() {
            S::store(c.add((r0 + i) * cr + (c0 + j) * cc), S::mul(acc, scale));
        }
    }
}

/// The whole [`Product`] in blocks of at most `R × C` (each at most 4).
#[inline(always)]
unsafe fn product<S: Simd, const R: usize, const C: usize>(p: Product) {
    let [rows, cols, _] = p.size;
    let mut r0 = 0;
    while r0 < rows {
        let rr = (rows - r0).min(R);
        let mut c0 = 0;
        while c0 < cols {
            let cc = (cols - c0).min(C);
            macro_rules! blocks {
                ($(($r:literal, $c:literal)),*) => {
                    match (rr, cc) {
                        $(($r, $c) => block::<S, $r, $c>(&p, r0, c0),)*
                        _ => unreachable!("blocks are at most 4 × 4"),
                    }
                };
            }
            blocks!(
                (1, 1),
                (1, 2),
                (1, 3),
                (1, 4),
                (2, 1),
                (2, 2),
                (2, 3),
                (2, 4),
                (3, 1),
                (3, 2),
                (3, 3),
                (3, 4),
                (4, 1),
                (4, 2),
                (4, 3),
                (4, 4)
            );
            c0 += cc;
        }
        r0 += rr;
    }
}

/// The value `Iterator::sum` starts from, which the tiled kernels' sums begin with.
#[inline(always)]
fn empty_sum() -> f32 {
    std::iter::empty::<f32>().sum()
}

/// The group's heads `first..first + count` (numbered `b · h + head`), rows `0..n`: row `i`,
/// column `c` of head `first + l` at `(i · k + c) · G + l` (lanes past `count` zero).
fn pack<'a>(
    x: Heads,
    shape: AttentionShape,
    [first, count, n]: [usize; 3],
    out: &'a mut Vec<f32>,
) -> &'a [f32] {
    let k = shape.k;
    let out = reused(out, n * k * G);
    let zeros = [0.0f32; MAX_WIDTH];
    let mut rows = [zeros.as_ptr(); G];
    for (l, row) in rows.iter_mut().enumerate().take(count) {
        let (b, h) = ((first + l) / shape.h, (first + l) % shape.h);
        let _ = x.row(b, h, n - 1, k); // the last row read is in bounds
        *row = x.rows(b, h, 0).0;
    }
    for i in 0..n {
        // SAFETY: rows `0..n` of each head are in bounds (checked above), the zeros `k` long;
        // `out` has room for the n · k · G lanes.
        unsafe { gather_transposed(&rows, k, out[i * k * G..].as_mut_ptr(), G) };
        for row in rows.iter_mut().take(count) {
            *row = row.wrapping_add(x.strides[2]);
        }
    }
    out
}

/// Writes rows `0..n` of the group's heads from lanes laid out as [`pack`] makes them.
///
/// # Safety
/// As [`Out::write`]: the rows belong to this task.
unsafe fn unpack(lanes: &[f32], out: Out, shape: AttentionShape, [first, count, n]: [usize; 3]) {
    let k = shape.k;
    let [sb, sh, si] = out.strides;
    // The lanes past `count` are written here and dropped.
    let mut sink = [0.0f32; MAX_WIDTH];
    let mut rows = [sink.as_mut_ptr(); G];
    for (l, row) in rows.iter_mut().enumerate().take(count) {
        let (b, h) = ((first + l) / shape.h, (first + l) % shape.h);
        *row = out.ptr.add(b * sb + h * sh);
    }
    for i in 0..n {
        scatter_transposed(lanes[i * k * G..].as_ptr(), G, k, &rows);
        for row in rows.iter_mut().take(count) {
            *row = row.wrapping_add(si);
        }
    }
}

/// One lane vector of a packed buffer: element `index`.
#[inline(always)]
fn lanes(x: &[f32], index: usize) -> &[f32; G] {
    x[index * G..(index + 1) * G].try_into().unwrap()
}

/// As [`lanes`], writable.
#[inline(always)]
fn lanes_mut(x: &mut [f32], index: usize) -> &mut [f32; G] {
    (&mut x[index * G..(index + 1) * G]).try_into().unwrap()
}

/// Each lane's largest of the `s` scores of `row`, with `super::super::max`'s accumulators.
#[inline(always)]
fn row_max(row: &[f32], s: usize) -> [f32; G] {
    let larger = |a: f32, b: f32| if b > a { b } else { a };
    let whole = s / LANES * LANES;
    let mut acc = [[f32::NEG_INFINITY; G]; LANES];
    for j in 0..whole {
        let (acc, x) = (&mut acc[j % LANES], lanes(row, j));
        for g in 0..G {
            acc[g] = larger(acc[g], x[g]);
        }
    }
    let mut m = [f32::NEG_INFINITY; G];
    for j in whole..s {
        let x = lanes(row, j);
        for g in 0..G {
            m[g] = larger(m[g], x[g]);
        }
    }
    for acc in &acc {
        for g in 0..G {
            m[g] = larger(m[g], acc[g]);
        }
    }
    m
}

/// Replaces each of the `s` scores of `row` with `exp(x − shift)` and returns each lane's sum,
/// with `super::exp_sum`'s accumulators.
#[inline(always)]
fn row_exp_sum(row: &mut [f32], s: usize, shift: &[f32; G]) -> [f32; G] {
    let whole = s / LANES * LANES;
    let mut acc = [[0.0f32; G]; LANES];
    for j in 0..whole {
        let (acc, x) = (&mut acc[j % LANES], lanes_mut(row, j));
        for g in 0..G {
            let e = exp(x[g] - shift[g]);
            x[g] = e;
            acc[g] += e;
        }
    }
    let mut tail = [empty_sum(); G];
    for j in whole..s {
        let x = lanes_mut(row, j);
        for g in 0..G {
            let e = exp(x[g] - shift[g]);
            x[g] = e;
            tail[g] += e;
        }
    }
    let mut total = [empty_sum(); G];
    for acc in &acc {
        for g in 0..G {
            total[g] += acc[g];
        }
    }
    std::array::from_fn(|g| total[g] + tail[g])
}

/// The forward pass of one group of heads.
#[derive(Clone, Copy)]
struct Forward<'a> {
    shape: AttentionShape,
    qkv: [Heads<'a>; 3],
    /// First head, heads.
    heads: [usize; 2],
    out: Out,
}

/// [`Forward`] in the form `S`, blocks of `R × C`; `lse` is the group's heads' `[count, t]`.
#[inline(always)]
unsafe fn forward<S: Simd, const R: usize, const C: usize>(
    f: Forward,
    lse: &mut [f32],
    scratch: &mut Scratch,
) {
    let AttentionShape { t, s, k: kw, .. } = f.shape;
    let [first, count] = f.heads;
    let scale = 1.0 / (kw as f32).sqrt();
    let Scratch {
        packed: [qp, kp, vp],
        scores,
        acc,
    } = scratch;
    let [q, k, v] = f.qkv;
    let q = pack(q, f.shape, [first, count, t], qp);
    let k = pack(k, f.shape, [first, count, s], kp);
    let v = pack(v, f.shape, [first, count, s], vp);
    let scores = reused(scores, t * s * G);
    let row = kw * G;
    product::<S, R, C>(Product {
        size: [t, s, kw],
        a: (q.as_ptr(), row, G),
        b: (k.as_ptr(), row, G),
        c: (scores.as_mut_ptr(), s * G, G),
        scale,
    });
    // The softmax of each row as the tiled kernel's online softmax leaves it after its one key
    // tile: the maximum over −∞, the sum added to zero.
    let mut stats = [([0.0f32; G], [0.0f32; G]); MAX_POSITIONS];
    for (i, (max, denom)) in stats.iter_mut().enumerate().take(t) {
        let row = &mut scores[i * s * G..(i + 1) * s * G];
        *max = row_max(row, s).map(|m| f32::NEG_INFINITY.max(m));
        let sum = row_exp_sum(row, s, max);
        *denom = sum.map(|x| 0.0 + x);
    }
    let acc = reused(acc, t * row);
    product::<S, R, C>(Product {
        size: [t, kw, s],
        a: (scores.as_ptr(), s * G, G),
        b: (v.as_ptr(), G, row),
        c: (acc.as_mut_ptr(), row, G),
        scale: 1.0,
    });
    for (i, (max, denom)) in stats.iter().enumerate().take(t) {
        let inv = denom.map(|d| 1.0 / d);
        for c in 0..kw {
            let x = lanes_mut(acc, i * kw + c);
            for g in 0..G {
                x[g] *= inv[g];
            }
        }
        for l in 0..count {
            lse[l * t + i] = max[l] + denom[l].ln();
        }
    }
    unpack(acc, f.out, f.shape, [first, count, t]);
}

/// Attention's forward pass over every head, a group of [`G`] at a time, in parallel: the
/// output into `out`, the log-sum-exp into `lse` (`[b · h, t]`).
pub(super) fn attention_forward(shape: AttentionShape, qkv: [Heads; 3], out: Out, lse: &mut [f32]) {
    let (t, heads) = (shape.t, shape.b * shape.h);
    lse.par_chunks_mut(t * G).enumerate().for_each_init(
        Scratch::default,
        |scratch, (group, lse)| {
            let first = group * G;
            let f = Forward {
                shape,
                qkv,
                heads: [first, (heads - first).min(G)],
                out,
            };
            // SAFETY: the group's rows of the output belong to this task; `isa` picks a form
            // only where the processor has its features.
            unsafe {
                match isa() {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => x86::forward_avx512(f, lse, scratch),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => x86::forward_avx2(f, lse, scratch),
                    _ => forward::<Portable, 2, 2>(f, lse, scratch),
                }
            }
        },
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{forward, Avx2, Avx512, Forward, Scratch};

    // AVX-512: blocks of 4 × 4 (16 of the 32 registers accumulate); AVX2, whose 16-lane unit
    // is two registers: 2 × 2 (8 of 16).

    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    pub(super) unsafe fn forward_avx512(f: Forward, lse: &mut [f32], scratch: &mut Scratch) {
        forward::<Avx512, 4, 4>(f, lse, scratch)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn forward_avx2(f: Forward, lse: &mut [f32], scratch: &mut Scratch) {
        forward::<Avx2, 2, 2>(f, lse, scratch)
    }
}
