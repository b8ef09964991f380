//! The commands that look inside any trained model: `eval`, `attention`, `explain` and `heads`.
//! Each loads whatever kind the artifact holds and asks it.

use crate::artifact::ArtifactDir;
use crate::cli::{AttentionArgs, EvalArgs, ExplainArgs, HeadsArgs};
use crate::config::{ModelSection, Seq2SeqConfig};
use crate::data::data_dir;
use crate::explain;
use crate::kernels::LabBackend;
use crate::kinds::{EvalRequest, HeadsRequest, HeldOutRequest};
use anyhow::{bail, Context, Result};
use burn::backend::Autodiff;

pub(super) fn run_eval<B: LabBackend>(args: EvalArgs, device: B::Device) -> Result<()> {
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    if args.limit == Some(0) {
        bail!("--limit must be at least 1 (leave it out to evaluate the whole test split)");
    }
    let artifact = ArtifactDir::new(&args.artifact_dir);
    let trained = crate::kinds::load::<B>(&artifact, &device)?;
    let request = EvalRequest {
        artifact_dir: args.artifact_dir.clone(),
        data_dir: data_dir(args.data.data_dir.as_deref()),
        batch_size: args.batch_size,
        limit: args.limit,
        output: args.output,
        beam: args.search.beam,
        length_penalty: args.search.length_penalty,
        max_len: args.search.max_len,
        cached: !args.search.no_cache,
        context: args.context,
    };
    trained.eval(&request, &device)
}

pub(super) fn run_attention<B: LabBackend>(args: AttentionArgs, device: B::Device) -> Result<()> {
    use crate::inspect::{html, picture, terminal};
    let model = crate::kinds::load::<B>(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let kind = model.config().model.kind();
    if args.target.is_some() && kind != <Seq2SeqConfig as ModelSection>::KIND {
        bail!("--target is for translators; this is a {kind} model");
    }
    let maps = model.attention(&args.input, args.target.as_deref(), &device)?;
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
        crate::files::write_atomic(&path, html::page(&maps)?.as_bytes())?;
        println!("interactive page written to {}", path.display());
    }
    if let Some(path) = args.json.clone().or_else(|| in_out("attention.json")) {
        crate::files::write_atomic(&path, maps.to_json()?.as_bytes())?;
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

pub(super) fn run_explain<B: LabBackend>(args: ExplainArgs, device: B::Device) -> Result<()> {
    if let (Some(dir), Some(text)) = (&args.artifact_dir, &args.text) {
        let trained = crate::kinds::load::<B>(&ArtifactDir::new(dir), &device)?;
        let model = trained.text_model()?;
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

pub(super) fn run_heads<B: LabBackend>(args: HeadsArgs, device: B::Device) -> Result<()> {
    if args.batch_size == 0 || args.batches == 0 {
        bail!("--batch-size and --batches must be at least 1");
    }
    let request = HeadsRequest {
        artifact_dir: args.artifact_dir,
        held_out: HeldOutRequest {
            data_dir: data_dir(args.data.data_dir.as_deref()),
            batch_size: args.batch_size,
            batches: args.batches,
        },
        steps: args.steps,
        prune: args.prune,
        out: args.out,
        png: args.png,
    };
    // Gradients of the gates need the autodiff backend; no forward pass needs the weights.
    crate::nn::without_weights(|| crate::kinds::heads::<Autodiff<B>>(&request, &device))
}
