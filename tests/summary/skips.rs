//! The record of tests that skipped for want of what they need (a Vulkan driver, a browser, the
//! datasets, a CUDA driver), shared by the suite, which writes it, and `tests/summary`, which
//! prints it after the suite's own summary line — where a user reads "N passed" and would
//! otherwise believe those tests checked something.
//!
//! `cargo test` starts the suite and then the summary as children of one cargo process, so the
//! record of a run is a file named after that parent's pid.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Where the skips of the cargo invocation with pid `parent` are recorded, under `dir`.
pub fn record_file(dir: &Path, parent: u32) -> PathBuf {
    dir.join("skipped").join(format!("cargo-{parent}.tsv"))
}

/// The record of the cargo invocation running this process.
pub fn this_run(dir: &Path) -> PathBuf {
    record_file(dir, std::os::unix::process::parent_id())
}

/// Appends "test ⇥ why" to `file` (one short write: whole lines from parallel tests).
pub fn record(file: &Path, test: &str, why: &str) -> std::io::Result<()> {
    if let Some(parent) = file.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let line = format!("{test}\t{}\n", why.replace(['\t', '\n'], " "));
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)?
        .write_all(line.as_bytes())
}

/// The closing lines for a record's text: the skipped tests grouped by reason, or nothing.
pub fn report(record: &str) -> String {
    let mut by_reason: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for line in record.lines() {
        if let Some((test, why)) = line.split_once('\t') {
            let tests = by_reason.entry(why).or_default();
            if !tests.contains(&test) {
                tests.push(test);
            }
        }
    }
    let total: usize = by_reason.values().map(Vec::len).sum();
    if total == 0 {
        return String::new();
    }
    let mut out = format!(
        "skipped: {total} of the tests counted as passed above checked nothing (or only part) \
         for want of what they need:\n"
    );
    for (why, mut tests) in by_reason {
        tests.sort_unstable();
        let shown = tests.iter().take(3).copied().collect::<Vec<_>>().join(", ");
        let more = match tests.len() {
            n if n > 3 => format!(" and {} more", n - 3),
            _ => String::new(),
        };
        let noun = if tests.len() == 1 { "test" } else { "tests" };
        out += &format!("  {} {noun}: {why}\n    ({shown}{more})\n", tests.len());
    }
    out += "CI runs them (but CUDA's): .ci/run installs what they need and sets CI_EXPECT_WGPU, \
            CI_EXPECT_BROWSER and CI_EXPECT_DATA, which make those skips failures.\n";
    out
}
