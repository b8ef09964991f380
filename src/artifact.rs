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
use std::path::{Path, PathBuf};

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
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644));
    let mut tmp = builder
        .tempfile_in(dir)
        .with_context(|| format!("cannot write in {}", dir.display()))?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// A [`FileRecorder`] that writes through a hidden temporary file and renames it into place.
///
/// burn's file recorders truncate the target and write into it; a run killed mid-write would
/// leave a corrupt checkpoint under the name `--resume` reads. This wrapper makes a checkpoint
/// file either complete or absent.
#[derive(Debug, Default, Clone)]
pub struct AtomicRecorder<R>(R);

impl<B: LabBackend, R: FileRecorder<B>> Recorder<B> for AtomicRecorder<R> {
    type Settings = R::Settings;
    type RecordArgs = PathBuf;
    type RecordOutput = ();
    type LoadArgs = PathBuf;

    fn save_item<I: Serialize>(&self, item: I, file: PathBuf) -> Result<(), RecorderError> {
        let target = file.with_extension(R::file_extension());
        let name = file
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("record");
        // A leading dot and no other dot: the inner recorder appends its extension.
        let partial = file.with_file_name(format!(".{name}-partial-{}", std::process::id()));
        let written = partial.with_extension(R::file_extension());
        self.0.save_item(item, partial)?;
        let io =
            |err: std::io::Error| RecorderError::Unknown(format!("{}: {err}", target.display()));
        std::fs::File::open(&written)
            .and_then(|f| f.sync_all())
            .map_err(io)?;
        std::fs::rename(&written, &target).map_err(io)
    }

    fn load_item<I: DeserializeOwned>(&self, file: &mut PathBuf) -> Result<I, RecorderError> {
        self.0.load_item(file)
    }
}

impl<B: LabBackend, R: FileRecorder<B>> FileRecorder<B> for AtomicRecorder<R> {
    fn file_extension() -> &'static str {
        R::file_extension()
    }
}

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

    /// Whether a previous run left anything here.
    pub fn holds_run(&self) -> bool {
        self.config().exists() || self.checkpoints().exists() || self.model_file().exists()
    }

    fn model_file(&self) -> PathBuf {
        self.model().with_extension("mpk")
    }

    /// Removes what a previous run wrote (and nothing else the directory may hold).
    pub fn clear(&self) -> Result<()> {
        for file in [
            "config.json",
            "tokenizer.json",
            "tokenizer-source.json",
            "model.mpk",
            "experiment.log",
        ] {
            let path = self.root.join(file);
            if path.exists() {
                std::fs::remove_file(&path)
                    .with_context(|| format!("cannot remove {}", path.display()))?;
            }
        }
        for dir in ["checkpoint", "train", "valid"] {
            let path = self.root.join(dir);
            if path.exists() {
                std::fs::remove_dir_all(&path)
                    .with_context(|| format!("cannot remove {}", path.display()))?;
            }
        }
        Ok(())
    }

    /// The newest epoch whose model, optimizer and scheduler checkpoints are all complete.
    pub fn latest_checkpoint(&self) -> Option<usize> {
        let entries = std::fs::read_dir(self.checkpoints()).ok()?;
        let names: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        let has = |kind: &str, epoch: usize| names.contains(&format!("{kind}-{epoch}.mpk"));
        names
            .iter()
            .filter_map(|n| n.strip_prefix("model-")?.strip_suffix(".mpk")?.parse().ok())
            .filter(|&e| has("optim", e) && has("scheduler", e))
            .max()
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
    let loaded =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model.load_record(record)))
            .map_err(|_| {
                anyhow!(
                    "{} was written by a model with another structure",
                    path.display()
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
