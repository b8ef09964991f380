//! The sentence classifier kind: cross-entropy over class scores of labelled sentences, test
//! accuracy with a confusion matrix, bidirectional self-attention to inspect.

use super::{held_out_batches, EvalRequest, HeldOutRequest, ModelKind};
use crate::artifact::{Tokenizers, Trained};
use crate::classify::{class_names, evaluate_classifier, report_confusion};
use crate::config::{
    ClassifierConfig, DataConfig, ExperimentConfig, ModelConfig, ModelSection, TokenizerKind,
};
use crate::data::{
    EncodedSentences, SentenceBatch, SentenceBatcher, SentimentCorpus, Special, Task, Tokenizer,
};
use crate::inspect::heads::HeldOut;
use crate::inspect::{
    predicted_class, text_statistics, weights_or_dense, AttentionGroup, AttentionMaps, GroupStats,
    TextModel,
};
use crate::kernels::{LabAutodiff, LabBackend};
use crate::models::TextClassifier;
use crate::nn::StackConfig;
use crate::train::speed::{bench_training, padding_note, BenchPlan, BenchReport};
use crate::train::{
    launch, supervised_steps, train_loader, unseeded, Session, Throughput, TrainReport,
};
use anyhow::{bail, Result};
use burn::data::dataset::Dataset;
use burn::prelude::Tensor;
use std::path::Path;
use std::sync::Arc;

supervised_steps!(TextClassifier, SentenceBatch, |model, batch| model
    .loss(batch.tokens, batch.labels));

impl ModelSection for ClassifierConfig {
    const KIND: &'static str = "classifier";
    const DESCRIPTION: &'static str = "text classifier";
    const COMMAND: &'static str = "classify";

