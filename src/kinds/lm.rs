//! The language model kind: next-token training on a text, whole-split evaluation, causal
//! self-attention to inspect.

use super::{EvalRequest, ModelKind, Prepared};
use crate::artifact::{Tokenizers, Trained};
use crate::config::{DataConfig, ExperimentConfig, LmConfig, ModelConfig, ModelSection};
use crate::data::{DatasetSpec, LmBatch, LmBatcher, LmItem, Task, TokenWindows, Tokenizer};
use crate::inspect::heads::LossOutput;
use crate::inspect::{
    text_statistics, weights_or_dense, AttentionGroup, AttentionMaps, GroupStats, TextModel,
};
use crate::kernels::LabBackend;
use crate::models::LanguageModel;
use crate::nn::StackConfig;
use crate::train::LaunchOptions;
use anyhow::{bail, Context, Result};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::prelude::*;
use std::path::Path;
use std::sync::Arc;

supervised_steps!(LanguageModel, LmConfig);

impl ModelSection for LmConfig {
    const KIND: &'static str = "lm";
    const DESCRIPTION: &'static str = "language model";
    const COMMAND: &'static str = "generate";
    const UNSERIALIZED_DEFAULTS: &'static [&'static str] = &["init_from"];

    fn validate(&self, data: &DataConfig) -> Result<()> {
        LmConfig::validate(self)?;
        if data.text_file.is_some() {
            return Ok(());
        }
        match Task::of(&data.dataset) {
            Some(Task::Translation) => bail!(
                "data: {} is a translation dataset; it needs a seq2seq model",
                data.dataset
            ),
            Some(Task::SentenceClassification | Task::Images) => bail!(
                "data: {} is a classification dataset; a language model needs text",
                data.dataset
            ),
            Some(Task::Text) | None => Ok(()),
        }
    }

    fn vocab_sizes(&self) -> (usize, usize) {
        (self.vocab_size, self.vocab_size)
    }

    fn with_vocab_sizes(&self, _source: usize, target: usize) -> ModelConfig {
        ModelConfig::Lm(LmConfig {
            vocab_size: target,
            ..self.clone()
        })
    }

    fn of(model: &ModelConfig) -> Option<&Self> {
        match model {
            ModelConfig::Lm(section) => Some(section),
            _ => None,
        }
    }
}

impl ModelKind for LmConfig {
    type Model<B: LabBackend> = LanguageModel<B>;
    type Item = LmItem;
    type Split = TokenWindows;
    type Batcher = LmBatcher;
    type Batch<B: LabBackend> = LmBatch<B>;

    fn build<B: LabBackend>(&self, device: &B::Device) -> LanguageModel<B> {
        self.init(device)
    }

    fn init_from(&self) -> Option<&Path> {
        self.init_from.as_deref()
    }

    fn stack(&self) -> &StackConfig {
        &self.stack
    }

    fn stack_mut(&mut self) -> &mut StackConfig {
        &mut self.stack
    }

    fn activation_floats(&self, _data: &DataConfig) -> f64 {
        self.stack.activation_floats(self.n_layers, self.context)
            + (self.context * self.vocab_size) as f64
    }

    fn prepare(
        mut config: ExperimentConfig,
        tokenizers: Option<Tokenizers>,
        data_dir: &Path,
    ) -> Result<Prepared<Self>> {
        let corpus = Corpus::load(&config, data_dir, tokenizers.map(|t| t.target))?;
        let vocab = corpus.tokenizer.vocab_size();
        config.model.set_vocab_sizes(vocab, vocab);
        let context = config.model_as::<LmConfig>()?.context;
        let per_step = config.train.batch_size * context;
        Ok(Prepared {
            tokenizers: Some(Tokenizers::shared(corpus.tokenizer)),
            summary: None,
            train: TokenWindows::new(corpus.train, context),
            valid: TokenWindows::new(corpus.valid, context),
            batcher: LmBatcher,
            lengths: None,
            padding: Vec::new(),
            launch: LaunchOptions::tokens(per_step, "tokens"),
            valid_items: format!("windows of {context} tokens spread over the validation split"),
            accuracy: false,
            config,
        })
    }

    fn batch<B: LabBackend>(
        batcher: &LmBatcher,
        items: Vec<LmItem>,
        _draw: Option<u64>,
        device: &B::Device,
    ) -> LmBatch<B> {
        batcher.batch(items, device)
    }

    fn loss<B: LabBackend>(model: &LanguageModel<B>, batch: LmBatch<B>) -> LossOutput<B> {
        model.loss(batch)
    }

    fn units<B: LabBackend>(batch: &LmBatch<B>) -> usize {
        batch.targets.dims().iter().product()
    }

    fn eval<B: LabBackend>(
        trained: &Trained<LanguageModel<B>>,
        request: &EvalRequest,
        device: &B::Device,
    ) -> Result<()> {
        let context = request.context.unwrap_or(trained.model.context());
        let (loss, perplexity, tokens) = evaluate_lm(
            trained,
            &request.data_dir,
            request.batch_size,
            context,
            device,
        )?;
        println!(
            "{}: validation loss {loss:.4}, perplexity {perplexity:.3} over the whole validation \
             split: {tokens} tokens in windows of {context} (train's figures are over a fixed \
             sample of it)",
            trained.config.name
        );
        Ok(())
    }

