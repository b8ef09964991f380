//! Writing an artifact's files: whole or not at all (temporary name, every write checked,
//! fsync, rename), and the checkpoint writer that tells the training what failed.

use super::ArtifactDir;
use crate::files::write_whole;
use crate::kernels::LabBackend;
use anyhow::Result;
use burn::record::{
    FileRecorder, FullPrecisionSettings, NamedMpkFileRecorder, Recorder, RecorderError,
};
use serde::{de::DeserializeOwned, Serialize};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The recorder for weights, optimizer and scheduler state: named MessagePack, full precision,
/// written atomically.
pub type ArtifactRecorder = AtomicRecorder<NamedMpkFileRecorder<FullPrecisionSettings>>;

/// What the checkpoint writers share with the training that started them: the first write
/// that failed (training stops and reports it), the run that `train --force` moved aside,
/// removed once the new run's first checkpoint is complete, and the records whose tensors the
/// checkpoint thread is still reading (see [`Self::wait_for_reads`]).
#[derive(Debug)]
pub struct CheckpointWatch {
    failure: Mutex<Option<String>>,
    replaced: Mutex<Option<(ArtifactDir, PathBuf)>>,
    reads: Mutex<usize>,
    read: Condvar,
    /// Epoch whose checkpoint fails as if the disk were full (`TRANSFORMER_LAB_FAIL_CHECKPOINT`,
    /// for testing what a full disk does to a run).
    fail_epoch: Option<usize>,
}

impl Default for CheckpointWatch {
    fn default() -> Self {
        Self::new()
    }
}

/// How long the training waits for a checkpoint's records to be read (see
/// [`CheckpointWatch::wait_for_reads`]); reading a model and its optimizer state takes seconds.
const READ_WAIT: Duration = Duration::from_secs(300);

/// The environment variable that makes epoch N's checkpoint fail with "no space left".
pub const FAIL_CHECKPOINT_ENV: &str = "TRANSFORMER_LAB_FAIL_CHECKPOINT";

impl CheckpointWatch {
    /// A watch for a run.
    pub fn new() -> Self {
        Self {
            failure: Mutex::new(None),
            replaced: Mutex::new(None),
            reads: Mutex::new(0),
            read: Condvar::new(),
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

    /// Notes `records` records handed to the checkpoint thread, each read (its tensors brought
    /// to the host) before the recorder writes it.
    pub fn reading(&self, records: usize) {
        *self.reads.lock().unwrap_or_else(|e| e.into_inner()) += records;
    }

    /// Called by the recorder once a record's tensors are on the host.
    fn record_read(&self) {
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        *reads = reads.saturating_sub(1);
        self.read.notify_all();
    }

    /// Waits until the checkpoint thread has read every record handed to it. The training
    /// thread calls it before its next tensor operation: burn 0.21's fusion loses tensor handles
    /// when one thread reads tensors while another runs operations on them (burn issue #4347,
    /// measured here as "Should have handle for tensor" when a checkpoint read the optimizer
    /// state during the next step), so the device work of the two threads never overlaps. The
    /// writing itself (serializing, disk) still overlaps the training. Gives up after
    /// `READ_WAIT`, should the checkpoint thread have died.
    pub fn wait_for_reads(&self) {
        let began = Instant::now();
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        while *reads > 0 {
            let Some(left) = READ_WAIT.checked_sub(began.elapsed()) else {
                return;
            };
            reads = match self.read.wait_timeout(reads, left) {
                Ok((reads, _)) => reads,
                Err(poisoned) => poisoned.into_inner().0,
            };
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
        // `Recorder::record` made `item` from the record: its tensors are read.
        if let Some(watch) = &self.watch {
            watch.record_read();
        }
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
            write_whole(&target, &bytes)?;
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
