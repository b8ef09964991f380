//! A trained text model seen as a reader of one text: its tokenizer, the stack that reads the
//! text and how the text enters it. `explain` walks through one of its heads; `embed` reads its
//! states. Each text kind makes one (`kinds/`); nothing here knows which kind it is.

use super::labels;
use crate::data::translation::pad_rows;
use crate::data::Tokenizer;
use crate::kernels::LabBackend;
use crate::nn::{AttentionMask, TransformerStack};
use anyhow::{bail, Result};
use burn::prelude::*;

/// How a text model reads one text.
pub struct TextModel<'a, B: LabBackend> {
    /// Tokenizes the text (a translator's source side).
    pub tokenizer: &'a Tokenizer,
    /// Token put before the text (a classifier's `<s>`).
    pub first: Option<usize>,
    /// Token put after the text (a translator's `</s>`).
    pub last: Option<usize>,
    /// The longest input the model takes.
    pub max_len: usize,
    /// Whether each position sees only the positions before it (a language model).
    pub causal: bool,
    /// The stack that reads the text.
    pub stack: &'a TransformerStack<B>,
    /// The input (static) embedding table, `[v, d]`.
    pub table: Tensor<B, 2>,
    /// The stack's input: token embedding and positions, `[1, n]` → `[1, n, d]`.
    pub embed: Box<dyn Fn(Tensor<B, 2, Int>) -> Tensor<B, 3> + 'a>,
}

impl<B: LabBackend> TextModel<'_, B> {
    /// The token ids of `text` as the model reads it (the kind's first and last tokens added),
    /// cut to the model's maximum length with a warning.
    pub fn encode(&self, text: &str) -> Result<Vec<usize>> {
        if text.trim().is_empty() {
            bail!("the text is empty: give the model something to read");
        }
        let text = if self.last.is_some() {
            text.trim()
        } else {
            text
        };
        let mut ids: Vec<usize> = self.first.into_iter().collect();
        ids.extend(self.tokenizer.encode(text)?);
        ids.extend(self.last);
        if ids.is_empty() {
            bail!("the text has no tokens");
        }
        let max = self.max_len;
        if ids.len() > max {
            eprintln!(
                "warning: the text has {} tokens; the model reads at most {max}, so only the first {max} are used",
                ids.len()
            );
            ids.truncate(max);
        }
        Ok(ids)
    }

    /// The ids of `text` with each token's byte span in it (the added first and last tokens span
    /// nothing); an error when longer than the model takes.
    pub fn encode_with_offsets(&self, text: &str) -> Result<Vec<(usize, (usize, usize))>> {
        let mut tokens: Vec<(usize, (usize, usize))> =
            self.first.map(|id| (id, (0, 0))).into_iter().collect();
        tokens.extend(self.tokenizer.encode_with_offsets(text)?);
        tokens.extend(self.last.map(|id| (id, (text.len(), text.len()))));
        if tokens.len() > self.max_len {
            bail!(
                "{text:?} has {} tokens; the model takes at most {}",
                tokens.len(),
                self.max_len
            );
        }
        Ok(tokens)
    }

    /// The label of each token id.
    pub fn labels(&self, ids: &[usize]) -> Vec<String> {
        labels(self.tokenizer, ids)
    }

    /// `[1, n]` ids as a tensor.
    pub fn tokens(&self, ids: &[usize], device: &B::Device) -> Tensor<B, 2, Int> {
        pad_rows::<B, Vec<u32>>(&[ids.iter().map(|&i| i as u32).collect()], device)
    }

    /// The mask of one unpadded text of `n` tokens: causal for a language model, none else.
    pub fn mask(&self, n: usize, device: &B::Device) -> Option<AttentionMask<B>> {
        self.causal.then(|| AttentionMask::causal(n, device))
    }

    /// The stack's output states on `ids` (after a pre-norm stack's final norm), `[1, n, d]`.
    pub fn states(&self, ids: &[usize], device: &B::Device) -> Tensor<B, 3> {
        let x = (self.embed)(self.tokens(ids, device));
        self.stack
            .forward(x, self.mask(ids.len(), device).as_ref(), None)
            .x
    }
}