    fn attention<B: LabBackend>(
        trained: &Trained<LanguageModel<B>>,
        input: &str,
        _target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps> {
        let text = Self::text_model(trained)?;
        let ids = text.encode(input)?;
        let mut maps = AttentionMaps::new(&trained.config.name, Self::KIND, input);
        maps.groups = vec![self_attention(trained, &text, &ids, device)?];
        Ok(maps)
    }

    fn statistics<B: LabBackend>(
        trained: &Trained<LanguageModel<B>>,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>> {
        let text = Self::text_model(trained)?;
        let ids = text.encode(&maps.input)?;
        text_statistics(maps, &ids, 0..ids.len(), seed, |shuffled| {
            Ok(vec![self_attention(trained, &text, shuffled, device)?])
        })
    }

    fn text_model<B: LabBackend>(trained: &Trained<LanguageModel<B>>) -> Result<TextModel<'_, B>> {
        let model = &trained.model;
        Ok(TextModel {
            tokenizer: trained.tokenizer(),
            first: None,
            last: None,
            max_len: model.context(),
            causal: true,
            stack: &model.decoder,
            table: model.token_embedding.weight.val(),
            embed: Box::new(|tokens| model.embed(tokens)),
        })
    }
}

/// The causal self-attention of every layer on `ids`.
fn self_attention<B: LabBackend>(
    trained: &Trained<LanguageModel<B>>,
    text: &TextModel<'_, B>,
    ids: &[usize],
    device: &B::Device,
) -> Result<AttentionGroup> {
    let tokens = text.tokens(ids, device);
    let out = trained.model.forward(tokens.clone());
    let weights = weights_or_dense(out.attention, || {
        let mask = text.mask(ids.len(), device);
        let x = trained.model.embed(tokens);
        trained.model.decoder.mixer_weights(x, mask.as_ref(), None)
    })?;
    let labels = text.labels(ids);
    Ok(AttentionGroup::from_layers(
        "self", true, &labels, &labels, weights,
    ))
}

/// Tokenized train and validation splits of the experiment's text.
pub struct Corpus {
    /// The tokenizer (fit on the training split, or the artifact's on resume).
    pub tokenizer: Tokenizer,
    /// Training token ids.
    pub train: Arc<Vec<u32>>,
    /// Validation token ids.
    pub valid: Arc<Vec<u32>>,
}

impl Corpus {
    /// Reads the dataset, splits it (the first `1 − valid_fraction` of characters for training)
    /// and tokenizes both parts, fitting a tokenizer on the training part unless one is given.
    pub fn load(
        config: &ExperimentConfig,
        data_dir: &Path,
        tokenizer: Option<Tokenizer>,
    ) -> Result<Self> {
        let path = match &config.data.text_file {
            Some(path) => path.clone(),
            None => DatasetSpec::find(&config.data.dataset)?
                .ensure(data_dir)?
                .remove(0),
        };
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?;
        let chars: Vec<char> = text.chars().collect();
        let split = ((chars.len() as f64) * (1.0 - config.data.valid_fraction)) as usize;
        let train_text: String = chars[..split].iter().collect();
        let valid_text: String = chars[split..].iter().collect();
        let tokenizer = match tokenizer {
            Some(tokenizer) => tokenizer,
            None => Tokenizer::fit(
                config.data.tokenizer,
                train_text.split_inclusive('\n'),
                config.data.bpe_vocab_size,
            )?,
        };
        let encode = |text: &str, part: &str| -> Result<Arc<Vec<u32>>> {
            let ids = tokenizer.encode(text).with_context(|| {
                format!("cannot tokenize the {part} split of {}", path.display())
            })?;
            Ok(Arc::new(ids.into_iter().map(|id| id as u32).collect()))
        };
        let train = encode(&train_text, "training")?;
        let valid = encode(&valid_text, "validation")?;
        let context = config.model_as::<LmConfig>()?.context;
        if train.len() <= context || valid.len() <= context {
            bail!("the text is too short for context {context}: each split needs more tokens");
        }
        Ok(Self {
            tokenizer,
            train,
            valid,
        })
    }
}

/// Validation loss, perplexity and token count over every non-overlapping window of the
/// validation split.
pub fn evaluate_lm<B: LabBackend>(
    trained: &Trained<LanguageModel<B>>,
    data_dir: &Path,
    batch_size: usize,
    context: usize,
    device: &B::Device,
) -> Result<(f64, f64, usize)> {
    let model = &trained.model;
    if context == 0 {
        bail!("--context must be at least 1");
    }
    if context > model.context() && !model.any_length() {
        let position = trained.config.model_as::<LmConfig>()?.position;
        bail!(
            "--context {context} is longer than the model's context {} and its {} positions end \
             there; use at most {}, or a model with rope or alibi positions",
            model.context(),
            serde_json::to_value(position)?
                .as_str()
                .unwrap_or("absolute"),
            model.context()
        );
    }
    let corpus = Corpus::load(&trained.config, data_dir, Some(trained.tokenizer().clone()))?;
    let windows = TokenWindows::non_overlapping(corpus.valid, context);
    let loader = DataLoaderBuilder::<B, _, _>::new(LmBatcher)
        .batch_size(batch_size)
        .set_device(device.clone())
        .build(windows);
    let (mut sum, mut count) = (0.0f64, 0usize);
    for batch in loader.iter() {
        let n = batch.targets.dims().iter().product::<usize>();
        let (loss, _, _) = trained.model.loss(batch);
        sum += loss.into_scalar().elem::<f64>() * n as f64;
        count += n;
    }
    let loss = sum / count as f64;
    Ok((loss, loss.exp(), count))
}
