//! The sentence classifier kind: cross-entropy over class scores of labelled sentences, test
//! accuracy with a confusion matrix, bidirectional self-attention to inspect.

use super::load_as;
use super::{EvalRequest, ModelKind, Prepared};
use crate::artifact::{ArtifactDir, Tokenizers, Trained};
use crate::classify::{class_names, evaluate_classifier, report_confusion};
use crate::config::{
    ClassifierConfig, DataConfig, ExperimentConfig, MlmConfig, ModelConfig, ModelSection,
    TokenizerKind,
};
use crate::data::{
    EncodedSentences, SentenceBatch, SentenceBatcher, SentenceItem, SentimentCorpus, Special, Task,
    Tokenizer,
};
use crate::inspect::heads::LossOutput;
use crate::inspect::{
    predicted_class, text_statistics, weights_or_dense, AttentionGroup, AttentionMaps, GroupStats,
    TextModel,
};
use crate::kernels::LabBackend;
use crate::models::{TextClassifier, TextEncoder};
use crate::nn::StackConfig;
use crate::train::LaunchOptions;
use anyhow::{bail, Result};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::module::Module;
use std::path::Path;

supervised_steps!(TextClassifier, ClassifierConfig);

impl ModelSection for ClassifierConfig {
    const KIND: &'static str = "classifier";
    const DESCRIPTION: &'static str = "text classifier";
    const COMMAND: &'static str = "classify";
    const UNSERIALIZED_DEFAULTS: &'static [&'static str] = &["init_from", "embedding_norm"];

    fn validate(&self, data: &DataConfig) -> Result<()> {
        ClassifierConfig::validate(self)?;
        if Task::of(&data.dataset) != Some(Task::SentenceClassification) {
            bail!(
                "data: a classifier needs a sentence-classification dataset (sst2 or uci-sentiment), not {}",
                data.dataset
            );
        }
        if !matches!(data.tokenizer, TokenizerKind::Bpe | TokenizerKind::Bert) {
            bail!(
                "data: a classifier needs the bpe tokenizer, or an imported BERT's (it uses \
                 <pad> and <s>)"
            );
        }
        if data.max_tokens < 2 || data.max_tokens > self.max_len {
            bail!(
                "data: max_tokens ({}) must be in 2..={} (the model's max_len)",
                data.max_tokens,
                self.max_len
            );
        }
        Ok(())
    }

    fn vocab_sizes(&self) -> (usize, usize) {
        (self.vocab_size, self.vocab_size)
    }

    fn with_vocab_sizes(&self, _source: usize, target: usize) -> ModelConfig {
        ModelConfig::Classifier(ClassifierConfig {
            vocab_size: target,
            ..self.clone()
        })
    }

    fn of(model: &ModelConfig) -> Option<&Self> {
        match model {
            ModelConfig::Classifier(section) => Some(section),
            _ => None,
        }
    }
}

impl ModelKind for ClassifierConfig {
    type Model<B: LabBackend> = TextClassifier<B>;
    type Item = SentenceItem;
    type Split = EncodedSentences;
    type Batcher = SentenceBatcher;
    type Batch<B: LabBackend> = SentenceBatch<B>;

    fn build<B: LabBackend>(&self, device: &B::Device) -> TextClassifier<B> {
        self.init(device)
    }

    fn init_from(&self) -> Option<&Path> {
        self.init_from.as_deref()
    }

    /// From a masked language model: its token embedding, positions and encoder, the head
    /// fresh; from a classifier: all of it.
    fn start_from<B: LabBackend>(
        &self,
        model: TextClassifier<B>,
        from: &ArtifactDir,
        device: &B::Device,
    ) -> Result<TextClassifier<B>> {
        let config = ExperimentConfig::load(&from.config())?;
        let Some(mlm) = MlmConfig::of(&config.model) else {
            return super::start_from_whole(model, from, device);
        };
        check_encoder_matches(self, mlm, from)?;
        let pretrained = load_as::<MlmConfig, B>(from, device)?.model;
        // Through records: the weights move, this config's dropout stays.
        let mut model = model;
        model.token_embedding =
            (model.token_embedding).load_record(pretrained.token_embedding.into_record());
        model.position = model
            .position
            .load_record(pretrained.position.into_record());
        model.encoder = model.encoder.load_record(pretrained.encoder.into_record());
        model.embedding_norm = model
            .embedding_norm
            .load_record(pretrained.embedding_norm.into_record());
        Ok(model)
    }

