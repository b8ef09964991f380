//! Tokenizers: characters (one token per distinct character of the training text) or
//! byte-level BPE, behind one [`Tokenizer`] type.

use super::bpe::{BpeTokenizer, Special};
use super::config::TokenizerKind;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

/// Maps each distinct character of a training text to an id, in sorted character order
/// (so the same text always gives the same vocabulary, as in nanoGPT's `prepare.py`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "CharTokenizerFile", into = "CharTokenizerFile")]
pub struct CharTokenizer {
    chars: Vec<char>,
    ids: HashMap<char, usize>,
}

/// The on-disk form: `{"kind": "char", "chars": "\n !$&'..."}`.
#[derive(Serialize, Deserialize)]
struct CharTokenizerFile {
    kind: String,
    chars: String,
}

impl TryFrom<CharTokenizerFile> for CharTokenizer {
    type Error = String;
    fn try_from(file: CharTokenizerFile) -> Result<Self, String> {
        if file.kind != "char" {
            return Err(format!(
                "expected a char tokenizer, found kind {:?}",
                file.kind
            ));
        }
        let chars: Vec<char> = file.chars.chars().collect();
        let ids: HashMap<char, usize> = chars.iter().enumerate().map(|(i, &c)| (c, i)).collect();
        if ids.len() != chars.len() {
            return Err("tokenizer file repeats a character".into());
        }
        Ok(Self { chars, ids })
    }
}

impl From<CharTokenizer> for CharTokenizerFile {
    fn from(tokenizer: CharTokenizer) -> Self {
        Self {
            kind: "char".into(),
            chars: tokenizer.chars.into_iter().collect(),
        }
    }
}

impl CharTokenizer {
    /// The vocabulary of `text`: its distinct characters, sorted.
    pub fn fit(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let ids = chars.iter().enumerate().map(|(i, &c)| (c, i)).collect();
        Self { chars, ids }
    }

    /// Number of tokens.
    pub fn vocab_size(&self) -> usize {
        self.chars.len()
    }

    /// Token ids of `text`; an error names every character outside the vocabulary.
    pub fn encode(&self, text: &str) -> Result<Vec<usize>> {
        let mut unknown: Vec<char> = text.chars().filter(|c| !self.ids.contains_key(c)).collect();
        if !unknown.is_empty() {
            unknown.sort_unstable();
            unknown.dedup();
            let list: Vec<String> = unknown.iter().map(|c| format!("{c:?}")).collect();
            bail!(
                "the text has characters outside the model's vocabulary: {} (the model knows {} characters)",
                list.join(", "),
                self.vocab_size()
            );
        }
        Ok(text.chars().map(|c| self.ids[&c]).collect())
    }

    /// The text of token ids.
    ///
    /// # Panics
    /// If an id is not below `vocab_size` (ids come from a model of this vocabulary).
    pub fn decode(&self, ids: &[usize]) -> String {
        ids.iter().map(|&i| self.chars[i]).collect()
    }

    /// Writes `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        crate::files::write_atomic(path, text.as_bytes())
    }

    /// Reads `tokenizer.json`.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read tokenizer {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("malformed tokenizer {}", path.display()))
    }
}

/// A model's tokenizer: characters, or byte-level BPE ([`BpeTokenizer`]). Saved as
/// `tokenizer.json` in the artifact directory and reloaded by every command that needs it.
#[derive(Clone, Debug)]
pub enum Tokenizer {
    /// One token per character of the training text; no special tokens.
    Char(CharTokenizer),
    /// Byte-level BPE with `<pad> <s> </s> <unk>` at ids 0–3.
    Bpe(Box<BpeTokenizer>),
}

impl Tokenizer {
    /// Fits a tokenizer of `kind` on `texts`; `vocab_size` is the BPE target (characters take
    /// as many tokens as the texts have distinct characters).
    pub fn fit<S: AsRef<str> + Send>(
        kind: TokenizerKind,
        texts: impl Iterator<Item = S> + Send,
        vocab_size: usize,
    ) -> Result<Self> {
        Ok(match kind {
            TokenizerKind::Char => {
                let text: String = texts.map(|s| s.as_ref().to_owned()).collect();
                Tokenizer::Char(CharTokenizer::fit(&text))
            }
            TokenizerKind::Bpe => Tokenizer::Bpe(Box::new(BpeTokenizer::train(texts, vocab_size)?)),
            TokenizerKind::Gpt2 | TokenizerKind::Bert => {
                let (name, model) = match kind {
                    TokenizerKind::Gpt2 => ("gpt2", "GPT-2"),
                    _ => ("bert", "BERT"),
                };
                bail!(
                    "data.tokenizer {name} is {model}'s own tokenizer: it comes with a checkpoint \
                     (`transformer-lab import {name}`) and is not fitted; start from the imported \
                     artifact with \"init_from\", or use char or bpe"
                )
            }
        })
    }

