//! Complete models: thin wrappers (embedding + [`crate::nn`] stack + head).

pub mod classifier;
pub mod clip;
pub mod lm;
pub mod mlm;
pub mod seq2seq;
pub(crate) mod text;
pub mod vit;

pub use classifier::{ClassifierConfig, ClassifierOutput, TextClassifier};
pub use clip::{info_nce, l2_normalize, Clip, ClipConfig, ClipOutput};
pub use lm::{LanguageModel, LmBatch, LmConfig, LmOutput};
pub use mlm::{MaskedLm, MlmConfig, MlmOutput};
pub use seq2seq::{DecoderOutput, Memory, Seq2Seq, Seq2SeqBatch, Seq2SeqConfig};
pub use text::TextEncoder;
pub use vit::{patchify, unpatchify, VisionTransformer, VitConfig, VitOutput};
