//! Vision Transformer (Dosovitskiy et al. 2021): cut the image into `p × p` patches, project
//! each flattened patch with one learned linear map, prepend a learned classification token,
//! add positions, run the encoder stack (no mask: every token sees every token), pool (the
//! classification token, or the mean) and classify.

use crate::kernels::{self, LabBackend};
use crate::nn::{
    pool, Activation, AttentionLayers, MultiHeadAttention, Pooling, PositionEncoding,
    PositionEncodingConfig, PositionKind, StackConfig, TransformerStack,
};
use anyhow::{bail, Result};
use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig, Initializer, Linear, LinearConfig};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

/// Configuration of [`VisionTransformer`] (the `model` of a `"kind": "vit"` experiment).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VitConfig {
    /// Input image height and width in pixels (square images).
    pub image_size: usize,
    /// Input channels (1 for grey images).
    pub channels: usize,
    /// Patch side `p`; must divide `image_size`.
    pub patch_size: usize,
    /// Classes.
    pub n_classes: usize,
    /// Width, heads, feed-forward, dropout, activation, norm placement, biases and mixer.
    #[serde(flatten)]
    pub stack: StackConfig,
    /// Encoder blocks.
    pub n_layers: usize,
    /// Positions: `learned` (1-D, the paper's default), `sinusoidal` (1-D), `sincos2d`
    /// (row and column), or `none`.
    pub position: PositionKind,
    /// What the head reads: `cls` (the classification token) or `mean` (of all tokens).
    pub pool: Pooling,
}

impl Default for VitConfig {
    fn default() -> Self {
        Self {
            image_size: 28,
            channels: 1,
            patch_size: 4,
            n_classes: 10,
            stack: StackConfig {
                d_model: 64,
                d_ff: 128,
                dropout: 0.1,
                activation: Activation::Gelu,
                ..StackConfig::default()
            },
            n_layers: 4,
            position: PositionKind::Learned,
            pool: Pooling::Cls,
        }
    }
}

impl VitConfig {
    /// Checks the relations between fields.
    pub fn validate(&self) -> Result<()> {
        if self.patch_size == 0 || !self.image_size.is_multiple_of(self.patch_size) {
            bail!(
                "model: image_size ({}) must be a multiple of patch_size ({})",
                self.image_size,
                self.patch_size
            );
        }
        if self.n_layers == 0 || self.channels == 0 || self.n_classes < 2 {
            bail!("model: n_layers and channels must be at least 1, n_classes at least 2");
        }
        if self.position == PositionKind::Sincos2d && !self.stack.d_model.is_multiple_of(4) {
            bail!("model: sincos2d positions need d_model divisible by 4");
        }
        self.stack.validate("vit", false)?;
        self.stack.validate_position(self.position)
    }

    /// Patches per side.
    pub fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Tokens the encoder sees: the patches and the classification token.
    pub fn n_tokens(&self) -> usize {
        self.grid() * self.grid() + 1
    }

    /// Builds the model (the config must be valid).
    pub fn init<B: LabBackend>(&self, device: &B::Device) -> VisionTransformer<B> {
        let (stack, d) = (&self.stack, self.stack.d_model);
        let patch_dim = self.channels * self.patch_size * self.patch_size;
        let position = PositionEncodingConfig::new(self.position, self.n_tokens(), d)
            .with_grid(Some([self.grid(), self.grid()]));
        VisionTransformer {
            patch_embedding: LinearConfig::new(patch_dim, d)
                .with_bias(stack.bias)
                .init(device),
            cls_token: Initializer::Normal {
                mean: 0.0,
                std: 0.02,
            }
            .init([1, 1, d], device),
            position: position.init(device),
            encoder: stack
                .encoder(self.n_layers, self.n_tokens())
                .with_relative(self.position.relative())
                .init(device),
            head: LinearConfig::new(d, self.n_classes)
                .with_bias(stack.bias)
                .with_initializer(Initializer::Zeros)
                .init(device),
            dropout: DropoutConfig::new(stack.dropout).init(),
            patch_size: self.patch_size,
            pooling: self.pool,
        }
    }
}

/// The Vision Transformer.
#[derive(Module, Debug)]
pub struct VisionTransformer<B: LabBackend> {
    /// Flattened patch `[c·p·p]` → `[d]`.
    pub patch_embedding: Linear<B>,
    /// The learned classification token, `[1, 1, d]`.
    pub cls_token: Param<Tensor<B, 3>>,
    /// Positions of the classification token (index 0) and the patches (row-major).
    pub position: PositionEncoding<B>,
    /// The encoder stack.
    pub encoder: TransformerStack<B>,
    /// Pooled state → class scores.
    pub head: Linear<B>,
    dropout: Dropout,
    patch_size: usize,
    #[module(skip)]
    pooling: Pooling,
}

