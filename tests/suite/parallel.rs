//! Data-parallel training (`train --devices`) and gradient accumulation
//! (`train.grad_accumulation`): each device's share of every batch, and the promise that
//! splitting a step's batch across devices, or across batches whose gradients are added up,
//! changes nothing but the order of sums.

use crate::common::{assert_clean_error, lm_weights as weights, run, stderr, tiny_text_experiment};
use burn::backend::NdArray;
use burn::data::dataset::InMemDataset;
use std::path::Path;
use std::sync::Arc;
use transformer_lab::train::{mix, replacement_batches_in_groups, Draw, EpochLoader};

/// A loader of the items `0..n` whose batch function returns the items themselves.
fn loader(
    n: usize,
    size: usize,
    lengths: Option<Vec<usize>>,
) -> EpochLoader<NdArray, usize, Vec<usize>> {
    let loader = EpochLoader::new(
        InMemDataset::new((0..n).collect()),
        Arc::new(|items, _, _| items),
        Default::default(),
        Draw::Replacement { batches: 9 },
        size,
        2,
        41,
        Arc::default(),
    );
    match lengths {
        Some(lengths) => loader.by_length(lengths),
        None => loader,
    }
}

#[test]
fn each_device_reads_its_own_share_and_the_shares_make_the_batch() {
    let n = 500;
    let lengths: Vec<usize> = (0..n).map(|i| 1 + (i * 7919) % 50).collect();
    for count in [2, 3, 4] {
        for lengths in [None, Some(lengths.clone())] {
            let whole = loader(n, 12, lengths.clone());
            let shards: Vec<_> = (0..count)
                .map(|j| loader(n, 12, lengths.clone()).shard(j, count, Default::default()))
                .collect();
            for epoch in [1, 2] {
                // The batches the shares are cut from: the one-device batches, or with lengths
                // the same draw cut only between runs of `count` (similar lengths side by side).
                let batches = match &lengths {
                    None => whole.batches(epoch),
                    Some(lengths) => replacement_batches_in_groups(
                        n,
                        9,
                        12,
                        mix(41, epoch as u64),
                        Some(lengths),
                        count,
                    ),
                };
                if lengths.is_none() {
                    assert!(batches.iter().all(|b| b.len() == 12));
                }
                let shares: Vec<Vec<Vec<usize>>> =
                    shards.iter().map(|s| s.batches(epoch)).collect();
                for (b, batch) in batches.iter().enumerate() {
                    assert!(batch.len().is_multiple_of(count), "{batch:?}");
                    // Share j holds positions j, j + count, …: disjoint, and together the batch.
                    let mut positions = vec![None; batch.len()];
                    for (j, share) in shares.iter().enumerate() {
                        let share = &share[b];
                        assert_eq!(share.len(), batch.len() / count, "an equal share each");
                        for (k, &item) in share.iter().enumerate() {
                            let at = j + k * count;
                            assert_eq!(batch[at], item);
                            assert!(positions[at].replace(j).is_none(), "read twice");
                        }
                    }
                    assert!(positions.iter().all(Option::is_some), "every item is read");
                }
                // A share's epoch, served from any batch on (a resumed run), is its batches.
                for skip in [0, 4] {
                    let served: Vec<Vec<usize>> = shards[count - 1]
                        .epoch_iter(epoch, skip)
                        .collect::<Vec<_>>();
                    assert_eq!(served, shares[count - 1][skip..].to_vec());
                }
            }
        }
    }
}

fn largest_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
        .fold(0.0, f32::max)
}

