//! The translator kind: teacher-forced training with label smoothing over padded pairs, BLEU on
//! the test split, and its three attentions (encoder, decoder, cross) to inspect.

use super::{EvalRequest, ModelKind, Prepared};
use crate::artifact::{Tokenizers, Trained};
use crate::bleu::corpus_bleu;
use crate::config::{
    DataConfig, ExperimentConfig, ModelConfig, ModelSection, Seq2SeqConfig, TokenizerKind,
    TrainConfig,
};
use crate::data::translation::{check_languages, COPY_TASK};
use crate::data::{
    EncodedPairs, Pair, PairItem, Seq2SeqBatch, Seq2SeqBatcher, Special, Task, Tokenizer,
    TranslationCorpus,
};
use crate::inspect::heads::LossOutput;
use crate::inspect::{
    labels, text_statistics, weights_or_dense, AttentionGroup, AttentionMaps, GroupStats, TextModel,
};
use crate::kernels::LabBackend;
use crate::models::Seq2Seq;
use crate::nn::AttentionMask;
use crate::nn::StackConfig;
use crate::train::LaunchOptions;
use crate::translate::{greedy, translate_texts, warn_truncated, SearchConfig};
use anyhow::{bail, Result};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::prelude::*;
use std::path::Path;
use std::time::Instant;

supervised_steps!(Seq2Seq, Seq2SeqConfig);

impl ModelSection for Seq2SeqConfig {
    const KIND: &'static str = "seq2seq";
    const DESCRIPTION: &'static str = "translation model";
    const COMMAND: &'static str = "translate";

    fn validate(&self, data: &DataConfig) -> Result<()> {
        Seq2SeqConfig::validate(self)?;
        if Task::of(&data.dataset) != Some(Task::Translation) {
            bail!(
                "data: a seq2seq model needs a translation dataset (tatoeba-fra-eng, multi30k or copy), not {}",
                data.dataset
            );
        }
        if data.tokenizer != TokenizerKind::Bpe {
            bail!("data: a seq2seq model needs the bpe tokenizer (it uses <pad> <s> </s>)");
        }
        if self.share_embeddings && !data.shared_vocab {
            bail!("model: share_embeddings needs data.shared_vocab");
        }
        if data.max_tokens < 3 || data.max_tokens > self.max_len {
            bail!(
                "data: max_tokens ({}) must be in 3..={} (the model's max_len)",
                data.max_tokens,
                self.max_len
            );
        }
        check_languages(data)
    }

    fn vocab_sizes(&self) -> (usize, usize) {
        (self.src_vocab_size, self.tgt_vocab_size)
    }

    fn with_vocab_sizes(&self, source: usize, target: usize) -> ModelConfig {
        ModelConfig::Seq2seq(Seq2SeqConfig {
            src_vocab_size: source,
            tgt_vocab_size: target,
            ..self.clone()
        })
    }

    fn of(model: &ModelConfig) -> Option<&Self> {
        match model {
            ModelConfig::Seq2seq(section) => Some(section),
            _ => None,
        }
    }
}

impl ModelKind for Seq2SeqConfig {
    type Model<B: LabBackend> = Seq2Seq<B>;
    type Item = PairItem;
    type Split = EncodedPairs;
    type Batcher = Seq2SeqBatcher;
    type Batch<B: LabBackend> = Seq2SeqBatch<B>;

    fn build<B: LabBackend>(&self, device: &B::Device) -> Seq2Seq<B> {
        self.init(device)
    }

    fn build_for_training<B: LabBackend>(
        &self,
        train: &TrainConfig,
        device: &B::Device,
    ) -> Seq2Seq<B> {
        self.init(device)
            .with_label_smoothing(train.label_smoothing)
    }

    fn stack(&self) -> &StackConfig {
        &self.stack
    }

    fn stack_mut(&mut self) -> &mut StackConfig {
        &mut self.stack
    }

    fn activation_floats(&self, data: &DataConfig) -> f64 {
        let t = data.max_tokens;
        self.stack.activation_floats(self.encoder_layers, t)
            + 1.5 * self.stack.activation_floats(self.decoder_layers, t)
            + (t * self.tgt_vocab_size) as f64
    }

