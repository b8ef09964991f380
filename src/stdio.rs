//! Output that a closed pipe cannot stop.
//!
//! Rust's `println!` panics when stdout is a pipe whose reader has gone (`train | head -1`), and
//! burn-train prints with `println!` too (its summary), so guarding our own writes is not enough.
//! [`guard`] puts a pipe of our own under file descriptors 1 and 2 when they are not terminals
//! and copies it to the real ones on a thread; once the real reader is gone the copier keeps
//! draining and drops the bytes, so no write in the process ever fails and the work goes on.

#[cfg(unix)]
mod unix {
    use std::fs::File;
    use std::io::{IsTerminal, Read, Write};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::thread::JoinHandle;

    /// One redirected descriptor: the original, kept to restore at the end, and its copier.
    struct Redirect {
        fd: i32,
        original: OwnedFd,
        copier: JoinHandle<()>,
    }

    /// Restores the real descriptors when dropped (see [`finish`]).
    pub struct Guard(());

    fn dup(fd: i32) -> Option<OwnedFd> {
        // SAFETY: dup returns a new descriptor we own, or -1.
        let new = unsafe { libc::dup(fd) };
        (new >= 0).then(|| unsafe { OwnedFd::from_raw_fd(new) })
    }

    fn redirect(fd: i32) -> Option<Redirect> {
        let original = dup(fd)?;
        let mut fds = [0i32; 2];
        // SAFETY: pipe fills two descriptors we then own.
        if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
            return None;
        }
        let (read, write) = unsafe { (File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let mut sink = File::from(dup(original.as_raw_fd())?);
        // SAFETY: both descriptors are open; dup2 makes `fd` a copy of the pipe's write end.
        if unsafe { libc::dup2(write.as_raw_fd(), fd) } < 0 {
            return None;
        }
        drop(write);
        let copier = std::thread::Builder::new()
            .name(format!("stdio-{fd}"))
            .spawn(move || copy_until_closed(read, &mut sink))
            .ok()?;
        Some(Redirect {
            fd,
            original,
            copier,
        })
    }

    /// Copies `read` to `sink` until every writer closed the pipe; after the first failed write
    /// (the reader went away) it only drains.
    fn copy_until_closed(mut read: File, sink: &mut File) {
        let mut buffer = [0u8; 8192];
        let mut open = true;
        loop {
            match read.read(&mut buffer) {
                Ok(0) => return,
                Ok(n) => {
                    if open && sink.write_all(&buffer[..n]).is_err() {
                        open = false;
                    }
                }
                Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    }

    /// The descriptors redirected by [`guard`], until [`finish`] restores them.
    static REDIRECTS: std::sync::Mutex<Vec<Redirect>> = std::sync::Mutex::new(Vec::new());

    /// Guards stdout and stderr where they are not terminals (a terminal keeps its own
    /// descriptor, so the dashboard and colours still see one), until the returned guard is
    /// dropped.
    pub fn guard() -> Guard {
        let mut redirects = REDIRECTS.lock().unwrap_or_else(|e| e.into_inner());
        if !std::io::stdout().is_terminal() {
            redirects.extend(redirect(1));
        }
        if !std::io::stderr().is_terminal() {
            redirects.extend(redirect(2));
        }
        Guard(())
    }

    /// Restores the real descriptors and waits until everything written reached them.
    pub fn finish() {
        let _ = std::io::stdout().flush();
        let _ = std::io::stderr().flush();
        let redirects: Vec<Redirect> =
            std::mem::take(&mut *REDIRECTS.lock().unwrap_or_else(|e| e.into_inner()));
        for redirect in redirects {
            // Pointing the descriptor back at the original closes the pipe's last writer, so
            // the copier sees the end, writes what is left, and returns.
            // SAFETY: both descriptors are open.
            unsafe { libc::dup2(redirect.original.as_raw_fd(), redirect.fd) };
            let _ = redirect.copier.join();
        }
    }

    impl Drop for Guard {
        fn drop(&mut self) {
            finish();
        }
    }
}

#[cfg(unix)]
pub use unix::{finish, guard, Guard};

/// Exits the process with `code` at once (no destructors run), after everything written to
/// stdout and stderr reached them.
pub fn exit(code: i32) -> ! {
    finish();
    std::process::exit(code)
}

/// Elsewhere a no-op.
#[cfg(not(unix))]
pub struct Guard;

/// Elsewhere a no-op.
#[cfg(not(unix))]
pub fn guard() -> Guard {
    Guard
}

/// Elsewhere a no-op.
#[cfg(not(unix))]
pub fn finish() {}

/// `n` and `noun`, the noun in the plural unless `n` is 1: "1 run", "2 runs".
pub fn count(n: usize, noun: &str) -> String {
    match n {
        1 => format!("1 {noun}"),
        n => format!("{n} {noun}s"),
    }
}
