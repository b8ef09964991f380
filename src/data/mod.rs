//! Datasets, tokenizers and batchers.

pub mod bpe;
pub mod captions;
pub mod config;
pub mod images;
pub mod masked;
pub mod registry;
pub mod sentiment;
pub mod text;
pub mod tokenizer;
pub mod translation;

pub use bpe::{BpeTokenizer, Special, END_OF_TEXT};
pub use captions::{
    caption_datasets, caption_tokens, CaptionBatch, CaptionBatcher, CaptionCorpus, CaptionItem,
    CaptionSplit, ClassCaptions, EncodedCaptions,
};
pub use config::{CopyTaskConfig, DataConfig, TokenizerKind};
pub use images::{ImageBatch, ImageBatcher, ImageItem, ImageSet};
pub use masked::{MaskedItem, MaskedSentences, Masking, MlmBatch};
pub use registry::{data_dir, DatasetSpec, Task, DATA_DIR_ENV};
pub use sentiment::{
    EncodedSentences, Labelled, SentenceBatch, SentenceBatcher, SentenceItem, SentimentCorpus,
};
pub use text::{LmBatch, LmBatcher, LmItem, TokenWindows};
pub use tokenizer::{CharTokenizer, Tokenizer};
pub use translation::{
    EncodedPairs, Pair, PairItem, Seq2SeqBatch, Seq2SeqBatcher, TestItem, TranslationCorpus,
};
