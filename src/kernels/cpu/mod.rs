//! CPU kernels over `f32` slices: both cores through rayon, loops shaped so the compiler
//! vectorises them, each built for AVX-512, AVX2 + FMA and the baseline, the widest the
//! processor has chosen at run time ([`isa`]).
//!
//! Reductions are written with [`LANES`] independent accumulators (a float sum is not
//! reassociated by the compiler, so a plain `iter().sum()` stays scalar). The attention kernels
//! work on `64 × 64` tiles whose products run on register-blocked kernels of our own
//! ([`tile`]: explicit AVX-512 / AVX2 forms, the causal mask's hidden part skipped), reading
//! heads in place through their strides.

//!
//! The kernels come in families, one file each: [`pointwise`] (GELU, dropout, AdamW and
//! clipping's passes), [`rows`] (LayerNorm, softmax, cross-entropy), [`linear`] (the tiled
//! products of linear layers), [`attention`] (flash-style forward and backward) and [`tile`]
//! (the products inside attention's tiles), and [`peak`] measures the ceiling the products run
//! against. This file holds what they share: the run-time
//! dispatch, the vectorising reductions, when a pass splits across cores (`min_tasks`) and the
//! uninitialised-buffer helpers.

use std::mem::MaybeUninit;

mod attention;
mod linear;
mod peak;
mod pointwise;
mod rows;
mod tile;

pub use attention::{
    attention_backward, attention_forward, heads_in_lanes, packed_attention_backward,
    with_tiles_only, AttentionShape, Heads,
};
pub use linear::{linear, linear_backward, linear_backward_in, linear_gelu, Form, Matrix};
pub use peak::fma_peak;
pub use pointwise::{
    adamw_all, dropout, gelu, gelu_with_derivative, mul, scale, sum_squares, sum_squares_all,
    AdamWParam, AdamWSlices, Strided,
};
pub use rows::{
    add_layer_norm, cross_entropy, cross_entropy_backward, layer_norm, layer_norm_backward,
    softmax, softmax_backward,
};

/// The instruction sets a kernel can be compiled for, widest first; each kernel is built for
/// all three and [`isa`] picks one at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 (F + VL) with FMA: sixteen lanes.
    Avx512,
    /// AVX2 with FMA: eight lanes.
    Avx2,
    /// The build target's baseline (SSE2 on x86-64).
    Baseline,
}

/// The forced choice (`0`: none; otherwise `Isa as u8 + 1`).
static FORCED: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

impl Isa {
    /// Every choice, widest first.
    pub const ALL: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Baseline];

    /// Its name as users know it: `AVX-512`, `AVX2` or `baseline`.
    pub fn label(self) -> &'static str {
        match self {
            Isa::Avx512 => "AVX-512",
            Isa::Avx2 => "AVX2",
            Isa::Baseline => "baseline",
        }
    }

    /// Whether this processor runs code built for `self`.
    pub fn available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx512 | Isa::Avx2 => false,
            Isa::Baseline => true,
        }
    }

    /// Makes every kernel run the form built for `isa` (`None`: the widest this processor
    /// has, the default), for tests and measurements of each form. The forms compute the same
    /// operations in the same order, so results are bit-identical whichever runs.
    ///
    /// # Panics
    /// When the processor cannot run `isa`.
    pub fn force(isa: Option<Isa>) {
        if let Some(isa) = isa {
            assert!(isa.available(), "this processor cannot run {isa:?} code");
        }
        let code = isa.map_or(0, |isa| isa as u8 + 1);
        FORCED.store(code, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The form the kernels run: the forced one, else the widest this processor has.
#[inline]
pub fn isa() -> Isa {
    static DETECTED: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    match FORCED.load(std::sync::atomic::Ordering::Relaxed) {
        0 => *DETECTED.get_or_init(|| {
            Isa::ALL
                .into_iter()
                .find(|isa| isa.available())
                .unwrap_or(Isa::Baseline)
        }),
        code => Isa::ALL[usize::from(code - 1)],
    }
}

/// Runs `f` on a thread of rayon's pool while the caller waits, so that the kernels' parallel
/// loops split their work inside the pool: called from a thread outside it, every loop hands
/// its work over, wakes a pool thread and sleeps on a latch until it is done — hundreds of
/// times a training step (measured: 9% of a shakespeare-char step on two cores). Runs `f` here
/// when this thread is in the pool already or the pool has one thread (a blocked caller in a
/// one-thread pool could wait on work only that thread can do).
///
/// The thread-local settings (fused kernels, precision, dropout stream) are the pool thread's
/// for the whole of `f`: call it before a command sets them, not around parts of a run. The
/// server's workers do not run in it, so a command whose answers they must reproduce
/// (translate, generate) stays out of it too: see `BackendTask::in_pool`.
pub fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() || rayon::current_num_threads() < 2 {
        return f();
    }
    rayon::scope(|_| f())
}

/// Accumulator lanes of the vectorised reductions.
pub(super) const LANES: usize = 16;
/// Elements per parallel task of the element-wise kernels.
pub(super) const CHUNK: usize = 1 << 14;
/// Element-wise and row-wise passes over fewer elements, called from outside rayon's pool, run
/// on the calling thread: handing work to the pool from outside wakes a worker and blocks on a
/// latch, which costs more than a pass over a `768 × 128` activation (LayerNorm's) saves.
pub(super) const SPLIT: usize = 1 << 17;
/// The same threshold for a caller on one of the pool's threads (training runs there: see
/// [`in_pool`]), where a split is a job pushed on its own queue for the other core to steal:
/// two chunks are worth it.
pub(super) const SPLIT_IN_POOL: usize = 2 * CHUNK;

/// Whether a pass over `n` elements splits into parallel tasks ([`SPLIT`], [`SPLIT_IN_POOL`]).
/// No kernel's result depends on it: each splits its work into the same tasks either way
/// and only runs them on one thread or several.
fn splits(n: usize) -> bool {
    n >= match rayon::current_thread_index() {
        Some(_) => SPLIT_IN_POOL,
        None => SPLIT,
    }
}

/// The least number of tasks rayon runs on one thread for a pass over `n` elements
/// (`with_min_len`): all of them where the pass does not split ([`splits`]), so they run in
/// order on the caller's thread.
pub(super) fn min_tasks(n: usize) -> usize {
    if splits(n) {
        1
    } else {
        usize::MAX
    }
}

/// Writes `values` into every element of `dst` and returns it, now initialised.
#[inline(always)]
pub(super) fn init(
    dst: &mut [MaybeUninit<f32>],
    values: impl ExactSizeIterator<Item = f32>,
) -> &mut [f32] {
    assert_eq!(values.len(), dst.len(), "a row written whole");
    for (d, v) in dst.iter_mut().zip(values) {
        d.write(v);
    }
    // SAFETY: every element was written just above.
    unsafe { assume_init(dst) }
}

/// `dst` as the `f32`s it holds.
///
/// # Safety
/// Every element of `dst` must have been written.
#[inline(always)]
pub(super) unsafe fn assume_init(dst: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    &mut *(dst as *mut [MaybeUninit<f32>] as *mut [f32])
}

/// Defines `pub fn $name` that runs the body compiled for the instruction set [`isa`] picks:
/// AVX-512, AVX2 + FMA, or the baseline target.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                match $crate::kernels::cpu::isa() {
                    // SAFETY: `isa` picks a form only where the processor has its features.
                    $crate::kernels::cpu::Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    $crate::kernels::cpu::Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::kernels::cpu::Isa::Baseline => {}
                }
            }
            body($($arg),*)
        }
    };
}