/// Class scores, the pooled vector they came from, and every layer's attention.
#[derive(Clone, Debug)]
pub struct VitOutput<B: LabBackend> {
    /// `[b, classes]`.
    pub logits: Tensor<B, 2>,
    /// `[b, d]`.
    pub pooled: Tensor<B, 2>,
    /// Per layer, `[b, h, n + 1, n + 1]`; token 0 is the classification token.
    pub attention: Vec<Tensor<B, 4>>,
}

/// Cuts images into non-overlapping `p × p` patches, each flattened channel-major.
///
/// # Shapes
/// `images`: `[b, c, H, W]` with `p` dividing `H` and `W` → `[b, (H/p)·(W/p), c·p·p]`, patches
/// in row-major order.
pub fn patchify<B: LabBackend>(images: Tensor<B, 4>, p: usize) -> Tensor<B, 3> {
    let [b, c, h, w] = images.dims();
    let (gh, gw) = (h / p, w / p);
    images
        .reshape([b, c, gh, p, gw, p]) // [b, c, gh, p, gw, p]
        .permute([0, 2, 4, 1, 3, 5]) // [b, gh, gw, c, p, p]
        .reshape([b, gh * gw, c * p * p])
}

/// The inverse of [`patchify`].
///
/// # Shapes
/// `patches`: `[b, (H/p)·(W/p), c·p·p]` → `[b, c, H, W]`.
pub fn unpatchify<B: LabBackend>(
    patches: Tensor<B, 3>,
    c: usize,
    h: usize,
    w: usize,
) -> Tensor<B, 4> {
    let [b, _, _] = patches.dims();
    let p = ((patches.dims()[2] / c) as f64).sqrt().round() as usize;
    patches
        .reshape([b, h / p, w / p, c, p, p]) // [b, gh, gw, c, p, p]
        .permute([0, 3, 1, 4, 2, 5]) // [b, c, gh, p, gw, p]
        .reshape([b, c, h, w])
}

impl<B: LabBackend> VisionTransformer<B> {
    /// Class scores of a batch of images.
    ///
    /// # Shapes
    /// `images`: `[b, c, H, W]` → logits `[b, classes]`.
    pub fn forward(&self, images: Tensor<B, 4>) -> VitOutput<B> {
        let out = self.encoder.forward(self.embed(images), None, None);
        let pooled = pool(out.x, self.pooling, None); // [b, d]
        VitOutput {
            logits: self.head.forward(pooled.clone()),
            pooled,
            attention: out.self_attention,
        }
    }

    /// Patch embedding, the `[CLS]` token first, positions (+ dropout): the encoder's input.
    ///
    /// # Shapes
    /// `images`: `[b, c, H, W]` → `[b, n + 1, d]`.
    pub fn embed(&self, images: Tensor<B, 4>) -> Tensor<B, 3> {
        let [b, _, _, _] = images.dims();
        let patches = patchify(images, self.patch_size); // [b, n, c·p·p]
        let x = self.patch_embedding.forward(patches); // [b, n, d]
        let d = x.dims()[2];
        let cls = self.cls_token.val().expand([b, 1, d]); // [b, 1, d]
        let x = Tensor::cat(vec![cls, x], 1); // [b, n + 1, d]
        crate::kernels::dropout(&self.dropout, self.position.forward(x))
    }

    /// Mean cross-entropy of a batch, with the logits and labels it was computed from.
    pub fn loss(
        &self,
        images: Tensor<B, 4>,
        labels: Tensor<B, 1, Int>,
    ) -> (Tensor<B, 1>, Tensor<B, 2>, Tensor<B, 1, Int>) {
        let logits = self.forward(images).logits;
        let loss = kernels::cross_entropy(logits.clone(), labels.clone(), 0.0, None).mean();
        (loss, logits, labels)
    }

    /// Patch side `p`.
    pub fn patch_size(&self) -> usize {
        self.patch_size
    }
}

impl<B: LabBackend> AttentionLayers<B> for VisionTransformer<B> {
    fn attention_layers(&mut self) -> Vec<(String, &mut MultiHeadAttention<B>)> {
        self.encoder.named_attention("layer ")
    }
}