    fn prepare(
        mut config: ExperimentConfig,
        tokenizers: Option<Tokenizers>,
        data_dir: &Path,
    ) -> Result<Prepared<Self>> {
        let data = TranslationData::load(&config, data_dir, tokenizers)?;
        let (source, target) = (
            data.tokenizers.source.vocab_size(),
            data.tokenizers.target.vocab_size(),
        );
        config.model.set_vocab_sizes(source, target);
        let summary = format!(
            "{}: {} training pairs ({} longer than {} tokens skipped), {} validation pairs, {} \
             test sentences; vocabulary {source} → {target}",
            config.data.dataset,
            data.train.len(),
            data.skipped,
            config.data.max_tokens,
            data.valid.len(),
            data.corpus.test.len(),
        );
        let mean_target = data.train.target_tokens() as f64 / data.train.len() as f64;
        let (sources, targets) = data.train.lengths().into_iter().unzip();
        Ok(Prepared {
            tokenizers: Some(data.tokenizers),
            summary: Some(summary),
            lengths: Some(data.train.length_keys()),
            padding: vec![("source", sources), ("target", targets)],
            train: data.train,
            valid: data.valid,
            batcher: Seq2SeqBatcher,
            launch: LaunchOptions::tokens(
                (config.train.batch_size as f64 * mean_target).round() as usize,
                "target tokens",
            )
            .padded(Special::Pad.id()),
            valid_items: "validation pairs (teacher-forced target loss)".into(),
            accuracy: false,
            config,
        })
    }

    fn batch<B: LabBackend>(
        batcher: &Seq2SeqBatcher,
        items: Vec<PairItem>,
        _draw: Option<u64>,
        device: &B::Device,
    ) -> Seq2SeqBatch<B> {
        batcher.batch(items, device)
    }

    /// The teacher-forced loss, label-smoothed as the model was built (a trained model loads
    /// without smoothing: its loss on the data).
    fn loss<B: LabBackend>(model: &Seq2Seq<B>, batch: Seq2SeqBatch<B>) -> LossOutput<B> {
        model.loss(&batch, model.label_smoothing())
    }

    fn units<B: LabBackend>(batch: &Seq2SeqBatch<B>) -> usize {
        let pad = Special::Pad.id() as i64;
        let real = batch.target_out.clone().not_equal_elem(pad).int().sum();
        real.into_scalar().elem::<i64>() as usize
    }

    fn eval<B: LabBackend>(
        trained: &Trained<Seq2Seq<B>>,
        request: &EvalRequest,
        device: &B::Device,
    ) -> Result<()> {
        let search = SearchConfig::resolve(
            request.beam,
            request.length_penalty,
            request.max_len,
            trained.model.max_len(),
        )?;
        let search = SearchConfig {
            cached: request.cached,
            ..search
        };
        let config = &trained.config;
        let mut test = TranslationCorpus::load(&config.data, &request.data_dir, config.seed)?.test;
        test.truncate(request.limit.unwrap_or(usize::MAX));
        let sources: Vec<String> = test.iter().map(|item| item.source.clone()).collect();
        let began = Instant::now();
        let (translations, truncated) = translate_texts(
            &trained.model,
            trained.tokenizers(),
            &sources,
            &search,
            request.batch_size,
            config.data.max_tokens,
            device,
        )?;
        let seconds = began.elapsed().as_secs_f64();
        warn_truncated(&truncated, config.data.max_tokens);
        let references: Vec<Vec<String>> =
            test.iter().map(|item| item.references.clone()).collect();
        let bleu = corpus_bleu(&translations, &references);
        println!(
            "{}: {} on {} test sentences of {}, beam {}, length penalty {}; decoded in {seconds:.1} s",
            config.name,
            bleu,
            test.len(),
            if config.data.dataset == COPY_TASK {
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
                "  src: {}\n  ref: {}\n  hyp: {}",
                item.source, item.references[0], hyp
            );
        }
        if let Some(path) = &request.output {
            let mut text = String::new();
            for (item, hyp) in test.iter().zip(&translations) {
                text.push_str(&format!(
                    "{}\t{}\t{}\n",
                    item.source,
                    item.references.join(" ||| "),
                    hyp
                ));
            }
            crate::files::write_atomic(path, text.as_bytes())?;
        }
        Ok(())
    }

