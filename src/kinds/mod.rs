//! The model kinds: one module per kind, each implementing [`ModelKind`] — everything the
//! application needs from a kind (its model, its data and batches, its loss, evaluation and
//! inspection) — for that kind's config section.
//!
//! Everything else is written once, here and in `train/`: `train`, `bench train` and `heads`
//! drive every kind through the same functions, reached through the one `match` on the kind
//! ([`each_kind!`](crate::config::each_kind)); commands that take an artifact of any kind
//! (`eval`, `attention`, `explain`, `embed`, `serve`) get an [`AnyTrained`], one variant per
//! kind; commands made for one kind (`generate`, `translate`, `predict`, `classify`) load it
//! with [`load_as`], which names the kind an artifact holds instead.

/// Implements burn-train's `TrainStep` and `InferenceStep` for a kind's model from the kind's
/// one loss (`ModelKind::loss`, which maps a batch to `(loss, logits, targets)`): training
/// backpropagates the loss, validation only reports it (without attention weights: see
/// [`crate::nn::without_weights`]).
macro_rules! supervised_steps {
    ($model:ident, $kind:ty) => {
        impl<B: $crate::kernels::LabAutodiff> burn::train::TrainStep for $model<B> {
            type Input = <$kind as $crate::kinds::ModelKind>::Batch<B>;
            type Output = burn::train::ClassificationOutput<B>;

            fn step(&self, batch: Self::Input) -> burn::train::TrainOutput<Self::Output> {
                let (loss, output, targets) =
                    <$kind as $crate::kinds::ModelKind>::loss(self, batch);
                let output = burn::train::ClassificationOutput {
                    loss,
                    output,
                    targets,
                };
                let grads = output.loss.backward();
                burn::train::TrainOutput::new(self, grads, output)
            }
        }

        impl<B: $crate::kernels::LabBackend> burn::train::InferenceStep for $model<B> {
            type Input = <$kind as $crate::kinds::ModelKind>::Batch<B>;
            type Output = burn::train::ClassificationOutput<B>;

            /// The loss and logits only, so attention runs as the fused kernel (as in `eval`)
            /// instead of building every head's weights: training's validation.
            fn step(&self, batch: Self::Input) -> Self::Output {
                let (loss, output, targets) = $crate::nn::without_weights(|| {
                    <$kind as $crate::kinds::ModelKind>::loss(self, batch)
                });
                burn::train::ClassificationOutput {
                    loss,
                    output,
                    targets,
                }
            }
        }
    };
}

mod classifier;
mod clip;
mod lm;
mod mlm;
mod seq2seq;
mod vit;

pub use clip::{
    image_maps as clip_image_maps, pca_2d, recall_at, text_maps as clip_text_maps, zero_shot,
    zero_shot_pixels,
};
pub use lm::{evaluate_lm, Corpus};
pub use mlm::{evaluate_mlm, fill_mask, Filled, MlmScore};
pub use seq2seq::TranslationData;
pub use vit::image_maps as vit_image_maps;

use crate::artifact::{
    check_new_artifact_dir, load_weights, write_new_artifact, ArtifactDir, Tokenizers, Trained,
};
use crate::config::{
    each_kind, ClassifierConfig, ClipConfig, DataConfig, ExperimentConfig, LmConfig, MlmConfig,
    ModelConfig, ModelSection, Seq2SeqConfig, TrainConfig, VitConfig,
};
use crate::inspect::heads::{self, HeldOut, HeldOutBatch, LossOutput, PruneStep};
use crate::inspect::{AttentionMaps, GroupStats, TextModel};
use crate::kernels::{LabAutodiff, LabBackend};
use crate::models::{Clip, LanguageModel, MaskedLm, Seq2Seq, TextClassifier, VisionTransformer};
use crate::nn::{pruned_heads, remove_heads, AttentionLayers, StackConfig};
use crate::train::speed::{bench_training, padding_note, BenchPlan, BenchReport};
use crate::train::{
    launch, train_loader, BatchFn, LaunchOptions, Session, TrainReport, TrainRequest,
};
use anyhow::{bail, Context, Result};
use burn::data::dataset::Dataset;
use burn::module::{AutodiffModule, Module};
use burn::train::{ClassificationOutput, InferenceStep, TrainStep};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Everything the application needs from one model kind, implemented for the kind's config
/// section (`LmConfig`, `Seq2SeqConfig`, …): its model, its data and how a batch is made, its
/// loss, its evaluation and inspection. `train`, `bench train` and `heads` drive every kind
/// through the same code ([`train`], [`bench`], [`heads`]); nothing else about training is
/// written per kind.
pub trait ModelKind: ModelSection {
    /// The trained model on backend `B`.
    type Model<B: LabBackend>: Module<B> + AttentionLayers<B>;
    /// One example of the kind's data (a window of tokens, a sentence, an image, a pair).
    type Item: Send + Sync + 'static;
    /// A split of the kind's data.
    type Split: Dataset<Self::Item> + 'static;
    /// What turns examples into a batch (the split's image size, the augmentation).
    type Batcher: Send + Sync + 'static;
    /// A batch of examples on backend `B`.
    type Batch<B: LabBackend>: Clone + Send + 'static;

