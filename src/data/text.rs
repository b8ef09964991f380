//! Next-token examples from a token stream: every window of `context + 1` consecutive tokens.

use crate::kernels::LabBackend;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::prelude::*;
use std::sync::Arc;

/// A batch of next-token examples: `targets[i, j] = inputs[i, j + 1]` in the source text.
#[derive(Clone, Debug)]
pub struct LmBatch<B: LabBackend> {
    /// `[b, t]` token ids.
    pub inputs: Tensor<B, 2, Int>,
    /// `[b, t]` the following token of each input position.
    pub targets: Tensor<B, 2, Int>,
}

/// One example: `context + 1` consecutive token ids (inputs are the first `context`, targets
/// the last `context`).
#[derive(Clone, Debug)]
pub struct LmItem {
    /// The window's ids.
    pub window: Vec<u32>,
}

/// All windows of `context + 1` tokens of a token stream; window `i` starts at token `i`.
///
/// Training samples windows at random (nanoGPT's `get_batch`); evaluation walks
/// non-overlapping ones ([`TokenWindows::non_overlapping`]).
#[derive(Clone, Debug)]
pub struct TokenWindows {
    tokens: Arc<Vec<u32>>,
    context: usize,
    stride: usize,
}

impl TokenWindows {
    /// Every window (stride 1). Empty when the stream is shorter than `context + 1`.
    pub fn new(tokens: Arc<Vec<u32>>, context: usize) -> Self {
        Self {
            tokens,
            context,
            stride: 1,
        }
    }

    /// Windows that share no target: stride `context`, covering the stream once.
    pub fn non_overlapping(tokens: Arc<Vec<u32>>, context: usize) -> Self {
        Self {
            tokens,
            context,
            stride: context,
        }
    }
}

impl Dataset<LmItem> for TokenWindows {
    fn get(&self, index: usize) -> Option<LmItem> {
        let start = index.checked_mul(self.stride)?;
        let window = self.tokens.get(start..start + self.context + 1)?;
        Some(LmItem {
            window: window.to_vec(),
        })
    }

    fn len(&self) -> usize {
        match self.tokens.len().checked_sub(self.context + 1) {
            Some(last_start) => last_start / self.stride + 1,
            None => 0,
        }
    }
}

/// Stacks windows into an [`LmBatch`] on the training device.
#[derive(Clone, Debug, Default)]
pub struct LmBatcher;

impl<B: LabBackend> Batcher<B, LmItem, LmBatch<B>> for LmBatcher {
    fn batch(&self, items: Vec<LmItem>, device: &B::Device) -> LmBatch<B> {
        let b = items.len();
        let t = items[0].window.len() - 1;
        let mut inputs = Vec::with_capacity(b * t);
        let mut targets = Vec::with_capacity(b * t);
        for item in &items {
            inputs.extend(item.window[..t].iter().map(|&id| id as i64));
            targets.extend(item.window[1..].iter().map(|&id| id as i64));
        }
        let tensor = |ids: Vec<i64>| Tensor::from_data(TensorData::new(ids, [b, t]), device);
        LmBatch {
            inputs: tensor(inputs),
            targets: tensor(targets),
        }
    }
}
