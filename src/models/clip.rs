//! CLIP (Radford et al. 2021): an image encoder (the [`VisionTransformer`]) and a text encoder
//! (the [`TextClassifier`]'s encoder), each followed by a linear projection into one shared
//! space and L2 normalisation; a learned temperature scales their cosine similarities, and the
//! symmetric InfoNCE loss pulls each image towards its own caption and away from the batch's
//! other captions (and each caption towards its image).

use super::classifier::{ClassifierConfig, TextClassifier};
use super::vit::{VisionTransformer, VitConfig};
use crate::kernels::{self, LabBackend};
use crate::nn::config::over_defaults_of;
use crate::nn::{
    Activation, AttentionLayers, MultiHeadAttention, Pooling, PositionKind, StackConfig,
};
use anyhow::{bail, Result};
use burn::module::{Module, Param};
use burn::nn::{Initializer, LinearConfig};
use burn::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Configuration of [`Clip`] (the `model` of a `"kind": "clip"` experiment).
///
/// Each tower is its own model's config — the image tower a [`VitConfig`], the text tower a
/// [`ClassifierConfig`] — whose head is the projection into the shared space: its `n_classes`
/// is `embed_dim` (never written in a tower). Each tower's `pruned_heads` names its own layers
/// (`"layer 2"`); the whole model's names are `"image layer 2"`, `"text layer 2"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "ClipSections")]
pub struct ClipConfig {
    /// Width of the shared image–text space.
    pub embed_dim: usize,
    /// The image encoder: a ViT (patch 7 and no dropout unless written).
    #[serde(serialize_with = "tower_out")]
    pub image: VitConfig,
    /// The text encoder over `<s> caption </s>`: a classifier's encoder (width 64, `d_ff` 128,
    /// `max_len` 24, no dropout, `pool` `last` — the end-of-text token, as in CLIP — unless
    /// written).
    #[serde(serialize_with = "tower_out")]
    pub text: ClassifierConfig,
    /// The temperature's starting value τ: similarities are multiplied by 1/τ (learned, as its
    /// logarithm).
    pub init_temperature: f64,
    /// The largest the scale 1/τ may grow (100 in the paper).
    pub max_logit_scale: f64,
}

/// A clip section as written: the towers as JSON objects, read over their own defaults once
/// `embed_dim` is known.
#[derive(Deserialize)]
#[serde(default)]
struct ClipSections {
    embed_dim: usize,
    image: serde_json::Map<String, serde_json::Value>,
    text: serde_json::Map<String, serde_json::Value>,
    init_temperature: f64,
    max_logit_scale: f64,
}

impl Default for ClipSections {
    fn default() -> Self {
        let clip = ClipConfig::default();
        Self {
            embed_dim: clip.embed_dim,
            image: Default::default(),
            text: Default::default(),
            init_temperature: clip.init_temperature,
            max_logit_scale: clip.max_logit_scale,
        }
    }
}

/// Fields of the towers' own configs a tower does not have: the projection's width is the clip
/// model's; a tower starts from nothing but the clip model's init.
const NOT_IN_A_TOWER: [&str; 2] = ["n_classes", "init_from"];

impl TryFrom<ClipSections> for ClipConfig {
    type Error = String;

    fn try_from(sections: ClipSections) -> Result<Self, String> {
        let defaults = ClipConfig::default();
        let read = |name: &str, given: serde_json::Map<String, serde_json::Value>| {
            if let Some(key) = NOT_IN_A_TOWER.iter().find(|k| given.contains_key(**k)) {
                return Err(format!(
                    "model.{name}: `{key}` is not a tower's (the projection's width is \
                     embed_dim)"
                ));
            }
            Ok(given)
        };
        let mut image: VitConfig =
            over_defaults_of(&defaults.image, read("image", sections.image)?, &[])
                .map_err(|e| format!("model.image: {e}"))?;
        let mut text: ClassifierConfig = over_defaults_of(
            &defaults.text,
            read("text", sections.text)?,
            &["embedding_norm"],
        )
        .map_err(|e| format!("model.text: {e}"))?;
        image.n_classes = sections.embed_dim;
        text.n_classes = sections.embed_dim;
        // Artifacts written before each tower kept its own: both towers' pruned heads in the
        // image tower's list, by the whole model's names.
        let mut clip = ClipConfig {
            embed_dim: sections.embed_dim,
            image,
            text,
            init_temperature: sections.init_temperature,
            max_logit_scale: sections.max_logit_scale,
        };
        let all = clip.pruned_heads();
        clip.set_pruned_heads(all);
        Ok(clip)
    }
}

