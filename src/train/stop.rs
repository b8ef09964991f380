//! Asking a run to stop without losing work: SIGTERM (schedulers, `docker stop`, systemd, a
//! shutdown), SIGINT (Ctrl-C, also inside the dashboard) and the dashboard's `q` all end the
//! run after the step in progress, with a checkpoint of that step (see `strategy`). A second
//! signal exits at once: every file is written under a temporary name and renamed into place,
//! and a mid-epoch checkpoint counts only once its marker is written last, so what an exit
//! leaves is the previous complete checkpoint.

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, OnceLock};

/// The exit status of a run that stopped on request and saved its step (`EX_TEMPFAIL`: try
/// again — `train --resume` continues it).
pub const STOPPED_STATUS: u8 = 75;

/// A run that stopped on request with its step saved: the line to print, and the exit status
/// [`STOPPED_STATUS`].
#[derive(Debug)]
pub struct Stopped(pub String);

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Stopped {}

/// What asked the run to stop: a signal's number, or [`StopRequest::KEY`] for the dashboard.
#[derive(Clone, Debug, Default)]
pub struct StopRequest(Arc<AtomicI32>);

/// The process's stop request, once [`install`] has run (only the binary installs it: a test
/// that trains in-process keeps the test runner's own handling of signals).
static INSTALLED: OnceLock<StopRequest> = OnceLock::new();

impl StopRequest {
    /// The dashboard's `q` (burn's interrupter), not a signal.
    pub const KEY: i32 = -1;

    /// The request the signal handlers set, if they are installed.
    pub fn installed() -> Option<Self> {
        INSTALLED.get().cloned()
    }

    /// Asks the run to stop, for `why` (a signal number or [`Self::KEY`]); returns whether it
    /// had been asked already.
    pub fn ask(&self, why: i32) -> bool {
        self.0
            .compare_exchange(0, why, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
    }

    /// What asked, if anything has.
    pub fn asked(&self) -> Option<i32> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            why => Some(why),
        }
    }

    /// How the request reads in a message: "SIGTERM", "SIGINT", "q".
    pub fn name(why: i32) -> &'static str {
        match why {
            libc_signal::SIGTERM => "SIGTERM",
            libc_signal::SIGINT => "SIGINT",
            _ => "q",
        }
    }
}

/// Signal numbers (POSIX) without the platform crate on every target.
mod libc_signal {
    pub const SIGINT: i32 = 2;
    pub const SIGTERM: i32 = 15;
}

/// Installs the handlers of SIGTERM and SIGINT for the rest of the process: the first asks the
/// run to stop after its step, a second exits at once with `128 + signal`. Also makes Ctrl-C a
/// signal again inside the dashboard, whose raw terminal mode turns it into a key press.
#[cfg(unix)]
pub fn install() -> anyhow::Result<()> {
    if INSTALLED.get().is_some() {
        return Ok(());
    }
    let request = StopRequest::default();
    let mut signals =
        signal_hook::iterator::Signals::new([libc_signal::SIGTERM, libc_signal::SIGINT])?;
    let asked = request.clone();
    std::thread::Builder::new()
        .name("stop-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                let name = StopRequest::name(signal);
                if asked.ask(signal) {
                    eprintln!(
                        "{name}: asked to stop a second time, exiting now; the newest complete \
                         checkpoint is kept (train --resume continues from it)"
                    );
                    crate::stdio::exit(128 + signal);
                }
                eprintln!(
                    "{name}: stopping after the step in progress and saving it (send it again \
                     to exit at once)"
                );
            }
        })?;
    let _ = INSTALLED.set(request);
    Ok(())
}

/// No signals to handle elsewhere: the run stops with the dashboard's `q` only.
#[cfg(not(unix))]
pub fn install() -> anyhow::Result<()> {
    Ok(())
}

/// Keeps the terminal's signal keys on while it lives, so that Ctrl-C stops the run inside
/// burn's dashboard as it does outside. The dashboard turns raw mode on (where Ctrl-C is a key it
/// ignores) from its own thread, whenever that thread starts: often during the first step, which
/// on a large model or a GPU's first compilation lasts long enough for a user to press Ctrl-C in
/// it. So a thread looks every 5 ms, not once a step (a `tcgetattr`, and a `tcsetattr` only
/// when the keys are off): a Ctrl-C within 5 ms of the dashboard's raw mode coming on is still
/// its key (at 50 ms a test typing as soon as the first frame was drawn lost one in CI).
/// Dropping it stops the thread.
pub struct SignalKeys {
    /// The watching thread and the sender whose drop stops it.
    watcher: Option<(std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>)>,
}

impl SignalKeys {
    /// Starts watching when stdin is a terminal; otherwise does nothing.
    pub fn watch() -> Self {
        if !std::io::IsTerminal::is_terminal(&std::io::stdin()) {
            return Self { watcher: None };
        }
        let (done, stop) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("signal-keys".into())
            .spawn(move || loop {
                signal_keys_on();
                match stop.recv_timeout(std::time::Duration::from_millis(5)) {
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                    _ => break,
                }
            });
        Self {
            watcher: thread.ok().map(|thread| (done, thread)),
        }
    }
}

impl Drop for SignalKeys {
    fn drop(&mut self) {
        if let Some((done, thread)) = self.watcher.take() {
            drop(done);
            let _ = thread.join();
        }
    }
}

/// Inside burn's dashboard the terminal is in raw mode, where Ctrl-C is a key the dashboard
/// ignores; this turns the terminal's signal keys back on so that Ctrl-C stops the run as it
/// does outside. Nothing when stdin is not a terminal (the call fails).
#[cfg(unix)]
fn signal_keys_on() {
    // SAFETY: tcgetattr/tcsetattr on fd 0 with a zeroed termios they fill in.
    unsafe {
        let mut term: libc::termios = std::mem::zeroed();
        if libc::tcgetattr(0, &mut term) == 0 && term.c_lflag & libc::ISIG == 0 {
            term.c_lflag |= libc::ISIG;
            libc::tcsetattr(0, libc::TCSANOW, &term);
        }
    }
}

/// Signal keys are on elsewhere.
#[cfg(not(unix))]
fn signal_keys_on() {}
