//! `train`: run or resume an experiment and say how it ended.

use crate::artifact::ArtifactDir;
use crate::cli::TrainArgs;
use crate::config::ExperimentConfig;
use crate::data::data_dir;
use crate::kernels::LabBackend;
use crate::train::parallel::NodeGroup;
use crate::train::stop::Stopped;
use crate::train::{AlreadyFinished, Outcome, TrainRequest};
use anyhow::Result;
use burn::backend::Autodiff;
use std::path::PathBuf;

pub(super) fn run_train<B: LabBackend>(args: TrainArgs, device: B::Device) -> Result<()> {
    let config = args
        .experiment
        .as_deref()
        .map(ExperimentConfig::load)
        .transpose()?;
    let artifact_dir = match (&args.artifact_dir, &config) {
        (Some(dir), _) => dir.clone(),
        (None, Some(config)) => PathBuf::from("artifacts").join(&config.name),
        (None, None) => PathBuf::from("artifacts/shakespeare-char"),
    };
    let nodes = match (args.nodes, args.node_rank, &args.coordinator) {
        (Some(count), Some(rank), Some(coordinator)) => {
            Some(NodeGroup::new(count, rank, coordinator)?)
        }
        _ => None,
    };
    // Node 0 writes the artifact; the others keep their copy of the run beside it.
    let artifact_dir = match &nodes {
        Some(group) if group.rank > 0 => {
            let mut own = artifact_dir.clone().into_os_string();
            own.push(format!("-node-{}", group.rank));
            let own = PathBuf::from(own);
            println!(
                "node {} of {}: node 0 writes {}; this node keeps its copy of the run in {}",
                group.rank,
                group.count,
                artifact_dir.display(),
                own.display()
            );
            own
        }
        _ => artifact_dir,
    };
    let request = TrainRequest {
        config,
        artifact: ArtifactDir::new(artifact_dir),
        data_dir: data_dir(args.data.data_dir.as_deref()),
        resume: args.resume,
        force: args.force,
        plain: args.plain,
        precision: args.precision,
        lr: args.lr,
        devices: args.devices,
        nodes,
    };
    let artifact = request.artifact.clone();
    crate::train::stop::install()?;
    let report = match crate::kinds::train::<Autodiff<B>>(request, device) {
        Err(err) if err.is::<AlreadyFinished>() => {
            println!("{err}");
            return Ok(());
        }
        result => result?,
    };
    let step = |epoch: usize| epoch * report.steps_per_epoch;
    let dir = artifact.root().display();
    if let Some(failure) = &report.metrics_failure {
        eprintln!("warning: {failure}; the table stops there");
    }
    let config = ExperimentConfig::load(&artifact.config())?;
    match crate::curves::write_run_curves(&artifact, &config) {
        Ok(path) => println!("training curves drawn in {}", path.display()),
        Err(err) => eprintln!("warning: no curves.png: {err:#}"),
    }
    if report.outcome == Outcome::Interrupted {
        let saved = report.saved_step.unwrap_or(step(report.epoch));
        return Err(Stopped(format!(
            "stopped: step {saved} of {} is saved in {}; continue with: transformer-lab train \
             --artifact-dir {dir} --resume",
            step(report.epochs),
            artifact.checkpoints().display()
        ))
        .into());
    }
    if report.steps > 0 {
        println!(
            "trained {} steps in {:.1} s: {:.0} {}/s (validation and checkpoints included)",
            report.steps, report.seconds, report.per_second, report.unit
        );
    }
    let how = match report.outcome {
        Outcome::StoppedEarly => format!(
            "stopped early at step {} of {} (no better validation loss for {} checks)",
            step(report.epoch),
            step(report.epochs),
            report
                .best
                .map_or(0, |(best, _)| report.epoch.saturating_sub(best))
        ),
        Outcome::WrittenFromCheckpoint => format!(
            "all {} steps were already trained; model.mpk written from the last checkpoint",
            step(report.epochs)
        ),
        _ => match step(report.epochs) {
            1 => "the 1 step trained".to_string(),
            steps => format!("all {steps} steps trained"),
        },
    };
    let loss = report
        .valid_loss
        .map(|l| format!(", validation loss {l:.4} over {}", report.valid_over))
        .unwrap_or_default();
    let best = match report.best {
        Some((epoch, best)) if epoch != report.epoch => format!(
            "; best validation loss {best:.4} at step {} (kept in checkpoint/model-{epoch}.mpk)",
            step(epoch)
        ),
        _ => String::new(),
    };
    println!(
        "{how}: model.mpk holds the weights of step {} (checkpoint epoch {}){loss}{best}",
        step(report.epoch),
        report.epoch
    );
    println!(
        "model written to {}; use it with: transformer-lab {} --artifact-dir {dir}",
        artifact.model_file().display(),
        report.use_with,
    );
    Ok(())
}
