//! `bench`: training throughput, fused kernels against their composed references, and the
//! token mixers' cost against length; the load on `serve`.

use crate::artifact::ArtifactDir;
use crate::cli::{
    BenchArgs, BenchCommand, BenchGenerateArgs, BenchKernelsArgs, BenchMatmulArgs, BenchMixersArgs,
    BenchServeArgs,
};
use crate::config::{ExperimentConfig, LmConfig};
use crate::data::data_dir;
use crate::generate::Decoding;
use crate::kernels::LabBackend;
use crate::kinds::load_as;
use anyhow::{anyhow, bail, Context, Result};
use burn::backend::Autodiff;

pub(super) fn run_bench<B: LabBackend>(args: BenchArgs, device: B::Device) -> Result<()> {
    let args = match args.what {
        BenchCommand::Train(args) => args,
        BenchCommand::Mixers(args) => return run_bench_mixers::<B>(args, device),
        BenchCommand::Kernels(args) => return run_bench_kernels::<B>(args, device),
        BenchCommand::Matmul(args) => return run_bench_matmul::<B>(args, device),
        BenchCommand::Generate(args) => return run_bench_generate::<B>(args, device),
        BenchCommand::Serve(args) => return run_bench_serve(args),
    };
    if args.steps == 0 || args.runs == 0 {
        bail!("--steps and --runs must be at least 1");
    }
    let mut config = experiment(args.experiment.as_deref())?;
    if let Some(on) = args.by_length {
        config.train.batch_by_length = on;
    }
    if let Some(precision) = args.precision {
        config.train.precision = precision;
    }
    let name = match config.train.precision {
        crate::kernels::Precision::F32 => config.name.clone(),
        precision => format!("{} ({})", config.name, precision.name()),
    };
    if args.profile && !B::TIMED_KERNELS {
        bail!(
            "--profile times each kernel call on the CPU, where a call returns when its work is \
             done; on {} the kernels run asynchronously: use --backend flex",
            B::name(&device)
        );
    }
    let plan = crate::bench::BenchPlan {
        steps: args.steps,
        warmup: args.warmup,
        runs: args.runs,
        profile: args.profile,
    };
    let data_dir = data_dir(args.data.data_dir.as_deref());
    let report = crate::kinds::bench::<Autodiff<B>>(config, &data_dir, plan, &device)?;
    print!(
        "{}",
        report.render(&format!("{name} on {}", B::name(&device)))
    );
    Ok(())
}

/// The experiment at `path`, or the built-in default (shakespeare-char).
fn experiment(path: Option<&std::path::Path>) -> Result<ExperimentConfig> {
    match path {
        Some(path) => ExperimentConfig::load(path),
        None => ExperimentConfig::parse(crate::config::DEFAULT_EXPERIMENT),
    }
}

/// `config`'s language model, or one error line: "`needs`; NAME is a KIND experiment".
fn language_model<'a>(config: &'a ExperimentConfig, needs: &str) -> Result<&'a LmConfig> {
    config.model_as::<LmConfig>().map_err(|_| {
        anyhow!(
            "{needs}; {} is a {} experiment",
            config.name,
            config.model.kind()
        )
    })
}

