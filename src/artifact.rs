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
use burn::record::{
    FileRecorder, FullPrecisionSettings, NamedMpkFileRecorder, Recorder, RecorderError,
};
use serde::{de::DeserializeOwned, Serialize};
use std::io::Write;
#[cfg(unix)]
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The recorder for weights, optimizer and scheduler state: named MessagePack, full precision,
/// written atomically.
pub type ArtifactRecorder = AtomicRecorder<NamedMpkFileRecorder<FullPrecisionSettings>>;

/// Writes `bytes` to `path` through a temporary file in the same directory, so `path` holds
/// either its old content or the whole new content.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Ordinary file permissions (0644 less the umask), not the temporary file's private 0600.
    let mut builder = tempfile::Builder::new();
    #[cfg(unix)]
    builder.permissions(std::fs::Permissions::from_mode(0o644));
    let mut tmp = builder
        .tempfile_in(dir)
        .with_context(|| format!("cannot write in {}", dir.display()))?;
    tmp.write_all(bytes)
        .and_then(|()| tmp.as_file().sync_all())
        .with_context(|| format!("cannot write {}", path.display()))?;
    tmp.persist(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// What the checkpoint writers share with the training that started them: the first write
/// that failed (training stops and reports it), and the run that `train --force` moved aside,
/// removed once the new run's first checkpoint is complete.
#[derive(Debug, Default)]
pub struct CheckpointWatch {
    failure: Mutex<Option<String>>,
    replaced: Mutex<Option<(ArtifactDir, PathBuf)>>,
    /// Epoch whose checkpoint fails as if the disk were full (`TRANSFORMER_LAB_FAIL_CHECKPOINT`,
    /// for testing what a full disk does to a run).
    fail_epoch: Option<usize>,
}

/// The environment variable that makes epoch N's checkpoint fail with "no space left".
pub const FAIL_CHECKPOINT_ENV: &str = "TRANSFORMER_LAB_FAIL_CHECKPOINT";

impl CheckpointWatch {
    /// A watch for a run; `replaced` is the directory holding the run it replaces, if any.
    pub fn new(replaced: Option<(ArtifactDir, PathBuf)>) -> Self {
        Self {
            failure: Mutex::new(None),
            replaced: Mutex::new(replaced),
            fail_epoch: std::env::var(FAIL_CHECKPOINT_ENV)
                .ok()
                .and_then(|v| v.parse().ok()),
        }
    }

    /// Notes the run that this one replaces, kept in `aside` until a checkpoint is complete.
    pub fn set_replaced(&self, artifact: ArtifactDir, aside: PathBuf) {
        if let Ok(mut replaced) = self.replaced.lock() {
            *replaced = Some((artifact, aside));
        }
    }

    /// The replaced run still waiting for this run's first checkpoint, if any.
    pub fn take_replaced(&self) -> Option<(ArtifactDir, PathBuf)> {
        self.replaced.lock().ok()?.take()
    }

    /// The first checkpoint write that failed: the file and the OS error.
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().ok()?.clone()
    }

    fn fail(&self, message: String) {
        if let Ok(mut failure) = self.failure.lock() {
            failure.get_or_insert(message);
        }
    }

    /// After a checkpoint file was written: once an epoch is complete, the replaced run goes.
    fn written(&self) {
        let Ok(mut replaced) = self.replaced.lock() else {
            return;
        };
        if let Some((artifact, dir)) = replaced.as_ref() {
            if artifact.latest_checkpoint().is_some() && std::fs::remove_dir_all(dir).is_ok() {
                *replaced = None;
            }
        }
    }
}

/// A [`FileRecorder`] that writes through a hidden temporary file, checks every write (burn's
/// recorders drop their buffered writer, so a full disk's last error is lost) and renames the
/// file into place: a file under a name that is read back is complete or absent. With a
/// [`CheckpointWatch`] it reports failures and completed checkpoints to the training.
#[derive(Debug, Default, Clone)]
pub struct AtomicRecorder<R> {
    inner: R,
    watch: Option<Arc<CheckpointWatch>>,
}

impl<R: Default> AtomicRecorder<R> {
    /// A recorder that reports to `watch`.
    pub fn watched(watch: Arc<CheckpointWatch>) -> Self {
        Self {
            inner: R::default(),
            watch: Some(watch),
        }
    }
}

/// The epoch of a checkpoint file name such as `model-12`.
fn checkpoint_epoch(file: &Path) -> Option<usize> {
    let name = file.file_name()?.to_str()?;
    name.rsplit_once('-')?.1.parse().ok()
}

