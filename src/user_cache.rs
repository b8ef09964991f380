//! The user's cache directory and what a cached result is valid for. The on-device kernel
//! check's results live there (`app::doctor`) and, on the GPU backends, cubecl's compiled
//! kernels and autotune choices (`backend::prepare_gpu`). The first two are only worth keeping
//! for the binary that made them (a rebuild compiles other kernels); the autotune choices, for
//! burn's pinned kernels, outlive a rebuild.

use std::path::PathBuf;

/// The environment variable that moves the cache directory (tests give each run its own).
pub const CACHE_ENV: &str = "TRANSFORMER_LAB_CACHE_DIR";

/// `$TRANSFORMER_LAB_CACHE_DIR`, else `$XDG_CACHE_HOME/transformer-lab`, else
/// `~/.cache/transformer-lab`; `None` where none of them is set.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |name| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var(CACHE_ENV)
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("transformer-lab")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("transformer-lab")))
}

/// This binary's size and modification time in seconds (zeros where unreadable).
fn binary_stamp() -> (u64, u64) {
    std::env::current_exe()
        .and_then(std::fs::metadata)
        .map(|m| {
            let modified = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs());
            (m.len(), modified)
        })
        .unwrap_or_default()
}

/// This binary: its version, size and modification time (a rebuild changes the last two).
pub fn binary_identity() -> String {
    let (size, modified) = binary_stamp();
    format!(
        "transformer-lab {} ({size} bytes, modified {modified})",
        env!("CARGO_PKG_VERSION")
    )
}

/// [`binary_identity`] as a directory name: `0.1.0-123456-1700000000`.
pub fn binary_dir_name() -> String {
    let (size, modified) = binary_stamp();
    format!("{}-{size}-{modified}", env!("CARGO_PKG_VERSION"))
}
