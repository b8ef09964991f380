//! `import` and `export`: checkpoints of other programs in and out (Hugging Face GPT-2; BERT
//! in).

use crate::artifact::ArtifactDir;
use crate::cli::{CheckpointFormat, ExportArgs, ImportArgs};
use crate::config::LmConfig;
use crate::kernels::LabBackend;
use anyhow::{bail, Result};

pub(super) fn run_import<B: LabBackend>(args: ImportArgs, device: B::Device) -> Result<()> {
    let (artifact, name, use_with) = match args.format {
        CheckpointFormat::Gpt2 => (
            crate::gpt2::import::<B>(&args.dir, &args.artifact_dir, &device)?,
            "GPT-2",
            "generate",
        ),
        CheckpointFormat::Bert => (
            crate::bert::import::<B>(&args.dir, &args.artifact_dir, &device)?,
            "BERT",
            "fill-mask",
        ),
    };
    println!(
        "{name} checkpoint {} imported to {}; use it with: transformer-lab {use_with} --artifact-dir {}",
        args.dir.display(),
        artifact.root().display(),
        artifact.root().display()
    );
    Ok(())
}

pub(super) fn run_export<B: LabBackend>(args: ExportArgs, device: B::Device) -> Result<()> {
    if args.format == CheckpointFormat::Bert {
        bail!("export writes GPT-2 checkpoints only; BERT is import only");
    }
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
