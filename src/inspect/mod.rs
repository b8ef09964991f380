//! Attention inspection: the weights of every layer and head of a trained model on one input,
//! as a terminal heatmap ([`terminal`]), a PNG grid ([`picture`]), a self-contained HTML page
//! ([`html`]), JSON, and per-head statistics ([`stats`]).
//!
//! The weights come from the models' own forward passes (the [`crate::nn`] stack returns them);
//! nothing here recomputes attention.

pub mod html;
pub mod picture;
pub mod stats;
pub mod terminal;

use crate::artifact::ArtifactDir;
use crate::classify::load_image;
use crate::config::{ExperimentConfig, ModelConfig};
use crate::data::images::normalise_pixel;
use crate::data::translation::pad_rows;
use crate::data::{Special, Tokenizer};
use crate::kernels::LabBackend;
use crate::models::vit::{patchify, unpatchify};
use crate::nn::AttentionMask;
use crate::train::{Trained, TrainedClassifier, TrainedTranslator, TrainedVit};
use crate::translate::{greedy, SearchConfig};
use anyhow::{anyhow, bail, Context, Result};
use burn::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;
use stats::{Geometry, Shuffled};
use std::path::Path;

/// The attention weights of one kind of attention (e.g. a decoder's cross-attention) in every
/// layer and head, with the tokens that label its rows (queries) and columns (keys).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AttentionGroup {
    /// `self`, `encoder`, `decoder` or `cross`.
    pub name: String,
    /// Whether queries may only attend to keys at or before their own position.
    pub causal: bool,
    /// Labels of the query positions (rows).
    pub queries: Vec<String>,
    /// Labels of the key positions (columns).
    pub keys: Vec<String>,
    /// `[layer][head][query][key]`; every row sums to 1.
    pub weights: Vec<Vec<Vec<Vec<f32>>>>,
}

impl AttentionGroup {
    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.weights.len()
    }

    /// Number of heads per layer.
    pub fn n_heads(&self) -> usize {
        self.weights.first().map_or(0, Vec::len)
    }

    /// Whether queries and keys are the same sequence (self-attention).
    pub fn is_self(&self) -> bool {
        self.name != "cross"
    }

    /// The `[query][key]` weights of one head, or a message naming the layers and heads that
    /// exist.
    pub fn head(&self, layer: usize, head: usize) -> Result<&Vec<Vec<f32>>> {
        check_head(
            &format!("the {} attention", self.name),
            (self.n_layers(), self.n_heads()),
            layer,
            head,
        )?;
        Ok(&self.weights[layer][head])
    }
}

/// Fails unless `layer` and `head` exist in `what`, which has `layers × heads`, naming the
/// ranges that do.
pub fn check_head(
    what: &str,
    (layers, heads): (usize, usize),
    layer: usize,
    head: usize,
) -> Result<()> {
    if layer >= layers {
        bail!(
            "layer {layer} does not exist: {what} has layers 0–{} (--layer)",
            layers - 1
        );
    }
    if head >= heads {
        bail!(
            "head {head} does not exist: each layer has heads 0–{} (--head)",
            heads - 1
        );
    }
    Ok(())
}

/// `"token weight"` of the three keys a row of weights gives most to, largest first.
pub fn strongest_keys(row: &[f32], keys: &[String]) -> String {
    let top: Vec<String> = crate::classify::top_classes(row, 3)
        .into_iter()
        .map(|(k, w)| format!("{} {w:.2}", keys[k]))
        .collect();
    top.join(", ")
}

/// Where a ViT's input came from, for drawing attention over the image.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ImageInput {
    /// Side of the (square, grey) model input in pixels.
    pub size: usize,
    /// Side of one patch in pixels.
    pub patch_size: usize,
    /// `size · size` grey pixels, 0 = background.
    pub pixels: Vec<u8>,
}

