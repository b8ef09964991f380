//! What a newcomer meets first: each command's `--help` lists only options that change what it
//! does, the README's examples run in the order written and write where git does not look, and
//! a test that skips for want of a driver, a browser or the data is named after the suite's
//! summary instead of hiding among the passes.

use crate::common::BIN;
use crate::skips;
use std::collections::{BTreeSet, HashSet};
use std::process::Command;

/// The long options `transformer-lab ARGS --help` lists (`--help` and `--version` left out).
fn options(args: &[&str]) -> BTreeSet<String> {
    let out = Command::new(BIN).args(args).arg("--help").output().unwrap();
    assert!(out.status.success(), "{args:?} --help failed");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|line| line.trim_start().starts_with('-'))
        .filter_map(|line| {
            // "  -e, --experiment <FILE>" or "      --resume"
            let long = line
                .split_whitespace()
                .take(2)
                .find(|w| w.starts_with("--"))?;
            Some(long[2..].trim_end_matches(',').to_string())
        })
        .filter(|name| name != "help" && name != "version")
        .collect()
}

const COMPUTE: [&str; 3] = ["backend", "no-fused", "kernel-check"];

#[test]
fn each_command_offers_the_backend_options_only_where_they_change_what_it_does() {
    let computing: &[&[&str]] = &[
        &["train"],
        &["generate"],
        &["eval"],
        &["translate"],
        &["predict"],
        &["zero-shot"],
        &["classify"],
        &["embed"],
        &["attention"],
        &["explain"],
        &["heads"],
        &["bench", "train"],
        &["bench", "mixers"],
        &["bench", "generate"],
    ];
    for command in computing {
        let have = options(command);
        for option in COMPUTE {
            assert!(have.contains(option), "{command:?} --help lacks --{option}");
        }
    }
    // Compare the fused and composed forms themselves: the backend only.
    for command in [&["doctor"][..], &["bench", "kernels"]] {
        let have = options(command);
        assert!(
            have.contains("backend"),
            "{command:?} --help lacks --backend"
        );
        for option in ["no-fused", "kernel-check"] {
            assert!(
                !have.contains(option),
                "{command:?} --help offers --{option}"
            );
        }
    }
    // Compute nothing on a backend.
    for command in [&["curves"][..], &["import"], &["export"]] {
        let have = options(command);
        for option in COMPUTE {
            assert!(
                !have.contains(option),
                "{command:?} --help offers --{option}"
            );
        }
    }
    assert_eq!(
        options(&["curves"]),
        ["metric", "split", "out", "csv"].map(String::from).into(),
        "curves --help"
    );
}

#[test]
fn backend_options_work_before_and_after_the_command_name() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["--backend", "ndarray", "explain"][..],
        &["explain", "--backend", "ndarray", "--no-fused"],
        // Given before a command that computes nothing, they are for the others: ignored.
        &["--backend", "ndarray", "curves", "missing"],
    ] {
        let out = Command::new(BIN)
            .args(args)
            .current_dir(dir.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
    }
    let out = Command::new(BIN)
        .args(["curves", "--backend", "ndarray", "a"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unexpected argument '--backend'"),
        "curves takes no --backend after its name"
    );
}

/// The commands of the README's "Set up" and "Use" blocks, in order, continuation lines
/// joined.
fn readme_commands() -> Vec<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let start = readme.find("## Set up").unwrap();
    let end = readme.find("### A run is never lost").unwrap();
    let mut commands = Vec::new();
    let mut in_block = false;
    let mut pending = String::new();
    for line in readme[start..end].lines() {
        if line.starts_with("```") {
            in_block = line == "```sh";
            continue;
        }
        let line = line.split(" # ").next().unwrap().trim();
        if !in_block || line.is_empty() || line.starts_with('#') {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(head) => pending += head,
            None => commands.push(std::mem::take(&mut pending) + line),
        }
    }
    commands
}

