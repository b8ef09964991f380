//! The subcommands, each generic over the backend.

use crate::artifact::ArtifactDir;
use crate::backend::BackendTask;
use crate::bleu::corpus_bleu;
use crate::classify::{
    class_names, evaluate_classifier, evaluate_vit, image_probabilities, load_image,
    text_probabilities, top_classes, Confusion,
};
use crate::cli::{
    AttentionArgs, BenchArgs, BenchCommand, BenchKernelsArgs, BenchMixersArgs, ClassifyArgs,
    Command, EmbedArgs, EvalArgs, ExplainArgs, GenerateArgs, PredictArgs, SearchArgs, TrainArgs,
    TranslateArgs,
};
use crate::config::{ExperimentConfig, ModelConfig};
use crate::data::{data_dir, TranslationCorpus};
use crate::embed::{cosine, TextEncoder};
use crate::explain;
use crate::generate::{check_prompt, generate, Sampling};
use crate::kernels::LabBackend;
use crate::train::{
    evaluate, train, Outcome, TrainRequest, Trained, TrainedClassifier, TrainedTranslator,
    TrainedVit,
};
use crate::translate::{translate_texts, SearchConfig, Truncated};
use anyhow::{anyhow, bail, Context, Result};
use burn::backend::Autodiff;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Instant;

impl BackendTask for Command {
    fn run<B: LabBackend>(self, device: B::Device) -> Result<()> {
        match self {
            Command::Train(args) => run_train::<B>(args, device),
            Command::Generate(args) => run_generate::<B>(args, device),
            Command::Eval(args) => run_eval::<B>(args, device),
            Command::Translate(args) => run_translate::<B>(args, device),
            Command::Predict(args) => run_predict::<B>(args, device),
            Command::Classify(args) => run_classify::<B>(args, device),
            Command::Embed(args) => run_embed::<B>(args, device),
            Command::Bench(args) => run_bench::<B>(args, device),
            Command::Attention(args) => run_attention::<B>(args, device),
            Command::Explain(args) => run_explain::<B>(args, device),
        }
    }
}

