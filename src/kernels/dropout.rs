//! Dropout masks from a counter-based generator: element `e` of a mask is a pure function of the
//! mask's seed and `e` (Philox4x32-10, Salmon et al. 2011, the generator of PyTorch's and
//! cuRAND's GPU dropout), so a kernel draws any tile of it where it needs it and the backward
//! pass draws the same tile again instead of storing the mask.
//!
//! Every dropout of a training step — on the attention weights (inside the fused attention
//! kernel), the embeddings, the feed-forward activation and the residual branches — takes a
//! fresh seed from one stream ([`next_mask`]), which [`reseed`] restarts: reseeded with the
//! backend before every batch, the masks of a resumed run are those of the run it replaced.

use std::cell::Cell;

/// One dropout mask: element `e` is kept (scaled by `1/(1−prob)`) or dropped (zero) by the
/// Philox block of `(seed, e / 4)`, word `e % 4`, compared with `prob · 2³²`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutMask {
    /// The probability of dropping an element, as `prob · 2³²` (exact for the comparison).
    threshold: u64,
    /// The key of the generator.
    pub seed: u64,
}

impl DropoutMask {
    /// The mask of probability `prob` (in `[0, 1)`) and `seed`.
    pub fn new(prob: f64, seed: u64) -> Self {
        assert!((0.0..1.0).contains(&prob), "dropout probability {prob}");
        Self {
            threshold: (prob * 4_294_967_296.0) as u64,
            seed,
        }
    }

    /// The drop probability.
    pub fn prob(&self) -> f64 {
        self.threshold as f64 / 4_294_967_296.0
    }

    /// The drop probability as `p · 2³²`: an element is dropped where its random word is below
    /// it.
    pub fn threshold_u32(&self) -> u32 {
        self.threshold as u32
    }

    /// What a kept element is multiplied by, `1/(1−p)`.
    pub fn scale(&self) -> f32 {
        (1.0 / (1.0 - self.prob())) as f32
    }

    /// The multipliers (`0` or `1/(1−p)`) of elements `start..start + out.len()`.
    pub fn fill(&self, start: u64, out: &mut [f32]) {
        fill(self.seed, self.threshold, self.scale(), start, out);
    }

    /// The multipliers of elements `0..n`.
    pub fn multipliers(&self, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; n];
        self.fill(0, &mut out);
        out
    }
}

/// Elements drawn together: `LANES` Philox blocks of four words.
const BATCH: usize = 4 * LANES;

/// Writes the multipliers of elements `start..start + out.len()` into `out`, a batch of
/// [`BATCH`] elements at a time (the partial batches at the ends through a scratch batch).
fn fill(seed: u64, threshold: u64, scale: f32, start: u64, out: &mut [f32]) {
    let key = [seed as u32, (seed >> 32) as u32];
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        unsafe { avx2::fill(key, threshold as u32, scale, start, out) };
        return;
    }
    fill_batches(start, out, |first, batch| {
        let words = philox_lanes(first, key);
        for (l, lane) in batch.chunks_exact_mut(4).enumerate() {
            for (w, x) in lane.iter_mut().enumerate() {
                *x = if (words[w][l] as u64) < threshold {
                    0.0
                } else {
                    scale
                };
            }
        }
    });
}

/// Cuts `start..start + out.len()` at multiples of [`BATCH`] and has `batch(first block,
/// multipliers)` write each batch: in place where whole, through a scratch batch at the ends.
#[inline(always)]
fn fill_batches(start: u64, out: &mut [f32], mut batch: impl FnMut(u64, &mut [f32; BATCH])) {
    const N: u64 = BATCH as u64;
    let end = start + out.len() as u64;
    let mut scratch = [0.0f32; BATCH];
    let mut e = start;
    while e < end {
        let (base, i) = (e / N * N, (e - start) as usize);
        if e == base && end - e >= N {
            let whole = (&mut out[i..i + BATCH]).try_into().expect("a whole batch");
            batch(base / 4, whole);
            e += N;
        } else {
            batch(base / 4, &mut scratch);
            let stop = (base + N).min(end);
            let (from, to) = ((e - base) as usize, (stop - base) as usize);
            out[i..i + to - from].copy_from_slice(&scratch[from..to]);
            e = stop;
        }
    }
}