    /// A fresh model (vocabulary sizes resolved, config validated), every head in place.
    fn build<B: LabBackend>(&self, device: &B::Device) -> Self::Model<B>;

    /// A fresh model to train with `train`'s settings (a translator's label smoothing).
    fn build_for_training<B: LabBackend>(
        &self,
        _train: &TrainConfig,
        device: &B::Device,
    ) -> Self::Model<B> {
        self.build(device)
    }

    /// The artifact whose weights (and tokenizers) a training starts from, if any.
    fn init_from(&self) -> Option<&Path> {
        None
    }

    /// `model` with the weights of the artifact in `from` (see [`ModelKind::init_from`]): by
    /// default the whole model, which must be the one this config describes.
    fn start_from<B: LabBackend>(
        &self,
        model: Self::Model<B>,
        from: &ArtifactDir,
        device: &B::Device,
    ) -> Result<Self::Model<B>> {
        start_from_whole(model, from, device)
    }

    /// The section's transformer settings.
    fn stack(&self) -> &StackConfig;

    /// The same, to change.
    fn stack_mut(&mut self) -> &mut StackConfig;

    /// Every stack's settings (a model with two encoders has two), to change.
    fn stacks_mut(&mut self) -> Vec<&mut StackConfig> {
        vec![self.stack_mut()]
    }

    /// The heads `heads --prune` removed, by the whole model's attention layer names (empty:
    /// unpruned).
    fn pruned_heads(&self) -> BTreeMap<String, Vec<usize>> {
        self.stack().pruned_heads.clone()
    }

    /// Records the heads removed from the model (see [`ModelKind::pruned_heads`]).
    fn set_pruned_heads(&mut self, pruned: BTreeMap<String, Vec<usize>>) {
        self.stack_mut().pruned_heads = pruned;
    }

    /// Floats one training example keeps for the backward pass, vocabulary sizes resolved (a
    /// lower bound, for the memory check before training).
    fn activation_floats(&self, data: &DataConfig) -> f64;

    /// Reads the experiment's data and splits it, fitting tokenizers unless `tokenizers` are
    /// given (a resumed run's, an `init_from` artifact's, a trained model's); the config comes
    /// back with the vocabulary sizes they resolve.
    fn prepare(
        config: ExperimentConfig,
        tokenizers: Option<Tokenizers>,
        data_dir: &Path,
    ) -> Result<Prepared<Self>>;

    /// A batch of `items`; `draw` is the seed of a training batch's draw (augmentation and
    /// masking follow it), `None` for held-out batches (no augmentation, fixed masks).
    fn batch<B: LabBackend>(
        batcher: &Self::Batcher,
        items: Vec<Self::Item>,
        draw: Option<u64>,
        device: &B::Device,
    ) -> Self::Batch<B>;

    /// The model's loss on a batch, with the scores and targets the metrics read — the one
    /// place the kind's loss is written (training, validation, `bench train` and `heads` all
    /// call it).
    fn loss<B: LabBackend>(model: &Self::Model<B>, batch: Self::Batch<B>) -> LossOutput<B>;

    /// What `bench train` counts in a batch (tokens, target tokens, sentences, images).
    fn units<B: LabBackend>(batch: &Self::Batch<B>) -> usize;

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
}

