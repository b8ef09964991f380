//! `import` and `export`: checkpoints of other programs in and out (Hugging Face GPT-2).

use crate::artifact::ArtifactDir;
use crate::cli::{CheckpointFormat, ExportArgs, ImportArgs};
use crate::config::LmConfig;
use crate::kernels::LabBackend;
use anyhow::Result;

pub(super) fn run_import<B: LabBackend>(args: ImportArgs, device: B::Device) -> Result<()> {
    let CheckpointFormat::Gpt2 = args.format;
    let artifact = crate::gpt2::import::<B>(&args.dir, &args.artifact_dir, &device)?;
    println!(
        "GPT-2 checkpoint {} imported to {}; use it with: transformer-lab generate --artifact-dir {}",
        args.dir.display(),
        artifact.root().display(),
        artifact.root().display()
    );
    Ok(())
}

pub(super) fn run_export<B: LabBackend>(args: ExportArgs, device: B::Device) -> Result<()> {
    let CheckpointFormat::Gpt2 = args.format;
    let artifact = ArtifactDir::new(&args.artifact_dir);
    let trained = crate::kinds::load_as::<LmConfig, B>(&artifact, &device)?;
    crate::gpt2::export(
        &trained.model,
        &trained.config,
        trained.tokenizer(),
        &args.to,
    )?;
    println!(
        "{} exported to {} as a Hugging Face GPT-2 checkpoint (GPT2LMHeadModel.from_pretrained)",
        args.artifact_dir.display(),
        args.to.display()
    );
    Ok(())
}
