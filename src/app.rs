//! The subcommands, each generic over the backend.

use crate::artifact::ArtifactDir;
use crate::backend::BackendTask;
use crate::cli::{Command, EvalArgs, ExplainArgs, GenerateArgs, TrainArgs};
use crate::config::ExperimentConfig;
use crate::data::data_dir;
use crate::explain;
use crate::generate::{check_prompt, generate, Sampling};
use crate::train::{evaluate, train, TrainRequest, Trained};
use anyhow::{bail, Result};
use burn::backend::Autodiff;
use burn::prelude::Backend;
use std::io::Write;
use std::path::PathBuf;

impl BackendTask for Command {
    fn run<B: Backend>(self, device: B::Device) -> Result<()> {
        match self {
            Command::Train(args) => run_train::<B>(args, device),
            Command::Generate(args) => run_generate::<B>(args, device),
            Command::Eval(args) => run_eval::<B>(args, device),
            Command::Explain(args) => run_explain::<B>(args, device),
        }
    }
}

fn run_train<B: Backend>(args: TrainArgs, device: B::Device) -> Result<()> {
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
    let request = TrainRequest {
        config,
        artifact: ArtifactDir::new(artifact_dir),
        data_dir: data_dir(args.data.data_dir.as_deref()),
        resume: args.resume,
        force: args.force,
        plain: args.plain,
    };
    let artifact = request.artifact.clone();
    let report = train::<Autodiff<B>>(request, device)?;
    println!(
        "trained {} steps in {:.1} s: {:.0} tokens/s (validation and checkpoints included)",
        report.steps, report.seconds, report.tokens_per_second
    );
    println!(
        "model written to {}; sample it with: transformer-lab generate --artifact-dir {}",
        artifact.model().with_extension("mpk").display(),
        artifact.root().display()
    );
    Ok(())
}

fn run_generate<B: Backend>(args: GenerateArgs, device: B::Device) -> Result<()> {
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        greedy: args.greedy,
    };
    sampling.validate()?;
    let trained = Trained::<B>::load(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let prompt_text = match args.prompt {
        Some(text) => text,
        None if trained.tokenizer.encode("\n").is_ok() => "\n".to_string(),
        None => trained.tokenizer.decode(&[0]),
    };
    let prompt = trained.tokenizer.encode(&prompt_text)?;
    check_prompt(
        prompt.len(),
        trained.config.model.context,
        trained.config.model.position,
    )?;
    let mut out = std::io::stdout().lock();
    write!(out, "{prompt_text}")?;
    out.flush()?;
    generate(
        &trained.model,
        &prompt,
        args.max_new_tokens,
        &sampling,
        args.seed,
        &device,
        |token| {
            write!(out, "{}", trained.tokenizer.decode(&[token]))?;
            out.flush()?;
            Ok(())
        },
    )?;
    writeln!(out)?;
    Ok(())
}

fn run_eval<B: Backend>(args: EvalArgs, device: B::Device) -> Result<()> {
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    let trained = Trained::<B>::load(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let data_dir = data_dir(args.data.data_dir.as_deref());
    let (loss, perplexity, tokens) = evaluate(&trained, &data_dir, args.batch_size, &device)?;
    println!(
        "{}: validation loss {loss:.4}, perplexity {perplexity:.3} over {tokens} tokens",
        trained.config.name
    );
    Ok(())
}

fn run_explain<B: Backend>(args: ExplainArgs, device: B::Device) -> Result<()> {
    let x = explain::parse_matrix("X", &args.x)?;
    let wq = explain::parse_matrix("W_Q", &args.wq)?;
    let wk = explain::parse_matrix("W_K", &args.wk)?;
    let wv = explain::parse_matrix("W_V", &args.wv)?;
    let walkthrough = explain::walkthrough::<B>(&x, &wq, &wk, &wv, &device)?;
    print!("{}", explain::render(&walkthrough, &x));
    Ok(())
}
