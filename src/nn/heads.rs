//! A model's attention layers by name, and heads removed from them: the one place pruning
//! reaches into a model. A pruned model's config lists the heads removed from each layer
//! ([`StackConfig::pruned_heads`](super::StackConfig::pruned_heads)), and the model is built
//! whole and then cut to that list, so every command loads a pruned artifact as it loads any.

use super::attention::MultiHeadAttention;
use super::stack::TransformerStack;
use crate::kernels::LabBackend;
use anyhow::{bail, Result};
use std::collections::BTreeMap;

/// A model whose attention layers can be listed, gated and cut head by head.
pub trait AttentionLayers<B: LabBackend> {
    /// Every attention layer, named for people (`layer 2`, `decoder 1 cross`; layers from 0),
    /// in order. A Hyena block has none.
    fn attention_layers(&mut self) -> Vec<(String, &mut MultiHeadAttention<B>)>;
}

impl<B: LabBackend> TransformerStack<B> {
    /// This stack's attention layers named `{prefix}{i}` (self-attention) and
    /// `{prefix}{i} cross` (cross-attention), layers from 0.
    pub fn named_attention(&mut self, prefix: &str) -> Vec<(String, &mut MultiHeadAttention<B>)> {
        let mut layers = Vec::new();
        for (i, block) in self.blocks.iter_mut().enumerate() {
            if let Some(attention) = &mut block.self_attention {
                layers.push((format!("{prefix}{i}"), attention));
            }
            if let Some(attention) = &mut block.cross_attention {
                layers.push((format!("{prefix}{i} cross"), attention));
            }
        }
        layers
    }
}

/// Cuts the heads `removed` names (layer name → head indices in the whole layer) out of
/// `model`'s attention layers (see [`MultiHeadAttention::without_heads`]).
pub fn remove_heads<B: LabBackend>(
    model: &mut impl AttentionLayers<B>,
    removed: &BTreeMap<String, Vec<usize>>,
) -> Result<()> {
    if removed.is_empty() {
        return Ok(());
    }
    let mut layers = model.attention_layers();
    for (name, heads) in removed {
        let Some((_, layer)) = layers.iter_mut().find(|(n, _)| n == name) else {
            let names: Vec<&str> = layers.iter().map(|(n, _)| n.as_str()).collect();
            bail!(
                "model.pruned_heads names {name:?}, which this model lacks (its attention layers: {})",
                names.join(", ")
            );
        };
        let h = layer.n_heads();
        if let Some(head) = heads.iter().find(|&&i| i >= h) {
            bail!("model.pruned_heads: {name:?} has {h} heads; there is no head {head}");
        }
        let mut distinct = heads.clone();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() != heads.len() {
            bail!("model.pruned_heads: {name:?} lists a head twice");
        }
        if distinct.len() >= h {
            bail!("model.pruned_heads: {name:?} must keep at least one of its {h} heads");
        }
        **layer = layer.without_heads(heads);
    }
    Ok(())
}

/// The heads pruning removed from `model`, by layer name (indices in the unpruned layers), as
/// [`StackConfig::pruned_heads`](super::StackConfig::pruned_heads) records them.
pub fn pruned_heads<B: LabBackend>(
    model: &mut impl AttentionLayers<B>,
) -> BTreeMap<String, Vec<usize>> {
    model
        .attention_layers()
        .into_iter()
        .map(|(name, layer)| (name, layer.removed_heads()))
        .filter(|(_, removed)| !removed.is_empty())
        .collect()
}
