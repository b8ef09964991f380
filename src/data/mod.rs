//! Datasets, tokenizers and batchers.

pub mod bpe;
pub mod registry;
pub mod text;
pub mod tokenizer;
pub mod translation;

pub use bpe::{BpeTokenizer, Special};
pub use registry::{data_dir, DatasetSpec, DATA_DIR_ENV};
pub use text::{LmBatcher, LmItem, TokenWindows};
pub use tokenizer::{CharTokenizer, Tokenizer};
pub use translation::{EncodedPairs, Pair, PairItem, Seq2SeqBatcher, TestItem, TranslationCorpus};
