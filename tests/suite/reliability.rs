//! A training run is never lost, cut short in silence, or misreported: the real binary under
//! kills, full disks, read-only directories, corrupt and edited files, closed pipes — and the
//! promise that makes resuming trustworthy: same seed, same weights; resumed = uninterrupted.

use crate::common::{assert_clean_error, BIN};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use transformer_lab::artifact::ArtifactDir;

/// The line [`Run`]'s corpus repeats.
const CORPUS_LINE: &str = "the quick brown fox jumps over the lazy dog.\n";

/// A temp dir with a corpus and `tiny.json`: a one-layer char LM with dropout (so resuming
/// must also restore the random stream), 6 epochs of 20 steps.
struct Run {
    dir: tempfile::TempDir,
}

impl Run {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("corpus.txt"), CORPUS_LINE.repeat(60)).unwrap();
        let run = Self { dir };
        run.experiment("tiny.json", 1, "{}");
        run
    }

    /// Writes experiment `name` with `num_workers`, the `"train"` fields of the JSON object
    /// `extra` replacing the defaults.
    fn experiment(&self, name: &str, workers: usize, extra: &str) {
        let mut config: serde_json::Value = serde_json::from_str(&format!(
            r#"{{"name": "tiny", "seed": 5,
               "model": {{"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 16, "dropout": 0.1}},
               "data": {{"text_file": "corpus.txt"}},
               "train": {{"batch_size": 8, "steps": 120, "steps_per_epoch": 20, "eval_batches": 2,
                          "warmup_steps": 5, "lr": 0.01, "num_workers": {workers}}}}}"#
        ))
        .unwrap();
        let extra: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(extra).unwrap();
        config["train"].as_object_mut().unwrap().extend(extra);
        std::fs::write(self.path(name), config.to_string()).unwrap();
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn command(&self, backend: &str, args: &[&str]) -> Command {
        let mut command = Command::new(BIN);
        command
            .args(["--backend", backend])
            .args(args)
            .current_dir(self.dir.path())
            .env("TRANSFORMER_LAB_DATA", self.path("no-data"))
            .env_remove(transformer_lab::artifact::FAIL_CHECKPOINT_ENV);
        command
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command("ndarray", args).output().unwrap()
    }

    /// `train -e tiny.json --artifact-dir ART` and its success.
    fn train(&self, art: &str) -> Output {
        let out = self.run(&["train", "-e", "tiny.json", "--artifact-dir", art]);
        assert_success(&out);
        out
    }

    fn weights(&self, art: &str) -> Vec<Vec<f32>> {
        weights(&self.path(art))
    }
}

fn assert_success(out: &Output) {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn weights(dir: &Path) -> Vec<Vec<f32>> {
    crate::common::lm_weights(dir)
}

/// Fails unless the process ended by SIGKILL (not by finishing before the kill).
fn assert_killed(status: std::process::ExitStatus, epoch: usize) {
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        status.signal(),
        Some(9),
        "the run ended ({status}) before the kill after epoch {epoch}"
    );
}

fn wait_for(path: &Path, child: &mut std::process::Child) {
    let start = Instant::now();
    while !path.exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "training ended before {} appeared",
            path.display()
        );
        assert!(start.elapsed() < Duration::from_secs(120), "timed out");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn same_seed_same_weights_whatever_the_number_of_workers() {
    let run = Run::new();
    run.train("one");
    run.experiment("tiny.json", 2, "{}");
    run.train("two-a");
    run.train("two-b");
    let one = run.weights("one");
    assert_eq!(run.weights("two-a"), run.weights("two-b"));
    assert_eq!(
        one,
        run.weights("two-a"),
        "the batches do not depend on num_workers"
    );
    // model.mpk is what training ended with.
    let first = crate::common::lm_weights_of(&run.path("one"), &run.path("one/checkpoint/model-6"));
    assert_eq!(one, first, "model.mpk is the last epoch's checkpoint");
}