pub(super) use multiversion;

/// `e^x` to within 2 ulp, branch-free so it vectorises; exactly 0 below −87.3.
///
/// Each step of the reduction and the polynomial is a fused multiply-add (`f32::mul_add`, one
/// rounding), where separate products and sums took two instructions: one instruction in the
/// AVX2 and AVX-512 forms (and on processors whose baseline has it, such as AArch64), a call of
/// the C library's `fmaf` in the x86-64 baseline form (slow, the same bits).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5·2²³: adding and subtracting it rounds to an integer
    let underflow = x < -87.3;
    let x = x.clamp(-87.3, 88.3);
    let rounded = x.mul_add(LOG2E, ROUND);
    let n = rounded - ROUND;
    // The integer `n` from the bits of `ROUND + n` (its ulp is 1): a float-to-int cast would
    // saturate and check for NaN element by element, which does not vectorise.
    let n_int = rounded.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let mut p: f32 = 1.987_569_1e-4;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let y = (p * r).mul_add(r, r) + 1.0;
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    if underflow {
        0.0
    } else {
        y * scale
    }
}

/// `erf(x)` as a rational function (odd numerator of degree 13 over an even denominator of
/// degree 8) on `[−4, 4]`, ±1 outside: a few ulp, branch-free.
/// Both polynomials by fused multiply-adds, as in [`exp`].
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p: f32 = -2.726_142_3e-10;
    p = p.mul_add(x2, 2.770_681_4e-8);
    p = p.mul_add(x2, -2.101_024e-6);
    p = p.mul_add(x2, -5.692_506_4e-5);
    p = p.mul_add(x2, -7.349_906_3e-4);
    p = p.mul_add(x2, -2.954_6e-3);
    p = p.mul_add(x2, -1.609_603_3e-2);
    let mut q: f32 = -1.456_607_2e-5;
    q = q.mul_add(x2, -2.133_740_6e-4);
    q = q.mul_add(x2, -1.682_827e-3);
    q = q.mul_add(x2, -7.373_329_2e-3);
    q = q.mul_add(x2, -1.426_473_9e-2);
    x * p / q
}

/// Sum with [`LANES`] accumulators (vectorises).
#[inline(always)]
pub(super) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The largest element (`−∞` for none; NaNs ignored), with [`LANES`] accumulators
/// (vectorises; a `fold` of `f32::max` stays scalar).
#[inline(always)]
pub(super) fn max(x: &[f32]) -> f32 {
    let larger = |a: f32, b: f32| if b > a { b } else { a };
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| larger(m, x));
    for c in chunks {
        for l in 0..LANES {
            acc[l] = larger(acc[l], c[l]);
        }
    }
    acc.into_iter().fold(tail, larger)
}

/// Inner product with [`LANES`] accumulators (vectorises).
#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Rows per parallel task of the row-wise kernels.
pub(super) fn rows_per_task(d: usize) -> usize {
    (CHUNK / d.max(1)).max(1)
}
/// A buffer of `n` elements that a kernel fills completely before it is read.
pub(super) fn uninit(n: usize) -> Vec<f32> {
    Vec::with_capacity(n)
}

/// Marks the `n` elements of `buffer` written.
///
/// # Safety
/// All `n` elements must have been written (through raw pointers).
pub(super) unsafe fn written(mut buffer: Vec<f32>, n: usize) -> Vec<f32> {
    debug_assert!(buffer.capacity() >= n);
    buffer.set_len(n);
    buffer
}
