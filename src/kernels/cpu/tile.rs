//! The small products inside attention's tiles (`64 × 64 × head width`), register-blocked with
//! explicit vector instructions: a block of rows × up to four 16-lane column units stays in
//! registers for the whole inner dimension, `B` is read from a packed row-major copy and `A` is
//! broadcast an element at a time from any layout (so `Pᵀ` and `dSᵀ` need no copy).
//!
//! Every output element is the same chain of fused multiply-adds, `acc = fma(a[i,p], b[p,j],
//! acc)` for `p` ascending from `acc = 0`, then `acc·scale` (added to the destination when
//! accumulating), whichever form runs — AVX-512, AVX2 (a 16-lane unit is two 8-lane registers)
//! or the portable one (`f32::mul_add`) — so the forms give the same bits. A [`Limit`] skips the
//! parts of a causal tile that are masked: columns a row cannot see, or inner indices whose
//! weight is exactly zero (adding an exact zero leaves the sum as it was).

use super::linear::Operand;
use super::{isa, Isa};

/// Lanes of one column unit; padded widths are multiples of it.
pub(super) const UNIT: usize = 16;

/// `n` rounded up to whole column units.
pub(super) fn padded(n: usize) -> usize {
    n.div_ceil(UNIT) * UNIT
}

/// Which parts of a product a causal mask makes unnecessary, for output row `i` (counted
/// from the product's first row) and an offset `o` between the tile's rows and columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Limit {
    /// Every part is needed.
    All,
    /// Row `i` needs columns `j ≤ i + o` only; the others may be left unwritten.
    Columns(isize),
    /// Row `i` reads inner indices `p ≤ i + o` only (`A` is zero beyond).
    InnerUpTo(isize),
    /// Row `i` reads inner indices `p ≥ i + o` only (`A` is zero before).
    InnerFrom(isize),
}

/// `C = scale·A·B` (or `C += scale·A·B` when `accumulate`) for `A` `m × k` in any layout, `B`
/// packed row-major `k × padded(n)` with rows `ldb` apart, `C` row-major with rows `ldc` apart.
/// Whole column units are written: `C` must have room for `padded(n)` columns per row (those
/// past `n` hold `B`'s padding's products).
#[derive(Clone, Copy, Debug)]
pub(super) struct Product {
    /// Rows of `A` and `C`.
    pub m: usize,
    /// Columns of `B` and `C`.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// `A`: pointer, row stride, column stride.
    pub a: Operand,
    /// `B`, packed.
    pub b: *const f32,
    /// `B`'s row stride, a multiple of [`UNIT`].
    pub ldb: usize,
    /// `C`.
    pub c: *mut f32,
    /// `C`'s row stride, a multiple of [`UNIT`].
    pub ldc: usize,
    /// Add to `C` instead of overwriting it.
    pub accumulate: bool,
    /// The factor applied to each sum.
    pub scale: f32,
    /// What a causal mask lets the product skip.
    pub limit: Limit,
}

impl Product {
    /// Runs the product in the form [`isa`] picks.
    ///
    /// # Safety
    /// `A` must be readable for `m × k` elements through its strides, `B` for `k` rows of
    /// `padded(n)`, and `C` writable (readable when accumulating) for `m` rows of `padded(n)`;
    /// `C` must not overlap `A` or `B`.
    pub(super) unsafe fn run(&self) {
        debug_assert!(self.ldb.is_multiple_of(UNIT) && self.ldc.is_multiple_of(UNIT));
        match isa() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86::run_avx512(self),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86::run_avx2(self),
            _ => run::<Portable>(self),
        }
    }
}

/// Writes the `rows × cols` matrix at `src` (rows `rs` apart, columns contiguous) transposed
/// into `dst`: element `(r, c)` to `dst[c·ld + r]`. Eight-by-eight blocks go through vector
/// registers where the processor has AVX2; only moves, so every form gives the same bits.
///
/// # Safety
/// `src` must be readable for the matrix; `dst` must hold `cols` rows of `ld ≥ rows`.
pub(super) unsafe fn transpose(
    src: *const f32,
    rs: usize,
    [rows, cols]: [usize; 2],
    dst: &mut [f32],
    ld: usize,
) {
    assert!(rows <= ld && (cols == 0 || dst.len() >= (cols - 1) * ld + rows));
    transpose_into(src, rs, [rows, cols], dst.as_mut_ptr(), ld)
}

