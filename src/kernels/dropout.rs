//! Dropout masks from a counter-based generator: element `e` of a mask is a pure function of the
//! mask's seed and `e` (Philox4x32-10, Salmon et al. 2011, the generator of PyTorch's and
//! cuRAND's GPU dropout), so a kernel draws any tile of it where it needs it and the backward
//! pass draws the same tile again instead of storing the mask.
//!
//! Every dropout of a training step — on the attention weights (inside the fused attention
//! kernel), the embeddings, the feed-forward activation and the residual branches — takes a
//! fresh seed from one stream ([`next_mask`]), which [`reseed`] restarts: reseeded with the
//! backend at every epoch, the masks of a resumed run are those of the run it replaced.

use super::cpu::multiversion;
use std::sync::Mutex;

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

multiversion! {
    /// Writes the multipliers of elements `start..` into `out`: whole batches of `LANES`
    /// blocks side by side (vectorised) where aligned, one block (four elements) at a time
    /// elsewhere.
    fn fill(seed: u64, threshold: u64, scale: f32, start: u64, out: &mut [f32]) {
        const BATCH: u64 = 4 * LANES as u64;
        let key = [seed as u32, (seed >> 32) as u32];
        let pick = |w: u32| if (w as u64) < threshold { 0.0 } else { scale };
        let end = start + out.len() as u64;
        let (mut e, mut i) = (start, 0usize);
        while e < end {
            if e % BATCH == 0 && end - e >= BATCH {
                let words = philox_lanes(e / 4, key);
                for (l, lane) in out[i..i + BATCH as usize].chunks_exact_mut(4).enumerate() {
                    for (w, x) in lane.iter_mut().enumerate() {
                        *x = pick(words[w][l]);
                    }
                }
                e += BATCH;
                i += BATCH as usize;
            } else {
                let words = philox(block(e / 4), key);
                let stop = ((e / 4 + 1) * 4).min(end);
                while e < stop {
                    out[i] = pick(words[(e % 4) as usize]);
                    e += 1;
                    i += 1;
                }
            }
        }
    }
}

/// The counter of block `n`.
fn block(n: u64) -> [u32; 4] {
    [n as u32, (n >> 32) as u32, 0, 0]
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
        [c[0][l], c[1][l], c[2][l], c[3][l]] = block(first + l as u64);
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

/// The stream's key and how many masks it has given since [`reseed`].
static STREAM: Mutex<(u64, u64)> = Mutex::new((0x5eed, 0));

/// Restarts the stream of dropout seeds from `seed`.
pub fn reseed(seed: u64) {
    *STREAM.lock().unwrap_or_else(|e| e.into_inner()) = (seed, 0);
}

/// A fresh mask of probability `prob`, the next seed of the stream.
pub fn next_mask(prob: f64) -> DropoutMask {
    let mut stream = STREAM.lock().unwrap_or_else(|e| e.into_inner());
    let (key, count) = *stream;
    stream.1 += 1;
    // The mask's seed: a Philox block of the stream's key at counter `count`.
    let words = philox(
        [count as u32, (count >> 32) as u32, 0xd409, 0],
        [key as u32, (key >> 32) as u32],
    );
    DropoutMask::new(prob, (words[0] as u64) << 32 | words[1] as u64)
}
