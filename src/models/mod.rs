//! Complete models: thin wrappers (embedding + [`crate::nn`] stack + head).

pub mod lm;
pub mod seq2seq;

pub use lm::{LanguageModel, LmBatch, LmOutput};
pub use seq2seq::{DecoderOutput, Memory, Seq2Seq, Seq2SeqBatch, Seq2SeqConfig};
