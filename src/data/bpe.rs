//! Byte-level BPE (GPT-2 style) trained with the `tokenizers` crate, saved in its standard
//! `tokenizer.json` format so other tools read it too; and the tokenizers imported checkpoints
//! bring in that format (GPT-2's byte-level BPE, BERT's WordPiece).
//!
//! Byte-level means every UTF-8 string is encodable: a character never seen in training falls
//! back to its bytes, so `decode(encode(text)) == text` for any text (after NFC normalisation).

use anyhow::{anyhow, Context, Result};
use std::collections::HashSet;
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer as HfTokenizer};

/// The special tokens, always the first four ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Special {
    /// Padding, id 0: ignored by the loss, masked out of attention.
    Pad,
    /// Start of sequence, id 1: the decoder's first input.
    Bos,
    /// End of sequence, id 2: ends every target.
    Eos,
    /// Unknown, id 3: reserved (byte-level BPE never needs it).
    Unk,
}

impl Special {
    /// Every special token, in id order.
    pub const ALL: [Special; 4] = [Special::Pad, Special::Bos, Special::Eos, Special::Unk];

    /// Its text form in the vocabulary.
    pub fn text(self) -> &'static str {
        match self {
            Special::Pad => "<pad>",
            Special::Bos => "<s>",
            Special::Eos => "</s>",
            Special::Unk => "<unk>",
        }
    }

    /// Its id.
    pub fn id(self) -> usize {
        self as usize
    }
}

/// The token a masked language model reads in place of the words it must predict; added to a
/// fitted vocabulary as its last id. It absorbs the space before it, so `the [MASK] sat` reads
/// as `the`, `[MASK]`, ` sat`, as a masked ` cat` would.
pub const MASK: &str = "[MASK]";

/// GPT-2's one special token, which ends (and separates) documents.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// BERT's special tokens, by the role of ours each one plays (`[CLS]` starts a text as `<s>`
/// does, `[SEP]` ends it as `</s>` does).
const BERT_SPECIALS: [(Special, &str); 4] = [
    (Special::Pad, "[PAD]"),
    (Special::Bos, "[CLS]"),
    (Special::Eos, "[SEP]"),
    (Special::Unk, "[UNK]"),
];

/// Whose tokenizer it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    /// Fitted here: `<pad> <s> </s> <unk>` at ids 0–3.
    Ours,
    /// GPT-2's: `<|endoftext|>` its one special token.
    Gpt2,
    /// BERT's WordPiece: `[PAD]` at id 0, `[CLS] [SEP] [UNK] [MASK]`.
    Bert,
}

/// A `tokenizers` tokenizer: our trained byte-level BPE (`<pad> <s> </s> <unk>` at ids 0–3), or
/// one imported with a checkpoint — GPT-2's byte-level BPE or BERT's WordPiece.
#[derive(Clone)]
pub struct BpeTokenizer {
    inner: HfTokenizer,
    family: Family,
}

impl std::fmt::Debug for BpeTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BpeTokenizer({} tokens)", self.vocab_size())
    }
}

impl BpeTokenizer {
    /// Learns merges from `texts` until the vocabulary (special tokens and the 256 byte
    /// symbols included) reaches `vocab_size`, or no pair occurs twice.
    pub fn train<S: AsRef<str> + Send>(
        texts: impl Iterator<Item = S> + Send,
        vocab_size: usize,
    ) -> Result<Self> {
        let model = BPE::builder()
            .unk_token(Special::Unk.text().into())
            .build()
            .map_err(|e| anyhow!("cannot build a BPE model: {e}"))?;
        let mut inner = HfTokenizer::new(model);
        inner
            .with_normalizer(Some(NFC))
            .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
            .with_decoder(Some(ByteLevelDecoder::default()));
        let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
        let trainer = BpeTrainerBuilder::new()
            .vocab_size(vocab_size)
            .min_frequency(2)
            .show_progress(false)
            .initial_alphabet(alphabet)
            .special_tokens(
                Special::ALL
                    .iter()
                    .map(|s| AddedToken::from(s.text(), true))
                    .collect(),
            )
            .build();
        inner
            .train(&mut TrainerWrapper::BpeTrainer(trainer), texts)
            .map_err(|e| anyhow!("BPE training failed: {e}"))?;
        Ok(Self {
            inner,
            family: Family::Ours,
        })
    }