    fn stack(&self) -> &StackConfig {
        &self.stack
    }

    fn stack_mut(&mut self) -> &mut StackConfig {
        &mut self.stack
    }

    fn activation_floats(&self, data: &DataConfig) -> f64 {
        self.stack.activation_floats(self.n_layers, data.max_tokens)
    }

    fn prepare(
        mut config: ExperimentConfig,
        tokenizers: Option<Tokenizers>,
        data_dir: &Path,
    ) -> Result<Prepared<Self>> {
        let (corpus, tokenizer, train, valid) = sentences(&config, data_dir, tokenizers)?;
        let vocab = tokenizer.vocab_size();
        config.model.set_vocab_sizes(vocab, vocab);
        let summary = format!(
            "{}: {} training, {} validation, {} test sentences; vocabulary {vocab}",
            config.data.dataset,
            train.len(),
            valid.len(),
            corpus.test.len(),
        );
        let lengths = train.lengths();
        Ok(Prepared {
            tokenizers: Some(Tokenizers::shared(tokenizer)),
            summary: Some(summary),
            train,
            valid,
            batcher: SentenceBatcher,
            padding: vec![("tokens", lengths.clone())],
            lengths: Some(lengths),
            launch: LaunchOptions::items(config.train.batch_size, "sent", "sentences"),
            valid_items: "validation sentences".into(),
            accuracy: true,
            config,
        })
    }

    fn batch<B: LabBackend>(
        batcher: &SentenceBatcher,
        items: Vec<SentenceItem>,
        _draw: Option<u64>,
        device: &B::Device,
    ) -> SentenceBatch<B> {
        batcher.batch(items, device)
    }

    fn loss<B: LabBackend>(model: &TextClassifier<B>, batch: SentenceBatch<B>) -> LossOutput<B> {
        model.loss(batch.tokens, batch.labels)
    }

    fn units<B: LabBackend>(batch: &SentenceBatch<B>) -> usize {
        batch.labels.dims()[0]
    }

    fn eval<B: LabBackend>(
        trained: &Trained<TextClassifier<B>>,
        request: &EvalRequest,
        device: &B::Device,
    ) -> Result<()> {
        report_confusion(
            &trained.config,
            "test sentences",
            request.output.as_deref(),
            &request.artifact_dir,
            || {
                let (data_dir, limit) = (&request.data_dir, request.limit);
                evaluate_classifier(trained, data_dir, request.batch_size, limit, device)
            },
        )
    }