/// `train --artifact-dir ART --plain ARGS` in `dir`, which must succeed: its standard output.
fn train_in(dir: &Path, art: &str, args: &[&str]) -> String {
    let mut all = vec!["train", "--artifact-dir", art, "--plain"];
    all.extend(args);
    let out = run(dir, &all);
    assert!(out.status.success(), "{}", stderr(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Writes `tiny.json` in `dir`, 40 steps of 8 windows without dropout (each device's share
/// draws masks of its own, so only then is a split step the same step); returns its text.
fn forty_steps_of_eight(dir: &Path) -> String {
    tiny_text_experiment(
        dir,
        r#"{"batch_size": 8, "steps": 40, "steps_per_epoch": 20, "eval_batches": 1,
            "warmup_steps": 4, "lr": 0.01}"#,
    );
    std::fs::read_to_string(dir.join("tiny.json")).unwrap()
}

#[test]
fn two_devices_train_the_weights_one_device_trains() {
    let dir = tempfile::tempdir().unwrap();
    let text = forty_steps_of_eight(dir.path());
    // The same run from another seed: how far apart two different trainings end.
    let other = text.replace(r#""name": "tiny","#, r#""name": "tiny", "seed": 7,"#);
    assert_ne!(text, other);
    std::fs::write(dir.path().join("other.json"), other).unwrap();
    let train = |art: &str, extra: &[&str]| {
        let mut args = Vec::from(extra);
        if !extra.contains(&"-e") {
            args.extend(["-e", "tiny.json"]);
        }
        train_in(dir.path(), art, &args)
    };
    train("one", &[]);
    let log = train("two", &["--devices", "0,1"]);
    assert!(
        log.contains("data-parallel on 2 devices") && log.contains("4 of every batch's 8 items"),
        "{log}"
    );
    train("two-again", &["--devices", "0,1"]);
    train("four", &["--devices", "0,1,2,3"]);
    // One device named: the run of that device alone (here the one CPU device), not a group.
    let single = train("device-3", &["--devices", "3"]);
    assert!(!single.contains("data-parallel"), "{single}");
    train("other-seed", &["-e", "other.json"]);
    let one = weights(&dir.path().join("one"));
    let two = weights(&dir.path().join("two"));
    assert_eq!(one, weights(&dir.path().join("device-3")), "one device");
    assert_eq!(
        two,
        weights(&dir.path().join("two-again")),
        "same seed, same weights"
    );
    // The mean of the shares' mean gradients is the batch's mean gradient: only the order of
    // the sums differs (measured: 1e-8 after 40 AdamW steps of lr 0.01), while another seed's
    // batches and initial weights end far away.
    let apart = largest_difference(&one, &weights(&dir.path().join("other-seed")));
    assert!(apart > 0.05, "{apart}");
    for (name, other) in [("two", &two), ("four", &weights(&dir.path().join("four")))] {
        let difference = largest_difference(&one, other);
        assert!(difference < 1e-5, "{name} devices: {difference}");
    }
}

#[test]
fn accumulated_batches_train_the_weights_of_one_batch_of_their_sum() {
    let dir = tempfile::tempdir().unwrap();
    let text = forty_steps_of_eight(dir.path());
    // Each experiment: `tiny.json` with `replace` made in it.
    let experiment = |name: &str, replace: &[(&str, &str)]| {
        let mut changed = text.clone();
        for (from, to) in replace {
            assert!(changed.contains(from), "{from}");
            changed = changed.replace(from, to);
        }
        std::fs::write(dir.path().join(name), changed).unwrap();
    };
    let batches =
        |size: usize, n: usize| format!(r#""batch_size": {size}, "grad_accumulation": {n}"#);
    let unclipped = r#""lr": 0.01, "grad_clip": 0"#;
    experiment("two.json", &[(r#""batch_size": 8"#, &batches(4, 2))]);
    experiment("four.json", &[(r#""batch_size": 8"#, &batches(2, 4))]);
    experiment("unclipped.json", &[(r#""lr": 0.01"#, unclipped)]);
    experiment(
        "two-unclipped.json",
        &[
            (r#""batch_size": 8"#, &batches(4, 2)),
            (r#""lr": 0.01"#, unclipped),
        ],
    );
    experiment(
        "other.json",
        &[(r#""name": "tiny","#, r#""name": "tiny", "seed": 7,"#)],
    );
    let train = |art: &str, args: &[&str]| train_in(dir.path(), art, args);
    train("one", &["-e", "tiny.json"]);
    let log = train("two", &["-e", "two.json"]);
    assert!(
        log.contains("for 40 steps of 2 batches of 4 each (gradients accumulated)"),
        "{log}"
    );
    train("four", &["-e", "four.json"]);
    train(
        "two-on-two-devices",
        &["-e", "two.json", "--devices", "0,1"],
    );
    train("unclipped", &["-e", "unclipped.json"]);
    train("two-unclipped", &["-e", "two-unclipped.json"]);
    train("other-seed", &["-e", "other.json"]);
    // One training loss a step, the mean of its batches' losses: the big batch's loss.
    let losses = |art: &str| -> Vec<f64> {
        let table = std::fs::read_to_string(dir.path().join(art).join("metrics.csv")).unwrap();
        table
            .lines()
            .filter(|l| l.contains(",train,loss,"))
            .map(|l| l.rsplit(',').next().unwrap().parse().unwrap())
            .collect()
    };
    let big = losses("one");
    assert_eq!(big.len(), 40);
    for art in ["two", "four"] {
        let steps = losses(art);
        assert_eq!(steps.len(), 40, "{art}: a loss a step");
        for (step, (a, b)) in big.iter().zip(&steps).enumerate() {
            assert!(
                (a - b).abs() < 1e-4,
                "{art}, step {}: {a} against {b}",
                step + 1
            );
        }
    }
    // The loader draws a step's items in the same order whatever the batch, and the mean of the
    // batches' mean gradients is the step's mean gradient: only the order of the sums differs,
    // while another seed's batches and initial weights end far away. With clipping (the
    // default 1.0) the norm is the mean's; without, the mean alone.
    let one = weights(&dir.path().join("one"));
    let apart = largest_difference(&one, &weights(&dir.path().join("other-seed")));
    assert!(apart > 0.05, "{apart}");
    for (name, base) in [
        ("two", "one"),
        ("four", "one"),
        ("two-on-two-devices", "one"),
        ("two-unclipped", "unclipped"),
    ] {
        let difference = largest_difference(
            &weights(&dir.path().join(base)),
            &weights(&dir.path().join(name)),
        );
        assert!(difference < 1e-5, "{name}: {difference}");
    }
    let clipped = largest_difference(&one, &weights(&dir.path().join("unclipped")));
    assert!(clipped > 1e-3, "clipping changes this run: {clipped}");
}

#[test]
fn impossible_device_lists_are_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    tiny_text_experiment(
        dir.path(),
        r#"{"batch_size": 6, "steps": 4, "steps_per_epoch": 2, "eval_batches": 1,
            "warmup_steps": 1}"#,
    );
    let train = |devices: &str| {
        run(
            dir.path(),
            &[
                "train",
                "-e",
                "tiny.json",
                "--artifact-dir",
                "art",
                "--devices",
                devices,
            ],
        )
    };
    assert_clean_error(
        &train("0,1,2,3"),
        "batch_size (6) must be a multiple of the number of devices (4)",
    );
    assert_clean_error(&train("0,0"), "devices must name each device once");
    assert!(!dir.path().join("art").exists(), "nothing written");
}

// ---- Several machines: processes on loopback ----

/// A free TCP port with the `count` after it free too (the nodes' tensor services).
fn free_ports(count: u16) -> u16 {
    loop {
        let base = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if base < 60000
            && (0..=count).all(|i| std::net::TcpListener::bind(("0.0.0.0", base + i)).is_ok())
        {
            return base;
        }
    }
}

/// `train` as node `rank` of `nodes` with the coordinator on `port`.
fn node(dir: &Path, rank: usize, nodes: usize, port: u16, args: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new(crate::common::BIN);
    command
        .args(["--backend", "ndarray", "train", "--plain"])
        .args(args)
        .args([
            "--nodes",
            &nodes.to_string(),
            "--node-rank",
            &rank.to_string(),
        ])
        .args(["--coordinator", &format!("127.0.0.1:{port}")])
        .env("TRANSFORMER_LAB_JOIN_TIMEOUT", "60")
        .env("TRANSFORMER_LAB_LEAVE_TIMEOUT", "20")
        .current_dir(dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    command
}

/// Runs nodes 0..`count` of `args` at once; their outputs, node 0's first.
fn nodes(dir: &Path, count: usize, args: &[&str]) -> Vec<std::process::Output> {
    let port = free_ports(count as u16 + 1);
    let children: Vec<_> = (0..count)
        .map(|rank| node(dir, rank, count, port, args).spawn().unwrap())
        .collect();
    // Read every node's output at once: a node blocked on a full pipe would stall the others.
    let waiting: Vec<_> = children
        .into_iter()
        .map(|child| std::thread::spawn(move || child.wait_with_output().unwrap()))
        .collect();
    waiting.into_iter().map(|w| w.join().unwrap()).collect()
}

#[test]
fn two_processes_train_the_weights_one_process_trains() {
    let dir = tempfile::tempdir().unwrap();
    tiny_text_experiment(
        dir.path(),
        r#"{"batch_size": 8, "steps": 40, "steps_per_epoch": 20, "eval_batches": 1,
            "warmup_steps": 4, "lr": 0.01}"#,
    );
    let out = run(
        dir.path(),
        &[
            "train",
            "-e",
            "tiny.json",
            "--artifact-dir",
            "one",
            "--plain",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    // Two nodes of one device each, then two nodes of two devices: batch 8 in shares of 4, 2.
    for (name, extra) in [("two", vec![]), ("four", vec!["--devices", "0,1"])] {
        let mut args = vec!["-e", "tiny.json", "--artifact-dir", name];
        args.extend(&extra);
        let outs = nodes(dir.path(), 2, &args);
        for (rank, out) in outs.iter().enumerate() {
            assert!(out.status.success(), "node {rank}: {}", stderr(out));
        }
        let log = String::from_utf8_lossy(&outs[1].stdout);
        assert!(log.contains("× 2 nodes (this is node 1)"), "{log}");
        assert!(
            log.contains("data-parallel on 1 device × 2 nodes:") || name == "four",
            "{log}"
        );
        // Node 0 writes the artifact, node 1 its own copy beside it: the same weights, bit for
        // bit; the one-process run's up to the order of sums.
        let zero = weights(&dir.path().join(name));
        let copy = weights(&dir.path().join(format!("{name}-node-1")));
        assert_eq!(zero, copy, "{name}: the nodes end with different weights");
        let difference = largest_difference(&weights(&dir.path().join("one")), &zero);
        assert!(difference < 1e-5, "{name}: {difference}");
    }
}

#[test]
fn a_node_that_differs_or_leaves_stops_the_others_in_one_line_and_the_group_resumes() {
    let dir = tempfile::tempdir().unwrap();
    tiny_text_experiment(
        dir.path(),
        r#"{"batch_size": 8, "steps": 400, "steps_per_epoch": 50, "eval_batches": 1,
            "warmup_steps": 4, "lr": 0.003}"#,
    );
    // Another experiment on one node: both refuse before the first step, naming it.
    let text = std::fs::read_to_string(dir.path().join("tiny.json")).unwrap();
    std::fs::write(
        dir.path().join("other.json"),
        text.replace("0.003", "0.002"),
    )
    .unwrap();
    let port = free_ports(3);
    let zero = node(
        dir.path(),
        0,
        2,
        port,
        &["-e", "tiny.json", "--artifact-dir", "odd"],
    )
    .spawn()
    .unwrap();
    let one = node(
        dir.path(),
        1,
        2,
        port,
        &["-e", "other.json", "--artifact-dir", "odd"],
    )
    .output()
    .unwrap();
    let zero = zero.wait_with_output().unwrap();
    for out in [&zero, &one] {
        assert_clean_error(
            out,
            "node 1 runs another experiment or another binary than node 0",
        );
    }
    // No coordinator: one line after the join timeout.
    let began = std::time::Instant::now();
    let alone = node(
        dir.path(),
        1,
        2,
        free_ports(3),
        &["-e", "tiny.json", "--artifact-dir", "alone"],
    )
    .env("TRANSFORMER_LAB_JOIN_TIMEOUT", "3")
    .output()
    .unwrap();
    assert_clean_error(
        &alone,
        "did not answer, or not all 2 nodes joined, within 3 s",
    );
    assert!(began.elapsed().as_secs() < 30, "{:?}", began.elapsed());
    // Node 1 killed mid-run: node 0 stops within a bounded time, naming node 1.
    let port = free_ports(3);
    let args = ["-e", "tiny.json", "--artifact-dir", "cut"];
    let zero = node(dir.path(), 0, 2, port, &args).spawn().unwrap();
    let mut one = node(dir.path(), 1, 2, port, &args).spawn().unwrap();
    let checkpoint = dir.path().join("cut-node-1/checkpoint/scheduler-2.mpk");
    let began = std::time::Instant::now();
    while !checkpoint.exists() {
        assert!(began.elapsed().as_secs() < 120, "no checkpoint of epoch 2");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    one.kill().unwrap();
    let _ = one.wait();
    let killed = std::time::Instant::now();
    let zero = zero.wait_with_output().unwrap();
    assert!(
        killed.elapsed().as_secs() < 30,
        "node 0 took {:?}",
        killed.elapsed()
    );
    assert_clean_error(&zero, "node 1");
    assert!(!stderr(&zero).contains("PANIC"), "{}", stderr(&zero));
    // Node 1 alive but silent (SIGSTOP): node 0 ends after the leave timeout, naming node 1.
    let port = free_ports(3);
    let args = ["-e", "tiny.json", "--artifact-dir", "silent"];
    let zero = node(dir.path(), 0, 2, port, &args)
        .env("TRANSFORMER_LAB_LEAVE_TIMEOUT", "3")
        .spawn()
        .unwrap();
    let mut one = node(dir.path(), 1, 2, port, &args).spawn().unwrap();
    let checkpoint = dir.path().join("silent-node-1/checkpoint/scheduler-1.mpk");
    let began = std::time::Instant::now();
    while !checkpoint.exists() {
        assert!(began.elapsed().as_secs() < 120, "no checkpoint of epoch 1");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    unsafe { libc::kill(one.id() as i32, libc::SIGSTOP) };
    let stopped = std::time::Instant::now();
    let zero = zero.wait_with_output().unwrap();
    let waited = stopped.elapsed();
    one.kill().unwrap();
    let _ = one.wait();
    assert!(waited.as_secs_f64() < 20.0, "node 0 took {waited:?}");
    assert_clean_error(&zero, "node 1 did not join the all-reduce of step");
    // Both resume as a group and finish where the uninterrupted group ends, to the bit. Node 1
    // loses its newest epoch checkpoint first (as if killed while writing it): the group
    // starts from the newest one both have.
    let dir_of = |name: &str| dir.path().join(name).join("checkpoint");
    let epochs = |dir: &str| -> Vec<usize> {
        let mut epochs: Vec<usize> = std::fs::read_dir(dir_of(dir))
            .unwrap()
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.strip_prefix("scheduler-")?
                    .strip_suffix(".mpk")?
                    .parse()
                    .ok()
            })
            .collect();
        epochs.sort();
        epochs
    };
    let newest = *epochs("cut-node-1").last().unwrap();
    for kind in ["model", "optim", "scheduler"] {
        let _ = std::fs::remove_file(dir_of("cut-node-1").join(format!("{kind}-{newest}.mpk")));
    }
    let start = (newest - 1) * 50;
    // The group resumes; SIGTERM reaches node 1 alone: both stop after the same step, saved.
    let port = free_ports(3);
    let args = ["--artifact-dir", "cut", "--resume"];
    let children: Vec<_> = (0..2)
        .map(|rank| node(dir.path(), rank, 2, port, &args).spawn().unwrap())
        .collect();
    let next = dir_of("cut").join(format!("scheduler-{}.mpk", newest + 1));
    let began = std::time::Instant::now();
    while !next.exists() {
        assert!(
            began.elapsed().as_secs() < 120,
            "no checkpoint of epoch {}",
            newest + 1
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    unsafe { libc::kill(children[1].id() as i32, libc::SIGTERM) };
    let outs: Vec<_> = children
        .into_iter()
        .map(|c| std::thread::spawn(move || c.wait_with_output().unwrap()))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|w| w.join().unwrap())
        .collect();
    let saved: Vec<usize> = outs
        .iter()
        .enumerate()
        .map(|(rank, out)| {
            let log = String::from_utf8_lossy(&out.stdout);
            assert!(
                log.contains(&format!("resuming after step {start}")),
                "{log}"
            );
            assert_eq!(out.status.code(), Some(75), "node {rank}: {}", stderr(out));
            let err = stderr(out);
            err.split("stopped: step ")
                .nth(1)
                .and_then(|rest| rest.split(' ').next())
                .and_then(|step| step.parse().ok())
                .unwrap_or_else(|| panic!("node {rank}: no saved step in {err}"))
        })
        .collect();
    assert_eq!(
        saved[0], saved[1],
        "the nodes stopped after different steps"
    );
    assert!(saved[0] > start && saved[0] < 400, "{saved:?}");
    let outs = nodes(dir.path(), 2, &["--artifact-dir", "cut", "--resume"]);
    for (rank, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "node {rank}: {}", stderr(out));
        let log = String::from_utf8_lossy(&out.stdout);
        assert!(
            log.contains(&format!("resuming after step {}", saved[0])),
            "{log}"
        );
    }
    let whole = nodes(
        dir.path(),
        2,
        &["-e", "tiny.json", "--artifact-dir", "whole"],
    );
    for (rank, out) in whole.iter().enumerate() {
        assert!(out.status.success(), "node {rank}: {}", stderr(out));
    }
    let cut = weights(&dir.path().join("cut"));
    assert_eq!(cut, weights(&dir.path().join("cut-node-1")));
    assert_eq!(
        cut,
        weights(&dir.path().join("whole")),
        "resumed ≠ uninterrupted"
    );
}