    /// Number of tokens, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<usize>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("cannot tokenize {text:?}: {e}"))?;
        Ok(encoding.get_ids().iter().map(|&id| id as usize).collect())
    }

    /// Token ids of `text` with the byte span `[start, end)` of `text` each one covers.
    pub fn encode_with_offsets(&self, text: &str) -> Result<Vec<(usize, (usize, usize))>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("cannot tokenize {text:?}: {e}"))?;
        Ok(encoding
            .get_ids()
            .iter()
            .zip(encoding.get_offsets())
            .map(|(&id, &span)| (id as usize, span))
            .collect())
    }

    /// The text of token ids; special tokens are dropped.
    pub fn decode(&self, ids: &[usize]) -> String {
        let ids: Vec<u32> = ids.iter().map(|&id| id as u32).collect();
        // Byte-level decoding cannot fail on ids of this vocabulary; an id from elsewhere
        // decodes to nothing rather than aborting a whole generation.
        self.inner.decode(&ids, true).unwrap_or_default()
    }

    /// The vocabulary entry of one id (byte-level symbols, e.g. `Ġthe` for " the").
    pub fn token(&self, id: usize) -> Option<String> {
        self.inner.id_to_token(id as u32)
    }

    /// The text of one token, special tokens included; a piece of a multi-byte character
    /// (which decodes to U+FFFD alone) shows as its vocabulary entry instead.
    pub fn token_text(&self, id: usize) -> String {
        match self.inner.decode(&[id as u32], false) {
            Ok(text) if !text.contains('\u{FFFD}') && !text.is_empty() => text,
            _ => self.token(id).unwrap_or_else(|| format!("#{id}")),
        }
    }

    /// The tokenizer in `tokenizers`' JSON format.
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(true)
            .map_err(|e| anyhow!("cannot serialise the tokenizer: {e}"))
    }

    /// The id of a token of the vocabulary (special tokens included).
    pub fn id_of(&self, token: &str) -> Option<usize> {
        self.inner.token_to_id(token).map(|id| id as usize)
    }

    /// Adds [`MASK`] (if it is not there yet) and gives its id.
    pub fn add_mask(&mut self) -> usize {
        if let Some(id) = self.id_of(MASK) {
            return id;
        }
        self.inner
            .add_special_tokens(&[AddedToken::from(MASK, true).lstrip(true)]);
        self.id_of(MASK).expect("the token just added")
    }

    /// Whether this is GPT-2's tokenizer (no `<pad> <s> </s> <unk>`).
    pub fn is_gpt2(&self) -> bool {
        self.family == Family::Gpt2
    }

    /// Whether this is BERT's WordPiece.
    pub fn is_bert(&self) -> bool {
        self.family == Family::Bert
    }

    /// The id of the token that plays `special`'s part: ours at its id, BERT's counterpart
    /// (`[CLS]` for `<s>`, …); GPT-2 has none.
    pub fn special(&self, special: Special) -> Option<usize> {
        match self.family {
            Family::Ours => Some(special.id()),
            Family::Gpt2 => None,
            Family::Bert => BERT_SPECIALS
                .iter()
                .find(|(role, _)| *role == special)
                .and_then(|(_, token)| self.id_of(token)),
        }
    }

    /// Whether `id` is a special token (`<s>`, `[CLS]`, `[MASK]`, `<|endoftext|>`, …), which
    /// no text's word is.
    pub fn is_special(&self, id: usize) -> bool {
        self.token(id)
            .is_some_and(|token| self.inner.get_added_vocabulary().is_special_token(&token))
    }

    /// BERT's tokenizer from its `tokenizer.json` (any `tokenizers` model — WordPiece for
    /// BERT's own): `[CLS] [SEP] [UNK] [MASK]` present and `[PAD]` at id 0, where the models
    /// here pad.
    pub fn bert_from_json(text: &str, path: &Path) -> Result<Self> {
        let inner: HfTokenizer = text
            .parse()
            .map_err(|e| anyhow!("malformed tokenizer {}: {e}", path.display()))?;
        Self::bert_checked(inner, path)
    }

    fn bert_checked(inner: HfTokenizer, path: &Path) -> Result<Self> {
        for token in BERT_SPECIALS.iter().map(|(_, t)| *t).chain([MASK]) {
            if inner.token_to_id(token).is_none() {
                return Err(anyhow!(
                    "tokenizer {} has no {token}: not a BERT tokenizer",
                    path.display()
                ));
            }
        }
        if inner.token_to_id("[PAD]") != Some(Special::Pad.id() as u32) {
            return Err(anyhow!(
                "tokenizer {}: [PAD] is not id 0, where transformer-lab's models pad",
                path.display()
            ));
        }
        Ok(Self {
            inner,
            family: Family::Bert,
        })
    }

    /// GPT-2's tokenizer from Hugging Face's `vocab.json` and `merges.txt`: byte-level BPE
    /// without a prefix space, `<|endoftext|>` its special token.
    pub fn gpt2_from_files(vocab: &Path, merges: &Path) -> Result<Self> {
        let (v, m) = (vocab.to_string_lossy(), merges.to_string_lossy());
        let model = BPE::from_file(&v, &m).build().map_err(|e| {
            anyhow!(
                "cannot read GPT-2's {} and {}: {e}",
                vocab.display(),
                merges.display()
            )
        })?;
        let mut inner = HfTokenizer::new(model);
        inner
            .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
            .with_decoder(Some(ByteLevelDecoder::default()));
        inner.add_special_tokens(&[AddedToken::from(END_OF_TEXT, true)]);
        Self::gpt2_checked(inner, vocab)
    }

    /// Reads a GPT-2 `tokenizer.json`, which must hold `<|endoftext|>`.
    pub fn gpt2_from_json(text: &str, path: &Path) -> Result<Self> {
        let inner: HfTokenizer = text
            .parse()
            .map_err(|e| anyhow!("malformed tokenizer {}: {e}", path.display()))?;
        Self::gpt2_checked(inner, path)
    }

    fn gpt2_checked(inner: HfTokenizer, path: &Path) -> Result<Self> {
        if inner.token_to_id(END_OF_TEXT).is_none() {
            return Err(anyhow!(
                "tokenizer {} has no {END_OF_TEXT}: not a GPT-2 tokenizer",
                path.display()
            ));
        }
        Ok(Self {
            inner,
            family: Family::Gpt2,
        })
    }

    /// Reads `tokenizers`' JSON format: ours (the special tokens checked at their ids), GPT-2's
    /// (`<|endoftext|>` and none of ours) or BERT's (`[CLS]` and none of ours).
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let inner: HfTokenizer = text
            .parse()
            .map_err(|e| anyhow!("malformed tokenizer {}: {e}", path.display()))?;
        let ours = Special::ALL
            .iter()
            .any(|s| inner.token_to_id(s.text()).is_some());
        if !ours && inner.token_to_id(END_OF_TEXT).is_some() {
            return Ok(Self {
                inner,
                family: Family::Gpt2,
            });
        }
        if !ours && inner.token_to_id("[CLS]").is_some() {
            return Self::bert_checked(inner, path);
        }
        for special in Special::ALL {
            let id = inner.token_to_id(special.text()).map(|id| id as usize);
            if id != Some(special.id()) {
                return Err(anyhow!(
                    "tokenizer {} does not have {} at id {}",
                    path.display(),
                    special.text(),
                    special.id()
                ))
                .context("it was not written by transformer-lab");
            }
        }
        Ok(Self {
            inner,
            family: Family::Ours,
        })
    }
}
