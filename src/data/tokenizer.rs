//! The character tokenizer: one token per distinct character of the training text.

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
        crate::artifact::write_atomic(path, text.as_bytes())
    }

    /// Reads `tokenizer.json`.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read tokenizer {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("malformed tokenizer {}", path.display()))
    }
}
