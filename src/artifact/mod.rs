//! The artifact directory: everything a trained model needs, describing itself.
//!
//! ```text
//! ARTIFACT_DIR/
//!   config.json       the resolved ExperimentConfig (vocab_size filled in)
//!   tokenizer.json    the tokenizer built from the training split (a translator's target
//!                     side, or both sides when the vocabulary is shared)
//!   tokenizer-source.json  a translator's source tokenizer, when vocabularies are separate
//!   model.mpk         the final weights (written when training ends)
//!   checkpoint/       {model,optim,scheduler}-EPOCH.mpk, written during training
//!   train/ valid/     per-epoch metric logs (burn-train)
//! ```
//!
//! Every file is written atomically (temporary file, fsync, rename), so an interrupted run
//! never leaves a half-written file under a name that is read back.

use crate::kernels::LabBackend;
use anyhow::{anyhow, bail, Context, Result};
use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::record::{Recorder, RecorderError};
use std::path::{Path, PathBuf};

pub mod metrics;
mod recorder;
mod trained;

pub use crate::files::write_atomic;
pub use recorder::{ArtifactRecorder, AtomicRecorder, CheckpointWatch, FAIL_CHECKPOINT_ENV};
pub use trained::{Tokenizers, Trained};

/// What a run writes in its directory (and `train --force` moves aside).
const RUN_FILES: [&str; 12] = [
    "config.json",
    ".trained-config.json",
    "tokenizer.json",
    "tokenizer-source.json",
    "model.mpk",
    "experiment.log",
    "checkpoint",
    "train",
    "valid",
    "confusion.png",
    "metrics.csv",
    "curves.png",
];

/// Paths inside an artifact directory.
#[derive(Clone, Debug)]
pub struct ArtifactDir {
    root: PathBuf,
}

impl ArtifactDir {
    /// Wraps a directory path (nothing is read or created).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `config.json`.
    pub fn config(&self) -> PathBuf {
        self.root.join("config.json")
    }

    /// `tokenizer.json`: the tokenizer of a language model, or of a translator's target side
    /// (of both sides when the vocabulary is shared).
    pub fn tokenizer(&self) -> PathBuf {
        self.root.join("tokenizer.json")
    }

    /// `tokenizer-source.json`: a translator's source tokenizer, when vocabularies are separate.
    pub fn source_tokenizer(&self) -> PathBuf {
        self.root.join("tokenizer-source.json")
    }

    /// `model.mpk` (without extension, as recorders take it).
    pub fn model(&self) -> PathBuf {
        self.root.join("model")
    }

    /// `checkpoint/`.
    pub fn checkpoints(&self) -> PathBuf {
        self.root.join("checkpoint")
    }

    /// `.trained-config.json`: config.json as training wrote it. Commands compare the two and
    /// refuse a config.json whose model (or, on resume, anything) was edited since.
    pub fn trained_config(&self) -> PathBuf {
        self.root.join(".trained-config.json")
    }

    /// `.replaced-run/`: the run that `train --force` moved aside, kept until the new run's
    /// first checkpoint is complete.
    pub fn replaced_run(&self) -> PathBuf {
        self.root.join(".replaced-run")
    }

    /// `.replaced-run.partial/`: where the previous run's files go one by one before the whole
    /// is renamed [`ArtifactDir::replaced_run`]; found after a kill, it goes back in full.
    pub fn replacing_run(&self) -> PathBuf {
        self.root.join(".replaced-run.partial")
    }

    /// `checkpoint/valid-loss.json`: each checkpointed epoch's validation loss.
    pub fn valid_losses(&self) -> PathBuf {
        self.checkpoints().join("valid-loss.json")
    }

    /// Whether a previous run left anything here.
    pub fn holds_run(&self) -> bool {
        RUN_FILES.iter().any(|f| {
            let path = self.root.join(f);
            match std::fs::read_dir(&path) {
                Ok(mut entries) => entries.next().is_some(),
                Err(_) => path.exists(),
            }
        })
    }

    /// `metrics.csv`: every logged value of the run (see [`metrics`]).
    pub fn metrics(&self) -> PathBuf {
        self.root.join("metrics.csv")
    }

    /// `curves.png`: the run's loss, learning rate and accuracy against step.
    pub fn curves(&self) -> PathBuf {
        self.root.join("curves.png")
    }

    /// `model.mpk`.
    pub fn model_file(&self) -> PathBuf {
        self.model().with_extension("mpk")
    }

