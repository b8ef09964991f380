//! The masked language model kind (BERT's pretraining): the loss over masked tokens of English
//! sentences, masked-token accuracy and perplexity on held-out sentences, `fill-mask`, and the
//! encoder's self-attention to inspect. A classifier starts from its embeddings and encoder
//! (`init_from`).

use super::classifier::{encoder_attention, encoder_text_model};
use super::{EvalRequest, ModelKind, Prepared};
use crate::artifact::{Tokenizers, Trained};
use crate::config::{DataConfig, ExperimentConfig, MlmConfig, ModelConfig, ModelSection};
use crate::data::masked::{english_parts, english_sentences, split_sentences};
use crate::data::{
    MaskedItem, MaskedSentences, Masking, MlmBatch, Special, Tokenizer, TokenizerKind,
};
use crate::inspect::heads::LossOutput;
use crate::inspect::{text_statistics, AttentionMaps, GroupStats, TextModel};
use crate::kernels::LabBackend;
use crate::models::MaskedLm;
use crate::nn::StackConfig;
use crate::train::LaunchOptions;
use anyhow::{bail, Context, Result};
use burn::data::dataset::Dataset;
use burn::prelude::*;
use std::path::Path;

supervised_steps!(MaskedLm, MlmConfig);

impl ModelSection for MlmConfig {
    const KIND: &'static str = "mlm";
    const DESCRIPTION: &'static str = "masked language model";
    const COMMAND: &'static str = "fill-mask";
    const UNSERIALIZED_DEFAULTS: &'static [&'static str] = &["embedding_norm"];

    fn validate(&self, data: &DataConfig) -> Result<()> {
        MlmConfig::validate(self)?;
        if !matches!(data.tokenizer, TokenizerKind::Bpe | TokenizerKind::Bert) {
            bail!(
                "data: a masked language model needs the bpe tokenizer (it adds [MASK] to it), \
                 or an imported BERT's"
            );
        }
        if data.text_file.is_none() {
            english_parts(&data.dataset)?;
        }
        if data.max_tokens < 3 || data.max_tokens > self.max_len {
            bail!(
                "data: max_tokens ({}) must be in 3..={} (the model's max_len)",
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
        ModelConfig::Mlm(MlmConfig {
            vocab_size: target,
            ..self.clone()
        })
    }

    fn of(model: &ModelConfig) -> Option<&Self> {
        match model {
            ModelConfig::Mlm(section) => Some(section),
            _ => None,
        }
    }
}

impl ModelKind for MlmConfig {
    type Model<B: LabBackend> = MaskedLm<B>;
    type Item = MaskedItem;
    type Split = MaskedSentences;
    type Batcher = Masking;
    type Batch<B: LabBackend> = MlmBatch<B>;

    fn build<B: LabBackend>(&self, device: &B::Device) -> MaskedLm<B> {
        self.init(device)
    }

    fn stack(&self) -> &StackConfig {
        &self.stack
    }

    fn stack_mut(&mut self) -> &mut StackConfig {
        &mut self.stack
    }

    fn activation_floats(&self, data: &DataConfig) -> f64 {
        // The head's scores are over masked positions only: ~15% of the tokens.
        self.stack.activation_floats(self.n_layers, data.max_tokens)
            + self.mask_fraction * (data.max_tokens * self.vocab_size) as f64
    }

    fn prepare(
        mut config: ExperimentConfig,
        tokenizers: Option<Tokenizers>,
        data_dir: &Path,
    ) -> Result<Prepared<Self>> {
        let data = &config.data;
        let sentences = english_sentences(data, data_dir, config.seed)?;
        let total = sentences.len();
        let (mut train, valid) = split_sentences(sentences, data.valid_fraction, config.seed)?;
        data.limit_train(&mut train);
        let tokenizer = match tokenizers {
            Some(tokenizers) => tokenizers.target,
            None => {
                let mut fitted = Tokenizer::fit(
                    data.tokenizer,
                    train.iter().map(String::as_str),
                    data.bpe_vocab_size,
                )?;
                fitted.add_mask()?;
                fitted
            }
        };
        let mask = tokenizer.mask().context(
            "the tokenizer has no [MASK]: it was not fitted for a masked language model",
        )?;
        let vocab = tokenizer.vocab_size();
        let train_set = MaskedSentences::encode(&train, &tokenizer, data.max_tokens)?;
        let valid_set = MaskedSentences::encode(&valid, &tokenizer, data.max_tokens)?;
        let summary = format!(
            "{}: {total} distinct training sentences → {} training ({} tokens), {} validation; \
             vocabulary {vocab} ([MASK] = {mask})",
            data.text_file
                .as_ref()
                .map_or_else(|| data.dataset.clone(), |p| p.display().to_string()),
            train_set.len(),
            train_set.tokens(),
            valid_set.len(),
        );
        let mean = train_set.tokens() as f64 / train_set.len().max(1) as f64;
        config.model.set_vocab_sizes(vocab, vocab);
        let section = config.model_as::<MlmConfig>()?;
        let lengths = train_set.lengths();
        Ok(Prepared {
            tokenizers: Some(Tokenizers::shared(tokenizer)),
            summary: Some(summary),
            train: train_set,
            valid: valid_set,
            batcher: Masking {
                mask,
                vocab,
                fraction: section.mask_fraction,
                seed: config.seed,
            },
            padding: vec![("tokens", lengths.clone())],
            lengths: Some(lengths),
            launch: LaunchOptions::tokens(
                (config.train.batch_size as f64 * mean).round() as usize,
                "tokens",
            ),
            valid_items: "validation sentences (the same masks every time)".into(),
            accuracy: true,
            config,
        })
    }

    fn batch<B: LabBackend>(
        masking: &Masking,
        items: Vec<MaskedItem>,
        draw: Option<u64>,
        device: &B::Device,
    ) -> MlmBatch<B> {
        masking.batch(items, draw, device)
    }

    fn loss<B: LabBackend>(model: &MaskedLm<B>, batch: MlmBatch<B>) -> LossOutput<B> {
        model.loss(batch)
    }

    fn units<B: LabBackend>(batch: &MlmBatch<B>) -> usize {
        let pad = Special::Pad.id() as i64;
        let real = batch.tokens.clone().not_equal_elem(pad).int().sum();
        real.into_scalar().elem::<i64>() as usize
    }

    fn eval<B: LabBackend>(
        trained: &Trained<MaskedLm<B>>,
        request: &EvalRequest,
        device: &B::Device,
    ) -> Result<()> {
        let score = evaluate_mlm(
            trained,
            &request.data_dir,
            request.batch_size,
            request.limit,
            device,
        )?;
        println!(
            "{}: validation masked-token accuracy {:.2}%, loss {:.4}, perplexity {:.3} over {} \
             masked tokens of {} sentences (BERT's masking, the same masks every time)",
            trained.config.name,
            100.0 * score.accuracy,
            score.loss,
            score.loss.exp(),
            score.masked,
            score.sentences
        );
        Ok(())
    }

    fn attention<B: LabBackend>(
        trained: &Trained<MaskedLm<B>>,
        input: &str,
        _target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps> {
        let text = Self::text_model(trained)?;
        let ids = text.encode(input)?;
        let mut maps = AttentionMaps::new(&trained.config.name, Self::KIND, input);
        maps.groups = vec![encoder_attention(
            &trained.model,
            "self",
            &text,
            &ids,
            device,
        )?];
        Ok(maps)
    }

    fn statistics<B: LabBackend>(
        trained: &Trained<MaskedLm<B>>,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>> {
        let text = Self::text_model(trained)?;
        let ids = text.encode(&maps.input)?;
        // `<s>` and `</s>` stay where they are.
        text_statistics(maps, &ids, 1..ids.len() - 1, seed, |shuffled| {
            Ok(vec![encoder_attention(
                &trained.model,
                "self",
                &text,
                shuffled,
                device,
            )?])
        })
    }

    fn text_model<B: LabBackend>(trained: &Trained<MaskedLm<B>>) -> Result<TextModel<'_, B>> {
        let tokenizer = trained.tokenizer();
        let last = tokenizer.special(Special::Eos);
        Ok(encoder_text_model(&trained.model, tokenizer, last))
    }
}

/// A masked language model's score on held-out sentences.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlmScore {
    /// Mean cross-entropy over the masked tokens.
    pub loss: f64,
    /// Share of masked tokens whose original is the top score.
    pub accuracy: f64,
    /// Masked tokens scored.
    pub masked: usize,
    /// Sentences read.
    pub sentences: usize,
}

/// The loss and accuracy over the masked tokens of the whole validation split (at most `limit`
/// sentences), masked as during training's validation.
pub fn evaluate_mlm<B: LabBackend>(
    trained: &Trained<MaskedLm<B>>,
    data_dir: &Path,
    batch_size: usize,
    limit: Option<usize>,
    device: &B::Device,
) -> Result<MlmScore> {
    let tokenizers = trained.tokenizers.clone();
    let prepared = MlmConfig::prepare(trained.config.clone(), tokenizers, data_dir)?;
    let n = prepared.valid.len().min(limit.unwrap_or(usize::MAX));
    let (mut sum, mut correct, mut masked) = (0.0f64, 0usize, 0usize);
    let mut start = 0;
    while start < n {
        let end = (start + batch_size.max(1)).min(n);
        let items = (start..end)
            .map(|i| prepared.valid.get(i).expect("an index below len"))
            .collect();
        let batch = prepared.batcher.batch::<B>(items, None, device);
        let (loss, logits, targets) = trained.model.loss(batch);
        let m = targets.dims()[0];
        sum += loss.into_scalar().elem::<f64>() * m as f64;
        let hits = logits.argmax(1).reshape([m]).equal(targets).int().sum();
        correct += hits.into_scalar().elem::<i64>() as usize;
        masked += m;
        start = end;
    }
    if masked == 0 {
        bail!("the validation split has no sentence to score");
    }
    Ok(MlmScore {
        loss: sum / masked as f64,
        accuracy: correct as f64 / masked as f64,
        masked,
        sentences: n,
    })
}

/// One `[MASK]` of a text and the tokens the model puts there.
#[derive(Clone, Debug, PartialEq)]
pub struct Filled {
    /// Which `[MASK]` of the text (0 = the first).
    pub index: usize,
    /// The `k` most probable ordinary tokens, most probable first, with their probability
    /// (of the whole vocabulary's distribution).
    pub tokens: Vec<(String, f32)>,
}

/// `fill-mask`: the `k` most probable tokens at each `[MASK]` of `text`.
pub fn fill_mask<B: LabBackend>(
    trained: &Trained<MaskedLm<B>>,
    text: &str,
    k: usize,
    device: &B::Device,
) -> Result<Vec<Filled>> {
    let tokenizer = trained.tokenizer();
    let mask = tokenizer
        .mask()
        .context("this model's tokenizer has no [MASK]")?;
    let reader = MlmConfig::text_model(trained)?;
    let ids = reader.encode(text)?;
    let places: Vec<usize> = (ids.iter().enumerate())
        .filter(|(_, &id)| id == mask)
        .map(|(i, _)| i)
        .collect();
    if places.is_empty() {
        bail!("{text:?} has no [MASK]: write [MASK] where the model should fill in a word");
    }
    let model = &trained.model;
    let states = model.forward(reader.tokens(&ids, device)).states; // [1, n, d]
    let [_, n, d] = states.dims();
    let rows: Vec<i64> = places.iter().map(|&p| p as i64).collect();
    let picked = states.reshape([n, d]).select(
        0,
        Tensor::from_data(TensorData::new(rows, [places.len()]), device),
    );
    let probabilities = crate::kernels::softmax(model.scores(picked));
    let values: Vec<f32> = probabilities
        .into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| anyhow::anyhow!("cannot read the scores: {e:?}"))?;
    let v = model.vocab_size();
    let ordinary = |id: usize| !tokenizer.is_special(id);
    Ok(values
        .chunks(v)
        .enumerate()
        .map(|(index, row)| {
            let mut ranked: Vec<(usize, f32)> = row
                .iter()
                .copied()
                .enumerate()
                .filter(|(id, _)| ordinary(*id))
                .collect();
            ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
            ranked.truncate(k);
            Filled {
                index,
                tokens: ranked
                    .into_iter()
                    .map(|(id, p)| (tokenizer.token_text(id), p))
                    .collect(),
            }
        })
        .collect())
}