/// The AVX2 form: eight blocks side by side in 256-bit registers, one word per register.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{bump, fill_batches, BATCH, M0, M1};
    use std::arch::x86_64::*;

    /// [`super::fill`] on a CPU with AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) fn fill(key: [u32; 2], threshold: u32, scale: f32, start: u64, out: &mut [f32]) {
        fill_batches(start, out, |first, batch| {
            let [v0, v1, v2, v3] = multipliers(philox8(first, key), threshold, scale);
            // SAFETY: `batch` holds four registers' worth of floats.
            unsafe {
                let p = batch.as_mut_ptr();
                _mm256_storeu_ps(p, v0);
                _mm256_storeu_ps(p.add(8), v1);
                _mm256_storeu_ps(p.add(16), v2);
                _mm256_storeu_ps(p.add(24), v3);
            }
        });
        const { assert!(BATCH == 32) };
    }

    /// The high and low 32 bits of `m · x`, lane by lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn mul_hi_lo(x: __m256i, m: __m256i) -> (__m256i, __m256i) {
        let even = _mm256_mul_epu32(x, m);
        let odd = _mm256_mul_epu32(_mm256_srli_epi64::<32>(x), m);
        let hi = _mm256_blend_epi32::<0b1010_1010>(_mm256_srli_epi64::<32>(even), odd);
        let lo = _mm256_blend_epi32::<0b1010_1010>(even, _mm256_slli_epi64::<32>(odd));
        (hi, lo)
    }

    /// Philox4x32-10 of blocks `first..first + 8` (`first` a multiple of 8): register `w`
    /// holds word `w` of each block.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn philox8(first: u64, key: [u32; 2]) -> [__m256i; 4] {
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mut c0 = _mm256_add_epi32(_mm256_set1_epi32(first as u32 as i32), lanes);
        let mut c1 = _mm256_set1_epi32((first >> 32) as u32 as i32);
        let (mut c2, mut c3) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        let (m0, m1) = (_mm256_set1_epi32(M0 as i32), _mm256_set1_epi32(M1 as i32));
        let mut key = key;
        for r in 0..10 {
            if r > 0 {
                key = bump(key);
            }
            let [k0, k1] = key;
            let (hi0, lo0) = mul_hi_lo(c0, m0);
            let (hi1, lo1) = mul_hi_lo(c2, m1);
            let (key0, key1) = (_mm256_set1_epi32(k0 as i32), _mm256_set1_epi32(k1 as i32));
            c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), key0);
            c1 = lo1;
            c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), key1);
            c3 = lo0;
        }
        [c0, c1, c2, c3]
    }

    /// The 32 multipliers of the words in element order (block by block, word by word).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn multipliers(words: [__m256i; 4], threshold: u32, scale: f32) -> [__m256; 4] {
        let (threshold, scale) = (_mm256_set1_epi32(threshold as i32), _mm256_set1_ps(scale));
        // Kept where word ≥ threshold (unsigned): max(word, threshold) == word.
        let keep = words.map(|w| {
            let kept = _mm256_cmpeq_epi32(_mm256_max_epu32(w, threshold), w);
            _mm256_and_ps(_mm256_castsi256_ps(kept), scale)
        });
        // Transpose four registers of eight blocks into eight blocks of four words.
        let [w0, w1, w2, w3] = keep.map(|x| _mm256_castps_si256(x));
        let (t0, t1) = (_mm256_unpacklo_epi32(w0, w1), _mm256_unpackhi_epi32(w0, w1));
        let (t2, t3) = (_mm256_unpacklo_epi32(w2, w3), _mm256_unpackhi_epi32(w2, w3));
        let (b04, b15) = (_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2));
        let (b26, b37) = (_mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3));
        [
            _mm256_permute2x128_si256::<0x20>(b04, b15),
            _mm256_permute2x128_si256::<0x20>(b26, b37),
            _mm256_permute2x128_si256::<0x31>(b04, b15),
            _mm256_permute2x128_si256::<0x31>(b26, b37),
        ]
        .map(|x| _mm256_castsi256_ps(x))
    }
}

/// Blocks computed side by side by [`philox_lanes`].
const LANES: usize = 8;

/// [`philox`] of the blocks `first..first + LANES`: `words[w][l]` is word `w` of block
/// `first + l`.
#[allow(clippy::needless_range_loop)] // lane `l` of four arrays, side by side
#[inline(always)]
fn philox_lanes(first: u64, key: [u32; 2]) -> [[u32; LANES]; 4] {
    let mut c = [[0u32; LANES]; 4];
    for l in 0..LANES {
        let n = first + l as u64;
        [c[0][l], c[1][l]] = [n as u32, (n >> 32) as u32];
    }
    let mut key = key;
    for r in 0..10 {
        if r > 0 {
            key = bump(key);
        }
        for l in 0..LANES {
            [c[0][l], c[1][l], c[2][l], c[3][l]] = round([c[0][l], c[1][l], c[2][l], c[3][l]], key);
        }
    }
    c
}

/// One Philox4x32 round of `counter` under the round's `key`.
#[inline(always)]
fn round(c: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let p0 = M0 * c[0] as u64;
    let p1 = M1 * c[2] as u64;
    [
        ((p1 >> 32) as u32) ^ c[1] ^ key[0],
        p1 as u32,
        ((p0 >> 32) as u32) ^ c[3] ^ key[1],
        p0 as u32,
    ]
}

/// The key of the next round.
#[inline(always)]
fn bump(key: [u32; 2]) -> [u32; 2] {
    [key[0].wrapping_add(W0), key[1].wrapping_add(W1)]
}

const M0: u64 = 0xD251_1F53;
const M1: u64 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds: the four random words of `counter` under `key`.
#[inline(always)]
pub fn philox(mut counter: [u32; 4], mut key: [u32; 2]) -> [u32; 4] {
    for r in 0..10 {
        if r > 0 {
            key = bump(key);
        }
        counter = round(counter, key);
    }
    counter
}

thread_local! {
    /// The stream's key and how many masks it has given since [`reseed`]. One per thread: a
    /// run draws its masks on the thread that seeded it (burn-train's single-device learner
    /// trains on the calling thread), so runs side by side in one process — tests — cannot
    /// take each other's masks.
    static STREAM: Cell<(u64, u64)> = const { Cell::new((0x5eed, 0)) };
}

/// Restarts this thread's stream of dropout seeds from `seed`.
pub fn reseed(seed: u64) {
    STREAM.with(|stream| stream.set((seed, 0)));
}

/// A fresh mask of probability `prob`, the next seed of this thread's stream.
pub fn next_mask(prob: f64) -> DropoutMask {
    let (key, count) = STREAM.with(|stream| {
        let (key, count) = stream.get();
        stream.set((key, count + 1));
        (key, count)
    });
    // The mask's seed: a Philox block of the stream's key at counter `count`.
    let words = philox(
        [count as u32, (count >> 32) as u32, 0xd409, 0],
        [key as u32, (key >> 32) as u32],
    );
    DropoutMask::new(prob, (words[0] as u64) << 32 | words[1] as u64)
}