    /// Which kind it is.
    pub fn kind(&self) -> TokenizerKind {
        match self {
            Tokenizer::Char(_) => TokenizerKind::Char,
            Tokenizer::Bpe(t) if t.is_gpt2() => TokenizerKind::Gpt2,
            Tokenizer::Bpe(t) if t.is_bert() => TokenizerKind::Bert,
            Tokenizer::Bpe(_) => TokenizerKind::Bpe,
        }
    }

    /// Number of tokens.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Char(t) => t.vocab_size(),
            Tokenizer::Bpe(t) => t.vocab_size(),
        }
    }

    /// Token ids of `text`. The char tokenizer rejects characters outside its vocabulary;
    /// byte-level BPE encodes anything.
    pub fn encode(&self, text: &str) -> Result<Vec<usize>> {
        match self {
            Tokenizer::Char(t) => t.encode(text),
            Tokenizer::Bpe(t) => t.encode(text),
        }
    }

    /// Token ids of `text` with the byte span `[start, end)` of `text` each one covers.
    pub fn encode_with_offsets(&self, text: &str) -> Result<Vec<(usize, (usize, usize))>> {
        match self {
            Tokenizer::Char(t) => {
                let ids = t.encode(text)?;
                Ok(ids
                    .into_iter()
                    .zip(text.char_indices())
                    .map(|(id, (start, c))| (id, (start, start + c.len_utf8())))
                    .collect())
            }
            Tokenizer::Bpe(t) => t.encode_with_offsets(text),
        }
    }

    /// The text of token ids (special tokens dropped).
    pub fn decode(&self, ids: &[usize]) -> String {
        match self {
            Tokenizer::Char(t) => t.decode(ids),
            Tokenizer::Bpe(t) => t.decode(ids),
        }
    }

    /// The text one token stands for (a special token's own name, e.g. `<s>`). A byte-level
    /// piece that is not valid UTF-8 on its own shows as its vocabulary entry.
    pub fn token_text(&self, id: usize) -> String {
        match self {
            Tokenizer::Char(t) => t.decode(&[id]),
            Tokenizer::Bpe(t) => t.token_text(id),
        }
    }

    /// The id of the token that plays `special`'s part, for tokenizers that have one (BERT's
    /// `[CLS]` for `<s>`, `[SEP]` for `</s>`).
    pub fn special(&self, special: Special) -> Option<usize> {
        match self {
            Tokenizer::Bpe(t) => t.special(special),
            Tokenizer::Char(_) => None,
        }
    }

    /// The ids that open and close a text an encoder reads: `<s>` and `</s>`, BERT's `[CLS]`
    /// and `[SEP]`.
    pub fn frame(&self) -> Result<(usize, usize)> {
        match (self.special(Special::Bos), self.special(Special::Eos)) {
            (Some(first), Some(last)) => Ok((first, last)),
            _ => bail!(
                "a {:?} tokenizer has no start and end tokens (<s> </s>, or BERT's [CLS] [SEP])",
                self.kind()
            ),
        }
    }

    /// Whether `id` is a special token rather than a piece of text.
    pub fn is_special(&self, id: usize) -> bool {
        match self {
            Tokenizer::Bpe(t) => t.is_special(id),
            Tokenizer::Char(_) => false,
        }
    }

    /// The id of `[MASK]`, for a tokenizer fitted for a masked language model.
    pub fn mask(&self) -> Option<usize> {
        match self {
            Tokenizer::Bpe(t) => t.id_of(super::bpe::MASK),
            Tokenizer::Char(_) => None,
        }
    }

    /// Adds `[MASK]` as the last id of a BPE vocabulary and gives it.
    pub fn add_mask(&mut self) -> Result<usize> {
        match self {
            Tokenizer::Bpe(t) => Ok(t.add_mask()),
            Tokenizer::Char(_) => bail!("a masked language model needs the bpe tokenizer"),
        }
    }

    /// Writes `tokenizer.json` atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = match self {
            Tokenizer::Char(t) => serde_json::to_string_pretty(t)?,
            Tokenizer::Bpe(t) => t.to_json()?,
        };
        crate::files::write_atomic(path, text.as_bytes())
    }

    /// Reads `tokenizer.json`, whichever kind it holds.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read tokenizer {}", path.display()))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("malformed tokenizer {}", path.display()))?;
        if value.get("kind").and_then(|k| k.as_str()) == Some("char") {
            let char_tokenizer = serde_json::from_value(value)
                .with_context(|| format!("malformed tokenizer {}", path.display()))?;
            return Ok(Tokenizer::Char(char_tokenizer));
        }
        Ok(Tokenizer::Bpe(Box::new(BpeTokenizer::from_json(
            &text, path,
        )?)))
    }
}
