//! What every model kind's capture shares: dense weights for sub-quadratic mixers, the predicted
//! class, a ViT's attention over its patches, and the shuffled-input comparison behind
//! `attention --stats`.

use super::stats::{self, Geometry, HeadStats, Shuffled};
use super::{AttentionGroup, AttentionMaps, ImageInput};
use crate::data::images::normalise_pixel;
use crate::kernels::LabBackend;
use crate::models::vit::{patchify, unpatchify, VisionTransformer};
use anyhow::{anyhow, Context, Result};
use burn::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::ops::Range;

/// The head statistics of one attention group, as numbers and as a printable table.
#[derive(Clone, Debug)]
pub struct GroupStats {
    /// The group's name.
    pub name: String,
    /// One entry per layer and head.
    pub heads: Vec<HeadStats>,
    /// The table [`stats::render`] makes of them.
    pub text: String,
}

/// The weights a forward pass returned (the full mixer's), or else the mixer's dense weights
/// computed on request; an error for a model without attention (Hyena).
pub fn weights_or_dense<B: LabBackend>(
    from_forward: Vec<Tensor<B, 4>>,
    dense: impl FnOnce() -> Option<Vec<Tensor<B, 4>>>,
) -> Result<Vec<Tensor<B, 4>>> {
    if !from_forward.is_empty() {
        return Ok(from_forward);
    }
    dense().ok_or_else(|| {
        anyhow!(
            "this model mixes tokens with the hyena operator (long convolutions and gating), \
             which has no attention weights to show"
        )
    })
}

/// `"label (p%)"` of the most likely class of one row of logits `[1, classes]`.
pub fn predicted_class<B: LabBackend>(logits: Tensor<B, 2>, classes: &[String]) -> String {
    let probabilities: Vec<f32> = burn::tensor::activation::softmax(logits, 1)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .expect("f32 probabilities");
    let (class, p) = crate::classify::top_classes(&probabilities, 1)[0];
    format!("{} ({:.1}%)", classes[class], 100.0 * p)
}

/// The labels of a ViT's tokens: `CLS`, then each patch as `row,col`.
pub fn patch_labels(grid: usize) -> Vec<String> {
    std::iter::once("CLS".to_string())
        .chain((0..grid * grid).map(|i| format!("{},{}", i / grid, i % grid)))
        .collect()
}

/// A ViT's self-attention on `image` (its patches reordered by `permutation` when given) and
/// its head's output (`[1, classes]`: class scores, or a CLIP image tower's projection).
pub fn vit_attention<B: LabBackend>(
    model: &VisionTransformer<B>,
    image: &ImageInput,
    permutation: Option<&[usize]>,
    device: &B::Device,
) -> Result<(AttentionGroup, Tensor<B, 2>)> {
    let size = image.size;
    let values: Vec<f32> = image.pixels.iter().map(|&p| normalise_pixel(p)).collect();
    let mut batch = Tensor::<B, 4>::from_data(TensorData::new(values, [1, 1, size, size]), device);
    if let Some(order) = permutation {
        let patches = patchify(batch, image.patch_size); // [1, n, p·p]
        let index = Tensor::<B, 1, Int>::from_data(
            TensorData::new(
                order.iter().map(|&i| i as i64).collect::<Vec<_>>(),
                [order.len()],
            ),
            device,
        );
        batch = unpatchify(patches.select(1, index), 1, size, size);
    }
    let out = model.forward(batch.clone());
    let weights = weights_or_dense(out.attention, || {
        model.encoder.mixer_weights(model.embed(batch), None, None)
    })?;
    let labels = patch_labels(size / image.patch_size);
    let group = AttentionGroup::from_layers("self", false, &labels, &labels, weights);
    Ok((group, out.logits))
}

/// A permutation of `0..n` that shuffles the positions in `movable` and keeps the others.
fn shuffled_order(rng: &mut StdRng, movable: Range<usize>, n: usize) -> Vec<usize> {
    let mut moved: Vec<usize> = movable.clone().collect();
    moved.shuffle(rng);
    let mut order: Vec<usize> = (0..n).collect();
    order[movable].copy_from_slice(&moved);
    order
}

/// Head statistics of a text model's `maps` on token `ids`, with the position-or-content
/// comparison made on the same ids with the positions in `movable` shuffled by `seed` (a
/// classifier keeps its `<s>` first, a translator its `</s>` last). `capture` runs the model
/// on shuffled ids and returns its groups in the order of `maps.groups`.
pub fn text_statistics(
    maps: &AttentionMaps,
    ids: &[usize],
    movable: Range<usize>,
    seed: u64,
    capture: impl FnOnce(&[usize]) -> Result<Vec<AttentionGroup>>,
) -> Result<Vec<GroupStats>> {
    let n = ids.len();
    let order = shuffled_order(&mut StdRng::seed_from_u64(seed), movable, n);
    let shuffled: Vec<usize> = order.iter().map(|&i| ids[i]).collect();
    let groups = capture(&shuffled)?;
    // A translator's decoder reads the same target either way; only the source moved.
    let orders: Vec<(Vec<usize>, Vec<usize>)> = groups
        .iter()
        .map(|g| {
            let same = |len: usize| (0..len).collect::<Vec<usize>>();
            match g.name.as_str() {
                "decoder" => (same(g.queries.len()), same(g.keys.len())),
                "cross" => (same(g.queries.len()), order.clone()),
                _ => (order.clone(), order.clone()),
            }
        })
        .collect();
    Ok(compare(maps, &groups, &orders, Geometry::Sequence))
}

/// Head statistics of a ViT's `maps`, compared with the same image whose patches are shuffled
/// by `seed`; `capture` runs the model with a patch permutation.
pub fn image_statistics(
    maps: &AttentionMaps,
    seed: u64,
    capture: impl FnOnce(&ImageInput, &[usize]) -> Result<AttentionGroup>,
) -> Result<Vec<GroupStats>> {
    let image = maps
        .image
        .as_ref()
        .context("a ViT's maps carry the image")?;
    let grid = image.size / image.patch_size;
    let mut rng = StdRng::seed_from_u64(seed);
    let patches = shuffled_order(&mut rng, 0..grid * grid, grid * grid);
    let group = capture(image, &patches)?;
    // The classification token stays first.
    let tokens: Vec<usize> = std::iter::once(0)
        .chain(patches.iter().map(|p| p + 1))
        .collect();
    let geometry = Geometry::Patches {
        grid,
        patch: image.patch_size,
    };
    Ok(compare(
        maps,
        &[group],
        &[(tokens.clone(), tokens)],
        geometry,
    ))
}

/// The statistics of each group of `maps` beside its shuffled twin.
fn compare(
    maps: &AttentionMaps,
    shuffled: &[AttentionGroup],
    orders: &[(Vec<usize>, Vec<usize>)],
    geometry: Geometry,
) -> Vec<GroupStats> {
    maps.groups
        .iter()
        .zip(shuffled)
        .zip(orders)
        .map(|((original, shuffled), (query_order, key_order))| {
            let comparison = Shuffled {
                group: shuffled,
                query_order,
                key_order,
            };
            let heads = stats::head_stats(original, geometry, Some(&comparison));
            GroupStats {
                name: original.name.clone(),
                text: stats::render(original, geometry, &heads),
                heads,
            }
        })
        .collect()
}