/// [`transpose`] into a destination that may be uninitialised.
///
/// # Safety
/// As [`transpose`], with `dst` writable for `cols` rows of `ld ≥ rows`.
pub(super) unsafe fn transpose_into(
    src: *const f32,
    rs: usize,
    [rows, cols]: [usize; 2],
    dst: *mut f32,
    ld: usize,
) {
    let blocks = vector_blocks();
    #[cfg(target_arch = "x86_64")]
    if blocks {
        x86::transpose_blocks(src, rs, [rows, cols], dst, ld);
    }
    outside_blocks([rows, cols], blocks, |r, c| {
        *dst.add(c * ld + r) = *src.add(r * rs + c)
    });
}

/// Whether the transposes move whole 8 × 8 blocks through vector registers (x86-64 with AVX2).
fn vector_blocks() -> bool {
    cfg!(target_arch = "x86_64") && isa() != Isa::Baseline
}

/// Calls `each(r, c)` for the elements of a `rows × cols` matrix that its whole 8 × 8 blocks
/// leave — the last rows (all columns) and the last columns (the others) — or for every
/// element where no blocks ran (`blocks` false): the scalar rest of the transposes.
#[inline(always)]
fn outside_blocks([rows, cols]: [usize; 2], blocks: bool, mut each: impl FnMut(usize, usize)) {
    let (r0, c0) = if blocks {
        (rows / 8 * 8, cols / 8 * 8)
    } else {
        (0, 0)
    };
    for r in 0..rows {
        let first = if r < r0 { c0 } else { 0 };
        for c in first..cols {
            each(r, c);
        }
    }
}

/// Writes the matrix whose row `r` is the `cols` elements at `rows[r]` transposed into `dst`:
/// element `(r, c)` to `dst[c·ld + r]`. [`transpose_into`] for rows anywhere in memory.
///
/// # Safety
/// Each row must be readable for `cols` elements; `dst` writable for `cols` rows of
/// `ld ≥ rows.len()`.
#[inline]
pub(super) unsafe fn gather_transposed(rows: &[*const f32], cols: usize, dst: *mut f32, ld: usize) {
    let blocks = vector_blocks();
    #[cfg(target_arch = "x86_64")]
    if blocks {
        x86::gather_blocks(rows, cols, dst, ld);
    }
    outside_blocks([rows.len(), cols], blocks, |r, c| {
        *dst.add(c * ld + r) = *rows[r].add(c)
    });
}

/// The inverse of [`gather_transposed`]: element `(c, r)` of the `cols × rows.len()` matrix at
/// `src` (rows `ld` apart) to `rows[r][c]`.
///
/// # Safety
/// `src` must be readable for the matrix and each row writable for `cols` elements; rows that
/// overlap (a sink for values to drop) end up holding one of the values written to them.
#[inline]
pub(super) unsafe fn scatter_transposed(
    src: *const f32,
    ld: usize,
    cols: usize,
    rows: &[*mut f32],
) {
    let blocks = vector_blocks();
    #[cfg(target_arch = "x86_64")]
    if blocks {
        x86::scatter_blocks(src, ld, cols, rows);
    }
    outside_blocks([rows.len(), cols], blocks, |r, c| {
        *rows[r].add(c) = *src.add(c * ld + r)
    });
}

/// Vector operations on one 16-lane column unit.
pub(super) trait Simd {
    /// One unit.
    type V: Copy;
    /// Column units a register block spans, at most (1 to 4).
    const UNITS: usize;
    /// Rows of a register block of `units` column units (at most 8).
    fn rows(units: usize) -> usize;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// `a·b + c`, rounded once.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
}

/// The form for any processor: arrays the compiler may vectorise, `f32::mul_add` for the fused
/// multiply-add (the same rounding as the vector forms').
pub(super) struct Portable;

