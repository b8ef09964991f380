//! CLIP (Radford et al. 2021): an image encoder (the [`VisionTransformer`]) and a text encoder
//! (the [`TextClassifier`]'s encoder), each followed by a linear projection into one shared
//! space and L2 normalisation; a learned temperature scales their cosine similarities, and the
//! symmetric InfoNCE loss pulls each image towards its own caption and away from the batch's
//! other captions (and each caption towards its image).

use super::classifier::{ClassifierConfig, TextClassifier};
use super::vit::{VisionTransformer, VitConfig};
use crate::kernels::{self, LabBackend};
use crate::nn::config::over_defaults;
use crate::nn::{
    Activation, AttentionLayers, MultiHeadAttention, Pooling, PositionKind, StackConfig,
};
use anyhow::{bail, Result};
use burn::module::{Module, Param};
use burn::nn::{Initializer, LinearConfig};
use burn::prelude::*;
use serde::de::Deserializer;
use serde::{Deserialize, Serialize};

/// Configuration of [`Clip`] (the `model` of a `"kind": "clip"` experiment).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClipConfig {
    /// Width of the shared image–text space.
    pub embed_dim: usize,
    /// The image encoder.
    #[serde(deserialize_with = "tower")]
    pub image: ImageTowerConfig,
    /// The text encoder.
    #[serde(deserialize_with = "tower")]
    pub text: TextTowerConfig,
    /// The temperature's starting value τ: similarities are multiplied by 1/τ (learned, as its
    /// logarithm).
    pub init_temperature: f64,
    /// The largest the scale 1/τ may grow (100 in the paper).
    pub max_logit_scale: f64,
}

/// The image encoder of a [`ClipConfig`]: a ViT whose head is the projection.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageTowerConfig {
    /// Input image height and width in pixels (square images).
    pub image_size: usize,
    /// Input channels (1 for grey images).
    pub channels: usize,
    /// Patch side `p`; must divide `image_size`.
    pub patch_size: usize,
    /// Width, heads, feed-forward, dropout, activation, norm placement, biases and mixer.
    #[serde(flatten)]
    pub stack: StackConfig,
    /// Encoder blocks.
    pub n_layers: usize,
    /// Positions: `learned`, `sinusoidal`, `sincos2d` or `none`.
    pub position: PositionKind,
    /// What the projection reads: `cls` (the classification token) or `mean`.
    pub pool: Pooling,
}

/// The text encoder of a [`ClipConfig`]: an encoder over `<s> caption </s>` whose head is the
/// projection.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TextTowerConfig {
    /// Vocabulary size; `0` = from the tokenizer (the saved config has it filled).
    pub vocab_size: usize,
    /// Width, heads, feed-forward, dropout, activation, norm placement, biases and mixer.
    #[serde(flatten)]
    pub stack: StackConfig,
    /// Encoder blocks.
    pub n_layers: usize,
    /// Longest caption in tokens (`<s>` and `</s>` included); longer captions are cut.
    pub max_len: usize,
    /// Positions: `learned`, `sinusoidal` or `none`.
    pub position: PositionKind,
    /// What the projection reads: `last` (the end-of-text token `</s>`, as in CLIP), `cls`
    /// (`<s>`) or `mean`.
    pub pool: Pooling,
}

impl Default for ClipConfig {
    fn default() -> Self {
        Self {
            embed_dim: 64,
            image: ImageTowerConfig::default(),
            text: TextTowerConfig::default(),
            init_temperature: 0.07,
            max_logit_scale: 100.0,
        }
    }
}

impl Default for ImageTowerConfig {
    fn default() -> Self {
        let vit = VitConfig::default();
        Self {
            image_size: vit.image_size,
            channels: vit.channels,
            patch_size: 7,
            stack: vit.stack,
            n_layers: vit.n_layers,
            position: vit.position,
            pool: vit.pool,
        }
    }
}

impl Default for TextTowerConfig {
    fn default() -> Self {
        Self {
            vocab_size: 0,
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
        }
    }
}

/// A tower read over its defaults, unknown keys refused.
fn tower<'de, D: Deserializer<'de>, T: Default + Serialize + serde::de::DeserializeOwned>(
    deserializer: D,
) -> Result<T, D::Error> {
    let given = serde_json::Map::<String, serde_json::Value>::deserialize(deserializer)?;
    over_defaults(given, &[]).map_err(serde::de::Error::custom)
}

impl ImageTowerConfig {
    /// The ViT this tower is, its head projecting to `embed_dim`.
    pub fn vit(&self, embed_dim: usize) -> VitConfig {
        VitConfig {
            image_size: self.image_size,
            channels: self.channels,
            patch_size: self.patch_size,
            n_classes: embed_dim,
            stack: self.stack.clone(),
            n_layers: self.n_layers,
            position: self.position,
            pool: self.pool,
        }
    }
}

impl TextTowerConfig {
    /// The text encoder this tower is, its head projecting to `embed_dim`.
    pub fn encoder(&self, embed_dim: usize) -> ClassifierConfig {
        ClassifierConfig {
            vocab_size: self.vocab_size,
            n_classes: embed_dim,
            stack: self.stack.clone(),
            n_layers: self.n_layers,
            max_len: self.max_len,
            position: self.position,
            pool: self.pool,
            init_from: None,
            embedding_norm: false,
        }
    }
}

impl ClipConfig {
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
        if !self.text.stack.pruned_heads.is_empty() {
            bail!(
                "model.text: pruned_heads of the whole model (both encoders) are listed in \
                 model.image"
            );
        }
        self.image.vit(self.embed_dim).validate()?;
        self.text.encoder(self.embed_dim).validate()
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
        let mut image = self.image.vit(self.embed_dim).init(device);
        image.head = projection(self.image.stack.d_model);
        let mut text = self.text.encoder(self.embed_dim).init(device);
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