/// Everything captured from one forward pass.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AttentionMaps {
    /// The experiment's name.
    pub model: String,
    /// `lm`, `classifier`, `seq2seq` or `vit`.
    pub kind: String,
    /// What the model was given (the text, or the image file).
    pub input: String,
    /// The model's answer, when it makes one (a translation, a class).
    pub output: Option<String>,
    /// One group per kind of attention: `self` (LM, classifier, ViT) or `encoder`, `decoder`
    /// and `cross` (translator).
    pub groups: Vec<AttentionGroup>,
    /// A ViT's input image.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageInput>,
}

impl AttentionMaps {
    /// The group called `name`, or (for `None`) the first one; an unknown name lists the
    /// groups that exist.
    pub fn group(&self, name: Option<&str>) -> Result<&AttentionGroup> {
        match name {
            None => Ok(&self.groups[0]),
            Some(name) => self
                .groups
                .iter()
                .find(|g| g.name == name)
                .with_context(|| {
                    let names: Vec<&str> = self.groups.iter().map(|g| g.name.as_str()).collect();
                    format!(
                        "this {} model has no {name:?} attention; it has: {} (--group)",
                        self.kind,
                        names.join(", ")
                    )
                }),
        }
    }

    /// The JSON export (`groups[i].weights` is `[layer][head][query][key]`).
    pub fn to_json(&self) -> Result<String> {
        Ok(serde_json::to_string(self)?)
    }
}

/// How a token is shown: a leading space as `▁` (as SentencePiece writes it), a newline as `↵`,
/// a tab as `⇥`.
pub fn token_label(text: &str) -> String {
    let text = text.replace('\n', "↵").replace('\t', "⇥");
    match text.strip_prefix(' ') {
        Some(rest) => format!("▁{rest}"),
        None => text,
    }
}

/// The label of each token id.
pub fn labels(tokenizer: &Tokenizer, ids: &[usize]) -> Vec<String> {
    ids.iter()
        .map(|&id| token_label(&tokenizer.token_text(id)))
        .collect()
}

/// `[b=1, h, q, k]` tensors, one per layer → `[layer][head][query][key]`.
pub fn to_nested<B: LabBackend>(layers: Vec<Tensor<B, 4>>) -> Vec<Vec<Vec<Vec<f32>>>> {
    layers
        .into_iter()
        .map(|w| {
            let [_, h, q, k] = w.dims();
            let values: Vec<f32> = w
                .into_data()
                .convert::<f32>()
                .to_vec()
                .expect("f32 attention weights");
            (0..h)
                .map(|head| {
                    (0..q)
                        .map(|row| {
                            let start = (head * q + row) * k;
                            values[start..start + k].to_vec()
                        })
                        .collect()
                })
                .collect()
        })
        .collect()
}

/// A trained model of any kind, as `attention` and `explain` need it (one is loaded per
/// command, so the variants' different sizes cost nothing).
#[allow(clippy::large_enum_variant)]
pub enum Inspectable<B: LabBackend> {
    /// Decoder-only language model.
    Lm(Trained<B>),
    /// Encoder classifier.
    Classifier(TrainedClassifier<B>),
    /// Encoder–decoder translator.
    Translator(TrainedTranslator<B>),
    /// Vision Transformer.
    Vit(TrainedVit<B>),
}

impl<B: LabBackend> Inspectable<B> {
    /// Loads whatever model `artifact` holds.
    pub fn load(artifact: &ArtifactDir, device: &B::Device) -> Result<Self> {
        let config = ExperimentConfig::load(&artifact.config())?;
        Ok(match config.model {
            ModelConfig::Lm(_) => Self::Lm(Trained::load(artifact, device)?),
            ModelConfig::Classifier(_) => {
                Self::Classifier(TrainedClassifier::load(artifact, device)?)
            }
            ModelConfig::Seq2seq(_) => Self::Translator(TrainedTranslator::load(artifact, device)?),
            ModelConfig::Vit(_) => Self::Vit(TrainedVit::load(artifact, device)?),
        })
    }

    /// The experiment config.
    pub fn config(&self) -> &ExperimentConfig {
        match self {
            Self::Lm(t) => &t.config,
            Self::Classifier(t) => &t.config,
            Self::Translator(t) => &t.config,
            Self::Vit(t) => &t.config,
        }
    }