impl Simd for Portable {
    type V = [f32; UNIT];
    const UNITS: usize = 1;
    fn rows(_: usize) -> usize {
        4
    }
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        [0.0; UNIT]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        [x; UNIT]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        p.cast::<[f32; UNIT]>().read_unaligned()
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        p.cast::<[f32; UNIT]>().write_unaligned(v)
    }
    #[inline(always)]
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|l| a[l] + b[l])
    }
    #[inline(always)]
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|l| a[l] * b[l])
    }
    #[inline(always)]
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::array::from_fn(|l| a[l].mul_add(b[l], c[l]))
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{run, Product, Simd};
    use std::arch::x86_64::*;

    /// AVX-512: a unit is one register; blocks of up to 6 rows × 4 units (24 of the 32
    /// registers accumulate).
    pub(in crate::kernels::cpu) struct Avx512;

    impl Simd for Avx512 {
        type V = __m512;
        const UNITS: usize = 4;
        fn rows(units: usize) -> usize {
            if units >= 4 {
                6
            } else {
                8
            }
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
    }

    /// AVX2: a unit is two registers; blocks of 6 rows × 1 unit (12 of the 16 registers
    /// accumulate).
    pub(in crate::kernels::cpu) struct Avx2;

    impl Simd for Avx2 {
        type V = (__m256, __m256);
        const UNITS: usize = 1;
        fn rows(_: usize) -> usize {
            6
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn zero() -> Self::V {
            (_mm256_setzero_ps(), _mm256_setzero_ps())
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn splat(x: f32) -> Self::V {
            let v = _mm256_set1_ps(x);
            (v, v)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load(p: *const f32) -> Self::V {
            (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn store(p: *mut f32, v: Self::V) {
            _mm256_storeu_ps(p, v.0);
            _mm256_storeu_ps(p.add(8), v.1);
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
            (_mm256_add_ps(a.0, b.0), _mm256_add_ps(a.1, b.1))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
            (_mm256_mul_ps(a.0, b.0), _mm256_mul_ps(a.1, b.1))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
            (
                _mm256_fmadd_ps(a.0, b.0, c.0),
                _mm256_fmadd_ps(a.1, b.1, c.1),
            )
        }
    }

    /// Rows and columns of a tile of [`transpose_blocks`].
    const TILE: usize = 32;

    /// Transposes the whole 8 × 8 blocks of a `rows × cols` matrix (see `super::transpose`).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn transpose_blocks(
        src: *const f32,
        rs: usize,
        [rows, cols]: [usize; 2],
        dst: *mut f32,
        ld: usize,
    ) {
        // In 32 × 32 tiles, each tile's blocks a column of blocks at a time: measured on the
        // Zen 4, `512 × 128` in 13 µs, against 23–29 µs a row of blocks at a time.
        let (rows, cols) = (rows / 8 * 8, cols / 8 * 8);
        // Plain nested loops: `flat_map` over `step_by` ranges was not inlined (a call per
        // block, 2.4% of the attention backward pass's samples).
        let mut r0 = 0;
        while r0 < rows {
            let mut c0 = 0;
            while c0 < cols {
                let (r_end, c_end) = ((r0 + TILE).min(rows), (c0 + TILE).min(cols));
                let mut c = c0;
                while c < c_end {
                    let mut r = r0;
                    while r < r_end {
                        transpose_block(src, rs, dst, ld, r, c);
                        r += 8;
                    }
                    c += 8;
                }
                c0 += TILE;
            }
            r0 += TILE;
        }
    }

    /// The `8 × 8` block at row `r`, column `c` of `src` transposed into `dst`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn transpose_block(
        src: *const f32,
        rs: usize,
        dst: *mut f32,
        ld: usize,
        r: usize,
        c: usize,
    ) {
        let at = |i: usize| _mm256_loadu_ps(src.add((r + i) * rs + c));
        let columns = transpose8([at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7)]);
        for (i, column) in columns.into_iter().enumerate() {
            _mm256_storeu_ps(dst.add((c + i) * ld + r), column);
        }
    }

    /// Eight vectors of eight transposed: element `j` of vector `i` becomes element `i` of
    /// vector `j`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn transpose8([a0, a1, a2, a3, a4, a5, a6, a7]: [__m256; 8]) -> [__m256; 8] {
        // Pairs of rows interleaved, then pairs of pairs, then the 128-bit halves.
        let (t0, t1) = (_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
        let (t2, t3) = (_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
        let (t4, t5) = (_mm256_unpacklo_ps(a4, a5), _mm256_unpackhi_ps(a4, a5));
        let (t6, t7) = (_mm256_unpacklo_ps(a6, a7), _mm256_unpackhi_ps(a6, a7));
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }

    /// The whole 8 × 8 blocks of [`super::gather_transposed`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gather_blocks(rows: &[*const f32], cols: usize, dst: *mut f32, ld: usize) {
        let (n, cols) = (rows.len() / 8 * 8, cols / 8 * 8);
        let mut r = 0;
        while r < n {
            let mut c = 0;
            while c < cols {
                let at = |i: usize| _mm256_loadu_ps(rows[r + i].add(c));
                let columns = transpose8([at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7)]);
                for (i, column) in columns.into_iter().enumerate() {
                    _mm256_storeu_ps(dst.add((c + i) * ld + r), column);
                }
                c += 8;
            }
            r += 8;
        }
    }

    /// The whole 8 × 8 blocks of [`super::scatter_transposed`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scatter_blocks(
        src: *const f32,
        ld: usize,
        cols: usize,
        rows: &[*mut f32],
    ) {
        let (n, cols) = (rows.len() / 8 * 8, cols / 8 * 8);
        let mut r = 0;
        while r < n {
            let mut c = 0;
            while c < cols {
                let at = |i: usize| _mm256_loadu_ps(src.add((c + i) * ld + r));
                let out = transpose8([at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7)]);
                for (i, row) in out.into_iter().enumerate() {
                    _mm256_storeu_ps(rows[r + i].add(c), row);
                }
                c += 8;
            }
            r += 8;
        }
    }

    /// The product with AVX-512.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    pub(super) unsafe fn run_avx512(p: &Product) {
        run::<Avx512>(p)
    }

    /// The product with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn run_avx2(p: &Product) {
        run::<Avx2>(p)
    }
}

