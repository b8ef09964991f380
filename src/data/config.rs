//! The `data` section of an experiment: which dataset, how to split and tokenize it.

use serde::{Deserialize, Serialize};

/// Which data to train on, how to split it and how to tokenize it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Dataset name: one declared in `datasets/` (`tinyshakespeare`, `tatoeba-fra-eng`,
    /// `multi30k`, `mnist`, `fashion-mnist`, `sst2`, `uci-sentiment`) or the synthetic `copy`
    /// task.
    pub dataset: String,
    /// A UTF-8 text file to train a language model on instead of a declared dataset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text_file: Option<std::path::PathBuf>,
    /// Image–caption pairs to train a clip model on instead of captions made for a declared
    /// image dataset's classes: one `image path<TAB>caption` per line, paths relative to the
    /// file's folder.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub captions_file: Option<std::path::PathBuf>,
    /// Tokenizer: `char` (one token per character of the training text) or `bpe` (byte-level
    /// BPE trained on the training split; translation needs it).
    pub tokenizer: TokenizerKind,
    /// BPE vocabulary size, special tokens and the 256 byte symbols included.
    pub bpe_vocab_size: usize,
    /// Translation: one tokenizer (and vocabulary) for both languages, trained on both sides.
    pub shared_vocab: bool,
    /// Fraction held out for validation: the end of the text for a language model, a seeded
    /// share of source sentences for a translation set without an official split.
    pub valid_fraction: f64,
    /// Translation sets without an official split: the share of source sentences held out
    /// for the test split.
    pub test_fraction: f64,
    /// Translation: source language code (`en`/`fr` for Tatoeba, `de`/`en` for Multi30k).
    pub source: String,
    /// Translation: target language code.
    pub target: String,
    /// Translation: training pairs with more tokens than this on either side (start/end
    /// tokens included) are skipped; longer inputs to `translate` are cut to it.
    /// Classification: texts are cut to this many tokens (`<s>` included).
    pub max_tokens: usize,
    /// The synthetic copy task.
    pub copy: CopyTaskConfig,
    /// Images: shift each training image by up to this many pixels each way (0 = off).
    pub augment_shift: usize,
    /// Train on only this many training examples of the seeded split — sentences, sentence
    /// pairs, images (for clip on several image datasets, this many of each); tokenizers are
    /// fitted on them alone. A quick run, or a learning curve over data size; validation and
    /// test stay whole. Not for language models, whose text is cut into windows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_examples: Option<usize>,
}

impl DataConfig {
    /// Cuts a training split to [`Self::train_examples`].
    pub fn limit_train<T>(&self, train: &mut Vec<T>) {
        if let Some(n) = self.train_examples {
            train.truncate(n);
        }
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            dataset: "tinyshakespeare".into(),
            text_file: None,
            captions_file: None,
            tokenizer: TokenizerKind::Char,
            bpe_vocab_size: 8000,
            shared_vocab: true,
            valid_fraction: 0.1,
            test_fraction: 0.05,
            source: "en".into(),
            target: "fr".into(),
            max_tokens: 64,
            copy: CopyTaskConfig::default(),
            augment_shift: 0,
            train_examples: None,
        }
    }
}

/// The copy task: random sequences of `symbols` distinct words; the target is the source.
/// A sanity check for an encoder–decoder: it is solvable exactly, through cross-attention only.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CopyTaskConfig {
    /// Distinct symbols (words `a`, `b`, … or `s0`, `s1`, … beyond 26).
    pub symbols: usize,
    /// Shortest sequence.
    pub min_len: usize,
    /// Longest sequence.
    pub max_len: usize,
    /// Training pairs generated (validation and test get a tenth each).
    pub train_pairs: usize,
}

impl Default for CopyTaskConfig {
    fn default() -> Self {
        Self {
            symbols: 10,
            min_len: 3,
            max_len: 10,
            train_pairs: 20_000,
        }
    }
}

/// How text becomes tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    /// One token per distinct character of the training text.
    Char,
    /// Byte-level BPE (`tokenizers` crate) with `<pad> <s> </s> <unk>` at ids 0–3.
    Bpe,
    /// GPT-2's byte-level BPE, which comes with an imported checkpoint (`import gpt2`); it is
    /// read from the artifact, never fitted.
    Gpt2,
    /// BERT's WordPiece (`[CLS] [SEP] [PAD] [MASK] [UNK]`), which comes with an imported
    /// checkpoint (`import bert`); read from the artifact, never fitted.
    Bert,
}