    /// The token ids of `text` as the model reads it (a classifier's `<s>` first, a
    /// translator's `</s>` last), cut to the model's maximum length with a warning.
    pub fn encode(&self, text: &str) -> Result<Vec<usize>> {
        if text.trim().is_empty() {
            bail!("the text is empty: give the model something to read");
        }
        let (mut ids, max) = match self {
            Self::Lm(t) => (t.tokenizer.encode(text)?, t.model.context()),
            Self::Classifier(t) => {
                let mut ids = vec![Special::Bos.id()];
                ids.extend(t.tokenizer.encode(text)?);
                (ids, t.model.max_len())
            }
            Self::Translator(t) => {
                let mut ids = t.tokenizers.source.encode(text.trim())?;
                ids.push(Special::Eos.id());
                (ids, t.model.max_len())
            }
            Self::Vit(_) => bail!("a ViT reads an image file, not text"),
        };
        if ids.is_empty() {
            bail!("the text has no tokens");
        }
        if ids.len() > max {
            eprintln!(
                "warning: the text has {} tokens; the model reads at most {max}, so only the first {max} are used",
                ids.len()
            );
            ids.truncate(max);
        }
        Ok(ids)
    }

    /// The token labels of `ids` (source side for a translator).
    pub fn labels(&self, ids: &[usize]) -> Vec<String> {
        match self {
            Self::Lm(t) => labels(&t.tokenizer, ids),
            Self::Classifier(t) => labels(&t.tokenizer, ids),
            Self::Translator(t) => labels(&t.tokenizers.source, ids),
            Self::Vit(_) => ids.iter().map(|i| i.to_string()).collect(),
        }
    }

