//! The one transformer implementation, generic over `B: LabBackend`.
//!
//! Every model in [`crate::models`] is built from these pieces; none has attention or blocks of
//! its own. Attention runs as the fused kernel in training and weight-free inference
//! ([`crate::kernels::attention`]) and in its composed form
//! ([`attention::scaled_dot_product_attention`], which returns the weights) everywhere else, so
//! every layer's and head's attention can be read from a forward pass.

pub mod attention;
pub mod block;
pub mod cache;
pub mod config;
pub mod feedforward;
pub mod fft;
pub mod heads;
pub mod hyena;
pub mod linear_attention;
pub mod mask;
pub mod mixer;
pub mod pool;
pub mod position;
pub mod relative;
pub mod sparse;
pub mod stack;

pub use attention::{
    attention_weights, masked_attention_weights, scaled_dot_product_attention, without_weights,
    AttentionOutput, MultiHeadAttention, MultiHeadAttentionConfig, StepInput,
};
pub use block::{BlockOutput, Residual, TransformerBlock, TransformerBlockConfig};
pub use cache::{Columns, CrossMemory, KvCache, LayerCache, Rows, RowsCache};
pub use config::StackConfig;
pub use feedforward::{Activation, FeedForward, FeedForwardConfig};
pub use heads::{pruned_heads, remove_heads, AttentionLayers};
pub use hyena::{Hyena, HyenaConfig};
pub use mask::{causal_mask, local_mask, padding_mask, strided_mask, AttentionMask};
pub use mixer::Mixer;
pub use pool::{pool, Pooling};
pub use position::{
    sincos_2d_table, sinusoid_table, PositionEncoding, PositionEncodingConfig, PositionKind,
};
pub use relative::{alibi_slopes, rope, rope_packed, rope_rows, RelativePosition};
pub use stack::{StackOutput, TransformerStack, TransformerStackConfig};

/// `layer` on the last dimension as one flat product (see [`crate::kernels::linear`]).
pub use crate::kernels::linear;