/// The words after `cargo run --release --` (or the command itself), quotes dropped.
fn words(command: &str) -> Vec<String> {
    let command = command.rsplit("| ").next().unwrap();
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    for c in command.chars() {
        match c {
            '"' => quoted = !quoted,
            ' ' if !quoted => words.extend((!word.is_empty()).then(|| std::mem::take(&mut word))),
            c => word.push(c),
        }
    }
    words.extend((!word.is_empty()).then_some(word));
    match words.iter().position(|w| w == "--") {
        Some(at) => words.split_off(at + 1),
        None => words,
    }
}

fn value_of(words: &[String], option: &str) -> Option<String> {
    words
        .iter()
        .position(|w| w == option)
        .map(|at| words[at + 1].clone())
}

#[test]
fn the_readmes_first_commands_use_only_runs_it_made_and_write_under_artifacts() {
    let commands = readme_commands();
    assert!(commands.len() > 20, "found {} commands", commands.len());
    let mut made: HashSet<String> = HashSet::new();
    let mut checked = 0;
    for command in &commands {
        let words = words(command);
        let Some(verb) = words.first() else { continue };
        if verb == "test" || command.starts_with("cargo test") {
            continue;
        }
        if verb == "train" {
            let experiment =
                value_of(&words, "-e").unwrap_or("experiments/shakespeare-char.json".into());
            let path = format!("{}/{experiment}", env!("CARGO_MANIFEST_DIR"));
            let config: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            made.insert(format!("artifacts/{}", config["name"].as_str().unwrap()));
            continue;
        }
        let mut used = value_of(&words, "--artifact-dir")
            .into_iter()
            .collect::<Vec<_>>();
        if verb == "curves" {
            used.extend(
                words[1..]
                    .iter()
                    .take_while(|w| !w.starts_with("--"))
                    .cloned(),
            );
        }
        for dir in used {
            assert!(
                made.contains(&dir),
                "`{command}` uses {dir}, which no earlier command made"
            );
            checked += 1;
        }
        for option in ["--out", "--png", "--html", "--json", "--csv"] {
            if let Some(path) = value_of(&words, option) {
                assert!(
                    path.starts_with("artifacts/"),
                    "`{command}` writes {path}, outside artifacts/ (which git ignores)"
                );
                if verb == "heads" {
                    made.insert(path);
                }
            }
        }
    }
    assert!(checked > 15, "checked only {checked} artifact uses");
    let ignored =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/.gitignore")).unwrap();
    assert!(
        ignored.lines().any(|l| l == "/artifacts"),
        "artifacts/ is not ignored by git"
    );
}

#[test]
fn skipped_tests_are_named_after_the_suite_grouped_by_what_they_lack() {
    let dir = tempfile::tempdir().unwrap();
    let file = skips::record_file(dir.path(), 42);
    assert_eq!(skips::report(""), "", "nothing skipped: nothing said");
    let lines = [
        ("wgpu_backend::a", "no adapter"),
        ("wgpu_backend::b", "no adapter"),
        ("browser::page", "no browser"),
        ("wgpu_backend::a", "no adapter"),
        ("kernel_check::c", "no adapter"),
        ("gpu::d", "no adapter"),
    ];
    for (test, why) in lines {
        skips::record(&file, test, why).unwrap();
    }
    let report = skips::report(&std::fs::read_to_string(&file).unwrap());
    let report: Vec<&str> = report.lines().collect();
    assert!(
        report[0].starts_with("skipped: 5 of the tests counted as passed"),
        "{report:?}"
    );
    assert_eq!(report[1], "  4 tests: no adapter");
    assert_eq!(
        report[2],
        "    (gpu::d, kernel_check::c, wgpu_backend::a and 1 more)"
    );
    assert_eq!(report[3], "  1 test: no browser");
    assert_eq!(report[4], "    (browser::page)");
    assert_eq!(report.len(), 6, "{report:?}");
    // The suite and the summary are children of one cargo: its pid names the record.
    assert_eq!(
        skips::this_run(dir.path()),
        skips::record_file(dir.path(), std::os::unix::process::parent_id())
    );
}
