//! Datasets, tokenizers and batchers.

pub mod registry;
pub mod text;
pub mod tokenizer;

pub use registry::{data_dir, DatasetSpec, DATA_DIR_ENV};
pub use text::{LmBatcher, LmItem, TokenWindows};
pub use tokenizer::CharTokenizer;
