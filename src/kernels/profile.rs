//! Where a training step's time goes, operation by operation, for `bench train --profile`: the
//! wall time of every fused kernel call, summed per operation and phase of the step (forward,
//! backward, optimizer). What the step spends outside those calls — burn's own operations,
//! autodiff's bookkeeping, allocation, the gaps between kernels — is the phase's time less
//! their sum.
//!
//! Off unless a benchmark turns it on: a call then costs one relaxed atomic load. Only a
//! backend whose kernels run to completion on the calling thread (flex's, see
//! [`super::LabBackend::TIMED_KERNELS`]) can be timed this way; a GPU backend's calls return
//! before the device has run them.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A phase of a training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// The forward pass and the loss.
    Forward,
    /// `backward()`.
    Backward,
    /// Clipping, decay and the AdamW update.
    Optimizer,
}

impl Phase {
    /// Every phase, in step order.
    pub const ALL: [Phase; 3] = [Phase::Forward, Phase::Backward, Phase::Optimizer];

    /// Its name in a report.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// One operation's calls in one phase.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    /// The phase the calls were made in.
    pub phase: Phase,
    /// The operation (e.g. `linear`, `attention backward`).
    pub name: &'static str,
    /// Calls counted.
    pub calls: u64,
    /// Their wall time, summed.
    pub seconds: f64,
    /// The floating-point operations of their matrix products (a multiply-add counts two),
    /// summed; 0 for an operation whose work is not counted.
    pub flops: f64,
}

static ON: AtomicBool = AtomicBool::new(false);
static PHASE: AtomicU8 = AtomicU8::new(0);
static TIMES: Mutex<Vec<OpTime>> = Mutex::new(Vec::new());

/// Starts (`true`) or stops counting calls. Counts already taken stay until [`take`].
pub fn enable(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// The phase the calls from now on are counted in.
pub fn set_phase(phase: Phase) {
    PHASE.store(phase as u8, Ordering::Relaxed);
}

/// Everything counted since the last call, in phase order then by time (largest first); the
/// counts start again from zero.
pub fn take() -> Vec<OpTime> {
    let mut times = std::mem::take(&mut *lock());
    times.sort_by(|a, b| a.phase.cmp(&b.phase).then(b.seconds.total_cmp(&a.seconds)));
    times
}

fn lock() -> std::sync::MutexGuard<'static, Vec<OpTime>> {
    // A panic while the lock was held leaves counts that are still counts.
    TIMES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn record(name: &'static str, elapsed: Duration, flops: f64) {
    let phase = Phase::ALL[usize::from(PHASE.load(Ordering::Relaxed)).min(2)];
    let mut times = lock();
    match times
        .iter_mut()
        .find(|t| t.phase == phase && t.name == name)
    {
        Some(t) => {
            t.calls += 1;
            t.seconds += elapsed.as_secs_f64();
            t.flops += flops;
        }
        None => times.push(OpTime {
            phase,
            name,
            calls: 1,
            seconds: elapsed.as_secs_f64(),
            flops,
        }),
    }
}

thread_local! {
    /// Timers open on this thread: a kernel that calls another is counted once, as itself.
    static OPEN: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Times the call it lives in, from its creation to its end, when counting is on: the first
/// line of a kernel's entry point, `let _timer = Timer::new("GELU");`. A timer opened inside
/// another (a kernel falling back on another) counts nothing: its time is the outer one's.
#[must_use = "the timer counts until it is dropped"]
pub struct Timer {
    name: &'static str,
    /// The call's product work, in floating-point operations.
    flops: f64,
    /// `None` when counting was off; `Some(None)` inside another timer.
    began: Option<Option<Instant>>,
}

impl Timer {
    /// Starts timing `name` (nothing when counting is off).
    #[inline]
    pub fn new(name: &'static str) -> Self {
        Self::with_flops(name, 0.0)
    }

    /// Starts timing `name`, a call whose matrix products do `flops` floating-point
    /// operations (what the report's rate is computed from).
    #[inline]
    pub fn with_flops(name: &'static str, flops: f64) -> Self {
        let began = ON.load(Ordering::Relaxed).then(|| {
            let open = OPEN.with(|open| {
                open.set(open.get() + 1);
                open.get()
            });
            (open == 1).then(Instant::now)
        });
        Self { name, flops, began }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        if let Some(began) = self.began {
            OPEN.with(|open| open.set(open.get() - 1));
            if let Some(began) = began {
                record(self.name, began.elapsed(), self.flops);
            }
        }
    }
}
