//! What is checked before a training touches anything: the artifact directory against the
//! request (resume, force, an edited config), a run an interrupted `--force` left aside, and
//! whether a batch can fit in memory.

use super::{Tokenizers, TrainRequest};
use crate::artifact::ArtifactDir;
use crate::config::ExperimentConfig;
use anyhow::{bail, Result};

/// `train --resume` of a run that already finished: nothing to do, which is not a failure (a
/// job re-run after its run completed succeeds); the message says so.
#[derive(Debug)]
pub struct AlreadyFinished(pub String);

impl std::fmt::Display for AlreadyFinished {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for AlreadyFinished {}

/// A run that `train --force` moved aside and that a kill left there: deleted if the new run
/// reached a complete checkpoint (only the deletion was interrupted), else put back.
pub(super) fn recover_replaced_run(artifact: &ArtifactDir) -> Result<()> {
    if artifact.settle_replaced_run()? {
        println!(
            "put back the run in {} that an interrupted `train --force` had moved aside",
            artifact.root().display()
        );
    }
    Ok(())
}

/// Checks the artifact directory against the request and returns the config to train and the
/// tokenizers to reuse. Nothing is written or removed here.
pub(super) fn prepare_artifact(
    request: &TrainRequest,
) -> Result<(ExperimentConfig, Option<Tokenizers>)> {
    let artifact = &request.artifact;
    if request.resume {
        if !artifact.config().exists() {
            bail!(
                "--resume: {} holds no run to resume (no config.json)",
                artifact.root().display()
            );
        }
        artifact.check_config_unchanged(true)?;
        let saved = ExperimentConfig::load(&artifact.config())?;
        if let Some(asked) = &request.config {
            let mut asked = asked.clone();
            let (source, target) = saved.model.vocab_sizes();
            asked.model.set_vocab_sizes(source, target);
            // Where it runs is not what it trains: a run may resume on other devices.
            asked.train.devices.clone_from(&saved.train.devices);
            if asked != saved {
                bail!(
                    "--resume: the experiment given differs from the one {} was trained with; \
                     resume without --experiment, or start a new run elsewhere",
                    artifact.root().display()
                );
            }
        }
        if let Some(precision) = request.precision {
            if precision != saved.train.precision {
                bail!(
                    "--resume: {} was trained with precision {}; a resumed run keeps it \
                     (drop --precision {})",
                    artifact.root().display(),
                    saved.train.precision.name(),
                    precision.name()
                );
            }
        }
        if artifact.model_file().exists() {
            return Err(AlreadyFinished(format!(
                "{} already finished: {} holds its trained weights, nothing to resume (--force \
                 starts over)",
                artifact.root().display(),
                artifact.model_file().display()
            ))
            .into());
        }
        let tokenizers = if saved.model.reads_text() {
            Some(Tokenizers::open(artifact, &saved)?)
        } else {
            None
        };
        let mut saved = saved;
        set_lr(&mut saved, request.lr)?;
        let asked_devices = request.config.as_ref().map(|c| c.train.devices.clone());
        set_devices(
            &mut saved,
            request
                .devices
                .as_ref()
                .or(asked_devices.flatten().as_ref()),
        )?;
        return Ok((saved, tokenizers));
    }
    if artifact.holds_run() && !request.force {
        bail!(
            "{} already holds a run; pass --resume to continue it or --force to replace it",
            artifact.root().display()
        );
    }
    let mut config = match &request.config {
        Some(config) => config.clone(),
        None => ExperimentConfig::parse(crate::config::DEFAULT_EXPERIMENT)
            .expect("the default experiment parses (tested)"),
    };
    if let Some(precision) = request.precision {
        config.train.precision = precision;
    }
    set_lr(&mut config, request.lr)?;
    set_devices(&mut config, request.devices.as_ref())?;
    config.validate()?;
    Ok((config, None))
}

/// `--devices`: the devices replaced for this invocation (one device: the plain path).
fn set_devices(config: &mut ExperimentConfig, devices: Option<&Vec<usize>>) -> Result<()> {
    if let Some(devices) = devices {
        config.train.devices = Some(devices.clone());
    }
    config.train.validate()
}

/// `--lr`: the peak learning rate replaced, `min_lr` scaled with it (the schedule's shape kept).
fn set_lr(config: &mut ExperimentConfig, lr: Option<f64>) -> Result<()> {
    let Some(lr) = lr else { return Ok(()) };
    if !(lr.is_finite() && lr > 0.0) {
        bail!("--lr {lr}: the learning rate must be a positive number");
    }
    let train = &mut config.train;
    train.min_lr *= lr / train.lr;
    train.lr = lr;
    Ok(())
}

/// Refuses a batch whose activations alone would not fit in this machine's free memory (a
/// lower bound: the step needs more than this). `per_example` is the floats one example keeps
/// (the model kind's estimate).
pub(super) fn check_memory(config: &ExperimentConfig, per_example: f64) -> Result<()> {
    let Some(available) = crate::memory::available_memory() else {
        return Ok(());
    };
    let bytes = 4.0 * per_example * config.train.batch_size as f64;
    if bytes > available as f64 {
        bail!(
            "train: batch_size {} needs at least {} of memory for one batch's activations; this \
             machine has {} available: lower batch_size, and raise grad_accumulation to keep \
             the items a step learns from ({} now)",
            config.train.batch_size,
            human_bytes(bytes),
            human_bytes(available as f64),
            config.train.batch_size * config.train.grad_accumulation
        );
    }
    Ok(())
}

fn human_bytes(bytes: f64) -> String {
    let units = ["B", "KB", "MB", "GB", "TB", "PB", "EB"];
    let power = (bytes.max(1.0).log10() / 3.0).floor().min(6.0) as i32;
    format!(
        "{:.1} {}",
        bytes / 1e3f64.powi(power),
        units[power as usize]
    )
}