    /// Moves what a previous run wrote (and nothing else the directory may hold) into
    /// [`ArtifactDir::replaced_run`], returning that directory. Renames within one directory:
    /// nothing is copied, nothing is lost if the process dies half-way — the files gather in
    /// [`ArtifactDir::replacing_run`], renamed `replaced_run` only once all are in, so a run
    /// moved aside is always whole (a partial move is put back whole by
    /// [`ArtifactDir::settle_replaced_run`]).
    pub fn move_run_aside(&self) -> Result<PathBuf> {
        let (aside, partial) = (self.replaced_run(), self.replacing_run());
        if aside.exists() || partial.exists() {
            bail!(
                "{} still holds a run moved aside by an earlier `train --force`; run `train \
                 --resume` once to settle it",
                self.root.display()
            );
        }
        std::fs::create_dir(&partial)
            .with_context(|| format!("cannot create {}", partial.display()))?;
        for name in RUN_FILES {
            let path = self.root.join(name);
            if path.exists() {
                std::fs::rename(&path, partial.join(name))
                    .with_context(|| format!("cannot move {} aside", path.display()))?;
            }
        }
        std::fs::rename(&partial, &aside)
            .with_context(|| format!("cannot rename {}", partial.display()))?;
        Ok(aside)
    }

    /// Puts back the run that [`ArtifactDir::move_run_aside`] moved, removing what a newer,
    /// unfinished run wrote in its place.
    pub fn restore_replaced_run(&self) -> Result<()> {
        let aside = self.replaced_run();
        for name in RUN_FILES {
            let path = self.root.join(name);
            if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else if path.exists() {
                std::fs::remove_file(&path)
            } else {
                Ok(())
            }
            .with_context(|| format!("cannot remove {}", path.display()))?;
            let moved = aside.join(name);
            if moved.exists() {
                std::fs::rename(&moved, &path)
                    .with_context(|| format!("cannot restore {}", path.display()))?;
            }
        }
        std::fs::remove_dir_all(&aside)
            .with_context(|| format!("cannot remove {}", aside.display()))
    }

    /// Settles a run that `train --force` moved aside: deleted if the newer run has a complete
    /// checkpoint, an epoch's or a mid-epoch one (only the deletion is left to do), else put
    /// back. Returns whether it was put back.
    pub fn settle_replaced_run(&self) -> Result<bool> {
        let partial = self.replacing_run();
        if partial.exists() {
            // Killed while moving the old run aside: no new run has begun; what was moved goes
            // back beside what was not.
            for name in RUN_FILES {
                let (moved, path) = (partial.join(name), self.root.join(name));
                if moved.exists() && !path.exists() {
                    std::fs::rename(&moved, &path)
                        .with_context(|| format!("cannot restore {}", path.display()))?;
                }
            }
            std::fs::remove_dir(&partial)
                .with_context(|| format!("cannot remove {}", partial.display()))?;
            return Ok(true);
        }
        let aside = self.replaced_run();
        if !aside.exists() {
            return Ok(false);
        }
        if self.latest_checkpoint().is_some() || !self.step_checkpoints().is_empty() {
            std::fs::remove_dir_all(&aside)
                .with_context(|| format!("cannot remove {}", aside.display()))?;
            return Ok(false);
        }
        self.restore_replaced_run()?;
        Ok(true)
    }

    /// Checks that files can be created in the directory and in `checkpoint/` (creating both).
    pub fn check_writable(&self) -> Result<()> {
        for dir in [self.root.clone(), self.checkpoints()] {
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            tempfile::Builder::new()
                .prefix(".write-test-")
                .tempfile_in(&dir)
                .with_context(|| format!("cannot write in {}", dir.display()))?;
        }
        Ok(())
    }

    /// Every epoch whose model, optimizer and scheduler checkpoints are all present, oldest first.
    pub fn complete_checkpoints(&self) -> Vec<usize> {
        let Ok(entries) = std::fs::read_dir(self.checkpoints()) else {
            return Vec::new();
        };
        let names: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        let has = |kind: &str, epoch: usize| names.contains(&format!("{kind}-{epoch}.mpk"));
        let mut epochs: Vec<usize> = names
            .iter()
            .filter_map(|n| n.strip_prefix("model-")?.strip_suffix(".mpk")?.parse().ok())
            .filter(|&e| has("optim", e) && has("scheduler", e))
            .collect();
        epochs.sort_unstable();
        epochs
    }

    /// The newest epoch whose model, optimizer and scheduler checkpoints are all present.
    pub fn latest_checkpoint(&self) -> Option<usize> {
        self.complete_checkpoints().last().copied()
    }