/// A kind's data, read, split and ready to batch: what [`ModelKind::prepare`] gives `train`,
/// `bench train` and `heads`.
pub struct Prepared<K: ModelKind> {
    /// The experiment, vocabulary sizes resolved.
    pub config: ExperimentConfig,
    /// The tokenizers the data was read with (saved with the artifact); none for images.
    pub tokenizers: Option<Tokenizers>,
    /// One line on the data, printed as a training starts ("sst2: 66,000 training, …").
    pub summary: Option<String>,
    /// The training split.
    pub train: K::Split,
    /// The validation split.
    pub valid: K::Split,
    /// What batches both.
    pub batcher: K::Batcher,
    /// Each training example's length, when batches may be grouped by length.
    pub lengths: Option<Vec<usize>>,
    /// Each padded side's lengths, for `bench train`'s padding note (`("source", …)`).
    pub padding: Vec<(&'static str, Vec<usize>)>,
    /// The metrics a training reports and what a step consumes.
    pub launch: LaunchOptions,
    /// What a validation example is, in words ("validation sentences"), for `heads`.
    pub valid_items: String,
    /// Whether accuracy means something beside the loss (classifiers), for `heads`.
    pub accuracy: bool,
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

/// A kind's two ways of batching: training batches (augmented from their draw's seed) and
/// held-out ones (as they are).
pub struct TrainAndHeldOut<T> {
    /// Makes training batches.
    pub train: T,
    /// Makes held-out batches.
    pub held_out: T,
}

/// A trained model of whichever kind an artifact holds: one variant per kind, so every command
/// that takes any artifact is checked by the compiler to handle every kind.
// One per command or worker, held for its life: boxing the variants would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum AnyTrained<B: LabBackend> {
    /// A language model.
    Lm(Trained<LanguageModel<B>>),
    /// A translator.
    Seq2seq(Trained<Seq2Seq<B>>),
    /// A text classifier.
    Classifier(Trained<TextClassifier<B>>),
    /// A Vision Transformer.
    Vit(Trained<VisionTransformer<B>>),
    /// A CLIP model.
    Clip(Trained<Clip<B>>),
    /// A masked language model.
    Mlm(Trained<MaskedLm<B>>),
}

/// `each_trained!(trained, K, t => expression)`: the expression with `t` the typed trained
/// model and `K` its kind's config section.
macro_rules! each_trained {
    ($trained:expr, $kind:ident, $t:ident => $body:expr) => {
        match $trained {
            AnyTrained::Lm($t) => {
                #[allow(dead_code)]
                type $kind = LmConfig;
                $body
            }
            AnyTrained::Seq2seq($t) => {
                #[allow(dead_code)]
                type $kind = Seq2SeqConfig;
                $body
            }
            AnyTrained::Classifier($t) => {
                #[allow(dead_code)]
                type $kind = ClassifierConfig;
                $body
            }
            AnyTrained::Vit($t) => {
                #[allow(dead_code)]
                type $kind = VitConfig;
                $body
            }
            AnyTrained::Clip($t) => {
                #[allow(dead_code)]
                type $kind = ClipConfig;
                $body
            }
            AnyTrained::Mlm($t) => {
                #[allow(dead_code)]
                type $kind = MlmConfig;
                $body
            }
        }
    };
}

impl<B: LabBackend> AnyTrained<B> {
    /// Its resolved config.
    pub fn config(&self) -> &ExperimentConfig {
        each_trained!(self, K, t => &t.config)
    }

    /// See [`ModelKind::eval`].
    pub fn eval(&self, request: &EvalRequest, device: &B::Device) -> Result<()> {
        each_trained!(self, K, t => K::eval(t, request, device))
    }