/// Kills `train` as soon as the checkpoint of each epoch in `kills` appears (mid-step of the
/// next epoch, or mid-way through writing the rest of that checkpoint), resumes each time, and
/// compares the end with the uninterrupted run: bit-identical weights. Each kill must land —
/// a run that finished first would leave nothing to resume.
fn killed_and_resumed_equals_uninterrupted(backend: &str, workers: usize, kills: &[usize]) {
    let run = Run::new();
    // On a CPU twelve epochs: after the last kill most of the run is still to come, so the
    // kill cannot miss a run that already finished (a whole run takes about 0.1 s on flex).
    // lavapipe's steps are slow enough for the six of the default.
    let steps = if backend == "wgpu" { 120 } else { 240 };
    run.experiment("tiny.json", workers, &format!(r#"{{"steps": {steps}}}"#));
    let out = run
        .command(
            backend,
            &["train", "-e", "tiny.json", "--artifact-dir", "whole"],
        )
        .output()
        .unwrap();
    assert_success(&out);
    let mut args = vec!["train", "-e", "tiny.json", "--artifact-dir", "cut"];
    for &epoch in kills {
        let mut child = run
            .command(backend, &args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_for(
            &run.path(&format!("cut/checkpoint/scheduler-{epoch}.mpk")),
            &mut child,
        );
        child.kill().unwrap(); // SIGKILL: no chance to clean up
        assert_killed(child.wait().unwrap(), epoch);
        args = vec!["train", "--artifact-dir", "cut", "--resume"];
    }
    let out = run.command(backend, &args).output().unwrap();
    assert_success(&out);
    assert!(
        stdout(&out).contains("resuming after step"),
        "{}",
        stdout(&out)
    );
    assert_eq!(
        run.weights("cut"),
        run.weights("whole"),
        "{backend}, {workers} worker(s): the resumed run's weights differ"
    );
    let table = |art: &str| std::fs::read_to_string(run.path(art).join("metrics.csv")).unwrap();
    assert_eq!(
        table("cut"),
        table("whole"),
        "{backend}, {workers} worker(s): the resumed run's metrics.csv differs"
    );
}

#[test]
fn a_run_killed_and_resumed_equals_the_uninterrupted_run_on_ndarray() {
    killed_and_resumed_equals_uninterrupted("ndarray", 1, &[1, 3, 4]);
}

#[cfg(feature = "flex")]
#[test]
fn a_run_killed_and_resumed_equals_the_uninterrupted_run_on_flex_with_two_workers() {
    killed_and_resumed_equals_uninterrupted("flex", 2, &[1, 3, 4]);
}

/// The last training step whose rows `metrics.csv` in `art` holds (0 before the first); the
/// table is flushed at every step.
fn logged_step(art: &Path) -> usize {
    let text = std::fs::read_to_string(art.join("metrics.csv")).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(',').collect();
            match fields.as_slice() {
                [step, _, "train", "lr", value] if value.parse::<f64>().is_ok() => {
                    step.parse().ok()
                }
                _ => None,
            }
        })
        .max()
        .unwrap_or(0)
}

/// Waits until `child`'s `metrics.csv` in `art` reaches step `step` (the child still running).
fn wait_for_step(art: &Path, step: usize, child: &mut std::process::Child) {
    let start = Instant::now();
    while logged_step(art) < step {
        assert!(
            child.try_wait().unwrap().is_none(),
            "training ended before step {step}"
        );
        assert!(start.elapsed() < Duration::from_secs(120), "timed out");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn send(child: &std::process::Child, signal: i32) {
    // SAFETY: kill(2) on the pid of a child not yet waited for.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
}

fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The step that a stopped run's last line says is saved.
fn saved_step(out: &Output) -> usize {
    let err = stderr_of(out);
    let line = err
        .lines()
        .find(|l| l.starts_with("stopped: step "))
        .unwrap_or_else(|| panic!("no `stopped:` line in {err}"));
    line["stopped: step ".len()..]
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no step in {line}"))
}

/// Stops `train` with each of `signals` in turn, once `metrics.csv` shows a step drawn at random
/// (seeded) from the next 60, checks the stop (status 75, one line naming the saved step, a
/// checkpoint of that step, within a bound), resumes each time, and compares the end with the
/// uninterrupted run: bit-identical weights and `metrics.csv`. With `kill_at`, the first run is
/// killed (SIGKILL) as epoch `kill_at`'s checkpoint appears, before the signals.
fn stopped_and_resumed_equals_uninterrupted(
    backend: &str,
    workers: usize,
    seed: u64,
    kill_at: Option<usize>,
    signals: &[i32],
) {
    stopped_and_resumed_equals_uninterrupted_with(backend, workers, seed, kill_at, signals, "")
}

/// [`stopped_and_resumed_equals_uninterrupted`] with more `"train"` fields (`extra`: JSON
/// object members) in both runs.
fn stopped_and_resumed_equals_uninterrupted_with(
    backend: &str,
    workers: usize,
    seed: u64,
    kill_at: Option<usize>,
    signals: &[i32],
    extra: &str,
) {
    use rand::{RngExt, SeedableRng};
    let run = Run::new();
    // lavapipe's steps are slow: six epochs there, twelve on a CPU.
    let steps = if backend == "wgpu" { 120 } else { 240 };
    let extra = if extra.is_empty() {
        String::new()
    } else {
        format!(", {extra}")
    };
    run.experiment(
        "tiny.json",
        workers,
        &format!(r#"{{"steps": {steps}{extra}}}"#),
    );
    let whole = run
        .command(
            backend,
            &["train", "-e", "tiny.json", "--artifact-dir", "whole"],
        )
        .output()
        .unwrap();
    assert_success(&whole);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut args = vec!["train", "-e", "tiny.json", "--artifact-dir", "cut"];
    let cut = run.path("cut");
    let mut saved = 0;
    if let Some(epoch) = kill_at {
        let mut child = run
            .command(backend, &args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_for(
            &cut.join(format!("checkpoint/scheduler-{epoch}.mpk")),
            &mut child,
        );
        child.kill().unwrap();
        assert_killed(child.wait().unwrap(), epoch);
        // The killed run's rows past its checkpoint stay until the next run rewrites the table:
        // the next target lies beyond them.
        saved = logged_step(&cut);
        args = vec!["train", "--artifact-dir", "cut", "--resume"];
    }
    for &signal in signals {
        let target = rng.random_range(saved + 1..(saved + 60).min(steps));
        let mut child = run
            .command(backend, &args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for_step(&cut, target, &mut child);
        let sent = Instant::now();
        send(&child, signal);
        let out = child.wait_with_output().unwrap();
        let took = sent.elapsed();
        assert_eq!(
            out.status.code(),
            Some(75),
            "signal {signal} at step {target}: {}",
            stderr_of(&out)
        );
        let step = saved_step(&out);
        assert!(
            (target..steps).contains(&step),
            "signal {signal} sent at step {target}, step {step} saved"
        );
        assert!(took < Duration::from_secs(20), "the stop took {took:?}");
        let checkpoint = cut.join("checkpoint");
        assert!(
            checkpoint.join(format!("step-{step}.json")).exists()
                || step.is_multiple_of(20)
                    && checkpoint
                        .join(format!("scheduler-{}.mpk", step / 20))
                        .exists(),
            "no checkpoint of step {step}"
        );
        assert!(
            stderr_of(&out).contains("--artifact-dir cut --resume"),
            "the line names the command that continues: {}",
            stderr_of(&out)
        );
        saved = step;
        args = vec!["train", "--artifact-dir", "cut", "--resume"];
    }
    let out = run.command(backend, &args).output().unwrap();
    assert_success(&out);
    assert!(
        stdout(&out).contains(&format!("resuming after step {saved}")),
        "{}",
        stdout(&out)
    );
    assert_eq!(
        run.weights("cut"),
        run.weights("whole"),
        "{backend}: the resumed run's weights differ"
    );
    assert_same_table(&run, "cut", "whole");
    let left: Vec<String> = std::fs::read_dir(cut.join("checkpoint"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.contains("step-"))
        .collect();
    assert!(left.is_empty(), "mid-epoch checkpoints left: {left:?}");
}

#[test]
fn sigterm_and_sigint_at_random_steps_then_resume_equal_the_uninterrupted_run_on_ndarray() {
    stopped_and_resumed_equals_uninterrupted(
        "ndarray",
        1,
        1,
        None,
        &[libc::SIGTERM, libc::SIGINT, libc::SIGTERM],
    );
    stopped_and_resumed_equals_uninterrupted("ndarray", 1, 2, None, &[libc::SIGINT, libc::SIGTERM]);
}

#[cfg(feature = "flex")]
#[test]
fn sigterm_and_sigint_at_random_steps_then_resume_equal_the_uninterrupted_run_on_flex() {
    stopped_and_resumed_equals_uninterrupted("flex", 2, 3, None, &[libc::SIGTERM, libc::SIGINT]);
}

/// Data-parallel on two devices (two peers on the CPU backend), dropout on: a kill at an
/// epoch's checkpoint and a SIGTERM mid-epoch, each resumed, end where the uninterrupted
/// two-device run ends, to the bit (every peer's share and dropout masks depend only on the
/// seed, the epoch and the batch).
#[test]
fn a_data_parallel_run_killed_and_stopped_then_resumed_equals_the_uninterrupted_run() {
    stopped_and_resumed_equals_uninterrupted_with(
        "ndarray",
        1,
        6,
        Some(2),
        &[libc::SIGTERM],
        r#""devices": [0, 1]"#,
    );
}

/// Three batches a step (gradient accumulation), on two devices: a kill at an epoch's
/// checkpoint, then a SIGTERM and a SIGINT mid-epoch, each resumed, end where the uninterrupted
/// run ends, to the bit (a stop waits for the step's last batch, and a resumed epoch skips three
/// batches for each step done).
#[test]
fn accumulated_steps_killed_and_stopped_then_resumed_equal_the_uninterrupted_run() {
    stopped_and_resumed_equals_uninterrupted_with(
        "ndarray",
        1,
        8,
        Some(2),
        &[libc::SIGTERM, libc::SIGINT],
        r#""devices": [0, 1], "grad_accumulation": 3"#,
    );
}

/// On the GPU backend as well: with burn's fusion, the checkpoint threads read tensors the
/// training thread made, and a resumed run's weights are restored on those threads. One kill
/// and one SIGTERM in one run: each process start compiles the kernels again on lavapipe (half
/// a minute).
#[cfg(feature = "wgpu-backend")]
#[test]
fn a_run_killed_then_stopped_by_sigterm_and_resumed_equals_the_uninterrupted_run_on_wgpu() {
    if crate::wgpu_backend::wgpu_runs() {
        stopped_and_resumed_equals_uninterrupted("wgpu", 1, 4, Some(2), &[libc::SIGTERM]);
    }
}

/// Fails at the first line where `metrics.csv` of `a` and `b` differ.
fn assert_same_table(run: &Run, a: &str, b: &str) {
    let table = |art: &str| std::fs::read_to_string(run.path(art).join("metrics.csv")).unwrap();
    let (ta, tb) = (table(a), table(b));
    let (la, lb): (Vec<&str>, Vec<&str>) = (ta.lines().collect(), tb.lines().collect());
    for (i, (x, y)) in la.iter().zip(&lb).enumerate() {
        assert_eq!(x, y, "metrics.csv of {a} and {b} differ at line {}", i + 1);
    }
    assert_eq!(
        la.len(),
        lb.len(),
        "metrics.csv of {a} and {b}: line counts"
    );
}

/// When [`stopped_in_the_dashboard`] types its keys.
#[derive(Clone, Copy, PartialEq)]
enum Typed {
    /// Once `metrics.csv` reaches step 30, the dashboard is up, and two more steps began.
    AfterStep30,
    /// As soon as the dashboard is up, which must be before the first step ends.
    InTheFirstStep,
}

/// Runs `train -e experiment` with a terminal (a pseudo-terminal of its own, so burn's
/// dashboard is shown), types `keys` when `typed` says, and returns its exit code and the line
/// the terminal showed that says where it stopped.
fn stopped_in_the_dashboard(
    run: &Run,
    experiment: &str,
    art: &str,
    keys: &[&[u8]],
    typed: Typed,
) -> (Option<i32>, String) {
    use std::io::{Read, Write};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::process::CommandExt;
    let (mut master, mut slave) = (0, 0);
    let size = libc::winsize {
        ws_row: 40,
        ws_col: 120,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty fills two descriptors that we then own.
    let opened = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &size,
        )
    };
    assert_eq!(opened, 0, "no pseudo-terminal");
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let mut command = run.command(
        "ndarray",
        &["train", "-e", experiment, "--artifact-dir", art],
    );
    command
        .env("TERM", "xterm")
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave.try_clone().unwrap()))
        .stderr(Stdio::from(slave.try_clone().unwrap()));
    let terminal = slave.as_raw_fd();
    // SAFETY: only async-signal-safe calls between fork and exec: a new session whose
    // controlling terminal is the pseudo-terminal (Ctrl-C there signals the session).
    unsafe {
        command.pre_exec(move || {
            libc::setsid();
            libc::ioctl(terminal, libc::TIOCSCTTY, 0);
            Ok(())
        });
    }
    let mut child = command.spawn().unwrap();
    // The terminal ends (the reader sees EIO) once no process holds its other side.
    drop(command);
    drop(slave);
    let mut reader = std::fs::File::from(master.try_clone().unwrap());
    let shown = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let reading = {
        let shown = shown.clone();
        std::thread::spawn(move || {
            let mut buffer = [0u8; 4096];
            // Ends with EIO once the child and its terminal are gone.
            while let Ok(n) = reader.read(&mut buffer) {
                if n == 0 {
                    break;
                }
                shown.lock().unwrap().extend_from_slice(&buffer[..n]);
            }
        })
    };
    let text = |shown: &std::sync::Mutex<Vec<u8>>| {
        String::from_utf8_lossy(&shown.lock().unwrap()).into_owned()
    };
    if typed == Typed::AfterStep30 {
        wait_for_step(&run.path(art), 30, &mut child);
    }
    // The dashboard's thread starts on its own time (late on a busy machine): keys typed before
    // its raw mode is on would be read by a terminal in another mode than the one a user types
    // into. So: a frame drawn (its raw mode came first), then, after step 30, two steps begun
    // after it.
    let start = Instant::now();
    while !text(&shown).contains("Stop the training.") {
        assert!(child.try_wait().unwrap().is_none(), "{art}: training ended");
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{art}: no dashboard drawn in 60 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let drawn = logged_step(&run.path(art));
    match typed {
        Typed::AfterStep30 => wait_for_step(&run.path(art), drawn + 2, &mut child),
        Typed::InTheFirstStep => assert_eq!(
            drawn, 0,
            "{art}: the first step ended before the dashboard was up: it must last longer"
        ),
    }
    // The run turns the signal keys back on within 5 ms of the dashboard's raw mode (a
    // watching thread's period); a person's first key comes later than a program's.
    std::thread::sleep(Duration::from_millis(100));
    let mut writer = std::fs::File::from(master);
    for key in keys {
        writer.write_all(key).unwrap();
        std::thread::sleep(Duration::from_millis(400));
    }
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            let all = text(&shown);
            let tail: String = all
                .chars()
                .skip(all.chars().count().saturating_sub(3000))
                .collect();
            panic!(
                "{art}: the dashboard did not stop in 60 s; the terminal's last output: {tail:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    drop(writer);
    reading.join().unwrap();
    let code = status.code();
    let line = text(&shown)
        .lines()
        .find(|l| l.contains("stopped: step "))
        .unwrap_or_else(|| panic!("{art}: exit {code:?}, no `stopped:` line"))
        .to_string();
    (code, line)
}

/// In burn's dashboard Ctrl-C (which its raw terminal mode turns into a key) and `q` then `s`
/// (its "stop the training") stop the run as SIGTERM does: status 75, the saved step named, a
/// complete checkpoint of that step.
#[test]
fn the_dashboard_stops_on_ctrl_c_and_on_q_with_the_step_saved() {
    let run = Run::new();
    run.experiment(
        "tiny.json",
        1,
        r#"{"steps": 2400, "steps_per_epoch": 1200}"#,
    );
    for (art, keys) in [
        ("ctrl-c", vec![&b"\x03"[..]]),
        ("q", vec![&b"q"[..], &b"s"[..]]),
    ] {
        let (code, line) =
            stopped_in_the_dashboard(&run, "tiny.json", art, &keys, Typed::AfterStep30);
        assert_eq!(code, Some(75), "{art}: {line}");
        let markers = step_markers(&run.path(art));
        assert_eq!(markers.len(), 1, "{art}: {markers:?}");
        assert!(
            markers[0] >= 30 && line.contains(&format!("stopped: step {} of 2400", markers[0])),
            "{art}: {line}, checkpoints {markers:?}"
        );
    }
}

/// The marker steps of the mid-epoch checkpoints in `art`.
fn step_markers(art: &Path) -> Vec<usize> {
    let mut steps: Vec<usize> = std::fs::read_dir(art.join("checkpoint"))
        .map(|entries| {
            entries
                .filter_map(|e| {
                    let name = e.ok()?.file_name().into_string().ok()?;
                    name.strip_prefix("step-")?
                        .strip_suffix(".json")?
                        .parse()
                        .ok()
                })
                .collect()
        })
        .unwrap_or_default();
    steps.sort_unstable();
    steps
}

/// A second SIGTERM while the first one's checkpoint is being written (held open between its
/// records and its marker) exits at once with 128 + 15; the half-written checkpoint is not
/// taken for one, and `--resume` continues from the epoch checkpoint before it, to the end of
/// the uninterrupted run.
#[test]
fn a_second_sigterm_during_the_save_exits_at_once_and_the_run_still_resumes() {
    let run = Run::new();
    run.experiment("tiny.json", 1, r#"{"steps": 360, "steps_per_epoch": 120}"#);
    run.train("whole");
    let cut = run.path("cut");
    let mut child = run
        .command(
            "ndarray",
            &["train", "-e", "tiny.json", "--artifact-dir", "cut"],
        )
        .env(transformer_lab::train::PAUSE_STEP_SAVE_ENV, "60000")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_step(&cut, 130, &mut child);
    send(&child, libc::SIGTERM);
    let start = Instant::now();
    let written = |dir: &Path| {
        std::fs::read_dir(dir.join("checkpoint"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .any(|n| n.starts_with("scheduler-step-"))
    };
    while !written(&cut) {
        assert!(start.elapsed() < Duration::from_secs(60), "no save began");
        std::thread::sleep(Duration::from_millis(1));
    }
    send(&child, libc::SIGTERM);
    let out = child.wait_with_output().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "the second signal did not exit at once"
    );
    assert_eq!(out.status.code(), Some(128 + 15), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("asked to stop a second time, exiting now"),
        "{}",
        stderr_of(&out)
    );
    assert!(
        step_markers(&cut).is_empty(),
        "an unfinished checkpoint has its marker"
    );
    let out = run.run(&["train", "--artifact-dir", "cut", "--resume"]);
    assert_success(&out);
    assert!(
        stdout(&out).contains("resuming after step 120"),
        "{}",
        stdout(&out)
    );
    assert_eq!(run.weights("cut"), run.weights("whole"));
    assert_same_table(&run, "cut", "whole");
}

/// `checkpoint_every` writes a mid-epoch checkpoint at every multiple of its steps, keeps only
/// the newest, and one taken by a `kill -9` resumes to the uninterrupted run; a finished run
/// keeps none. A period of 0 is refused in one line.
#[test]
fn checkpoint_every_writes_what_it_says_and_a_kill_resumes_from_it() {
    let run = Run::new();
    let every = r#"{"steps": 240, "steps_per_epoch": 120, "checkpoint_every": {"steps": 25}}"#;
    run.experiment("tiny.json", 1, every);
    run.train("whole");
    assert!(
        step_markers(&run.path("whole")).is_empty(),
        "a finished run keeps none"
    );
    let cut = run.path("cut");
    let mut child = run
        .command(
            "ndarray",
            &["train", "-e", "tiny.json", "--artifact-dir", "cut"],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !step_markers(&cut).iter().any(|&s| s >= 150) {
        assert!(child.try_wait().unwrap().is_none(), "training ended first");
        assert!(start.elapsed() < Duration::from_secs(120), "timed out");
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    assert_killed(child.wait().unwrap(), 1);
    // The newest, and the one before it only if the kill came between the newest's marker
    // and the removal of the older one.
    let markers = step_markers(&cut);
    assert!(
        !markers.is_empty()
            && markers.len() <= 2
            && markers
                .iter()
                .all(|&s| s % 25 == 0 && s > 120 && s % 120 != 0),
        "mid-epoch checkpoints after the kill: {markers:?}"
    );
    let newest = markers[markers.len() - 1];
    let out = run.run(&["train", "--artifact-dir", "cut", "--resume"]);
    assert_success(&out);
    assert!(
        stdout(&out).contains(&format!("resuming after step {newest}")),
        "{}",
        stdout(&out)
    );
    assert_eq!(run.weights("cut"), run.weights("whole"));
    assert_same_table(&run, "cut", "whole");

    run.experiment("zero.json", 1, r#"{"checkpoint_every": {"minutes": 0}}"#);
    let out = run.run(&["train", "-e", "zero.json", "--artifact-dir", "zero"]);
    assert_clean_error(&out, "checkpoint_every.minutes must be above 0");
}

/// `checkpoint_every` in minutes counts the time since the last checkpoint: a period shorter
/// than a step checkpoints after every step (a kill loses at most the step in flight), one
/// longer than the run never mid-epoch (a kill goes back to the epoch's checkpoint); both
/// resume to the uninterrupted run.
#[test]
fn checkpoint_every_minutes_counts_the_time_since_the_last_checkpoint() {
    let run = Run::new();
    let shape = r#""steps": 240, "steps_per_epoch": 120"#;
    run.experiment("tiny.json", 1, &format!("{{{shape}}}"));
    run.train("whole");
    for (name, minutes) in [("often", "1e-7"), ("rare", "1000")] {
        let every = format!(r#"{{{shape}, "checkpoint_every": {{"minutes": {minutes}}}}}"#);
        run.experiment(&format!("{name}.json"), 1, &every);
        let art = run.path(name);
        let mut child = run
            .command(
                "ndarray",
                &[
                    "train",
                    "-e",
                    &format!("{name}.json"),
                    "--artifact-dir",
                    name,
                ],
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_for_step(&art, 150, &mut child);
        child.kill().unwrap();
        assert_killed(child.wait().unwrap(), 1);
        let (logged, markers) = (logged_step(&art), step_markers(&art));
        let resumed_after = match name {
            "often" => {
                // The step whose rows are logged may not have its checkpoint yet; the one
                // before it has (the newest, with its predecessor if the kill came between).
                let newest = *markers.last().expect("a mid-epoch checkpoint");
                assert!(
                    newest + 1 >= logged && markers.len() <= 2,
                    "killed after step {logged}, mid-epoch checkpoints {markers:?}"
                );
                Some(newest)
            }
            _ => {
                assert!(markers.is_empty(), "none in 1000 minutes: {markers:?}");
                None
            }
        };
        let out = run.run(&["train", "--artifact-dir", name, "--resume"]);
        assert_success(&out);
        let resumed = stdout(&out)
            .split("resuming after step ")
            .nth(1)
            .and_then(|rest| {
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()?
                    .parse()
                    .ok()
            });
        match resumed_after {
            Some(step) => assert_eq!(resumed, Some(step), "{name}: {}", stdout(&out)),
            // The epoch's checkpoint, or the start if the kill came before it was complete
            // (it is written beside the steps that follow it).
            None => assert!(
                matches!(resumed, None | Some(120)),
                "{name}: {}",
                stdout(&out)
            ),
        }
        assert_eq!(run.weights(name), run.weights("whole"), "{name}");
        assert_same_table(&run, name, "whole");
    }
}

#[test]
fn a_checkpoint_that_cannot_be_written_stops_the_run_with_one_line() {
    let run = Run::new();
    run.train("whole");
    let out = run
        .command(
            "ndarray",
            &["train", "-e", "tiny.json", "--artifact-dir", "full"],
        )
        .env(transformer_lab::artifact::FAIL_CHECKPOINT_ENV, "3")
        .output()
        .unwrap();
    assert_clean_error(&out, "full/checkpoint/model-3.mpk");
    assert_clean_error(&out, "No space left on device");
    assert!(!stdout(&out).contains("model written"), "{}", stdout(&out));
    let art = ArtifactDir::new(run.path("full"));
    assert!(
        !art.model_file().exists(),
        "an unfinished run wrote model.mpk"
    );
    assert_eq!(art.latest_checkpoint(), Some(2), "epoch 2 stays complete");
    let leftovers: Vec<_> = std::fs::read_dir(art.checkpoints())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.contains("partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    // Space freed: the run continues and ends where the uninterrupted one did.
    assert_success(&run.run(&["train", "--artifact-dir", "full", "--resume"]));
    assert_eq!(run.weights("full"), run.weights("whole"));
}

#[cfg(unix)]
#[test]
fn a_read_only_checkpoint_directory_is_one_clear_error() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let run = Run::new();
    let mode = |path: &Path, mode: u32| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    mode(run.dir.path(), 0o755);
    std::fs::create_dir_all(run.path("ro/checkpoint")).unwrap();
    mode(&run.path("ro"), 0o777);
    mode(&run.path("ro/checkpoint"), 0o555);
    let mut command = run.command(
        "ndarray",
        &["train", "-e", "tiny.json", "--artifact-dir", "ro"],
    );
    // Root writes anywhere: run as nobody, for whom 0555 is read-only.
    if unsafe { libc::geteuid() } == 0 {
        command.uid(65534).gid(65534);
    }
    let out = command.output().unwrap();
    assert_clean_error(&out, "ro/checkpoint");
    assert_clean_error(&out, "Permission denied");
    assert!(!run.path("ro/model.mpk").exists());
}

#[test]
fn force_keeps_the_old_run_until_the_new_one_has_a_checkpoint() {
    const FORCE: [&str; 6] = [
        "train",
        "-e",
        "tiny.json",
        "--artifact-dir",
        "art",
        "--force",
    ];
    let run = Run::new();
    run.train("art");
    let before = run.weights("art");
    let config = std::fs::read_to_string(run.path("art/config.json")).unwrap();
    // Fails before training: a missing text file.
    std::fs::write(
        run.path("bad.json"),
        std::fs::read_to_string(run.path("tiny.json"))
            .unwrap()
            .replace("corpus.txt", "missing.txt"),
    )
    .unwrap();
    let out = run.run(&[
        "train",
        "-e",
        "bad.json",
        "--artifact-dir",
        "art",
        "--force",
    ]);
    assert_clean_error(&out, "missing.txt");
    // Fails in training, before its first checkpoint: the old run comes back.
    let out = run
        .command("ndarray", &FORCE)
        .env(transformer_lab::artifact::FAIL_CHECKPOINT_ENV, "1")
        .output()
        .unwrap();
    assert_clean_error(&out, "model-1.mpk");
    // Killed right after moving the old run aside: the next start puts it back.
    let mut child = run
        .command("ndarray", &FORCE)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(&run.path("art/.replaced-run"), &mut child);
    child.kill().unwrap();
    child.wait().unwrap();
    let out = run.run(&["train", "--artifact-dir", "art", "--resume"]);
    assert!(
        stdout(&out).contains("put back"),
        "{}{}",
        stdout(&out),
        stderr_of(&out)
    );
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(
        stdout(&out).contains("already finished"),
        "{}",
        stdout(&out)
    );
    assert_eq!(run.weights("art"), before, "the old run survived");
    assert_eq!(
        std::fs::read_to_string(run.path("art/config.json")).unwrap(),
        config
    );
    // Killed half-way through moving the old run aside (some files moved, the checkpoints not
    // yet): it goes back whole, not mistaken for a new run with a checkpoint.
    let partial = run.path("art/.replaced-run.partial");
    std::fs::create_dir(&partial).unwrap();
    for name in ["model.mpk", "config.json"] {
        std::fs::rename(run.path("art").join(name), partial.join(name)).unwrap();
    }
    let out = run.run(&["train", "--artifact-dir", "art", "--resume"]);
    assert!(stdout(&out).contains("put back"), "{}", stdout(&out));
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(
        stdout(&out).contains("already finished"),
        "{}",
        stdout(&out)
    );
    assert!(!partial.exists());
    assert_eq!(
        run.weights("art"),
        before,
        "the old run survived a partial move"
    );
    // Stopped by SIGTERM before its first epoch checkpoint: the step it saved is the new run's
    // first checkpoint, so the old run goes and `--resume` continues the new one.
    let mut child = run
        .command("ndarray", &FORCE)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once the old run (its metrics.csv too) is aside, the table read is the new run's.
    wait_for(&run.path("art/.replaced-run"), &mut child);
    wait_for_step(&run.path("art"), 3, &mut child);
    send(&child, libc::SIGTERM);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(75), "{}", stderr_of(&out));
    let step = saved_step(&out);
    assert!(
        step < 20,
        "saved step {step}: not before the first epoch checkpoint"
    );
    assert_eq!(step_markers(&run.path("art")), [step]);
    assert!(
        !run.path("art/.replaced-run").exists(),
        "the old run is still kept"
    );
    let out = run.run(&["train", "--artifact-dir", "art", "--resume"]);
    assert_success(&out);
    assert!(stdout(&out).contains(&format!("resuming after step {step}")));
    // A --force that works replaces it, and nothing of the old run is left.
    assert_success(&run.run(&FORCE));
    assert!(!run.path("art/.replaced-run").exists());
}

#[test]
fn an_edited_config_is_refused_in_one_line() {
    let run = Run::new();
    run.train("art");
    let edit = |from: &str, to: &str| {
        let path = run.path("art/config.json");
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replace(from, to)).unwrap();
        text
    };
    std::fs::remove_file(run.path("art/model.mpk")).unwrap();
    let original = edit("\"d_model\": 16", "\"d_model\": 32");
    assert_clean_error(
        &run.run(&["train", "--artifact-dir", "art", "--resume"]),
        "model.d_model is 32 there but the run was trained with 16",
    );
    std::fs::write(run.path("art/config.json"), &original).unwrap();
    assert_success(&run.run(&["train", "--artifact-dir", "art", "--resume"]));
    // n_heads keeps every shape: only the trained config can tell.
    edit("\"n_heads\": 2", "\"n_heads\": 4");
    assert_clean_error(
        &run.run(&["generate", "--artifact-dir", "art", "--max-new-tokens", "3"]),
        "model.n_heads",
    );
    // An artifact from before .trained-config.json: the weights' shapes still refuse, cleanly.
    std::fs::write(run.path("art/config.json"), &original).unwrap();
    std::fs::remove_file(run.path("art/.trained-config.json")).unwrap();
    edit("\"n_layers\": 1", "\"n_layers\": 2");
    assert_clean_error(
        &run.run(&["eval", "--artifact-dir", "art"]),
        "another structure",
    );
    // The right config and a truncated model file: said so, not blamed on the config.
    std::fs::write(run.path("art/config.json"), &original).unwrap();
    let model = std::fs::read(run.path("art/model.mpk")).unwrap();
    std::fs::write(run.path("art/model.mpk"), &model[..model.len() / 2]).unwrap();
    assert_clean_error(
        &run.run(&["eval", "--artifact-dir", "art"]),
        "model.mpk cannot be read: it is damaged, truncated or not a model file",
    );
}

#[test]
fn resume_skips_checkpoints_that_cannot_be_loaded() {
    let run = Run::new();
    run.train("whole");
    let resume = |art: &str| run.run(&["train", "--artifact-dir", art, "--resume"]);
    let copy = |name: &str| {
        let out = Command::new("cp")
            .args(["-r", "whole", name])
            .current_dir(run.dir.path())
            .output()
            .unwrap();
        assert_success(&out);
        std::fs::remove_file(run.path(&format!("{name}/model.mpk"))).unwrap();
    };
    // A truncated newest model: back to epoch 5, and the end is the same.
    copy("cut");
    let model = run.path("cut/checkpoint/model-6.mpk");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let out = resume("cut");
    assert_success(&out);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("skipped the checkpoint of epoch 6"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        stdout(&out).contains("resuming after step 100"),
        "{}",
        stdout(&out)
    );
    assert_eq!(run.weights("cut"), run.weights("whole"));
    // Garbage optimizer state and an empty scheduler file: none loads, one line says why.
    copy("bad");
    std::fs::write(run.path("bad/checkpoint/optim-6.mpk"), b"garbage").unwrap();
    std::fs::write(run.path("bad/checkpoint/scheduler-5.mpk"), b"").unwrap();
    assert_clean_error(&resume("bad"), "none of the 2 checkpoints");
}

#[test]
fn resume_after_the_last_checkpoint_writes_the_model() {
    let run = Run::new();
    run.train("art");
    let trained = run.weights("art");
    std::fs::remove_file(run.path("art/model.mpk")).unwrap();
    // A resumed run keeps its precision; half precision needs a GPU backend. Neither touches
    // the run.
    assert_clean_error(
        &run.run(&[
            "train",
            "--artifact-dir",
            "art",
            "--resume",
            "--precision",
            "f16",
        ]),
        "was trained with precision f32",
    );
    assert_clean_error(
        &run.run(&[
            "train",
            "-e",
            "tiny.json",
            "--artifact-dir",
            "half",
            "--precision",
            "bf16",
        ]),
        "precision bf16 is not supported by this backend",
    );
    assert!(!run.path("half").exists());
    let out = run.run(&["train", "--artifact-dir", "art", "--resume"]);
    assert_success(&out);
    assert!(stdout(&out).contains("already trained"), "{}", stdout(&out));
    assert_eq!(run.weights("art"), trained);
}

#[test]
fn checkpoints_keep_the_last_k_and_the_best_and_early_stopping_ends_a_run() {
    let run = Run::new();
    let out = run.train("art");
    let log = stdout(&out);
    assert!(
        log.contains("model.mpk holds the weights of step 120 (checkpoint epoch 6)"),
        "{log}"
    );
    let art = ArtifactDir::new(run.path("art"));
    assert_eq!(art.complete_checkpoints(), vec![5, 6], "{log}");
    // A lr so high that the loss gets worse: the best epoch is kept beside the last one, and
    // patience 1 stops the run.
    run.experiment(
        "tiny.json",
        1,
        r#"{"lr": 1.0, "min_lr": 1.0, "grad_clip": 0.0, "keep_checkpoints": 1, "early_stopping": {"patience": 1}}"#,
    );
    let out = run.train("early");
    let log = stdout(&out);
    let art = ArtifactDir::new(run.path("early"));
    let losses: std::collections::BTreeMap<usize, f64> =
        serde_json::from_str(&std::fs::read_to_string(art.valid_losses()).unwrap()).unwrap();
    let last = *losses.keys().last().unwrap();
    let best = losses
        .iter()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .map(|(e, _)| *e)
        .unwrap();
    assert!(last < 6 && last == best + 1, "{losses:?}\n{log}");
    assert!(log.contains("stopped early"), "{log}");
    assert_eq!(art.complete_checkpoints(), vec![best, last]);
    assert!(art.model_file().exists());
}

#[test]
fn a_closed_stdout_never_stops_the_work() {
    use std::io::{BufRead, BufReader};
    let run = Run::new();
    let mut child = run
        .command(
            "ndarray",
            &[
                "train",
                "-e",
                "tiny.json",
                "--artifact-dir",
                "art",
                "--plain",
            ],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    // The reader is gone (like `| head -1`): every later line meets a closed pipe.
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{status}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(run.path("art/model.mpk").exists());
    for args in [
        vec!["eval", "--artifact-dir", "art"],
        vec![
            "generate",
            "--artifact-dir",
            "art",
            "--max-new-tokens",
            "200",
        ],
    ] {
        let mut child = run
            .command("ndarray", &args)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        assert!(child.wait().unwrap().success(), "{args:?}");
    }
}

#[test]
fn empty_experiments_and_impossible_batches_are_refused() {
    let run = Run::new();
    for (text, expected) in [("{}", "an empty object"), ("[]", "a JSON array")] {
        std::fs::write(run.path("e.json"), text).unwrap();
        assert_clean_error(
            &run.run(&["train", "-e", "e.json", "--artifact-dir", "e"]),
            expected,
        );
    }
    run.experiment("huge.json", 1, r#"{"batch_size": 1000000000}"#);
    assert_clean_error(
        &run.run(&["train", "-e", "huge.json", "--artifact-dir", "huge"]),
        "lower batch_size",
    );
    assert!(
        !run.path("huge").exists(),
        "nothing written for a refused run"
    );
}

/// Ctrl-C pressed inside the dashboard during a long first step (a large model, a GPU's first
/// compilation) stops the run after that step, with the step saved. The dashboard turns raw
/// mode on from its own thread whenever that thread starts, often after the first step began,
/// so turning the signal keys back on once a step is not enough.
#[test]
fn ctrl_c_in_the_dashboard_during_a_long_first_step_stops_after_it() {
    let run = Run::new();
    // Batches of 4096 windows: steps of a second or more in a debug build. A Ctrl-C lost
    // leaves the run to its end, status 0.
    std::fs::write(run.path("corpus.txt"), CORPUS_LINE.repeat(4000)).unwrap();
    run.experiment(
        "slow.json",
        1,
        r#"{"batch_size": 4096, "steps": 20, "steps_per_epoch": 10}"#,
    );
    let (code, line) =
        stopped_in_the_dashboard(&run, "slow.json", "slow", &[b"\x03"], Typed::InTheFirstStep);
    assert_eq!(code, Some(75), "{line}");
    assert!(line.contains("stopped: step 1 of 20"), "{line}");
    assert_eq!(step_markers(&run.path("slow")), [1]);
}