    /// Removes the half-written files (`.NAME-partial-…`) a killed run left in `checkpoint/` and
    /// beside `model.mpk`; returns how many.
    pub fn remove_partial_files(&self) -> usize {
        let mut removed = 0;
        for dir in [self.root.clone(), self.checkpoints()] {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name();
                let name = name.to_string_lossy();
                let partial = name.starts_with('.') && name.contains("-partial-")
                    || name.starts_with(".write-test-")
                    || name.starts_with(".tmp");
                if partial && entry.path().is_file() && std::fs::remove_file(entry.path()).is_ok() {
                    removed += 1;
                }
            }
        }
        removed
    }

    /// Refuses a `config.json` edited since training wrote it: its `model` section (with
    /// `everything`, the whole file — what `--resume` needs) must equal `.trained-config.json`'s.
    /// Artifacts written before that file existed are not checked.
    pub fn check_config_unchanged(&self, everything: bool) -> Result<()> {
        let trained = self.trained_config();
        if !trained.exists() {
            return Ok(());
        }
        let read = |path: &Path| -> Result<serde_json::Value> {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            serde_json::from_str(&text).with_context(|| format!("malformed {}", path.display()))
        };
        let (now, then) = (read(&self.config())?, read(&trained)?);
        let (now, then, scope) = if everything {
            (now, then, "")
        } else {
            (now["model"].clone(), then["model"].clone(), "model")
        };
        if let Some((path, edited, original)) = first_difference(&now, &then, scope) {
            bail!(
                "{} was edited after training: {path} is {edited} there but the run was trained \
                 with {original}; put it back (the trained config is {})",
                self.config().display(),
                trained.display()
            );
        }
        Ok(())
    }

    /// The mid-epoch checkpoint of global step `step`: `checkpoint/step-STEP.json` (where the
    /// run stood), written after its model, optimizer and scheduler files
    /// (`{model,optim,scheduler}-step-STEP.mpk`) were complete.
    pub fn step_marker(&self, step: usize) -> PathBuf {
        self.checkpoints().join(format!("step-{step}.json"))
    }

    /// Every step with a complete mid-epoch checkpoint (its marker and three files), oldest
    /// first.
    pub fn step_checkpoints(&self) -> Vec<usize> {
        let Ok(entries) = std::fs::read_dir(self.checkpoints()) else {
            return Vec::new();
        };
        let names: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        let has = |kind: &str, step: usize| names.contains(&format!("{kind}-step-{step}.mpk"));
        let mut steps: Vec<usize> = names
            .iter()
            .filter_map(|n| n.strip_prefix("step-")?.strip_suffix(".json")?.parse().ok())
            .filter(|&s| has("model", s) && has("optim", s) && has("scheduler", s))
            .collect();
        steps.sort_unstable();
        steps
    }

    /// Deletes the mid-epoch checkpoint of `step`: its marker first, so that what is left of it
    /// is never taken for complete.
    pub fn remove_step_checkpoint(&self, step: usize) -> Result<()> {
        let marker = self.step_marker(step);
        let files = ["model", "optim", "scheduler"]
            .map(|kind| self.checkpoints().join(format!("{kind}-step-{step}.mpk")));
        for path in std::iter::once(marker).chain(files) {
            match std::fs::remove_file(&path) {
                Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                    return Err(err).with_context(|| format!("cannot remove {}", path.display()))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Deletes epoch `epoch`'s three checkpoint files.
    pub fn remove_checkpoint(&self, epoch: usize) -> Result<()> {
        for kind in ["model", "optim", "scheduler"] {
            let path = self.checkpoints().join(format!("{kind}-{epoch}.mpk"));
            match std::fs::remove_file(&path) {
                Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                    return Err(err).with_context(|| format!("cannot remove {}", path.display()))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The weights to use for inference: `model.mpk`, else the newest checkpoint's.
    pub fn weights(&self) -> Result<PathBuf> {
        if self.model_file().exists() {
            return Ok(self.model());
        }
        if let Some(epoch) = self.latest_checkpoint() {
            return Ok(self.checkpoints().join(format!("model-{epoch}")));
        }
        if !self.root.exists() {
            bail!("artifact directory {} does not exist", self.root.display());
        }
        bail!(
            "{} holds no trained model (no model.mpk and no complete checkpoint); train one with \
             `transformer-lab train --artifact-dir {}`",
            self.root.display(),
            self.root.display()
        )
    }
}

/// Fails unless `dir` is free for something new (absent, or an empty directory).
pub fn check_new_artifact_dir(dir: &Path) -> Result<()> {
    match std::fs::read_dir(dir).map(|mut entries| entries.next().is_none()) {
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Ok(true) => Ok(()),
        Ok(false) => bail!(
            "{} already exists and is not empty; give a new directory",
            dir.display()
        ),
        Err(err) => bail!("cannot use {}: {err}", dir.display()),
    }
}

/// Fills the new directory `dir` (absent or empty) with `fill`: into a hidden sibling first,
/// renamed into place once `fill` succeeded, so `dir` never holds half of it.
pub fn write_new_dir(dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    check_new_artifact_dir(dir)?;
    let name = dir
        .file_name()
        .with_context(|| format!("{} names no directory", dir.display()))?;
    let partial = dir.with_file_name(format!(".{}.partial", name.to_string_lossy()));
    if partial.exists() {
        // Ours: left by a write that did not finish.
        std::fs::remove_dir_all(&partial)
            .with_context(|| format!("cannot remove {}", partial.display()))?;
    }
    std::fs::create_dir_all(&partial)
        .with_context(|| format!("cannot create {}", partial.display()))?;
    fill(&partial)?;
    if dir.exists() {
        // Empty (checked above): make way for the rename.
        std::fs::remove_dir(dir).with_context(|| format!("{} is not empty", dir.display()))?;
    }
    std::fs::rename(&partial, dir)
        .with_context(|| format!("cannot move {} to {}", partial.display(), dir.display()))
}

/// Writes a new artifact (`config.json`, the tokenizers, `model.mpk`) to `dir`, which must be
/// absent or empty (see [`write_new_dir`]).
pub fn write_new_artifact<B: LabBackend, M: Module<B>>(
    dir: &Path,
    config: &crate::config::ExperimentConfig,
    tokenizers: Option<&Tokenizers>,
    model: M,
) -> Result<ArtifactDir> {
    write_new_dir(dir, |staged| {
        let staged = ArtifactDir::new(staged);
        config.save(&staged.config())?;
        if let Some(tokenizers) = tokenizers {
            tokenizers.save(&staged)?;
        }
        model
            .save_file(staged.model(), &ArtifactRecorder::default())
            .with_context(|| format!("cannot write {}", staged.model_file().display()))?;
        Ok(())
    })?;
    Ok(ArtifactDir::new(dir))
}

/// Loads weights into `model`, refusing a file written for a model of another shape.
pub fn load_weights<B: LabBackend, M: Module<B>>(
    model: M,
    path: &Path,
    device: &B::Device,
) -> Result<M> {
    let expected = param_shapes(&model);
    let record = ArtifactRecorder::default()
        .load(path.to_path_buf(), device)
        .map_err(|err| {
            let file = path.with_extension("mpk");
            match err {
                RecorderError::FileNotFound(_) => anyhow!("{} does not exist", file.display()),
                // burn's message for a record it cannot decode adds lines about an old format.
                RecorderError::DeserializeError(why) | RecorderError::Unknown(why) => anyhow!(
                    "{} cannot be read: it is damaged, truncated or not a model file ({})",
                    file.display(),
                    first_line(&why)
                ),
            }
        })?;
    // burn panics on a record of another structure.
    let loaded = catch_silently(|| model.load_record(record)).ok_or_else(|| {
        anyhow!(
            "{} was written by a model with another structure",
            path.with_extension("mpk").display()
        )
    })?;
    let found = param_shapes(&loaded);
    if found != expected {
        bail!(
            "{} was written by a model of another shape than config.json describes \
             (parameter shapes differ: expected {} tensors, found {}; first difference {:?} vs {:?})",
            path.with_extension("mpk").display(),
            expected.len(),
            found.len(),
            expected.iter().zip(&found).find(|(a, b)| a != b).map(|(a, _)| a),
            expected.iter().zip(&found).find(|(a, b)| a != b).map(|(_, b)| b),
        );
    }
    Ok(loaded)
}

/// The first place where `a` and `b` differ: its dotted path and both values.
fn first_difference(
    a: &serde_json::Value,
    b: &serde_json::Value,
    path: &str,
) -> Option<(String, String, String)> {
    use serde_json::Value;
    let join = |key: &str| {
        if path.is_empty() {
            key.to_string()
        } else {
            format!("{path}.{key}")
        }
    };
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter().find_map(|key| {
                let missing = Value::String("(absent)".into());
                first_difference(
                    x.get(key).unwrap_or(&missing),
                    y.get(key).unwrap_or(&missing),
                    &join(key),
                )
            })
        }
        _ if a == b => None,
        _ => Some((path.to_string(), a.to_string(), b.to_string())),
    }
}

/// Runs `f`; `None` if it panicked, without printing the panic's message and backtrace: burn
/// panics (rather than erring) on a record whose structure does not match the model.
pub fn catch_silently<T>(f: impl FnOnce() -> T) -> Option<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    result.ok()
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or(text)
}

/// The shape of every float parameter, in visiting order.
pub fn param_shapes<B: LabBackend, M: Module<B>>(model: &M) -> Vec<Vec<usize>> {
    struct Shapes(Vec<Vec<usize>>);
    impl<B: LabBackend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.val().dims().to_vec());
        }
    }
    let mut shapes = Shapes(Vec::new());
    model.visit(&mut shapes);
    shapes.0
}