    fn attention<B: LabBackend>(
        trained: &Trained<TextClassifier<B>>,
        input: &str,
        _target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps> {
        let text = Self::text_model(trained)?;
        let ids = text.encode(input)?;
        let mut maps = AttentionMaps::new(&trained.config.name, Self::KIND, input);
        let (group, class) = self_attention(trained, &text, &ids, device)?;
        maps.groups = vec![group];
        maps.output = Some(class);
        Ok(maps)
    }

    fn statistics<B: LabBackend>(
        trained: &Trained<TextClassifier<B>>,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>> {
        let text = Self::text_model(trained)?;
        let ids = text.encode(&maps.input)?;
        // `<s>` stays first.
        text_statistics(maps, &ids, 1..ids.len(), seed, |shuffled| {
            Ok(vec![self_attention(trained, &text, shuffled, device)?.0])
        })
    }

    fn text_model<B: LabBackend>(trained: &Trained<TextClassifier<B>>) -> Result<TextModel<'_, B>> {
        Ok(encoder_text_model(
            &trained.model,
            trained.tokenizer(),
            None,
        ))
    }
}

/// Checks that a classifier described by `classifier` can take the encoder of the masked
/// language model `mlm` (in `from`): the same widths, heads, layers, positions and vocabulary.
fn check_encoder_matches(
    classifier: &ClassifierConfig,
    mlm: &MlmConfig,
    from: &ArtifactDir,
) -> Result<()> {
    let differ = classifier.encoder_shape().differences(&mlm.encoder_shape());
    if !differ.is_empty() {
        bail!(
            "model.init_from {}: its encoder is not the one this config describes: {}",
            from.root().display(),
            differ.join("; ")
        );
    }
    Ok(())
}

/// A text encoder — the classifier's, the masked language model's, or a clip model's text
/// tower — as the reader of one text (`<s>` first, `last` after the text when given).
pub(super) fn encoder_text_model<'a, B: LabBackend, E: TextEncoder<B>>(
    model: &'a E,
    tokenizer: &'a Tokenizer,
    last: Option<usize>,
) -> TextModel<'a, B> {
    TextModel {
        tokenizer,
        first: tokenizer.special(Special::Bos),
        last,
        max_len: model.max_len(),
        causal: false,
        stack: model.encoder(),
        table: model.token_embedding().weight.val(),
        embed: Box::new(|tokens| model.embed(tokens)),
    }
}

/// A text encoder's self-attention, every layer, on `ids` (one unpadded text: no mask) as the
/// group `name`.
pub(super) fn encoder_attention<B: LabBackend, E: TextEncoder<B>>(
    model: &E,
    name: &str,
    text: &TextModel<'_, B>,
    ids: &[usize],
    device: &B::Device,
) -> Result<AttentionGroup> {
    let tokens = text.tokens(ids, device);
    let (_, attention) = model.states(tokens.clone());
    let weights = weights_or_dense(attention, || {
        model
            .encoder()
            .mixer_weights(model.embed(tokens), None, None)
    })?;
    let labels = text.labels(ids);
    Ok(AttentionGroup::from_layers(
        name, false, &labels, &labels, weights,
    ))
}

/// The classifier's self-attention on `ids` and the predicted class.
fn self_attention<B: LabBackend>(
    trained: &Trained<TextClassifier<B>>,
    text: &TextModel<'_, B>,
    ids: &[usize],
    device: &B::Device,
) -> Result<(AttentionGroup, String)> {
    let group = encoder_attention(&trained.model, "self", text, ids, device)?;
    let logits = trained.model.forward(text.tokens(ids, device)).logits;
    let class = predicted_class(logits, &class_names(&trained.config.data.dataset)?);
    Ok((group, class))
}

/// The sentiment corpus of `config`, its tokenizer (fitted on the training split unless a
/// resumed run brings its own) and the tokenized training and validation splits.
fn sentences(
    config: &ExperimentConfig,
    data_dir: &Path,
    tokenizers: Option<Tokenizers>,
) -> Result<(
    SentimentCorpus,
    Tokenizer,
    EncodedSentences,
    EncodedSentences,
)> {
    let data = &config.data;
    let mut corpus = SentimentCorpus::load(
        &data.dataset,
        data_dir,
        data.valid_fraction,
        data.test_fraction,
        config.seed,
    )?;
    data.limit_train(&mut corpus.train);
    let tokenizer = match tokenizers {
        Some(tokenizers) => tokenizers.target,
        None => Tokenizer::fit(
            data.tokenizer,
            corpus.train.iter().map(|row| row.text.as_str()),
            data.bpe_vocab_size,
        )?,
    };
    let train_set = EncodedSentences::encode(&corpus.train, &tokenizer, data.max_tokens)?;
    let valid = EncodedSentences::encode(&corpus.valid, &tokenizer, data.max_tokens)?;
    Ok((corpus, tokenizer, train_set, valid))
}