/// A tower as written: its config without the fields a tower does not have.
fn tower_out<S: serde::Serializer, T: Serialize>(
    tower: &T,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let mut fields = match serde_json::to_value(tower) {
        Ok(serde_json::Value::Object(fields)) => fields,
        _ => return Err(serde::ser::Error::custom("a tower serializes to an object")),
    };
    for key in NOT_IN_A_TOWER {
        fields.remove(key);
    }
    fields.serialize(serializer)
}

impl Default for ClipConfig {
    fn default() -> Self {
        let embed_dim = 64;
        Self {
            embed_dim,
            image: VitConfig {
                patch_size: 7,
                n_classes: embed_dim,
                stack: StackConfig {
                    dropout: 0.0,
                    ..VitConfig::default().stack
                },
                ..VitConfig::default()
            },
            text: ClassifierConfig {
                vocab_size: 0,
                n_classes: embed_dim,
                stack: StackConfig {
                    d_model: 64,
                    d_ff: 128,
                    activation: Activation::Gelu,
                    ..StackConfig::default()
                },
                n_layers: 2,
                max_len: 24,
                position: PositionKind::Learned,
                pool: Pooling::Last,
                init_from: None,
                embedding_norm: false,
            },
            init_temperature: 0.07,
            max_logit_scale: 100.0,
        }
    }
}

/// The towers, by the prefix of their layers' names in the whole model.
const TOWERS: [&str; 2] = ["image ", "text "];

impl ClipConfig {
    /// The whole model's pruned heads: each tower's, its layers' names prefixed (`"text layer 1"`).
    pub fn pruned_heads(&self) -> BTreeMap<String, Vec<usize>> {
        let stacks = [&self.image.stack, &self.text.stack];
        TOWERS
            .iter()
            .zip(stacks)
            .flat_map(|(tower, stack)| {
                stack.pruned_heads.iter().map(move |(layer, heads)| {
                    // (A name already carrying a tower's prefix: an older artifact's.)
                    let named = if TOWERS.iter().any(|t| layer.starts_with(t)) {
                        layer.clone()
                    } else {
                        format!("{tower}{layer}")
                    };
                    (named, heads.clone())
                })
            })
            .collect()
    }

    /// Gives each tower its layers' part of the whole model's `pruned` heads.
    pub fn set_pruned_heads(&mut self, pruned: BTreeMap<String, Vec<usize>>) {
        self.image.stack.pruned_heads.clear();
        self.text.stack.pruned_heads.clear();
        for (layer, heads) in pruned {
            let (stack, own) = match layer.strip_prefix(TOWERS[1]) {
                Some(own) => (&mut self.text.stack, own),
                None => (
                    &mut self.image.stack,
                    layer.strip_prefix(TOWERS[0]).unwrap_or(&layer),
                ),
            };
            stack.pruned_heads.insert(own.to_string(), heads);
        }
    }

    /// Checks the relations between fields.
    pub fn validate(&self) -> Result<()> {
        if self.embed_dim < 2 {
            bail!("model: embed_dim must be at least 2");
        }
        let scale = 1.0 / self.init_temperature;
        if !(self.init_temperature > 0.0 && scale.is_finite()) {
            bail!("model: init_temperature must be positive");
        }
        if self.max_logit_scale.is_nan() || self.max_logit_scale < scale {
            bail!(
                "model: max_logit_scale ({}) must be at least 1/init_temperature ({scale:.3})",
                self.max_logit_scale
            );
        }
        if self.image.pool == Pooling::Last {
            bail!("model.image: pool must be cls or mean (last is the text encoder's)");
        }
        if self.image.n_classes != self.embed_dim || self.text.n_classes != self.embed_dim {
            bail!(
                "model: each tower projects to embed_dim ({})",
                self.embed_dim
            );
        }
        if self.text.init_from.is_some() {
            bail!("model.text: init_from is not a tower's");
        }
        self.image.validate()?;
        self.text.validate()
    }

    /// Builds the model. `text.vocab_size` must be resolved and the config validated.
    pub fn init<B: LabBackend>(&self, device: &B::Device) -> Clip<B> {
        let projection = |d: usize| {
            LinearConfig::new(d, self.embed_dim)
                .with_bias(false)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: (d as f64).powf(-0.5),
                })
                .init(device)
        };
        let mut image = self.image.init(device);
        image.head = projection(self.image.stack.d_model);
        let mut text = self.text.init(device);
        text.head = projection(self.text.stack.d_model);
        let log_scale = (1.0 / self.init_temperature).ln();
        Clip {
            image,
            text,
            logit_scale: Param::from_tensor(Tensor::from_floats([log_scale as f32], device)),
            max_logit_scale: self.max_logit_scale,
        }
    }
}