    fn attention<B: LabBackend>(
        trained: &Trained<Seq2Seq<B>>,
        input: &str,
        target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps> {
        let text = Self::text_model(trained)?;
        let ids = text.encode(input)?;
        let mut maps = AttentionMaps::new(&trained.config.name, Self::KIND, input);
        let (groups, output) = attentions(trained, &text, &ids, target, device)?;
        maps.groups = groups;
        maps.output = Some(output);
        Ok(maps)
    }

    fn statistics<B: LabBackend>(
        trained: &Trained<Seq2Seq<B>>,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>> {
        let text = Self::text_model(trained)?;
        let ids = text.encode(&maps.input)?;
        // `</s>` stays last; the decoder reads the same target.
        text_statistics(maps, &ids, 0..ids.len() - 1, seed, |shuffled| {
            let target = maps.output.as_deref();
            Ok(attentions(trained, &text, shuffled, target, device)?.0)
        })
    }

    fn text_model<B: LabBackend>(trained: &Trained<Seq2Seq<B>>) -> Result<TextModel<'_, B>> {
        let model = &trained.model;
        Ok(TextModel {
            tokenizer: &trained.tokenizers().source,
            first: None,
            last: Some(Special::Eos.id()),
            max_len: model.max_len(),
            causal: false,
            stack: &model.encoder,
            table: model.src_embedding.weight.val(),
            embed: Box::new(|tokens| model.embed_source(tokens)),
        })
    }
}

/// The encoder, decoder and cross-attention of every layer with the source `ids`, over `target`
/// (or the model's own greedy translation, decoded to text and read back so both take the same
/// path), and the target text.
fn attentions<B: LabBackend>(
    trained: &Trained<Seq2Seq<B>>,
    text: &TextModel<'_, B>,
    ids: &[usize],
    target: Option<&str>,
    device: &B::Device,
) -> Result<(Vec<AttentionGroup>, String)> {
    let (model, tokenizers) = (&trained.model, trained.tokenizers());
    let tokens = text.tokens(ids, device);
    let target_text = match target {
        Some(text) => text.trim().to_string(),
        None => {
            let search = SearchConfig {
                beam_size: 1,
                length_penalty: 0.0,
                max_len: model.max_len() - 1,
                cached: true,
            };
            let ids = greedy(model, tokens.clone(), &search).remove(0).tokens;
            tokenizers.target.decode(&ids)
        }
    };
    let target_ids = tokenizers.target.encode(&target_text)?;
    let mut target_in = vec![Special::Bos.id()];
    target_in.extend(target_ids.iter().take(model.max_len() - 1));
    let source_labels = text.labels(ids);
    let target_labels = labels(&tokenizers.target, &target_in);
    let memory = model.encode(tokens.clone());
    let encoder = weights_or_dense(memory.attention.clone(), || {
        let x = model.embed_source(tokens);
        model.encoder.mixer_weights(x, None, None)
    })?;
    let target_tensor = text.tokens(&target_in, device);
    let out = model.decode(&memory, target_tensor.clone());
    let decoder = weights_or_dense(out.self_attention, || {
        let causal = AttentionMask::causal(target_in.len(), device);
        let memory = (&memory.states, Some(&memory.mask));
        let x = model.embed_target(target_tensor);
        model.decoder.mixer_weights(x, Some(&causal), Some(memory))
    })?;
    let group = AttentionGroup::from_layers;
    let groups = vec![
        group("encoder", false, &source_labels, &source_labels, encoder),
        group("decoder", true, &target_labels, &target_labels, decoder),
        group(
            "cross",
            false,
            &target_labels,
            &source_labels,
            out.cross_attention,
        ),
    ];
    Ok((groups, target_text))
}

/// A translation dataset read, split and tokenized.
pub struct TranslationData {
    /// The raw splits (the test split is for BLEU).
    pub corpus: TranslationCorpus,
    /// The tokenizers (trained on the training split, or the artifact's).
    pub tokenizers: Tokenizers,
    /// Tokenized training pairs within `max_tokens`.
    pub train: EncodedPairs,
    /// Tokenized validation pairs within `max_tokens`.
    pub valid: EncodedPairs,
    /// Training pairs skipped for length.
    pub skipped: usize,
}

impl TranslationData {
    /// Loads the experiment's dataset, fitting tokenizers on its training split unless given.
    pub fn load(
        config: &ExperimentConfig,
        data_dir: &Path,
        tokenizers: Option<Tokenizers>,
    ) -> Result<Self> {
        let data = &config.data;
        let mut corpus = TranslationCorpus::load(data, data_dir, config.seed)?;
        data.limit_train(&mut corpus.train);
        let tokenizers = match tokenizers {
            Some(tokenizers) => tokenizers,
            None => {
                let sources = corpus.train.iter().map(|p| p.source.as_str());
                let targets = corpus.train.iter().map(|p| p.target.as_str());
                let fit = |texts: Vec<&str>| {
                    Tokenizer::fit(data.tokenizer, texts.into_iter(), data.bpe_vocab_size)
                };
                if data.shared_vocab {
                    Tokenizers::shared(fit(sources.chain(targets).collect())?)
                } else {
                    Tokenizers {
                        source: fit(sources.collect())?,
                        target: fit(targets.collect())?,
                        shared: false,
                    }
                }
            }
        };
        let encode = |pairs: &[Pair]| {
            EncodedPairs::encode(
                pairs,
                &tokenizers.source,
                &tokenizers.target,
                data.max_tokens,
            )
        };
        let (train, skipped) = encode(&corpus.train)?;
        let (valid, _) = encode(&corpus.valid)?;
        if train.is_empty() || valid.is_empty() {
            bail!(
                "{}: no training or validation pair fits in max_tokens {}",
                data.dataset,
                data.max_tokens
            );
        }
        Ok(Self {
            corpus,
            tokenizers,
            train,
            valid,
            skipped,
        })
    }
}
