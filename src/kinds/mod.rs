//! The model kinds: one module per kind, each implementing [`ModelKind`] — everything the
//! application needs from a kind (build, train, load, evaluate, show its attention, read its
//! text states) — for that kind's config section.
//!
//! Commands never match on the kind. `train`, `eval`, `attention`, `explain` and `embed` ask
//! [`ModelConfig::visit`](crate::config::ModelConfig::visit) (the one place a kind is matched)
//! through the visitors here; commands made for one kind (`generate`, `translate`, `predict`,
//! `classify`) load it with [`load_as`], which names the kind an artifact holds instead.

mod classifier;
mod clip;
mod lm;
mod seq2seq;
mod vit;

pub use clip::{
    image_maps as clip_image_maps, pca_2d, recall_at, text_maps as clip_text_maps, zero_shot,
    zero_shot_pixels,
};
pub use lm::{evaluate_lm, Corpus};
pub use seq2seq::TranslationData;
pub use vit::image_maps as vit_image_maps;

use crate::artifact::{
    check_new_artifact_dir, write_new_artifact, ArtifactDir, Tokenizers, Trained,
};
use crate::config::{DataConfig, ExperimentConfig, ModelSection, Visit};
use crate::inspect::heads::{self, HeldOut, HeldOutBatch, LossOutput, PruneStep};
use crate::inspect::{AttentionMaps, GroupStats, TextModel};
use crate::kernels::{LabAutodiff, LabBackend};
use crate::nn::{pruned_heads, remove_heads, AttentionLayers, StackConfig};
use crate::train::speed::{BenchPlan, BenchReport};
use crate::train::{Session, TrainReport, TrainRequest};
use anyhow::{bail, Result};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::module::Module;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Everything the application needs from one model kind, implemented for the kind's config
/// section (`LmConfig`, `Seq2SeqConfig`, …).
pub trait ModelKind: ModelSection {
    /// The trained model on backend `B`.
    type Model<B: LabBackend>: Module<B> + AttentionLayers<B>;

    /// A fresh model (vocabulary sizes resolved, config validated), every head in place.
    fn build<B: LabBackend>(&self, device: &B::Device) -> Self::Model<B>;

    /// The section's transformer settings.
    fn stack(&self) -> &StackConfig;

    /// The same, to change.
    fn stack_mut(&mut self) -> &mut StackConfig;

    /// Every stack's settings (a model with two encoders has two), to change.
    fn stacks_mut(&mut self) -> Vec<&mut StackConfig> {
        vec![self.stack_mut()]
    }

    /// `heads`: held-out (validation) batches of a trained model's data, each giving the loss
    /// of whichever model it is handed.
    fn held_out<B: LabBackend>(
        trained: &Trained<Self::Model<B>>,
        request: &HeldOutRequest,
        device: &B::Device,
    ) -> Result<HeldOut<'static, B, Self::Model<B>>>;

    /// Reads the data (fitting tokenizers unless `tokenizers` come from a resumed run),
    /// begins `session` with the resolved config, and trains.
    fn train<B: LabAutodiff>(
        &self,
        config: ExperimentConfig,
        tokenizers: Option<Tokenizers>,
        session: &Session,
        data_dir: &Path,
        device: B::Device,
    ) -> Result<TrainReport>;

    /// Floats one training example keeps for the backward pass, vocabulary sizes resolved (a
    /// lower bound, for the memory check before training).
    fn activation_floats(&self, data: &DataConfig) -> f64;

    /// Evaluates on held-out data and prints the result (loss and perplexity, BLEU, accuracy).
    fn eval<B: LabBackend>(
        trained: &Trained<Self::Model<B>>,
        request: &EvalRequest,
        device: &B::Device,
    ) -> Result<()>;

