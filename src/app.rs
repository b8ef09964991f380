//! The subcommands, each generic over the backend.

use crate::artifact::ArtifactDir;
use crate::backend::BackendTask;
use crate::bleu::corpus_bleu;
use crate::cli::{
    Command, EvalArgs, ExplainArgs, GenerateArgs, SearchArgs, TrainArgs, TranslateArgs,
};
use crate::config::{ExperimentConfig, ModelConfig};
use crate::data::{data_dir, TranslationCorpus};
use crate::explain;
use crate::generate::{check_prompt, generate, Sampling};
use crate::train::{evaluate, train, TrainRequest, Trained, TrainedTranslator};
use crate::translate::{translate_texts, SearchConfig, Truncated};
use anyhow::{bail, Context, Result};
use burn::backend::Autodiff;
use burn::prelude::Backend;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Instant;

impl BackendTask for Command {
    fn run<B: Backend>(self, device: B::Device) -> Result<()> {
        match self {
            Command::Train(args) => run_train::<B>(args, device),
            Command::Generate(args) => run_generate::<B>(args, device),
            Command::Eval(args) => run_eval::<B>(args, device),
            Command::Translate(args) => run_translate::<B>(args, device),
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
        "trained {} steps in {:.1} s: {:.0} {}/s (validation and checkpoints included)",
        report.steps, report.seconds, report.per_second, report.unit
    );
    println!(
        "model written to {}; use it with: transformer-lab {} --artifact-dir {}",
        artifact.model().with_extension("mpk").display(),
        report.use_with,
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
    let lm = trained.config.lm()?;
    check_prompt(prompt.len(), lm.context, lm.position)?;
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
    let artifact = ArtifactDir::new(&args.artifact_dir);
    if artifact.config().exists() {
        let config = ExperimentConfig::load(&artifact.config())?;
        if let ModelConfig::Seq2seq(_) = config.model {
            return run_eval_translation::<B>(args, device);
        }
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

/// A translator's SearchConfig from the command line, `max_len` defaulting to the model's.
fn search_config<B: Backend>(
    args: &SearchArgs,
    translator: &TrainedTranslator<B>,
) -> Result<SearchConfig> {
    let search = SearchConfig {
        beam_size: args.beam,
        length_penalty: args.length_penalty,
        max_len: args.max_len.unwrap_or(translator.model.max_len() - 1),
    };
    search.validate()?;
    Ok(search)
}

fn warn_truncated(truncated: &[Truncated], max_tokens: usize) {
    for cut in truncated {
        eprintln!(
            "warning: input {} has {} tokens; translated its first {} (the model's maximum is {max_tokens} with </s>)",
            cut.index + 1,
            cut.tokens,
            max_tokens - 1
        );
    }
}

fn run_translate<B: Backend>(args: TranslateArgs, device: B::Device) -> Result<()> {
    let translator = TrainedTranslator::<B>::load(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let search = search_config(&args.search, &translator)?;
    let texts = if args.texts.is_empty() {
        std::io::stdin()
            .lock()
            .lines()
            .collect::<std::io::Result<Vec<String>>>()
            .context("cannot read stdin as UTF-8 text")?
    } else {
        args.texts
    };
    let max_tokens = translator.config.data.max_tokens;
    let (translations, truncated) = translate_texts(
        &translator.model,
        &translator.tokenizers,
        &texts,
        &search,
        args.batch_size,
        max_tokens,
        &device,
    )?;
    warn_truncated(&truncated, max_tokens);
    let mut out = std::io::stdout().lock();
    for line in translations {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

fn run_eval_translation<B: Backend>(args: EvalArgs, device: B::Device) -> Result<()> {
    let translator = TrainedTranslator::<B>::load(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let search = search_config(&args.search, &translator)?;
    let config = &translator.config;
    let data_dir = data_dir(args.data.data_dir.as_deref());
    let mut test = TranslationCorpus::load(&config.data, &data_dir, config.seed)?.test;
    test.truncate(args.limit.unwrap_or(usize::MAX));
    let sources: Vec<String> = test.iter().map(|item| item.source.clone()).collect();
    let began = Instant::now();
    let (translations, truncated) = translate_texts(
        &translator.model,
        &translator.tokenizers,
        &sources,
        &search,
        args.batch_size,
        config.data.max_tokens,
        &device,
    )?;
    let seconds = began.elapsed().as_secs_f64();
    warn_truncated(&truncated, config.data.max_tokens);
    let references: Vec<Vec<String>> = test.iter().map(|item| item.references.clone()).collect();
    let bleu = corpus_bleu(&translations, &references);
    println!(
        "{}: {} on {} test sentences of {}, beam {}, length penalty {}; decoded in {seconds:.1} s",
        config.name,
        bleu,
        test.len(),
        if config.data.dataset == crate::data::translation::COPY_TASK {
            "the copy task".to_string()
        } else {
            format!(
                "{} ({} → {})",
                config.data.dataset, config.data.source, config.data.target
            )
        },
        search.beam_size,
        search.length_penalty
    );
    for ((item, hyp), _) in test.iter().zip(&translations).zip(0..3) {
        println!(
            "  src: {}
  ref: {}
  hyp: {}",
            item.source, item.references[0], hyp
        );
    }
    if let Some(path) = &args.output {
        let mut text = String::new();
        for (item, hyp) in test.iter().zip(&translations) {
            text.push_str(&format!(
                "{}\t{}\t{}\n",
                item.source,
                item.references.join(" ||| "),
                hyp
            ));
        }
        crate::artifact::write_atomic(path, text.as_bytes())?;
    }
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