/// The contrastive image–text model.
#[derive(Module, Debug)]
pub struct Clip<B: LabBackend> {
    /// Image encoder; its `head` is the image projection `[d_image] → [embed_dim]`.
    pub image: VisionTransformer<B>,
    /// Text encoder; its `head` is the text projection `[d_text] → [embed_dim]`.
    pub text: TextClassifier<B>,
    /// `ln(1/τ)`, learned: `[1]`.
    pub logit_scale: Param<Tensor<B, 1>>,
    #[module(skip)]
    max_logit_scale: f64,
}

/// Similarities of a batch of images with a batch of texts, and both encoders' attention.
#[derive(Clone, Debug)]
pub struct ClipOutput<B: LabBackend> {
    /// `[images, texts]`: the scaled cosine similarities (image `i` with text `j`).
    pub logits: Tensor<B, 2>,
    /// The image encoder's attention, per layer `[b, h, n + 1, n + 1]`.
    pub image_attention: Vec<Tensor<B, 4>>,
    /// The text encoder's attention, per layer `[b, h, t, t]`.
    pub text_attention: Vec<Tensor<B, 4>>,
}

/// Rows scaled to unit length.
///
/// # Shapes
/// `[b, e]` → `[b, e]`.
pub fn l2_normalize<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 2> {
    let norm = x.clone().powi_scalar(2).sum_dim(1).sqrt().clamp_min(1e-12); // [b, 1]
    x / norm
}

/// The symmetric InfoNCE loss of a square matrix of scaled similarities whose diagonal holds
/// the matching pairs: the mean of the cross-entropy of each row over its columns (image →
/// text) and of each column over its rows (text → image).
///
/// # Shapes
/// `logits`: `[b, b]` → `[1]`.
pub fn info_nce<B: LabBackend>(logits: Tensor<B, 2>) -> Tensor<B, 1> {
    let [b, _] = logits.dims();
    let targets = Tensor::<B, 1, Int>::arange(0..b as i64, &logits.device());
    let images = kernels::cross_entropy(logits.clone(), targets.clone(), 0.0, None).mean();
    let texts = kernels::cross_entropy(logits.transpose(), targets, 0.0, None).mean();
    (images + texts) / 2.0
}

impl<B: LabBackend> Clip<B> {
    /// Unit-length embeddings of images.
    ///
    /// # Shapes
    /// `images`: `[b, c, H, W]` → `[b, embed_dim]`.
    pub fn embed_images(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        l2_normalize(self.image.forward(images).logits)
    }

    /// Unit-length embeddings of padded token rows (`<s> … </s>`, `<pad>` on the right).
    ///
    /// # Shapes
    /// `tokens`: `[b, t]` → `[b, embed_dim]`.
    pub fn embed_texts(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 2> {
        l2_normalize(self.text.forward(tokens).logits)
    }

    /// The similarity scale `1/τ = exp(logit_scale)`, clamped at `max_logit_scale`: `[1]`.
    pub fn scale(&self) -> Tensor<B, 1> {
        self.logit_scale.val().exp().clamp_max(self.max_logit_scale)
    }

    /// The scaled similarities of every image with every text.
    ///
    /// # Shapes
    /// `images`: `[b, c, H, W]`, `tokens`: `[k, t]` → logits `[b, k]`.
    pub fn forward(&self, images: Tensor<B, 4>, tokens: Tensor<B, 2, Int>) -> ClipOutput<B> {
        let image = self.image.forward(images);
        let text = self.text.forward(tokens);
        let (i, t) = (l2_normalize(image.logits), l2_normalize(text.logits));
        let logits = i.matmul(t.transpose()) * self.scale().unsqueeze::<2>(); // [b, k]
        ClipOutput {
            logits,
            image_attention: image.attention,
            text_attention: text.attention,
        }
    }

    /// The InfoNCE loss of a batch of matching pairs, with the image → text logits and the
    /// targets (each image's own caption).
    pub fn loss(
        &self,
        images: Tensor<B, 4>,
        tokens: Tensor<B, 2, Int>,
    ) -> (Tensor<B, 1>, Tensor<B, 2>, Tensor<B, 1, Int>) {
        let logits = self.forward(images, tokens).logits;
        let [b, _] = logits.dims();
        let targets = Tensor::<B, 1, Int>::arange(0..b as i64, &logits.device());
        (info_nce(logits.clone()), logits, targets)
    }
}

impl<B: LabBackend> AttentionLayers<B> for Clip<B> {
    fn attention_layers(&mut self) -> Vec<(String, &mut MultiHeadAttention<B>)> {
        let mut layers = self.image.encoder.named_attention("image layer ");
        layers.extend(self.text.encoder.named_attention("text layer "));
        layers
    }
}