fn run_train<B: LabBackend>(args: TrainArgs, device: B::Device) -> Result<()> {
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
    let step = |epoch: usize| epoch * report.steps_per_epoch;
    let dir = artifact.root().display();
    if report.outcome == Outcome::Interrupted {
        println!(
            "stopped after step {} of {}; model.mpk not written. Continue with: \
             transformer-lab train --artifact-dir {dir} --resume",
            step(report.epoch),
            step(report.epochs)
        );
        return Ok(());
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
        _ => format!("all {} steps trained", step(report.epochs)),
    };
    let loss = report
        .valid_loss
        .map(|l| format!(", validation loss {l:.4}"))
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

fn run_generate<B: LabBackend>(args: GenerateArgs, device: B::Device) -> Result<()> {
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

fn run_eval<B: LabBackend>(args: EvalArgs, device: B::Device) -> Result<()> {
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    let artifact = ArtifactDir::new(&args.artifact_dir);
    if artifact.config().exists() {
        let config = ExperimentConfig::load(&artifact.config())?;
        match config.model {
            ModelConfig::Seq2seq(_) => return run_eval_translation::<B>(args, device),
            ModelConfig::Vit(_) | ModelConfig::Classifier(_) => {
                return run_eval_classifier::<B>(args, &config, device)
            }
            ModelConfig::Lm(_) => {}
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
fn search_config<B: LabBackend>(
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

fn run_translate<B: LabBackend>(args: TranslateArgs, device: B::Device) -> Result<()> {
    let translator = TrainedTranslator::<B>::load(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let search = search_config(&args.search, &translator)?;
    let texts = texts_or_stdin(args.texts)?;
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

fn run_eval_translation<B: LabBackend>(args: EvalArgs, device: B::Device) -> Result<()> {
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

fn run_eval_classifier<B: LabBackend>(
    args: EvalArgs,
    config: &ExperimentConfig,
    device: B::Device,
) -> Result<()> {
    let artifact = ArtifactDir::new(&args.artifact_dir);
    let data_dir = data_dir(args.data.data_dir.as_deref());
    let began = Instant::now();
    let (confusion, what): (Confusion, &str) = match config.model {
        ModelConfig::Vit(_) => {
            let trained = TrainedVit::<B>::load(&artifact, &device)?;
            let c = evaluate_vit(&trained, &data_dir, args.batch_size, args.limit, &device)?;
            (c, "test images")
        }
        _ => {
            let trained = TrainedClassifier::<B>::load(&artifact, &device)?;
            let c = evaluate_classifier(&trained, &data_dir, args.batch_size, args.limit, &device)?;
            (c, "test sentences")
        }
    };
    let seconds = began.elapsed().as_secs_f64();
    let accuracy = 100.0 * confusion.accuracy();
    println!(
        "{}: test accuracy {accuracy:.2}% on {} {what} of {} ({seconds:.1} s)",
        config.name,
        confusion.total(),
        config.data.dataset
    );
    let path = args
        .output
        .unwrap_or_else(|| artifact.root().join("confusion.png"));
    let title = format!(
        "{} on {}: {accuracy:.2}% of {}",
        config.name,
        config.data.dataset,
        confusion.total()
    );
    crate::plot::confusion_png(&path, &title, &confusion.classes, &confusion.counts)?;
    println!("confusion matrix written to {}", path.display());
    Ok(())
}

fn run_predict<B: LabBackend>(args: PredictArgs, device: B::Device) -> Result<()> {
    let trained = TrainedVit::<B>::load(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let size = trained.config.vit()?.image_size;
    let classes = class_names(&trained.config.data.dataset);
    let prepared = args
        .images
        .iter()
        .map(|path| load_image(path, size))
        .collect::<Result<Vec<_>>>()?;
    let pixels: Vec<Vec<u8>> = prepared.iter().map(|p| p.pixels.clone()).collect();
    let probabilities = image_probabilities(&trained, &pixels, size, &device)
        .into_data()
        .into_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("cannot read probabilities: {e:?}"))?;
    for ((path, image), row) in args
        .images
        .iter()
        .zip(&prepared)
        .zip(probabilities.chunks(classes.len()))
    {
        let top: Vec<String> = top_classes(row, args.top.max(1))
            .into_iter()
            .map(|(class, p)| format!("{} {:.1}%", classes[class], 100.0 * p))
            .collect();
        let note = if image.inverted {
            " (inverted: light background)"
        } else {
            ""
        };
        println!("{}: {}{note}", path.display(), top.join(", "));
    }
    Ok(())
}

/// The texts given as arguments, or else stdin's lines.
fn texts_or_stdin(texts: Vec<String>) -> Result<Vec<String>> {
    if !texts.is_empty() {
        return Ok(texts);
    }
    std::io::stdin()
        .lock()
        .lines()
        .collect::<std::io::Result<Vec<String>>>()
        .context("cannot read stdin as UTF-8 text")
}

fn run_classify<B: LabBackend>(args: ClassifyArgs, device: B::Device) -> Result<()> {
    let trained = TrainedClassifier::<B>::load(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let classes = class_names(&trained.config.data.dataset);
    let texts = texts_or_stdin(args.texts)?;
    if texts.is_empty() {
        bail!("no text to classify: give TEXT arguments or lines on stdin");
    }
    let probabilities = text_probabilities(&trained, &texts, &device)?
        .into_data()
        .into_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("cannot read probabilities: {e:?}"))?;
    let mut out = std::io::stdout().lock();
    for (text, row) in texts.iter().zip(probabilities.chunks(classes.len())) {
        let (class, p) = top_classes(row, 1)[0];
        writeln!(out, "{}	{:.3}	{text}", classes[class], p)?;
    }
    Ok(())
}

fn run_embed<B: LabBackend>(args: EmbedArgs, device: B::Device) -> Result<()> {
    let encoder = TextEncoder::<B>::load(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let mut vectors = Vec::new();
    let mut lacking = Vec::new();
    for (i, sentence) in args.sentences.iter().enumerate() {
        match encoder.word_vectors(sentence, &args.word, &device)? {
            Some(v) => vectors.push(v),
            None => lacking.push(format!("{} {sentence:?}", i + 1)),
        }
    }
    if !lacking.is_empty() {
        bail!(
            "the word {:?} is not in sentence {}",
            args.word,
            lacking.join(", sentence ")
        );
    }
    let d = vectors[0].contextual.len();
    let shown = if args.dims == 0 { d } else { args.dims.min(d) };
    println!(
        "contextual vector of {:?} (first {shown} of {d} dimensions; mean over its tokens):",
        args.word
    );
    for (i, (sentence, v)) in args.sentences.iter().zip(&vectors).enumerate() {
        let values: Vec<String> = v.contextual[..shown]
            .iter()
            .map(|x| format!("{x:+.3}"))
            .collect();
        let more = if shown < d { " …" } else { "" };
        println!(
            "  [{}] {sentence}
      ({} token{}) [{}{more}]",
            i + 1,
            v.tokens,
            if v.tokens == 1 { "" } else { "s" },
            values.join(", ")
        );
    }
    println!("cosine similarity, contextual (static input embedding in brackets):");
    for i in 0..vectors.len() {
        for j in i + 1..vectors.len() {
            println!(
                "  [{}] vs [{}]: {:.3}  ({:.3})",
                i + 1,
                j + 1,
                cosine(&vectors[i].contextual, &vectors[j].contextual),
                cosine(&vectors[i].static_, &vectors[j].static_)
            );
        }
    }
    Ok(())
}

fn run_bench<B: LabBackend>(args: BenchArgs, device: B::Device) -> Result<()> {
    let args = match args.what {
        BenchCommand::Train(args) => args,
        BenchCommand::Mixers(args) => return run_bench_mixers::<B>(args, device),
        BenchCommand::Kernels(args) => return run_bench_kernels::<B>(args, device),
    };
    if args.steps == 0 || args.runs == 0 {
        bail!("--steps and --runs must be at least 1");
    }
    let config = match &args.experiment {
        Some(path) => ExperimentConfig::load(path)?,
        None => ExperimentConfig::parse(crate::config::DEFAULT_EXPERIMENT)?,
    };
    if config.lm().is_err() {
        bail!(
            "bench train measures language-model experiments; {} is a {} experiment",
            config.name,
            config.model.kind()
        );
    }
    let plan = crate::bench::BenchPlan {
        steps: args.steps,
        warmup: args.warmup,
        runs: args.runs,
    };
    let data_dir = data_dir(args.data.data_dir.as_deref());
    let report = crate::bench::bench_lm::<Autodiff<B>>(&config, &data_dir, plan, &device)?;
    print!(
        "{}",
        report.render(&format!("{} on {}", config.name, B::name(&device)))
    );
    Ok(())
}

fn run_bench_kernels<B: LabBackend>(args: BenchKernelsArgs, device: B::Device) -> Result<()> {
    if args.reps == 0 || args.vocab == 0 {
        bail!("--reps and --vocab must be at least 1");
    }
    let config = match &args.experiment {
        Some(path) => ExperimentConfig::load(path)?,
        None => ExperimentConfig::parse(crate::config::DEFAULT_EXPERIMENT)?,
    };
    let lm = config.lm().map_err(|_| {
        anyhow!(
            "bench kernels uses language-model shapes; {} is a {} experiment",
            config.name,
            config.model.kind()
        )
    })?;
    let rows = crate::bench::kernels::bench_kernels::<Autodiff<B>>(
        lm,
        config.train.batch_size,
        args.vocab,
        args.reps,
        &device,
    )?;
    println!(
        "{} on {}: forward + backward of each operation, median of {} runs",
        config.name,
        B::name(&device),
        args.reps
    );
    print!("{}", crate::bench::kernels::render(&rows));
    Ok(())
}

fn run_bench_mixers<B: LabBackend>(args: BenchMixersArgs, device: B::Device) -> Result<()> {
    use crate::bench::mixers::{bench_mixers, render, to_csv, write_png, MixerPlan};
    use crate::nn::{HyenaConfig, Mixer};
    let mixers = args
        .mixers
        .iter()
        .map(|name| {
            Ok(match name.as_str() {
                "full" => Mixer::Full,
                "local" => Mixer::Local {
                    window: args.window,
                },
                "strided" => Mixer::Strided {
                    stride: args.stride,
                },
                "linear" => Mixer::Linear { chunk: args.chunk },
                "hyena" => Mixer::Hyena(HyenaConfig::default()),
                other => bail!(
                    "unknown mixer {other:?}; choose from full, local, strided, linear, hyena"
                ),
            })
        })
        .collect::<Result<Vec<Mixer>>>()?;
    for mixer in &mixers {
        mixer.validate("language model", true)?;
    }
    if args.lengths.is_empty() || args.lengths.windows(2).any(|w| w[0] >= w[1]) {
        bail!("--lengths must be increasing");
    }
    if args.runs == 0 || args.d_model == 0 || args.heads == 0 || args.batch == 0 {
        bail!("--runs, --d-model, --heads and --batch must be at least 1");
    }
    if !args.d_model.is_multiple_of(args.heads) {
        bail!("--d-model must be divisible by --heads");
    }
    let plan = MixerPlan {
        lengths: args.lengths.clone(),
        d_model: args.d_model,
        n_heads: args.heads,
        batch: args.batch,
        runs: args.runs,
        budget_s: args.budget_s,
        memory_limit: (crate::memory::available_memory().unwrap_or(8 << 30) as f64
            * args.memory_share) as usize,
    };
    let backend = B::name(&device);
    eprintln!(
        "bench mixers on {backend}: d_model {}, {} heads, batch {}, causal; {} runs per point",
        plan.d_model, plan.n_heads, plan.batch, plan.runs
    );
    let points = bench_mixers::<Autodiff<B>>(&mixers, &plan, &device, |p| {
        eprintln!(
            "  {:<8} {:>6} tokens: forward {:>9.2} ms, fwd+bwd {:>9.2} ms",
            p.mixer,
            p.length,
            p.forward_s * 1e3,
            p.train_s * 1e3
        );
    })?;
    print!("{}", render(&points, &mixers));
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let csv = args.out.join("mixers.csv");
    crate::artifact::write_atomic(&csv, to_csv(&points).as_bytes())?;
    let png = args.out.join("mixers.png");
    let title = format!(
        "token mixers on {backend}: one causal layer, d_model {}, {} heads (window {}, stride {})",
        plan.d_model, plan.n_heads, args.window, args.stride
    );
    write_png(&png, &points, &mixers, &title)?;
    println!("wrote {} and {}", csv.display(), png.display());
    Ok(())
}

fn run_attention<B: LabBackend>(args: AttentionArgs, device: B::Device) -> Result<()> {
    use crate::inspect::{html, picture, terminal, Inspectable};
    let model = Inspectable::<B>::load(&ArtifactDir::new(&args.artifact_dir), &device)?;
    if args.target.is_some() && !matches!(model, Inspectable::Translator(_)) {
        bail!(
            "--target is for translators; this is a {} model",
            model.config().model.kind()
        );
    }
    let maps = model.capture(&args.input, args.target.as_deref(), &device)?;
    let group = maps.group(args.group.as_deref())?;
    // Made first: an unknown layer or head fails before anything is printed or written.
    let heatmap = terminal::heatmap(group, args.layer, args.head, terminal::colour_wanted())?;
    if let Some(output) = &maps.output {
        println!("model output: {output}");
    }
    print!("{heatmap}");
    let in_out = |name: &str| args.out.as_ref().map(|dir| dir.join(name));
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    if let Some(path) = args.png.clone().or_else(|| in_out("attention.png")) {
        for written in picture::write_pngs(&maps, &path)? {
            println!("picture written to {}", written.display());
        }
    }
    if let Some(path) = args.html.clone().or_else(|| in_out("attention.html")) {
        crate::artifact::write_atomic(&path, html::page(&maps)?.as_bytes())?;
        println!("interactive page written to {}", path.display());
    }
    if let Some(path) = args.json.clone().or_else(|| in_out("attention.json")) {
        crate::artifact::write_atomic(&path, maps.to_json()?.as_bytes())?;
        println!("weights written to {}", path.display());
    }
    if args.stats {
        println!();
        for stats in model.statistics(&maps, args.seed, &device)? {
            println!("{}", stats.text);
        }
    }
    Ok(())
}

fn run_explain<B: LabBackend>(args: ExplainArgs, device: B::Device) -> Result<()> {
    if let (Some(dir), Some(text)) = (&args.artifact_dir, &args.text) {
        let model = crate::inspect::Inspectable::<B>::load(&ArtifactDir::new(dir), &device)?;
        let walkthrough = explain::model_walkthrough(&model, text, args.layer, args.head, &device)?;
        print!("{}", explain::render_model(&walkthrough));
        return Ok(());
    }
    let x = explain::parse_matrix("X", &args.x)?;
    let wq = explain::parse_matrix("W_Q", &args.wq)?;
    let wk = explain::parse_matrix("W_K", &args.wk)?;
    let wv = explain::parse_matrix("W_V", &args.wv)?;
    let walkthrough = explain::walkthrough::<B>(&x, &wq, &wk, &wv, &device)?;
    print!("{}", explain::render(&walkthrough, &x));
    Ok(())
}