impl<B: LabBackend> Recorder<B> for AtomicRecorder<NamedMpkFileRecorder<FullPrecisionSettings>> {
    type Settings = FullPrecisionSettings;
    type RecordArgs = PathBuf;
    type RecordOutput = ();
    type LoadArgs = PathBuf;

    fn save_item<I: Serialize>(&self, item: I, file: PathBuf) -> Result<(), RecorderError> {
        let target = file.with_extension("mpk");
        let result = (|| -> std::io::Result<()> {
            let bytes = rmp_serde::to_vec_named(&item).map_err(std::io::Error::other)?;
            if let Some(watch) = &self.watch {
                let model = file.file_name().is_some_and(|n| {
                    n.to_str()
                        .is_some_and(|n| n.starts_with("model-") || n == "model")
                });
                if model
                    && watch.fail_epoch.is_some()
                    && watch.fail_epoch == checkpoint_epoch(&file)
                {
                    return Err(std::io::Error::from_raw_os_error(28)); // ENOSPC
                }
            }
            let dir = target.parent().unwrap_or(Path::new("."));
            let name = target
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("record");
            // A leading dot: never taken for a checkpoint; removed on the next start if a kill
            // leaves it behind.
            let prefix = format!(".{name}-partial-");
            let mut builder = tempfile::Builder::new();
            builder.prefix(&prefix);
            #[cfg(unix)]
            builder.permissions(std::fs::Permissions::from_mode(0o644));
            let mut tmp = builder.tempfile_in(dir)?;
            tmp.write_all(&bytes)?;
            tmp.as_file().sync_all()?;
            tmp.persist(&target).map_err(|e| e.error)?;
            Ok(())
        })();
        match result {
            Ok(()) => {
                if let Some(watch) = &self.watch {
                    watch.written();
                }
                Ok(())
            }
            Err(err) => {
                let message = format!("cannot write {}: {err}", target.display());
                if let Some(watch) = &self.watch {
                    watch.fail(message.clone());
                }
                Err(RecorderError::Unknown(message))
            }
        }
    }

    fn load_item<I: DeserializeOwned>(&self, file: &mut PathBuf) -> Result<I, RecorderError> {
        <NamedMpkFileRecorder<FullPrecisionSettings> as Recorder<B>>::load_item(&self.inner, file)
    }
}

impl<B: LabBackend> FileRecorder<B>
    for AtomicRecorder<NamedMpkFileRecorder<FullPrecisionSettings>>
{
    fn file_extension() -> &'static str {
        "mpk"
    }
}

/// What a run writes in its directory (and `train --force` moves aside).
const RUN_FILES: [&str; 10] = [
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

    /// `model.mpk`.
    pub fn model_file(&self) -> PathBuf {
        self.model().with_extension("mpk")
    }

    /// Moves what a previous run wrote (and nothing else the directory may hold) into
    /// [`ArtifactDir::replaced_run`], returning that directory. Renames within one directory:
    /// nothing is copied, nothing is lost if the process dies half-way.
    pub fn move_run_aside(&self) -> Result<PathBuf> {
        let aside = self.replaced_run();
        if aside.exists() {
            std::fs::remove_dir_all(&aside)
                .with_context(|| format!("cannot remove {}", aside.display()))?;
        }
        std::fs::create_dir(&aside)
            .with_context(|| format!("cannot create {}", aside.display()))?;
        for name in RUN_FILES {
            let path = self.root.join(name);
            if path.exists() {
                std::fs::rename(&path, aside.join(name))
                    .with_context(|| format!("cannot move {} aside", path.display()))?;
            }
        }
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
        let scope = if everything { "" } else { "model" };
        let pick = |v: &serde_json::Value| match scope {
            "" => v.clone(),
            key => v.get(key).cloned().unwrap_or_default(),
        };
        if let Some((path, edited, original)) = first_difference(&pick(&now), &pick(&then), scope) {
            bail!(
                "{} was edited after training: {path} is {edited} there but the run was trained \
                 with {original}; put it back (the trained config is {})",
                self.config().display(),
                trained.display()
            );
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
            anyhow!(
                "{} does not hold weights for this model's config ({})",
                path.with_extension("mpk").display(),
                first_line(&format!("{err:?}"))
            )
        })?;
    // burn panics on a record of another structure; catch it without printing its trace.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let loaded =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model.load_record(record)));
    std::panic::set_hook(hook);
    let loaded = loaded.map_err(|_| {
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
