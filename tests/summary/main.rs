//! Runs after the suite (cargo runs test targets in name order): prints which of its tests
//! skipped and why, then forgets the record. Prints nothing when none skipped, and lists no
//! tests of its own (`--list`, as test runners ask).

#[allow(dead_code)] // record is the suite's
mod skips;

fn main() {
    if std::env::args().any(|arg| arg == "--list") {
        return;
    }
    let file = skips::this_run(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")));
    if let Ok(record) = std::fs::read_to_string(&file) {
        print!("{}", skips::report(&record));
        let _ = std::fs::remove_file(&file);
    }
    // Records of suites run without this summary (`cargo test --test suite`) go after a week.
    let week = std::time::Duration::from_secs(7 * 24 * 3600);
    for entry in std::fs::read_dir(file.parent().unwrap())
        .into_iter()
        .flatten()
        .flatten()
    {
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > week));
        if old {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}