    fn validate(&self, data: &DataConfig) -> Result<()> {
        ClassifierConfig::validate(self)?;
        if Task::of(&data.dataset) != Some(Task::SentenceClassification) {
            bail!(
                "data: a classifier needs a sentence-classification dataset (sst2 or uci-sentiment), not {}",
                data.dataset
            );
        }
        if data.tokenizer != TokenizerKind::Bpe {
            bail!("data: a classifier needs the bpe tokenizer (it uses <pad> and <s>)");
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
}

impl ModelKind for ClassifierConfig {
    type Model<B: LabBackend> = TextClassifier<B>;

    fn build<B: LabBackend>(&self, device: &B::Device) -> TextClassifier<B> {
        self.init(device)
    }

    fn stack(&self) -> &StackConfig {
        &self.stack
    }

    fn stack_mut(&mut self) -> &mut StackConfig {
        &mut self.stack
    }

    fn held_out<B: LabBackend>(
        trained: &Trained<TextClassifier<B>>,
        request: &HeldOutRequest,
        device: &B::Device,
    ) -> Result<HeldOut<'static, B, TextClassifier<B>>> {
        let tokenizers = Some(trained.tokenizers().clone());
        let (_, _, _, valid) = sentences(&trained.config, &request.data_dir, tokenizers)?;
        let loss = |m: &TextClassifier<B>, b: SentenceBatch<B>| m.loss(b.tokens, b.labels);
        let (n, batches) = held_out_batches(&valid, request, SentenceBatcher, device, loss)?;
        Ok(HeldOut {
            what: format!("{n} validation sentences"),
            batches,
            accuracy: true,
        })
    }

    fn activation_floats(&self, data: &DataConfig) -> f64 {
        self.stack.activation_floats(self.n_layers, data.max_tokens)
    }

    fn train<B: LabAutodiff>(
        &self,
        mut config: ExperimentConfig,
        tokenizers: Option<Tokenizers>,
        session: &Session,
        data_dir: &Path,
        device: B::Device,
    ) -> Result<TrainReport> {
        let (corpus, tokenizer, train_set, valid) = sentences(&config, data_dir, tokenizers)?;
        let data = &config.data;
        println!(
            "{}: {} training, {} validation, {} test sentences; vocabulary {}",
            data.dataset,
            train_set.len(),
            valid.len(),
            corpus.test.len(),
            tokenizer.vocab_size()
        );
        let vocab = tokenizer.vocab_size();
        config.model.set_vocab_sizes(vocab, vocab);
        let classifier = config.model_as::<ClassifierConfig>()?.clone();
        let floats = classifier.activation_floats(&config.data);
        let lengths = train_set.lengths();
        session.begin(&config, Some(&Tokenizers::shared(tokenizer)), floats)?;
        crate::kernels::seed::<B>(&device, config.seed);
        let loaders = session.loaders(
            &config,
            &device,
            train_set,
            unseeded(SentenceBatcher),
            valid,
            unseeded(SentenceBatcher),
            Some(lengths),
        );
        let throughput = Throughput {
            per_step: config.train.batch_size,
            unit: "sent",
        };
        let model = classifier.init::<B>(&device);
        launch(&config, session, model, loaders, None, false, throughput)
    }

    fn bench<B: LabAutodiff>(
        &self,
        mut config: ExperimentConfig,
        data_dir: &Path,
        plan: BenchPlan,
        device: &B::Device,
    ) -> Result<BenchReport> {
        let (_, tokenizer, train_set, _) = sentences(&config, data_dir, None)?;
        let vocab = tokenizer.vocab_size();
        config.model.set_vocab_sizes(vocab, vocab);
        let classifier = config.model_as::<ClassifierConfig>()?.clone();
        let lengths = train_set.lengths();
        let padding = padding_note(&config, &[("tokens", lengths.clone())], &lengths);
        let batcher = unseeded(SentenceBatcher);
        let loader = train_loader(
            &config,
            device,
            train_set,
            batcher,
            Arc::default(),
            Some(lengths),
        );
        let sentences = |batch: &SentenceBatch<B>| batch.labels.dims()[0];
        let init = || classifier.init::<B>(device);
        let loss = |model: &TextClassifier<B>, batch: SentenceBatch<B>| {
            model.loss(batch.tokens, batch.labels).0
        };
        let mut report = bench_training(
            &config,
            plan,
            &loader,
            "sentences",
            sentences,
            init,
            loss,
            device,
        )?;
        report.notes.push(padding);
        Ok(report)
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

/// A text encoder — the classifier's, or a clip model's text tower — as the reader of one text
/// (`<s>` first, `last` after the text when given).
pub(super) fn encoder_text_model<'a, B: LabBackend>(
    model: &'a TextClassifier<B>,
    tokenizer: &'a Tokenizer,
    last: Option<usize>,
) -> TextModel<'a, B> {
    TextModel {
        tokenizer,
        first: Some(Special::Bos.id()),
        last,
        max_len: model.max_len(),
        causal: false,
        stack: &model.encoder,
        table: model.token_embedding.weight.val(),
        embed: Box::new(|tokens| model.embed(tokens)),
    }
}

/// A text encoder's self-attention, every layer, on `ids` (one unpadded text: no mask) as the
/// group `name`, and its head's output `[1, classes]` (class scores, or a projection).
pub(super) fn encoder_attention<B: LabBackend>(
    model: &TextClassifier<B>,
    name: &str,
    text: &TextModel<'_, B>,
    ids: &[usize],
    device: &B::Device,
) -> Result<(AttentionGroup, Tensor<B, 2>)> {
    let tokens = text.tokens(ids, device);
    let out = model.forward(tokens.clone());
    let weights = weights_or_dense(out.attention, || {
        model.encoder.mixer_weights(model.embed(tokens), None, None)
    })?;
    let labels = text.labels(ids);
    let group = AttentionGroup::from_layers(name, false, &labels, &labels, weights);
    Ok((group, out.logits))
}

/// The classifier's self-attention on `ids` and the predicted class.
fn self_attention<B: LabBackend>(
    trained: &Trained<TextClassifier<B>>,
    text: &TextModel<'_, B>,
    ids: &[usize],
    device: &B::Device,
) -> Result<(AttentionGroup, String)> {
    let (group, logits) = encoder_attention(&trained.model, "self", text, ids, device)?;
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