/// One register block: `R` rows × `U` units of `C` from inner indices `p0..p1`.
#[inline(always)]
unsafe fn block<S: Simd, const R: usize, const U: usize>(
    p: &Product,
    [row, col]: [usize; 2],
    [p0, p1]: [usize; 2],
) {
    let (a, a_rs, a_cs) = p.a;
    let a = a.add(row * a_rs);
    let b = p.b.add(col);
    let mut acc = [[S::zero(); U]; R];
    for k in p0..p1 {
        let b_row = b.add(k * p.ldb);
        let mut bv = [S::zero(); U];
        for (u, v) in bv.iter_mut().enumerate() {
            *v = S::load(b_row.add(u * UNIT));
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let x = S::splat(*a.add(r * a_rs + k * a_cs));
            for (acc, &bv) in acc.iter_mut().zip(&bv) {
                *acc = S::fma(x, bv, *acc);
            }
        }
    }
    let scale = S::splat(p.scale);
    for (r, acc) in acc.iter().enumerate() {
        let c = p.c.add((row + r) * p.ldc + col);
        for (u, &acc) in acc.iter().enumerate() {
            let dst = c.add(u * UNIT);
            let x = S::mul(acc, scale);
            S::store(
                dst,
                if p.accumulate {
                    S::add(S::load(dst), x)
                } else {
                    x
                },
            );
        }
    }
}

/// A block of `rows` (1 to 8) rows × `U` units.
#[inline(always)]
unsafe fn block_rows<S: Simd, const U: usize>(
    p: &Product,
    rows: usize,
    at: [usize; 2],
    inner: [usize; 2],
) {
    match rows {
        1 => block::<S, 1, U>(p, at, inner),
        2 => block::<S, 2, U>(p, at, inner),
        3 => block::<S, 3, U>(p, at, inner),
        4 => block::<S, 4, U>(p, at, inner),
        5 => block::<S, 5, U>(p, at, inner),
        6 => block::<S, 6, U>(p, at, inner),
        7 => block::<S, 7, U>(p, at, inner),
        _ => block::<S, 8, U>(p, at, inner),
    }
}

/// The whole product, block by block, in the form `S`.
#[inline(always)]
unsafe fn run<S: Simd>(p: &Product) {
    let Product { m, n, k, limit, .. } = *p;
    let units = padded(n) / UNIT;
    // The rows spread evenly over the fewest blocks: a block of one or two rows is bound by its
    // chains' latency (17 rows as 8 + 8 + 1 took longer than 6 + 6 + 5). Every output element
    // is its own chain, so the partition changes no bits.
    let mut blocks = m.div_ceil(S::rows(units.min(S::UNITS)));
    let mut row = 0;
    while row < m {
        let rows = (m - row).div_ceil(blocks);
        blocks -= 1;
        let last = (row + rows - 1) as isize;
        let clamp = |x: isize, hi: usize| x.clamp(0, hi as isize) as usize;
        let (inner, width) = match limit {
            Limit::All => ([0, k], n),
            Limit::Columns(o) => ([0, k], clamp(last + o + 1, n)),
            Limit::InnerUpTo(o) => ([0, clamp(last + o + 1, k)], n),
            Limit::InnerFrom(o) => ([clamp(row as isize + o, k), k], n),
        };
        let mut unit = 0;
        let width_units = width.div_ceil(UNIT);
        while unit < width_units {
            let at = [row, unit * UNIT];
            match (width_units - unit).min(S::UNITS) {
                1 => block_rows::<S, 1>(p, rows, at, inner),
                2 => block_rows::<S, 2>(p, rows, at, inner),
                3 => block_rows::<S, 3>(p, rows, at, inner),
                _ => block_rows::<S, 4>(p, rows, at, inner),
            }
            unit += S::UNITS;
        }
        row += rows;
    }
}