fn run_bench_kernels<B: LabBackend>(args: BenchKernelsArgs, device: B::Device) -> Result<()> {
    if args.reps == 0 || args.vocab == 0 {
        bail!("--reps and --vocab must be at least 1");
    }
    let config = experiment(args.experiment.as_deref())?;
    let lm = language_model(&config, "bench kernels uses language-model shapes")?;
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

fn run_bench_matmul<B: LabBackend>(args: BenchMatmulArgs, device: B::Device) -> Result<()> {
    if args.vocab == 0 || args.rows == Some(0) {
        bail!("--vocab and --rows must be at least 1");
    }
    let config = experiment(args.experiment.as_deref())?;
    let lm = language_model(&config, "bench matmul uses language-model shapes")?;
    if let Some(half) = args.precision.half() {
        if !B::mixed_precision(&device, half) {
            bail!(
                "--precision {}: {} has no products in that type",
                args.precision.name(),
                B::name(&device)
            );
        }
    }
    let plan = crate::bench::matmul::MatmulPlan {
        products: crate::bench::matmul::step_products(
            lm,
            args.rows.unwrap_or(config.train.batch_size * lm.context),
            args.vocab,
            &args.only,
        ),
        precision: args.precision,
        all: !args.autotune_only,
        kernels: args.kernels,
        runs: args.runs,
    };
    plan.check()?;
    if !B::autotunes() {
        // The backend's own refusal, before the header.
        B::time_products(&device, &plan, &mut |_| {})?;
    }
    eprintln!(
        "bench matmul: {} products of a {} step on {}, {} operands; the first launch of each kernel compiles it",
        plan.products.len(),
        config.name,
        B::name(&device),
        args.precision.name()
    );
    let names: Vec<String> = plan.products.iter().map(|p| p.name.clone()).collect();
    let timings = B::time_products(&device, &plan, &mut |t| {
        let what = match &t.seconds {
            Ok(s) => format!("{:.1} µs", s * 1e6),
            Err(_) => "did not run".into(),
        };
        eprintln!("  {} {}: {what}", names[t.product], t.kernel);
    })?;
    println!(
        "{} on {}: each product's kernels, fastest first ({} operands, f32 output; median of {} samples)",
        config.name,
        B::name(&device),
        args.precision.name(),
        args.runs
    );
    print!("{}", crate::bench::matmul::render(&plan, &timings));
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
    crate::files::write_atomic(&csv, to_csv(&points).as_bytes())?;
    let png = args.out.join("mixers.png");
    let title = format!(
        "token mixers on {backend}: one causal layer, d_model {}, {} heads (window {}, stride {})",
        plan.d_model, plan.n_heads, args.window, args.stride
    );
    write_png(&png, &points, &mixers, &title)?;
    println!("wrote {} and {}", csv.display(), png.display());
    Ok(())
}

fn run_bench_generate<B: LabBackend>(args: BenchGenerateArgs, device: B::Device) -> Result<()> {
    use crate::bench::generate::{bench_generate, render, GeneratePlan};
    // Checked before the model is loaded or made: a bad plan costs nothing.
    let plan = GeneratePlan {
        prompt_len: args.prompt_len,
        new_tokens: args.tokens,
        batches: args.batch.clone(),
        decodings: if args.cached_only {
            vec![Decoding::Cached]
        } else {
            vec![Decoding::Cached, Decoding::Recompute]
        },
        runs: args.runs,
    };
    plan.check()?;
    let (name, model, section) = match &args.artifact_dir {
        Some(dir) => {
            let trained = load_as::<LmConfig, B>(&ArtifactDir::new(dir), &device)?;
            let section = trained.config.model_as::<LmConfig>()?.clone();
            (dir.display().to_string(), trained.model, section)
        }
        None => {
            let config = experiment(args.experiment.as_deref())?;
            let mut lm = language_model(&config, "bench generate times language models")?.clone();
            if args.vocab == 0 {
                bail!("--vocab must be at least 1");
            }
            lm.vocab_size = args.vocab;
            (
                format!("{} (random weights)", config.name),
                lm.init::<B>(&device),
                lm,
            )
        }
    };
    // As `generate` refuses it: a prompt past learned positions would be timed cut short.
    crate::generate::check_prompt(plan.prompt_len, section.context, section.position)
        .map_err(|err| anyhow!("--prompt-len {}: {err}", plan.prompt_len))?;
    eprintln!(
        "bench generate: {name} on {}: {} prompt token(s), {} new, greedy; median of {} runs",
        B::name(&device),
        plan.prompt_len,
        plan.new_tokens,
        plan.runs
    );
    let timings = crate::nn::without_weights(|| {
        bench_generate(&model, &plan, &device, |t| {
            eprintln!(
                "  {:?} batch {}: {:.1} tokens/s",
                t.decoding, t.batch, t.tokens_per_s
            )
        })
    })?;
    print!("{}", render(&timings));
    Ok(())
}

/// `bench serve`: the load generator against a `serve` child process (which computes; this
/// process only sends requests and reads streams).
pub(super) fn run_bench_serve(args: BenchServeArgs) -> Result<()> {
    if !(args.seconds > 0.0 && args.seconds.is_finite()) {
        bail!("--seconds must be a positive number, got {}", args.seconds);
    }
    let server_args = match args.backend.backend {
        Some(kind) => vec![
            "--backend".to_string(),
            clap::ValueEnum::to_possible_value(&kind)
                .expect("every backend has a name")
                .get_name()
                .to_string(),
        ],
        None => Vec::new(),
    };
    let plan = crate::bench::serve::LoadPlan {
        artifact: args.artifact_dir,
        clients: args.clients,
        requests: args.requests,
        max_tokens: args.max_tokens,
        prompt: args.prompt,
        max_batch: args.max_batch,
        limit: std::time::Duration::from_secs_f64(args.seconds),
        server_args,
    };
    use crate::bench::serve::{gains, row_line, TABLE_HEAD};
    eprintln!("{TABLE_HEAD}");
    let rows = crate::bench::serve::run_load(&plan, |row| eprintln!("{}", row_line(row)))?;
    println!("{TABLE_HEAD}");
    for row in &rows {
        println!("{}", row_line(row));
    }
    for (clients, gain) in gains(&rows) {
        println!("batching at {clients} clients: {gain:.2}x the tokens/s of one at a time");
    }
    if let Some(path) = &args.csv {
        let mut csv = String::from(
            "server,clients,requests,requests_per_s,tokens_per_s,first_token_p50_ms,first_token_p99_ms,per_token_p50_ms,per_token_p99_ms\n",
        );
        for r in &rows {
            csv.push_str(&format!(
                "{},{},{},{:.3},{:.1},{:.2},{:.2},{:.3},{:.3}\n",
                r.server,
                r.clients,
                r.requests,
                r.requests_per_s,
                r.tokens_per_s,
                r.first_token_ms.0,
                r.first_token_ms.1,
                r.per_token_ms.0,
                r.per_token_ms.1
            ));
        }
        crate::files::write_atomic(path, csv.as_bytes())?;
    }
    Ok(())
}