    /// The attention weights of every layer and head on `input` (a text, or an image path); a
    /// translator attends over `target` when given, else over its own translation.
    fn attention<B: LabBackend>(
        trained: &Trained<Self::Model<B>>,
        input: &str,
        target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps>;

    /// Head statistics of `maps`, compared with the same input shuffled by `seed`.
    fn statistics<B: LabBackend>(
        trained: &Trained<Self::Model<B>>,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>>;

    /// The model as a reader of one text (for `explain` and `embed`), or why it is not one.
    fn text_model<B: LabBackend>(trained: &Trained<Self::Model<B>>) -> Result<TextModel<'_, B>>;

    /// `bench train`: `plan`'s training steps of a fresh model on batches of the real training
    /// data, drawn as `train` draws them, timed phase by phase.
    fn bench<B: LabAutodiff>(
        &self,
        config: ExperimentConfig,
        data_dir: &Path,
        plan: BenchPlan,
        device: &B::Device,
    ) -> Result<BenchReport>;
}

/// What `eval` was asked.
#[derive(Clone, Debug)]
pub struct EvalRequest {
    /// The artifact evaluated.
    pub artifact_dir: PathBuf,
    /// Where datasets are found.
    pub data_dir: PathBuf,
    /// Examples per batch.
    pub batch_size: usize,
    /// Evaluate only the first N test examples (translators, classifiers).
    pub limit: Option<usize>,
    /// Translators: the tab-separated translations; classifiers: the confusion PNG.
    pub output: Option<PathBuf>,
    /// Translators: beam size (1 = greedy).
    pub beam: usize,
    /// Translators: GNMT length penalty α.
    pub length_penalty: f64,
    /// Translators: most tokens per output (default: the model's maximum length).
    pub max_len: Option<usize>,
    /// Translators: decode from the key–value cache (else re-run each prefix).
    pub cached: bool,
    /// Language models: tokens per evaluation window (default: the model's context).
    pub context: Option<usize>,
}

/// A trained model of whichever kind an artifact holds.
pub trait AnyTrained<B: LabBackend> {
    /// Its resolved config.
    fn config(&self) -> &ExperimentConfig;
    /// See [`ModelKind::eval`].
    fn eval(&self, request: &EvalRequest, device: &B::Device) -> Result<()>;
    /// See [`ModelKind::attention`].
    fn attention(
        &self,
        input: &str,
        target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps>;
    /// See [`ModelKind::statistics`].
    fn statistics(
        &self,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>>;
    /// See [`ModelKind::text_model`].
    fn text_model(&self) -> Result<TextModel<'_, B>>;
    /// The trained model itself, for [`trained_as`].
    fn as_any(&self) -> &dyn std::any::Any;
}

/// The trained model of kind `K` that `trained` holds, if it is of that kind.
pub fn trained_as<K: ModelKind, B: LabBackend>(
    trained: &dyn AnyTrained<B>,
) -> Option<&Trained<K::Model<B>>> {
    trained.as_any().downcast_ref()
}

struct Loaded<K: ModelKind, B: LabBackend>(Trained<K::Model<B>>);

impl<K: ModelKind, B: LabBackend> AnyTrained<B> for Loaded<K, B> {
    fn config(&self) -> &ExperimentConfig {
        &self.0.config
    }
    fn eval(&self, request: &EvalRequest, device: &B::Device) -> Result<()> {
        K::eval(&self.0, request, device)
    }
    fn attention(
        &self,
        input: &str,
        target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps> {
        K::attention(&self.0, input, target, device)
    }
    fn statistics(
        &self,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>> {
        K::statistics(&self.0, maps, seed, device)
    }
    fn text_model(&self) -> Result<TextModel<'_, B>> {
        K::text_model(&self.0)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        &self.0
    }
}

/// Loads the model `artifact` holds, whatever its kind.
pub fn load<B: LabBackend>(
    artifact: &ArtifactDir,
    device: &B::Device,
) -> Result<Box<dyn AnyTrained<B>>> {
    let config = ExperimentConfig::load(&artifact.config())?;
    config.model.visit(Load { artifact, device })
}

struct Load<'x, B: LabBackend> {
    artifact: &'x ArtifactDir,
    device: &'x B::Device,
}

impl<K: ModelKind, B: LabBackend> Visit<'_, K> for Load<'_, B> {
    type Output = Result<Box<dyn AnyTrained<B>>>;
    fn visit(self, _: &K) -> Self::Output {
        let trained = load_as::<K, B>(self.artifact, self.device)?;
        Ok(Box::new(Loaded::<K, B>(trained)))
    }
}

/// Loads the model of kind `K` that `artifact` holds; another kind is an error naming it.
pub fn load_as<K: ModelKind, B: LabBackend>(
    artifact: &ArtifactDir,
    device: &B::Device,
) -> Result<Trained<K::Model<B>>> {
    Trained::open(artifact, device, |config| {
        if config.model.kind() != K::KIND {
            bail!(
                "{} holds a {} model, not a {} ({}); use it with `transformer-lab {}`",
                artifact.root().display(),
                config.model.kind(),
                K::DESCRIPTION,
                K::KIND,
                config.model.command()
            );
        }
        build(config.model_as::<K>()?, device)
    })
}

/// The model `section` describes: built whole, then cut to the heads its config keeps.
fn build<K: ModelKind, B: LabBackend>(section: &K, device: &B::Device) -> Result<K::Model<B>> {
    let mut model = section.build::<B>(device);
    remove_heads(&mut model, &section.stack().pruned_heads)?;
    Ok(model)
}

/// Refuses to train a pruned config from scratch (its heads were chosen for trained weights).
fn check_unpruned<K: ModelKind>(section: &K) -> Result<()> {
    if !section.stack().pruned_heads.is_empty() {
        bail!(
            "model.pruned_heads: this config describes a model pruned by `transformer-lab heads \
             --prune`; train the unpruned config (remove pruned_heads) and prune it after training"
        );
    }
    Ok(())
}

/// Runs (or resumes) the training `request` asks for, with the kind its config names.
pub fn train<B: LabAutodiff>(request: TrainRequest, device: B::Device) -> Result<TrainReport> {
    crate::train::run(request, |config, tokenizers, session, data_dir| {
        crate::kernels::use_precision::<B>(config.train.precision, &device)?;
        let model = config.model.clone();
        model.visit(Train::<B> {
            config,
            tokenizers,
            session,
            data_dir,
            device,
        })
    })
}

struct Train<'x, B: LabAutodiff> {
    config: ExperimentConfig,
    tokenizers: Option<Tokenizers>,
    session: &'x Session,
    data_dir: &'x Path,
    device: B::Device,
}

impl<K: ModelKind, B: LabAutodiff> Visit<'_, K> for Train<'_, B> {
    type Output = Result<TrainReport>;
    fn visit(self, section: &K) -> Self::Output {
        check_unpruned(section)?;
        section.train::<B>(
            self.config,
            self.tokenizers,
            self.session,
            self.data_dir,
            self.device,
        )
    }
}

/// `bench train` of `config`, whatever its kind (see [`ModelKind::bench`]).
pub fn bench<B: LabAutodiff>(
    config: ExperimentConfig,
    data_dir: &Path,
    plan: BenchPlan,
    device: &B::Device,
) -> Result<BenchReport> {
    crate::kernels::use_precision::<B>(config.train.precision, device)?;
    let model = config.model.clone();
    model.visit(Bench::<B> {
        config,
        data_dir,
        plan,
        device,
    })
}

struct Bench<'x, B: LabAutodiff> {
    config: ExperimentConfig,
    data_dir: &'x Path,
    plan: BenchPlan,
    device: &'x B::Device,
}

impl<K: ModelKind, B: LabAutodiff> Visit<'_, K> for Bench<'_, B> {
    type Output = Result<BenchReport>;
    fn visit(self, section: &K) -> Self::Output {
        check_unpruned(section)?;
        section.bench::<B>(self.config, self.data_dir, self.plan, self.device)
    }
}

/// Which held-out data `heads` judges a model on.
#[derive(Clone, Debug)]
pub struct HeldOutRequest {
    /// Where datasets are found.
    pub data_dir: PathBuf,
    /// Examples per batch.
    pub batch_size: usize,
    /// Batches, their examples spread evenly over the validation split.
    pub batches: usize,
}

/// What `heads` was asked.
#[derive(Clone, Debug)]
pub struct HeadsRequest {
    /// The artifact judged.
    pub artifact_dir: PathBuf,
    /// Its held-out data.
    pub held_out: HeldOutRequest,
    /// Heads the pruning curve removes at most (default: all but one per layer).
    pub steps: Option<usize>,
    /// Write an artifact without the first N heads the greedy curve removed …
    pub prune: Option<usize>,
    /// … here.
    pub out: Option<PathBuf>,
    /// The pruning curves' PNG (default: `heads.png` in the artifact).
    pub png: Option<PathBuf>,
}

/// `n` batches of `request.batch_size` items spread evenly over `dataset` (all of it when
/// smaller), made by `batcher`, each handed to `loss` with whichever model is judged.
pub fn held_out_batches<B, M, I, O>(
    dataset: &impl Dataset<I>,
    request: &HeldOutRequest,
    batcher: impl Batcher<B, I, O>,
    device: &B::Device,
    loss: impl Fn(&M, O) -> LossOutput<B> + Clone + 'static,
) -> Result<(usize, Vec<HeldOutBatch<'static, B, M>>)>
where
    B: LabBackend,
    O: Clone + 'static,
{
    let len = dataset.len();
    let total = len.min(request.batches * request.batch_size);
    if total == 0 {
        bail!("the validation split is empty: nothing to judge the heads on");
    }
    let items: Vec<I> = (0..total)
        .map(|i| dataset.get(i * len / total).expect("an index below len"))
        .collect();
    let mut batches = Vec::new();
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        let chunk: Vec<I> = items.by_ref().take(request.batch_size).collect();
        let batch = batcher.batch(chunk, device);
        let loss = loss.clone();
        batches.push(Box::new(move |m: &M| loss(m, batch.clone())) as HeldOutBatch<'static, B, M>);
    }
    Ok((total, batches))
}

/// `heads`: the worth of every head of the model in `request.artifact_dir`, the pruning
/// curves (table and PNG), and, when asked, the pruned artifact.
pub fn heads<B: LabAutodiff>(request: &HeadsRequest, device: &B::Device) -> Result<()> {
    let artifact = ArtifactDir::new(&request.artifact_dir);
    artifact.weights()?;
    let config = ExperimentConfig::load(&artifact.config())?;
    config.model.visit(Heads::<B> { request, device })
}

struct Heads<'x, B: LabAutodiff> {
    request: &'x HeadsRequest,
    device: &'x B::Device,
}

impl<K: ModelKind, B: LabAutodiff> Visit<'_, K> for Heads<'_, B> {
    type Output = Result<()>;
    fn visit(self, _: &K) -> Self::Output {
        study_heads::<K, B>(self.request, self.device)
    }
}

fn study_heads<K: ModelKind, B: LabAutodiff>(
    request: &HeadsRequest,
    device: &B::Device,
) -> Result<()> {
    let artifact = ArtifactDir::new(&request.artifact_dir);
    let out = match (request.prune, &request.out) {
        (Some(_), None) => bail!("--prune needs --out DIR: where to write the pruned artifact"),
        (None, Some(_)) => bail!("--out is where --prune writes; give --prune N too"),
        (Some(_), Some(out)) => {
            check_new_artifact_dir(out)?;
            Some(out)
        }
        (None, None) => None,
    };
    // Scored on the inner backend (a forward pass on the autodiff one keeps its graph), with
    // gradients from the same weights on the autodiff one, without dropout there.
    let differentiable = Trained::open(&artifact, device, |config| {
        let mut section = config.model_as::<K>()?.clone();
        for stack in section.stacks_mut() {
            stack.dropout = 0.0;
        }
        build::<K, B>(&section, device)
    })?;
    let trained = Trained::open::<B::InnerBackend>(&artifact, device, |config| {
        build::<K, B::InnerBackend>(config.model_as::<K>()?, device)
    })?;
    let mut reader = trained.model.clone();
    let prunable = heads::prunable(&mut reader);
    if prunable == 0 {
        bail!(
            "{} has no head to spare: its attention layers have one head each, or it has none",
            artifact.root().display()
        );
    }
    if let Some(n) = request.prune.filter(|&n| n == 0 || n > prunable) {
        bail!("--prune {n}: this model can lose 1 to {prunable} heads (each layer keeps one)");
    }
    let steps = request
        .steps
        .unwrap_or(prunable)
        .max(request.prune.unwrap_or(0))
        .min(prunable);
    let held_out = K::held_out(&trained, &request.held_out, device)?;
    println!(
        "{}: every head judged on {}",
        trained.config.name, held_out.what
    );

    let gradients = {
        let held_out = K::held_out(&differentiable, &request.held_out, device)?;
        heads::gate_gradients(&differentiable.model, &held_out)
    };
    drop(differentiable);
    let (full, importance) = heads::importance(&trained.model, &held_out, &gradients);
    print!("{}", heads::render_table(full, &importance));

    eprintln!(
        "pruning greedily, {}, every remaining head re-evaluated at each step…",
        crate::stdio::count(steps, "head")
    );
    let greedy = heads::prune_greedily(&trained.model, &held_out, steps, |step| {
        if let Some((layer, head)) = &step.head {
            eprintln!(
                "  {:>3}/{steps}: {layer} head {head} → loss {:.4}",
                step.removed, step.score.loss
            );
        }
    });
    let by_delta = heads::order_by(&importance, |h| h.delta);
    let by_delta = heads::prune_in_order(&trained.model, &held_out, &by_delta, steps);
    let by_gradient = heads::order_by(&importance, |h| h.gradient);
    let by_gradient = heads::prune_in_order(&trained.model, &held_out, &by_gradient, steps);
    let curves: [(&str, &[PruneStep]); 3] = [
        ("greedy", &greedy),
        ("by Δ loss", &by_delta),
        ("by |∂L/∂ξ|", &by_gradient),
    ];
    println!();
    print!("{}", heads::render_curves(&curves));
    let png = request
        .png
        .clone()
        .unwrap_or_else(|| artifact.root().join("heads.png"));
    let title = format!(
        "{}: held-out loss as heads are removed",
        trained.config.name
    );
    heads::write_curves_png(&png, &title, &curves)?;
    println!("pruning curves written to {}", png.display());

    if let (Some(n), Some(out)) = (request.prune, out) {
        write_pruned::<K, B::InnerBackend>(&trained, &held_out, &greedy, n, out, device)?;
    }
    Ok(())
}

/// Writes `trained` without the first `n` heads of the greedy curve to `out`, then loads it
/// back and checks it scores what the gated model scored.
fn write_pruned<K: ModelKind, B: LabBackend>(
    trained: &Trained<K::Model<B>>,
    held_out: &HeldOut<'static, B, K::Model<B>>,
    greedy: &[PruneStep],
    n: usize,
    out: &Path,
    device: &B::Device,
) -> Result<()> {
    let removed = heads::removed_by_layer(greedy, n);
    let mut model = trained.model.clone();
    remove_heads(&mut model, &removed)?;
    let mut section = trained.config.model_as::<K>()?.clone();
    // Every layer knows its heads' places in the unpruned layer, earlier prunings included.
    section.stack_mut().pruned_heads = pruned_heads(&mut model);
    let mut config = trained.config.clone();
    let (source, target) = section.vocab_sizes();
    config.model = section.with_vocab_sizes(source, target);
    config.name = format!("{}-pruned", trained.config.name);
    let written = write_new_artifact(out, &config, trained.tokenizers.as_ref(), model.clone())?;

    // Read back as any command reads it; it must score what the gated model scored.
    let reloaded = Trained::open(&written, device, |config| {
        build(config.model_as::<K>()?, device)
    })?;
    // Each timed twice, alternating; the faster pass of each counts.
    let time = |m: &K::Model<B>| {
        let start = Instant::now();
        let score = held_out.score(m);
        (score, start.elapsed().as_secs_f64())
    };
    let (mut full_s, mut pruned_s) = (f64::INFINITY, f64::INFINITY);
    let (mut full, mut score) = (None, None);
    for _ in 0..2 {
        let (s, t) = time(&trained.model);
        (full, full_s) = (Some(s), full_s.min(t));
        let (s, t) = time(&reloaded.model);
        (score, pruned_s) = (Some(s), pruned_s.min(t));
    }
    let (full, score) = (full.expect("timed"), score.expect("timed"));
    let expected = greedy[n].score.loss;
    if (score.loss - expected).abs() > 1e-4 * (1.0 + expected.abs()) {
        bail!(
            "the pruned artifact in {} scores loss {:.6}, not the {expected:.6} of the model with \
             those heads gated off; it is left there for inspection",
            out.display(),
            score.loss
        );
    }
    let map = &section.stack().pruned_heads;
    println!(
        "pruned artifact written to {}: {n} heads removed ({}), held-out loss {:.4} (with every \
         head {:.4}); one pass over the held-out batches {:.0} ms vs {:.0} ms",
        out.display(),
        map.iter()
            .map(|(layer, heads)| format!("{layer}: {heads:?}"))
            .collect::<Vec<_>>()
            .join("; "),
        score.loss,
        full.loss,
        1e3 * pruned_s,
        1e3 * full_s
    );
    Ok(())
}
