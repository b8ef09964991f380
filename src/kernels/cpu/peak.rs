//! The ceiling the products run against: how many `f32` multiply-adds the pool's threads can
//! do together in a second when doing nothing else, measured on the processor at hand — for
//! `bench train --profile`, which sets the linear layers' rate beside it.

use super::Isa;
use std::time::Instant;

/// Independent chains of fused multiply-adds: enough to keep every multiply-add unit busy
/// through its latency (4 cycles, 2 units on recent Intel cores: 8 registers in flight), few
/// enough to stay in AVX2's 16 registers.
const CHAINS: usize = 12;

/// Loop iterations of one measurement: about 10 ms a thread at AVX-512 on a core with one
/// 512-bit multiply-add a cycle.
const ITERATIONS: usize = 3 << 20;

/// Measurements taken; the fastest counts (anything else on the machine only slows one).
const TRIES: usize = 3;

/// The `f32` multiply-add rate, in FLOP/s (a multiply-add is two), of every thread of rayon's
/// pool at once, each running [`CHAINS`] independent chains of the widest vector multiply-add
/// the processor has for [`ITERATIONS`]: the most any product can reach here (the `gemm`
/// crate picks the widest form for itself, whatever [`Isa::force`] says). Takes about 30 ms.
pub fn fma_peak() -> f64 {
    let isa = Isa::ALL
        .into_iter()
        .find(|isa| isa.available())
        .unwrap_or(Isa::Baseline);
    let lanes = match isa {
        Isa::Avx512 => 16,
        Isa::Avx2 => 8,
        Isa::Baseline => 1,
    };
    let flops_per_thread = (2 * CHAINS * lanes * ITERATIONS) as f64;
    (0..TRIES)
        .map(|_| {
            let began = Instant::now();
            let sums = rayon::broadcast(|_| std::hint::black_box(chains(isa, ITERATIONS)));
            let seconds = began.elapsed().as_secs_f64();
            // The sums keep the loops from being optimised away (each converges to 1).
            assert!(
                sums.iter().all(|s| s.is_finite()),
                "multiply-add chains diverged"
            );
            flops_per_thread * sums.len() as f64 / seconds
        })
        .fold(0.0, f64::max)
}

/// [`CHAINS`] chains of `x ← x·a + b` for `iterations` steps in `isa`'s form (one the processor
/// has); the sum of their final values.
fn chains(isa: Isa, iterations: usize) -> f32 {
    let (a, b) = (
        std::hint::black_box(0.999_9f32),
        std::hint::black_box(1e-4f32),
    );
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: the caller picked a form the processor has.
        Isa::Avx512 => return unsafe { x86::chains_avx512(iterations, a, b) },
        Isa::Avx2 => return unsafe { x86::chains_avx2(iterations, a, b) },
        Isa::Baseline => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa; // only the portable form elsewhere
    let mut x = [1.0f32; CHAINS];
    for _ in 0..iterations {
        for x in &mut x {
            *x = x.mul_add(a, b);
        }
    }
    x.iter().sum()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::*;

    /// The chains in 512-bit registers.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn chains_avx512(iterations: usize, a: f32, b: f32) -> f32 {
        let (a, b) = (_mm512_set1_ps(a), _mm512_set1_ps(b));
        let mut x = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..iterations {
            for x in &mut x {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        _mm512_reduce_add_ps(
            x.into_iter()
                .fold(_mm512_setzero_ps(), |s, x| _mm512_add_ps(s, x)),
        )
    }

    /// The chains in 256-bit registers.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn chains_avx2(iterations: usize, a: f32, b: f32) -> f32 {
        let (a, b) = (_mm256_set1_ps(a), _mm256_set1_ps(b));
        let mut x = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..iterations {
            for x in &mut x {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let s = x
            .into_iter()
            .fold(_mm256_setzero_ps(), |s, x| _mm256_add_ps(s, x));
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), s);
        lanes.iter().sum()
    }
}
