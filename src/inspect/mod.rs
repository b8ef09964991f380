//! Attention inspection: the weights of every layer and head of a trained model on one input,
//! as a terminal heatmap ([`terminal`]), a PNG grid ([`picture`]), a self-contained HTML page
//! ([`html`]), JSON, and per-head statistics ([`stats`]); what each head is worth ([`heads`]).
//!
//! The weights come from the models' own forward passes (the [`crate::nn`] stack returns them);
//! nothing here recomputes attention. Each model kind captures its own groups (`kinds/`) with
//! the helpers of [`capture`]; [`TextModel`] is a text model seen as a reader of one text, for
//! `explain` and `embed`.

pub mod heads;
pub mod html;
pub mod picture;
pub mod stats;
pub mod terminal;

mod capture;
mod text;

pub use capture::{
    image_statistics, patch_labels, predicted_class, text_statistics, vit_attention,
    weights_or_dense, GroupStats,
};
pub use text::TextModel;

use crate::data::Tokenizer;
use crate::kernels::LabBackend;
use anyhow::{bail, Context, Result};
use burn::prelude::*;
use serde::Serialize;

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

    /// Number of heads of the widest layer (a pruned model's layers can differ).
    pub fn n_heads(&self) -> usize {
        self.weights.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Number of heads of `layer`.
    pub fn heads_in(&self, layer: usize) -> usize {
        self.weights.get(layer).map_or(0, Vec::len)
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
            self.n_layers(),
            |l| self.heads_in(l),
            layer,
            head,
        )?;
        Ok(&self.weights[layer][head])
    }
}

/// Fails unless `layer` and `head` exist in `what`, which has `layers` layers of
/// `heads_in(layer)` heads, naming the ranges that do.
pub fn check_head(
    what: &str,
    layers: usize,
    heads_in: impl Fn(usize) -> usize,
    layer: usize,
    head: usize,
) -> Result<()> {
    if layer >= layers {
        bail!(
            "layer {layer} does not exist: {what} has layers 0–{} (--layer)",
            layers - 1
        );
    }
    let heads = heads_in(layer);
    if head >= heads {
        bail!(
            "head {head} does not exist: layer {layer} has heads 0–{} (--head)",
            heads - 1
        );
    }
    Ok(())
}

/// `"token weight"` of the three keys a row of weights gives most to, largest first; keys of
/// weight 0 — those the mask hides from this query — are no candidates and are left out.
pub fn strongest_keys(row: &[f32], keys: &[String]) -> String {
    let top: Vec<String> = crate::classify::top_classes(row, 3)
        .into_iter()
        .filter(|&(_, w)| w > 0.0)
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
    /// Maps of `model` (an experiment's name) of `kind` on `input`, groups to be filled in.
    pub fn new(model: &str, kind: &str, input: &str) -> Self {
        Self {
            model: model.to_string(),
            kind: kind.to_string(),
            input: input.to_string(),
            output: None,
            groups: Vec::new(),
            image: None,
        }
    }

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

impl AttentionGroup {
    /// A group named `name` whose rows are `queries` and columns `keys`, from one `[1, h, q, k]`
    /// tensor per layer.
    pub fn from_layers<B: LabBackend>(
        name: &str,
        causal: bool,
        queries: &[String],
        keys: &[String],
        layers: Vec<Tensor<B, 4>>,
    ) -> Self {
        Self {
            name: name.to_string(),
            causal,
            queries: queries.to_vec(),
            keys: keys.to_vec(),
            weights: to_nested(layers),
        }
    }
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
