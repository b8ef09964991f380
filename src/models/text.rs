//! What the text encoders (the classifier, the masked language model and CLIP's text tower)
//! share: the same fields, built the same way, reading tokens the same way — which is what lets
//! a classifier start from a masked language model's weights as they are.

use crate::kernels::{self, LabBackend};
use crate::nn::{
    PositionEncoding, PositionEncodingConfig, PositionKind, StackConfig, TransformerStack,
};
use burn::nn::{Dropout, Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig};
use burn::prelude::*;

/// A text encoder's weights before its head.
pub(crate) struct EncoderParts<B: LabBackend> {
    pub token_embedding: Embedding<B>,
    pub position: PositionEncoding<B>,
    pub encoder: TransformerStack<B>,
    pub embedding_norm: Option<LayerNorm<B>>,
}

/// The settings that shape [`EncoderParts`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct EncoderShape<'a> {
    pub vocab_size: usize,
    pub stack: &'a StackConfig,
    pub n_layers: usize,
    pub max_len: usize,
    pub position: PositionKind,
    pub embedding_norm: bool,
}

impl EncoderShape<'_> {
    /// Every setting that decides the weights' shapes and meaning, by its config name (dropout
    /// and pruning left out: a fine-tuned model may choose its own).
    fn settings(&self) -> serde_json::Map<String, serde_json::Value> {
        let stack = StackConfig {
            d_ff: self.stack.d_ff(),
            pruned_heads: Default::default(),
            ..self.stack.clone()
        };
        let mut settings = match serde_json::to_value(&stack) {
            Ok(serde_json::Value::Object(fields)) => fields,
            _ => unreachable!("a StackConfig serializes to an object"),
        };
        settings.remove("dropout");
        let json = serde_json::json!({
            "norm_epsilon": stack.norm_epsilon,
            "vocab_size": self.vocab_size,
            "n_layers": self.n_layers,
            "max_len": self.max_len,
            "position": self.position,
            "embedding_norm": self.embedding_norm,
        });
        if let serde_json::Value::Object(more) = json {
            settings.extend(more);
        }
        settings
    }

    /// `"name A here, B there"` for each setting in which `other` differs.
    pub fn differences(&self, other: &EncoderShape<'_>) -> Vec<String> {
        let theirs = other.settings();
        self.settings()
            .into_iter()
            .filter(|(name, value)| theirs.get(name) != Some(value))
            .map(|(name, value)| {
                let there = theirs.get(&name).cloned().unwrap_or_default();
                format!("{name} {value} here, {there} there")
            })
            .collect()
    }

    /// Fresh weights: the token embedding `N(0, 0.02)`, the stack's own init.
    pub fn init<B: LabBackend>(&self, device: &B::Device) -> EncoderParts<B> {
        let (stack, d) = (self.stack, self.stack.d_model);
        EncoderParts {
            token_embedding: EmbeddingConfig::new(self.vocab_size, d)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: 0.02,
                })
                .init(device),
            position: PositionEncodingConfig::new(self.position, self.max_len, d).init(device),
            encoder: stack
                .encoder(self.n_layers, self.max_len)
                .with_relative(self.position.relative())
                .init(device),
            embedding_norm: self.embedding_norm.then(|| {
                LayerNormConfig::new(d)
                    .with_bias(stack.bias)
                    .with_epsilon(stack.norm_epsilon)
                    .init(device)
            }),
        }
    }
}

/// The encoder's input of token rows `[b, n]` → `[b, n, d]`: token embedding + positions, the
/// LayerNorm over their sum when the encoder has one (BERT's), dropout.
pub(crate) fn embed_tokens<B: LabBackend>(
    parts: (&Embedding<B>, &PositionEncoding<B>, Option<&LayerNorm<B>>),
    epsilon: f64,
    dropout: &Dropout,
    tokens: Tensor<B, 2, Int>,
) -> Tensor<B, 3> {
    let (table, position, norm) = parts;
    let x = position.forward(kernels::embedding(table.weight.val(), tokens));
    let x = match norm {
        Some(norm) => kernels::layer_norm(norm, epsilon, x),
        None => x,
    };
    kernels::dropout(dropout, x)
}

/// What the commands that read one text (attention, embed, explain, statistics) need of a text
/// encoder: the classifier's, the masked language model's, CLIP's text tower.
pub trait TextEncoder<B: LabBackend> {
    /// Token embedding `[v, d]`.
    fn token_embedding(&self) -> &Embedding<B>;
    /// The encoder stack.
    fn encoder(&self) -> &TransformerStack<B>;
    /// The encoder's input of token rows `[b, n]` → `[b, n, d]`.
    fn embed(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3>;
    /// Longest input the positions cover.
    fn max_len(&self) -> usize;
    /// The encoder's states `[b, n, d]` and every layer's attention `[b, h, n, n]` on padded
    /// token rows.
    fn states(&self, tokens: Tensor<B, 2, Int>) -> (Tensor<B, 3>, Vec<Tensor<B, 4>>);
}

/// [`TextEncoder`] for a model with the text encoders' fields (`token_embedding`, `encoder`)
/// and methods (`embed`, `max_len`, `forward` giving `states` and `attention`).
macro_rules! text_encoder {
    ($model:ident) => {
        impl<B: LabBackend> super::TextEncoder<B> for $model<B> {
            fn token_embedding(&self) -> &burn::nn::Embedding<B> {
                &self.token_embedding
            }

            fn encoder(&self) -> &crate::nn::TransformerStack<B> {
                &self.encoder
            }

            fn embed(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
                $model::embed(self, tokens)
            }

            fn max_len(&self) -> usize {
                $model::max_len(self)
            }

            fn states(&self, tokens: Tensor<B, 2, Int>) -> (Tensor<B, 3>, Vec<Tensor<B, 4>>) {
                let out = self.forward(tokens);
                (out.states, out.attention)
            }
        }
    };
}
pub(crate) use text_encoder;