    /// Runs the model on `input` (a text, or an image path for a ViT) and collects the
    /// attention weights of every layer and head. A translator attends over `target` when it is
    /// given, else over its own greedy translation.
    pub fn capture(
        &self,
        input: &str,
        target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps> {
        let config = self.config();
        let mut maps = AttentionMaps {
            model: config.name.clone(),
            kind: config.model.kind().to_string(),
            input: input.to_string(),
            output: None,
            groups: Vec::new(),
            image: None,
        };
        match self {
            Self::Vit(t) => {
                let vit = config.vit()?;
                let image = load_image(Path::new(input), vit.image_size)?;
                let input = ImageInput {
                    size: vit.image_size,
                    patch_size: vit.patch_size,
                    pixels: image.pixels,
                };
                let (group, class) = vit_attention(t, &input, None, device)?;
                maps.output = Some(class);
                maps.groups.push(group);
                maps.image = Some(input);
            }
            _ => {
                let ids = self.encode(input)?;
                maps.groups = self.text_attention(&ids, target, &mut maps.output, device)?;
            }
        }
        Ok(maps)
    }

    /// The attention groups of a text model on token `ids`.
    pub fn text_attention(
        &self,
        ids: &[usize],
        target: Option<&str>,
        output: &mut Option<String>,
        device: &B::Device,
    ) -> Result<Vec<AttentionGroup>> {
        let tokens = pad_rows::<B>(&[ids.iter().map(|&i| i as u32).collect()], device);
        let source_labels = self.labels(ids);
        let group = |name: &str, causal, queries: &[String], keys: &[String], w| AttentionGroup {
            name: name.to_string(),
            causal,
            queries: queries.to_vec(),
            keys: keys.to_vec(),
            weights: to_nested(w),
        };
        Ok(match self {
            Self::Lm(t) => {
                let out = t.model.forward(tokens.clone());
                let weights = weights_or_dense(out.attention, || {
                    let mask = AttentionMask::causal(ids.len(), device);
                    let x = t.model.embed(tokens);
                    t.model.decoder.mixer_weights(x, Some(&mask), None)
                })?;
                vec![group("self", true, &source_labels, &source_labels, weights)]
            }
            Self::Classifier(t) => {
                let out = t.model.forward(tokens.clone());
                *output = Some(predicted_class(out.logits, &t.config.data.dataset));
                // One unpadded sentence: no mask.
                let weights = weights_or_dense(out.attention, || {
                    t.model
                        .encoder
                        .mixer_weights(t.model.embed(tokens), None, None)
                })?;
                vec![group(
                    "self",
                    false,
                    &source_labels,
                    &source_labels,
                    weights,
                )]
            }
            Self::Translator(t) => {
                // The model's own translation is decoded to text and read back, so that a
                // given target and a generated one take the same path.
                let target_text = match target {
                    Some(text) => text.trim().to_string(),
                    None => {
                        let search = SearchConfig {
                            beam_size: 1,
                            length_penalty: 0.0,
                            max_len: t.model.max_len() - 1,
                        };
                        let ids = greedy(&t.model, tokens.clone(), &search).remove(0).tokens;
                        t.tokenizers.target.decode(&ids)
                    }
                };
                let target_ids = t.tokenizers.target.encode(&target_text)?;
                *output = Some(target_text);
                let mut target_in = vec![Special::Bos.id()];
                target_in.extend(target_ids.iter().take(t.model.max_len() - 1));
                let target_labels = labels(&t.tokenizers.target, &target_in);
                let memory = t.model.encode(tokens.clone());
                let encoder = weights_or_dense(memory.attention.clone(), || {
                    let x = t.model.embed_source(tokens);
                    t.model.encoder.mixer_weights(x, None, None)
                })?;
                let target_tensor =
                    pad_rows::<B>(&[target_in.iter().map(|&i| i as u32).collect()], device);
                let out = t.model.decode(&memory, target_tensor.clone());
                let decoder = weights_or_dense(out.self_attention, || {
                    let causal = AttentionMask::causal(target_in.len(), device);
                    let memory = (&memory.states, Some(&memory.mask));
                    let x = t.model.embed_target(target_tensor);
                    t.model
                        .decoder
                        .mixer_weights(x, Some(&causal), Some(memory))
                })?;
                vec![
                    group("encoder", false, &source_labels, &source_labels, encoder),
                    group("decoder", true, &target_labels, &target_labels, decoder),
                    group(
                        "cross",
                        false,
                        &target_labels,
                        &source_labels,
                        out.cross_attention,
                    ),
                ]
            }
            Self::Vit(_) => bail!("a ViT reads an image file, not text"),
        })
    }
}

impl<B: LabBackend> Inspectable<B> {
    /// Head statistics of every group of `maps`, with the position-or-content comparison made
    /// on the same input shuffled by a permutation drawn from `seed` (a classifier keeps its
    /// `<s>` first, a translator its `</s>` last, a ViT its classification token).
    pub fn statistics(
        &self,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut shuffle = |positions: std::ops::Range<usize>, n: usize| {
            let mut moved: Vec<usize> = positions.clone().collect();
            moved.shuffle(&mut rng);
            let mut order: Vec<usize> = (0..n).collect();
            order[positions].copy_from_slice(&moved);
            order
        };
        let (groups, orders, geometry) = match self {
            Self::Vit(t) => {
                let image = maps
                    .image
                    .as_ref()
                    .context("a ViT's maps carry the image")?;
                let grid = image.size / image.patch_size;
                let patches = shuffle(0..grid * grid, grid * grid);
                let (group, _) = vit_attention(t, image, Some(&patches), device)?;
                let tokens: Vec<usize> = std::iter::once(0)
                    .chain(patches.iter().map(|p| p + 1))
                    .collect();
                let geometry = Geometry::Patches {
                    grid,
                    patch: image.patch_size,
                };
                (vec![group], vec![(tokens.clone(), tokens)], geometry)
            }
            _ => {
                let ids = self.encode(&maps.input)?;
                let n = ids.len();
                let order = match self {
                    Self::Classifier(_) => shuffle(1..n, n),
                    Self::Translator(_) => shuffle(0..n - 1, n),
                    _ => shuffle(0..n, n),
                };
                let shuffled: Vec<usize> = order.iter().map(|&i| ids[i]).collect();
                let mut output = None;
                let groups =
                    self.text_attention(&shuffled, maps.output.as_deref(), &mut output, device)?;
                let orders = groups
                    .iter()
                    .map(|g| {
                        let same = |len: usize| (0..len).collect::<Vec<usize>>();
                        match g.name.as_str() {
                            "decoder" => (same(g.queries.len()), same(g.keys.len())),
                            "cross" => (same(g.queries.len()), order.clone()),
                            _ => (order.clone(), order.clone()),
                        }
                    })
                    .collect();
                (groups, orders, Geometry::Sequence)
            }
        };
        Ok(maps
            .groups
            .iter()
            .zip(&groups)
            .zip(&orders)
            .map(|((original, shuffled), (query_order, key_order))| {
                let comparison = Shuffled {
                    group: shuffled,
                    query_order,
                    key_order,
                };
                let heads = stats::head_stats(original, geometry, Some(&comparison));
                GroupStats {
                    name: original.name.clone(),
                    text: stats::render(original, geometry, &heads),
                    heads,
                }
            })
            .collect())
    }
}

/// The head statistics of one attention group, as numbers and as a printable table.
#[derive(Clone, Debug)]
pub struct GroupStats {
    /// The group's name.
    pub name: String,
    /// One entry per layer and head.
    pub heads: Vec<stats::HeadStats>,
    /// The table [`stats::render`] makes of them.
    pub text: String,
}

/// `"label (p%)"` of the most likely class of one row of logits `[1, classes]`.
fn predicted_class<B: LabBackend>(logits: Tensor<B, 2>, dataset: &str) -> String {
    let probabilities: Vec<f32> = burn::tensor::activation::softmax(logits, 1)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .expect("f32 probabilities");
    let (class, p) = crate::classify::top_classes(&probabilities, 1)[0];
    format!(
        "{} ({:.1}%)",
        crate::classify::class_names(dataset)[class],
        100.0 * p
    )
}

/// The labels of a ViT's tokens: `CLS`, then each patch as `row,col`.
pub fn patch_labels(grid: usize) -> Vec<String> {
    std::iter::once("CLS".to_string())
        .chain((0..grid * grid).map(|i| format!("{},{}", i / grid, i % grid)))
        .collect()
}

/// The weights a forward pass returned (the full mixer's), or else the mixer's dense weights
/// computed on request; an error for a model without attention (Hyena).
fn weights_or_dense<B: LabBackend>(
    from_forward: Vec<Tensor<B, 4>>,
    dense: impl FnOnce() -> Option<Vec<Tensor<B, 4>>>,
) -> Result<Vec<Tensor<B, 4>>> {
    if !from_forward.is_empty() {
        return Ok(from_forward);
    }
    dense().ok_or_else(|| {
        anyhow!(
            "this model mixes tokens with the hyena operator (long convolutions and gating), \
             which has no attention weights to show"
        )
    })
}

/// A ViT's self-attention on `image` (its patches reordered by `permutation` when given) and
/// its predicted class with probability.
pub fn vit_attention<B: LabBackend>(
    trained: &TrainedVit<B>,
    image: &ImageInput,
    permutation: Option<&[usize]>,
    device: &B::Device,
) -> Result<(AttentionGroup, String)> {
    let size = image.size;
    let values: Vec<f32> = image.pixels.iter().map(|&p| normalise_pixel(p)).collect();
    let mut batch = Tensor::<B, 4>::from_data(TensorData::new(values, [1, 1, size, size]), device);
    if let Some(order) = permutation {
        let patches = patchify(batch, image.patch_size); // [1, n, p·p]
        let index = Tensor::<B, 1, Int>::from_data(
            TensorData::new(
                order.iter().map(|&i| i as i64).collect::<Vec<_>>(),
                [order.len()],
            ),
            device,
        );
        batch = unpatchify(patches.select(1, index), 1, size, size);
    }
    let out = trained.model.forward(batch.clone());
    let class = predicted_class(out.logits, &trained.config.data.dataset);
    let weights = weights_or_dense(out.attention, || {
        let encoder = &trained.model.encoder;
        encoder.mixer_weights(trained.model.embed(batch), None, None)
    })?;
    let labels = patch_labels(size / image.patch_size);
    let group = AttentionGroup {
        name: "self".to_string(),
        causal: false,
        queries: labels.clone(),
        keys: labels,
        weights: to_nested(weights),
    };
    Ok((group, class))
}
