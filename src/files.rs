//! Files written whole or not at all: a temporary name beside the target, every write checked,
//! fsync, rename. Every file the application writes (configs, tokenizers, weights, pictures,
//! exports) goes through here, so a full disk or a kill never leaves half a file.

use anyhow::{Context, Result};
use std::io::Write;
#[cfg(unix)]
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

/// Writes `bytes` to `path` through a temporary file in the same directory, so `path` holds
/// either its old content or the whole new content.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_whole(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

/// Writes `bytes` to a hidden `.NAME-partial-…` file beside `path` (never read back; removed
/// on the next start if a kill leaves it), checks every write, syncs it and renames it to `path`.
pub(crate) fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let prefix = format!(".{name}-partial-");
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix);
    // Ordinary file permissions (0644 less the umask), not the temporary file's private 0600.
    #[cfg(unix)]
    builder.permissions(std::fs::Permissions::from_mode(0o644));
    let mut tmp = builder.tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}
