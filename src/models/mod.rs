//! Complete models: thin wrappers (embedding + [`crate::nn`] stack + head).

pub mod lm;

pub use lm::{LanguageModel, LmBatch, LmOutput};