    /// See [`ModelKind::attention`].
    pub fn attention(
        &self,
        input: &str,
        target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps> {
        each_trained!(self, K, t => K::attention(t, input, target, device))
    }

    /// See [`ModelKind::statistics`].
    pub fn statistics(
        &self,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>> {
        each_trained!(self, K, t => K::statistics(t, maps, seed, device))
    }

    /// See [`ModelKind::text_model`].
    pub fn text_model(&self) -> Result<TextModel<'_, B>> {
        each_trained!(self, K, t => K::text_model(t))
    }
}

/// Loads the model `artifact` holds, whatever its kind.
pub fn load<B: LabBackend>(artifact: &ArtifactDir, device: &B::Device) -> Result<AnyTrained<B>> {
    let config = ExperimentConfig::load(&artifact.config())?;
    Ok(match &config.model {
        ModelConfig::Lm(_) => AnyTrained::Lm(load_as::<LmConfig, B>(artifact, device)?),
        ModelConfig::Seq2seq(_) => {
            AnyTrained::Seq2seq(load_as::<Seq2SeqConfig, B>(artifact, device)?)
        }
        ModelConfig::Classifier(_) => {
            AnyTrained::Classifier(load_as::<ClassifierConfig, B>(artifact, device)?)
        }
        ModelConfig::Vit(_) => AnyTrained::Vit(load_as::<VitConfig, B>(artifact, device)?),
        ModelConfig::Clip(_) => AnyTrained::Clip(load_as::<ClipConfig, B>(artifact, device)?),
        ModelConfig::Mlm(_) => AnyTrained::Mlm(load_as::<MlmConfig, B>(artifact, device)?),
    })
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
    remove_heads(&mut model, &section.pruned_heads())?;
    Ok(model)
}

/// Refuses to train a pruned config from scratch (its heads were chosen for trained weights).
fn check_unpruned<K: ModelKind>(section: &K) -> Result<()> {
    if !section.pruned_heads().is_empty() {
        bail!(
            "model.pruned_heads: this config describes a model pruned by `transformer-lab heads \
             --prune`; train the unpruned config (remove pruned_heads) and prune it after training"
        );
    }
    Ok(())
}

/// The batch function of training batches (drawn with a seed) of kind `K`.
fn train_batches<K: ModelKind, B: LabBackend>(
    batcher: Arc<K::Batcher>,
) -> BatchFn<B, K::Item, K::Batch<B>> {
    Arc::new(move |items, seed, device| K::batch::<B>(&batcher, items, Some(seed), device))
}

/// The batch function of held-out batches of kind `K`.
fn held_out_batches_of<K: ModelKind, B: LabBackend>(
    batcher: Arc<K::Batcher>,
) -> BatchFn<B, K::Item, K::Batch<B>> {
    Arc::new(move |items, _seed, device| K::batch::<B>(&batcher, items, None, device))
}

/// Runs (or resumes) the training `request` asks for, with the kind its config names.
pub fn train<B: LabAutodiff>(request: TrainRequest, device: B::Device) -> Result<TrainReport> {
    crate::train::run(request, |config, tokenizers, session, data_dir| {
        crate::kernels::use_precision::<B>(config.train.precision, &device)?;
        let model = config.model.clone();
        each_kind!(&model, section => {
            train_kind::<_, B>(section, config, tokenizers, session, data_dir, device)
        })
    })
}

/// The tokenizers of the artifact a run starts from (`init_from`): a run that starts from an
/// artifact reads its data as that artifact did; the config must name their kind.
fn init_from_tokenizers(
    config: &ExperimentConfig,
    from: Option<&ArtifactDir>,
) -> Result<Option<Tokenizers>> {
    let Some(from) = from else {
        return Ok(None);
    };
    let tokenizers = Tokenizers::load(from)?;
    let (named, theirs) = (config.data.tokenizer, tokenizers.target.kind());
    if named != theirs {
        let name = |kind| serde_json::to_value(kind).unwrap_or_default();
        bail!(
            "data.tokenizer is {}, but model.init_from's tokenizer is {}: name the one the \
             model was trained with",
            name(named).as_str().unwrap_or("?"),
            name(theirs).as_str().unwrap_or("?")
        );
    }
    Ok(Some(tokenizers))
}

/// One training of kind `K`: its data, then the shared path of `train/`.
fn train_kind<K, B>(
    section: &K,
    config: ExperimentConfig,
    tokenizers: Option<Tokenizers>,
    session: &Session,
    data_dir: &Path,
    device: B::Device,
) -> Result<TrainReport>
where
    K: ModelKind,
    B: LabAutodiff,
    K::Model<B>: TrainStep<Input = K::Batch<B>, Output = ClassificationOutput<B>>
        + AutodiffModule<B>
        + core::fmt::Display
        + 'static,
    <K::Model<B> as AutodiffModule<B>>::InnerModule: InferenceStep<
        Input = K::Batch<B::InnerBackend>,
        Output = ClassificationOutput<B::InnerBackend>,
    >,
{
    check_unpruned(section)?;
    let from = section.init_from().map(ArtifactDir::new);
    let tokenizers = tokenizers.map_or_else(
        || init_from_tokenizers(&config, from.as_ref()),
        |t| Ok(Some(t)),
    )?;
    let prepared = K::prepare(config, tokenizers, data_dir)?;
    let config = &prepared.config;
    if let Some(summary) = &prepared.summary {
        println!("{summary}");
    }
    let section = config.model_as::<K>()?;
    let floats = section.activation_floats(&config.data);
    let devices = match &config.train.devices {
        Some(ids) if !ids.is_empty() => crate::backend::peer_devices::<B>(&device, ids)?,
        _ => vec![device.clone()],
    };
    // The model lives where peer 0 trains: on the first device listed (`--devices 1` trains on
    // device 1 alone, `--devices 2,3` on 2 and 3), not on the backend's default device.
    let device = devices[0].clone();
    let nodes = session.nodes().map_or(1, |g| g.count);
    let peers = devices.len() * nodes;
    if !config.train.batch_size.is_multiple_of(peers) {
        bail!(
            "train: batch_size ({}) must be a multiple of the devices of all nodes ({peers}): each \
             trains on an equal share of every batch",
            config.train.batch_size
        );
    }
    session.begin(config, prepared.tokenizers.as_ref(), floats)?;
    if peers > 1 {
        let shared = devices.len() > 1 && devices.iter().skip(1).all(|d| *d == devices[0]);
        println!(
            "data-parallel on {} ({}){}: each trains on {} of every batch's {} items{}",
            crate::stdio::count(devices.len(), "device"),
            devices
                .iter()
                .map(|d| format!("{d:?}"))
                .collect::<Vec<_>>()
                .join(", "),
            session
                .nodes()
                .map(|g| format!(" × {} nodes (this is node {})", g.count, g.rank))
                .unwrap_or_default(),
            config.train.batch_size / peers,
            config.train.batch_size,
            if shared {
                "; they share one device here, so this tests the path and is no faster"
            } else {
                ""
            }
        );
    }
    crate::kernels::seed::<B>(&device, config.seed);
    // The step check's batch: the first items of the training split, one device's share up to
    // 16 (its composed attention holds every score: the memory of a --no-fused step).
    let probe: Vec<K::Item> = match crate::kernels::step_check::wanted() {
        Some(_) => (0..(config.train.batch_size / peers).min(16))
            .filter_map(|i| prepared.train.get(i))
            .collect(),
        None => Vec::new(),
    };
    let batcher = Arc::new(prepared.batcher);
    let probe_batcher = batcher.clone();
    let loaders = session.loaders(
        config,
        &devices,
        prepared.train,
        train_batches::<K, B>(batcher.clone()),
        prepared.valid,
        held_out_batches_of::<K, B::InnerBackend>(batcher),
        prepared.lengths,
    );
    let mut model = section.build_for_training::<B>(&config.train, &device);
    if let Some(from) = &from {
        model = section.start_from(model, from, &device)?;
        println!("starting from the weights of {}", from.weights()?.display());
    }
    if !probe.is_empty() {
        let batch = K::batch::<B>(&probe_batcher, probe, Some(config.seed), &device);
        let shape = run_shape(config, peers);
        crate::kernels::step_check::prepare(&shape, &model, |model| {
            K::loss(model, batch.clone()).0
        });
    }
    launch(config, session, model, loaders, prepared.launch)
}

/// What makes a run's shapes, for the step check's cache: the model and data sections and one
/// device's share of a batch (of which the check takes up to 16 items), hashed (the cache key also names the binary, which fixes the
/// hash function).
fn run_shape(config: &ExperimentConfig, peers: usize) -> String {
    use std::hash::{Hash, Hasher};
    let sections = serde_json::to_string(&(&config.model, &config.data)).unwrap_or_default();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (sections, config.train.batch_size / peers).hash(&mut hasher);
    format!("{} {:016x}", config.name, hasher.finish())
}

/// `bench train` of `config`, whatever its kind: `plan`'s training steps of a fresh model on
/// batches of the real training data, drawn as `train` draws them, timed phase by phase.
pub fn bench<B: LabAutodiff>(
    config: ExperimentConfig,
    data_dir: &Path,
    plan: BenchPlan,
    device: &B::Device,
) -> Result<BenchReport> {
    crate::kernels::use_precision::<B>(config.train.precision, device)?;
    let model = config.model.clone();
    each_kind!(&model, section => bench_kind::<_, B>(section, config, data_dir, plan, device))
}

fn bench_kind<K: ModelKind, B: LabAutodiff>(
    section: &K,
    config: ExperimentConfig,
    data_dir: &Path,
    plan: BenchPlan,
    device: &B::Device,
) -> Result<BenchReport>
where
    K::Model<B>: AutodiffModule<B>,
{
    check_unpruned(section)?;
    let from = section.init_from().map(ArtifactDir::new);
    let tokenizers = init_from_tokenizers(&config, from.as_ref())?;
    let prepared = K::prepare(config, tokenizers, data_dir)?;
    let config = &prepared.config;
    let section = config.model_as::<K>()?;
    let padding = match (&prepared.lengths, prepared.padding.is_empty()) {
        (Some(keys), false) => Some(padding_note(config, &prepared.padding, keys)),
        _ => None,
    };
    let loader = train_loader(
        config,
        device,
        prepared.train,
        train_batches::<K, B>(Arc::new(prepared.batcher)),
        Arc::default(),
        prepared.lengths,
    );
    let init = || section.build_for_training::<B>(&config.train, device);
    let loss = |model: &K::Model<B>, batch| K::loss(model, batch).0;
    let units = prepared.launch.throughput.units;
    let mut report = bench_training(
        config,
        plan,
        &loader,
        units,
        K::units::<B>,
        init,
        loss,
        device,
    )?;
    report.notes.extend(padding);
    Ok(report)
}

/// `heads`: held-out (validation) batches of a trained model's data, each giving the loss of
/// whichever model it is handed.
fn held_out_of<K: ModelKind, B: LabBackend>(
    trained: &Trained<K::Model<B>>,
    request: &HeldOutRequest,
    device: &B::Device,
) -> Result<HeldOut<'static, B, K::Model<B>>> {
    let tokenizers = trained.tokenizers.clone();
    let prepared = K::prepare(trained.config.clone(), tokenizers, &request.data_dir)?;
    let batcher = Arc::new(prepared.batcher);
    let batch = move |items, device: &B::Device| K::batch::<B>(&batcher, items, None, device);
    let loss = |m: &K::Model<B>, b| K::loss(m, b);
    let (n, batches) = held_out_batches(&prepared.valid, request, batch, device, loss)?;
    Ok(HeldOut {
        what: format!("{n} {}", prepared.valid_items),
        batches,
        accuracy: prepared.accuracy,
    })
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
/// smaller), made by `batch`, each handed to `loss` with whichever model is judged.
fn held_out_batches<B, M, I, O>(
    dataset: &impl Dataset<I>,
    request: &HeldOutRequest,
    batch: impl Fn(Vec<I>, &B::Device) -> O,
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
        let batch = batch(chunk, device);
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
    each_kind!(&config.model, section => study_heads::<_, B>(section, request, device))
}

fn study_heads<K: ModelKind, B: LabAutodiff>(
    _: &K,
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
    let held_out = held_out_of::<K, _>(&trained, &request.held_out, device)?;
    println!(
        "{}: every head judged on {}",
        trained.config.name, held_out.what
    );

    let gradients = {
        let held_out = held_out_of::<K, _>(&differentiable, &request.held_out, device)?;
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
    section.set_pruned_heads(pruned_heads(&mut model));
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
    let map = &section.pruned_heads();
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

/// `model` with every weight of the artifact in `from`, whose model must be the one `model`'s
/// config describes (the default of [`ModelKind::start_from`]).
pub(crate) fn start_from_whole<M: Module<B>, B: LabBackend>(
    model: M,
    from: &ArtifactDir,
    device: &B::Device,
) -> Result<M> {
    let weights = from.weights()?;
    load_weights(model, &weights, device).with_context(|| {
        format!(
            "model.init_from {}: its model is not the one this config describes",
            from.root().display()
        )
    })
}
