//! The contrastive image–text kind (CLIP): symmetric InfoNCE over a batch of image–caption
//! pairs; zero-shot classification with prompts never seen in training, retrieval recall, the
//! similarity matrix and a 2-D map of both embeddings; attention of either encoder.

use super::classifier::{encoder_attention, encoder_text_model};
use super::{EvalRequest, ModelKind, Prepared, TrainAndHeldOut};
use crate::artifact::{Tokenizers, Trained};
use crate::classify::load_image;
use crate::config::{ClipConfig, DataConfig, ExperimentConfig, ModelConfig, ModelSection};
use crate::data::images::normalise_pixel;
use crate::data::translation::pad_rows;
use crate::data::{
    caption_datasets, caption_tokens, CaptionBatch, CaptionBatcher, CaptionCorpus, CaptionItem,
    CaptionSplit, EncodedCaptions, Special, Tokenizer, TokenizerKind,
};
use crate::inspect::heads::LossOutput;
use crate::inspect::{
    image_statistics, text_statistics, vit_attention, AttentionGroup, AttentionMaps, GroupStats,
    ImageInput, TextModel,
};
use crate::kernels::LabBackend;
use crate::models::Clip;
use crate::nn::StackConfig;
use crate::plot::{embedding_png, similarity_png, Thumbnail};
use crate::train::LaunchOptions;
use anyhow::{bail, Result};
use burn::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

supervised_steps!(Clip, ClipConfig);

/// Image–caption pairs the retrieval recall is measured on (spread evenly over the test split).
const RECALL_PAIRS: usize = 1000;

impl ModelSection for ClipConfig {
    const KIND: &'static str = "clip";
    const DESCRIPTION: &'static str = "contrastive image–text model";
    const COMMAND: &'static str = "zero-shot";

    fn validate(&self, data: &DataConfig) -> Result<()> {
        ClipConfig::validate(self)?;
        if self.image.channels != 1 {
            bail!("model.image: channels must be 1 (images are read as grey)");
        }
        if data.captions_file.is_none() {
            caption_datasets(&data.dataset)?;
            if self.image.image_size != 28 {
                bail!(
                    "model.image: {} images are 28×28: set image_size 28",
                    data.dataset
                );
            }
        }
        if data.tokenizer != TokenizerKind::Bpe {
            bail!("data: a clip model needs the bpe tokenizer (it uses <pad>, <s> and </s>)");
        }
        if data.max_tokens < 3 || data.max_tokens > self.text.max_len {
            bail!(
                "data: max_tokens ({}) must be in 3..={} (the text encoder's max_len)",
                data.max_tokens,
                self.text.max_len
            );
        }
        Ok(())
    }

    fn vocab_sizes(&self) -> (usize, usize) {
        (self.text.vocab_size, self.text.vocab_size)
    }

    fn with_vocab_sizes(&self, _source: usize, target: usize) -> ModelConfig {
        let mut section = self.clone();
        section.text.vocab_size = target;
        ModelConfig::Clip(section)
    }

    fn of(model: &ModelConfig) -> Option<&Self> {
        match model {
            ModelConfig::Clip(section) => Some(section),
            _ => None,
        }
    }
}

/// The experiment's image–caption pairs.
fn corpus(config: &ExperimentConfig, data_dir: &Path) -> Result<CaptionCorpus> {
    let (data, clip) = (&config.data, config.model_as::<ClipConfig>()?);
    match &data.captions_file {
        Some(path) => {
            let mut corpus = CaptionCorpus::from_file(
                path,
                clip.image.image_size,
                data.valid_fraction,
                data.test_fraction,
                config.seed,
            )?;
            if let Some(n) = data.train_examples {
                corpus.train.truncate(n);
            }
            Ok(corpus)
        }
        None => CaptionCorpus::for_classes(
            &data.dataset,
            data_dir,
            data.valid_fraction,
            data.train_examples,
            config.seed,
        ),
    }
}

/// The corpus, its tokenizer (fitted on the training captions unless a resumed run brings its
/// own) and the tokenized training and validation pairs.
fn pairs(
    config: &ExperimentConfig,
    data_dir: &Path,
    tokenizers: Option<Tokenizers>,
) -> Result<(CaptionCorpus, Tokenizer, EncodedCaptions, EncodedCaptions)> {
    let corpus = corpus(config, data_dir)?;
    let data = &config.data;
    let tokenizer = match tokenizers {
        Some(tokenizers) => tokenizers.target,
        None => Tokenizer::fit(data.tokenizer, corpus.train.captions(), data.bpe_vocab_size)?,
    };
    let train = EncodedCaptions::encode(&corpus.train, &tokenizer, data.max_tokens)?;
    let valid = EncodedCaptions::encode(&corpus.valid, &tokenizer, data.max_tokens)?;
    Ok((corpus, tokenizer, train, valid))
}

impl ModelKind for ClipConfig {
    type Model<B: LabBackend> = Clip<B>;
    type Item = CaptionItem;
    type Split = EncodedCaptions;
    type Batcher = TrainAndHeldOut<CaptionBatcher>;
    type Batch<B: LabBackend> = CaptionBatch<B>;

    fn build<B: LabBackend>(&self, device: &B::Device) -> Clip<B> {
        self.init(device)
    }

    /// The image encoder's settings.
    fn stack(&self) -> &StackConfig {
        &self.image.stack
    }

    fn stack_mut(&mut self) -> &mut StackConfig {
        &mut self.image.stack
    }

    fn stacks_mut(&mut self) -> Vec<&mut StackConfig> {
        vec![&mut self.image.stack, &mut self.text.stack]
    }

    fn pruned_heads(&self) -> BTreeMap<String, Vec<usize>> {
        ClipConfig::pruned_heads(self)
    }

    fn set_pruned_heads(&mut self, pruned: BTreeMap<String, Vec<usize>>) {
        ClipConfig::set_pruned_heads(self, pruned)
    }

    fn activation_floats(&self, data: &DataConfig) -> f64 {
        let vit = &self.image;
        vit.stack.activation_floats(vit.n_layers, vit.n_tokens())
            + self
                .text
                .stack
                .activation_floats(self.text.n_layers, data.max_tokens)
    }

    fn prepare(
        mut config: ExperimentConfig,
        tokenizers: Option<Tokenizers>,
        data_dir: &Path,
    ) -> Result<Prepared<Self>> {
        let (corpus, tokenizer, train, valid) = pairs(&config, data_dir, tokenizers)?;
        let captions = corpus.train.pools.iter().map(Vec::len).sum::<usize>();
        let vocab = tokenizer.vocab_size();
        let summary = format!(
            "{}: {} training, {} validation, {} test images; {captions} distinct training \
             captions; vocabulary {vocab}",
            config
                .data
                .captions_file
                .as_ref()
                .map_or_else(|| config.data.dataset.clone(), |p| p.display().to_string()),
            corpus.train.len(),
            corpus.valid.len(),
            corpus.test.len(),
        );
        config.model.set_vocab_sizes(vocab, vocab);
        let size = train.size();
        let (shift, seed) = (config.data.augment_shift, config.seed);
        Ok(Prepared {
            tokenizers: Some(Tokenizers::shared(tokenizer)),
            summary: Some(summary),
            train,
            valid,
            batcher: TrainAndHeldOut {
                train: CaptionBatcher::new(size, shift, seed),
                held_out: CaptionBatcher::new(size, 0, seed),
            },
            lengths: None,
            padding: Vec::new(),
            launch: LaunchOptions::items(config.train.batch_size, "pair", "pairs"),
            valid_items: "validation image–caption pairs".into(),
            accuracy: false,
            config,
        })
    }

    fn batch<B: LabBackend>(
        batcher: &TrainAndHeldOut<CaptionBatcher>,
        items: Vec<CaptionItem>,
        draw: Option<u64>,
        device: &B::Device,
    ) -> CaptionBatch<B> {
        match draw {
            Some(seed) => batcher.train.batch_seeded(items, seed, device),
            None => batcher.held_out.batch_seeded(items, 0, device),
        }
    }

    fn loss<B: LabBackend>(model: &Clip<B>, batch: CaptionBatch<B>) -> LossOutput<B> {
        model.loss(batch.images, batch.tokens)
    }

    fn units<B: LabBackend>(batch: &CaptionBatch<B>) -> usize {
        batch.groups.dims()[0]
    }

    fn eval<B: LabBackend>(
        trained: &Trained<Clip<B>>,
        request: &EvalRequest,
        device: &B::Device,
    ) -> Result<()> {
        evaluate(trained, request, device)
    }

    fn attention<B: LabBackend>(
        trained: &Trained<Clip<B>>,
        input: &str,
        _target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps> {
        let path = Path::new(input);
        if path.is_file() {
            let size = trained.config.model_as::<ClipConfig>()?.image.image_size;
            image_maps(trained, input, load_image(path, size)?.pixels, device)
        } else {
            text_maps(trained, input, device)
        }
    }

    fn statistics<B: LabBackend>(
        trained: &Trained<Clip<B>>,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>> {
        if maps.image.is_some() {
            return image_statistics(maps, seed, |image, patches| {
                Ok(vit_attention(&trained.model.image, image, Some(patches), device)?.0)
            });
        }
        let text = Self::text_model(trained)?;
        let ids = text.encode(&maps.input)?;
        // `<s>` and `</s>` stay where they are.
        text_statistics(maps, &ids, 1..ids.len() - 1, seed, |shuffled| {
            Ok(vec![text_attention(trained, &text, shuffled, device)?])
        })
    }

    fn text_model<B: LabBackend>(trained: &Trained<Clip<B>>) -> Result<TextModel<'_, B>> {
        let (model, tokenizer) = (&trained.model.text, trained.tokenizer());
        let last = tokenizer.special(Special::Eos);
        Ok(encoder_text_model(model, tokenizer, last))
    }
}

/// `input` as the image encoder's input when it names an image file; `None` for text.
/// The image encoder's attention on one image already read (`image_size²` grey pixels);
/// `input` names it.
pub fn image_maps<B: LabBackend>(
    trained: &Trained<Clip<B>>,
    input: &str,
    pixels: Vec<u8>,
    device: &B::Device,
) -> Result<AttentionMaps> {
    let clip = trained.config.model_as::<ClipConfig>()?;
    let image = ImageInput {
        size: clip.image.image_size,
        patch_size: clip.image.patch_size,
        pixels,
    };
    let mut maps = AttentionMaps::new(&trained.config.name, ClipConfig::KIND, input);
    let (group, _) = vit_attention(&trained.model.image, &image, None, device)?;
    maps.groups.push(group);
    maps.image = Some(image);
    Ok(maps)
}

/// The text encoder's attention on one caption.
pub fn text_maps<B: LabBackend>(
    trained: &Trained<Clip<B>>,
    input: &str,
    device: &B::Device,
) -> Result<AttentionMaps> {
    let mut maps = AttentionMaps::new(&trained.config.name, ClipConfig::KIND, input);
    let text = ClipConfig::text_model(trained)?;
    let ids = text.encode(input)?;
    maps.groups
        .push(text_attention(trained, &text, &ids, device)?);
    Ok(maps)
}
/// The text encoder's self-attention on `ids` (one caption, unpadded).
fn text_attention<B: LabBackend>(
    trained: &Trained<Clip<B>>,
    text: &TextModel<'_, B>,
    ids: &[usize],
    device: &B::Device,
) -> Result<AttentionGroup> {
    encoder_attention(&trained.model.text, "text", text, ids, device)
}

/// Unit-length embeddings of `n` grey `size × size` images, `batch` at a time: `n · e`
/// values, row-major.
fn embed_images<B: LabBackend>(
    model: &Clip<B>,
    pixels: &[u8],
    size: usize,
    batch: usize,
    device: &B::Device,
) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for chunk in pixels.chunks(batch.max(1) * size * size) {
        let values: Vec<f32> = chunk.iter().map(|&p| normalise_pixel(p)).collect();
        let n = chunk.len() / (size * size);
        let images = Tensor::from_data(TensorData::new(values, [n, 1, size, size]), device);
        out.extend(floats(model.embed_images(images))?);
    }
    Ok(out)
}

/// Unit-length embeddings of captions (`<s> … </s>`, padded per batch of 256).
fn embed_captions<B: LabBackend>(
    model: &Clip<B>,
    tokenizer: &Tokenizer,
    captions: &[String],
    max_tokens: usize,
    device: &B::Device,
) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for chunk in captions.chunks(256) {
        let rows = (chunk.iter())
            .map(|c| caption_tokens(tokenizer, c, max_tokens))
            .collect::<Result<Vec<_>>>()?;
        out.extend(floats(model.embed_texts(pad_rows(&rows, device)))?);
    }
    Ok(out)
}

fn floats<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Result<Vec<f32>> {
    (tensor.into_data().convert::<f32>().into_vec::<f32>())
        .map_err(|e| anyhow::anyhow!("cannot read a tensor: {e:?}"))
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn normalized(mut v: Vec<f32>) -> Vec<f32> {
    let norm = dot(&v, &v).sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= norm);
    v
}

/// Each class's embedding from its prompts: the mean of the prompts' unit embeddings,
/// normalized again (prompt ensembling, Radford et al. 2021 §3.1.4).
fn ensembled(embeddings: &[f32], e: usize) -> Vec<f32> {
    let n = embeddings.len() / e;
    let mut mean = vec![0.0f32; e];
    for row in embeddings.chunks(e) {
        mean.iter_mut()
            .zip(row)
            .for_each(|(m, x)| *m += x / n as f32);
    }
    normalized(mean)
}

/// Recall@k both ways on pairs `(images[i], texts[i])`: a hit is a retrieved item of the
/// query's group (its class, or the pair itself). Returns `[(i→t @1, @5), (t→i @1, @5)]`.
pub fn recall_at(images: &[f32], texts: &[f32], groups: &[usize], e: usize) -> [(f64, f64); 2] {
    let n = groups.len();
    let rows: Vec<&[f32]> = images.chunks(e).collect();
    let cols: Vec<&[f32]> = texts.chunks(e).collect();
    let recall = |query: &dyn Fn(usize, usize) -> f32| {
        let (mut at1, mut at5) = (0usize, 0usize);
        for q in 0..n {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| query(q, b).total_cmp(&query(q, a)));
            at1 += usize::from(groups[order[0]] == groups[q]);
            at5 += usize::from(order.iter().take(5).any(|&r| groups[r] == groups[q]));
        }
        (at1 as f64 / n as f64, at5 as f64 / n as f64)
    };
    [
        recall(&|q, r| dot(rows[q], cols[r])),
        recall(&|q, r| dot(cols[q], rows[r])),
    ]
}

/// `eval`: zero-shot accuracy with held-out prompts on each dataset's test images, retrieval
/// recall on held-out captions, and the pictures.
fn evaluate<B: LabBackend>(
    trained: &Trained<Clip<B>>,
    request: &EvalRequest,
    device: &B::Device,
) -> Result<()> {
    let began = Instant::now();
    let config = &trained.config;
    let (model, tokenizer) = (&trained.model, trained.tokenizer());
    let (e, max_tokens) = (
        config.model_as::<ClipConfig>()?.embed_dim,
        config.data.max_tokens,
    );
    let mut test = test_pairs(corpus(config, &request.data_dir)?)?;
    if let Some(limit) = request.limit {
        test.split = keep_per_group_range(&test, limit);
    }
    let split = &test.split;
    println!(
        "{}: embedding {} test images and their captions",
        config.name,
        split.len()
    );
    let images = embed_images(model, &split.pixels, split.size, request.batch_size, device)?;
    let mut class_embeddings = Vec::new();
    if let Some(classes) = &test.classes {
        for prompts in &classes.held_out {
            let prompt_embeddings = embed_captions(model, tokenizer, prompts, max_tokens, device)?;
            class_embeddings.push(ensembled(&prompt_embeddings, e));
        }
        let prompts: usize = classes.held_out.iter().map(Vec::len).sum();
        println!(
            "zero-shot with held-out prompts ({prompts} prompts, ensembled per class; no template \
             or synonym among them was seen in training):"
        );
        let predict = |i: usize, range: std::ops::Range<usize>| {
            let image = &images[i * e..(i + 1) * e];
            range
                .max_by(|&a, &b| {
                    dot(image, &class_embeddings[a]).total_cmp(&dot(image, &class_embeddings[b]))
                })
                .expect("a dataset has classes")
        };
        let mut joint = 0usize;
        for (dataset, range) in &classes.datasets {
            let members: Vec<usize> = (0..split.len())
                .filter(|&i| range.contains(&split.groups[i]))
                .collect();
            let right = (members.iter())
                .filter(|&&i| predict(i, range.clone()) == split.groups[i])
                .count();
            joint += members
                .iter()
                .filter(|&&i| predict(i, 0..classes.names.len()) == split.groups[i])
                .count();
            println!(
                "  {dataset}: {:.2}% of {} test images ({}-way)",
                100.0 * right as f64 / members.len().max(1) as f64,
                members.len(),
                range.len()
            );
        }
        if classes.datasets.len() > 1 {
            println!(
                "  all together: {:.2}% ({}-way over every class)",
                100.0 * joint as f64 / split.len().max(1) as f64,
                classes.names.len()
            );
        }
    }
    // Retrieval over pairs spread evenly over the test split, each image with one of its
    // (held-out) captions drawn by the seed.
    let n = split.len().min(RECALL_PAIRS);
    let chosen: Vec<usize> = (0..n).map(|i| i * split.len() / n).collect();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(config.seed);
    let captions: Vec<String> = (chosen.iter())
        .map(|&i| {
            let pool = &split.pools[split.pool_of[i]];
            pool[rand::RngExt::random_range(&mut rng, 0..pool.len())].clone()
        })
        .collect();
    let texts = embed_captions(model, tokenizer, &captions, max_tokens, device)?;
    let pair_images: Vec<f32> = (chosen.iter())
        .flat_map(|&i| images[i * e..(i + 1) * e].iter().copied())
        .collect();
    let groups: Vec<usize> = chosen.iter().map(|&i| split.groups[i]).collect();
    let [(i1, i5), (t1, t5)] = recall_at(&pair_images, &texts, &groups, e);
    let hit = if test.classes.is_some() {
        "a hit is an item of the query's class"
    } else {
        "a hit is the query's own pair"
    };
    println!(
        "retrieval over {n} test pairs ({hit}): image→text R@1 {:.1}% R@5 {:.1}% · text→image \
         R@1 {:.1}% R@5 {:.1}%",
        100.0 * i1,
        100.0 * i5,
        100.0 * t1,
        100.0 * t5
    );
    let folder = request
        .output
        .clone()
        .unwrap_or_else(|| request.artifact_dir.clone());
    pictures(trained, &test, &images, &class_embeddings, &folder, device)?;
    println!("({:.1} s)", began.elapsed().as_secs_f64());
    Ok(())
}

/// The test split and, for class captions, the classes.
struct TestPairs {
    split: CaptionSplit,
    classes: Option<crate::data::ClassCaptions>,
}

fn test_pairs(corpus: CaptionCorpus) -> Result<TestPairs> {
    if corpus.test.is_empty() {
        bail!("the test split is empty: nothing to evaluate");
    }
    Ok(TestPairs {
        split: corpus.test,
        classes: corpus.classes,
    })
}

/// The first `limit` test images of each dataset (all of a caption file's first `limit`).
fn keep_per_group_range(test: &TestPairs, limit: usize) -> CaptionSplit {
    let split = &test.split;
    let ranges: Vec<std::ops::Range<usize>> = match &test.classes {
        Some(classes) => classes.datasets.iter().map(|(_, r)| r.clone()).collect(),
        None => std::iter::once(0..usize::MAX).collect(),
    };
    let mut kept = vec![0usize; ranges.len()];
    let keep: Vec<usize> = (0..split.len())
        .filter(|&i| {
            let which = ranges
                .iter()
                .position(|r| r.contains(&split.groups[i]))
                .unwrap_or(0);
            kept[which] += 1;
            kept[which] <= limit
        })
        .collect();
    let s = split.size * split.size;
    CaptionSplit {
        size: split.size,
        pixels: keep
            .iter()
            .flat_map(|&i| split.pixels[i * s..(i + 1) * s].iter().copied())
            .collect(),
        groups: keep.iter().map(|&i| split.groups[i]).collect(),
        pool_of: keep.iter().map(|&i| split.pool_of[i]).collect(),
        pools: split.pools.clone(),
    }
}

/// `similarity.png` (one image per class, or the first pairs, against their captions) and
/// `embeddings.png` (a PCA map of image and class-prompt embeddings) in `folder`.
fn pictures<B: LabBackend>(
    trained: &Trained<Clip<B>>,
    test: &TestPairs,
    images: &[f32],
    class_embeddings: &[Vec<f32>],
    folder: &Path,
    device: &B::Device,
) -> Result<()> {
    let config = &trained.config;
    let split = &test.split;
    let e = config.model_as::<ClipConfig>()?.embed_dim;
    let s = split.size * split.size;
    // One image per group, up to 20: the first of each class, or the first pairs.
    let mut picked: Vec<usize> = Vec::new();
    for i in 0..split.len() {
        if picked.len() == 20 {
            break;
        }
        if !picked.iter().any(|&p| split.groups[p] == split.groups[i]) {
            picked.push(i);
        }
    }
    picked.sort_by_key(|&i| split.groups[i]);
    let captions: Vec<String> = (picked.iter())
        .map(|&i| split.pools[split.pool_of[i]][0].clone())
        .collect();
    let texts = embed_captions(
        &trained.model,
        trained.tokenizer(),
        &captions,
        config.data.max_tokens,
        device,
    )?;
    let values: Vec<Vec<f32>> = (texts.chunks(e))
        .map(|t| {
            picked
                .iter()
                .map(|&i| dot(t, &images[i * e..(i + 1) * e]))
                .collect()
        })
        .collect();
    let thumbnails: Vec<Thumbnail> = (picked.iter())
        .map(|&i| Thumbnail {
            size: split.size,
            pixels: split.pixels[i * s..(i + 1) * s].to_vec(),
        })
        .collect();
    let path = folder.join("similarity.png");
    let title = format!("{}: test images × held-out captions", config.name);
    similarity_png(&path, &title, &captions, &thumbnails, &values)?;
    println!("similarity matrix written to {}", path.display());

    // PCA of up to 2,000 images and the class embeddings, fitted on both together.
    let n = split.len().min(2000);
    let chosen: Vec<usize> = (0..n).map(|i| i * split.len() / n).collect();
    let mut rows: Vec<Vec<f32>> = (chosen.iter())
        .map(|&i| images[i * e..(i + 1) * e].to_vec())
        .collect();
    rows.extend(class_embeddings.iter().cloned());
    let projected = pca_2d(&rows);
    let points: Vec<(f64, f64, usize)> = (chosen.iter().zip(&projected))
        .map(|(&i, &(x, y))| (x, y, split.groups[i]))
        .collect();
    let names: Vec<String> = match &test.classes {
        Some(classes) => classes.names.clone(),
        None => Vec::new(),
    };
    let markers: Vec<(f64, f64, usize, String)> = (projected[n..].iter().enumerate())
        .map(|(c, &(x, y))| (x, y, c, names[c].clone()))
        .collect();
    let path = folder.join("embeddings.png");
    let title = format!("{}: image and class-prompt embeddings (PCA)", config.name);
    embedding_png(&path, &title, ("PC 1", "PC 2"), &points, &markers, &names)?;
    println!("embedding map written to {}", path.display());
    Ok(())
}

/// The rows projected on their first two principal components (power iteration on the
/// covariance, the first component deflated before the second).
pub fn pca_2d(rows: &[Vec<f32>]) -> Vec<(f64, f64)> {
    let (n, e) = (rows.len(), rows.first().map_or(0, Vec::len));
    if n == 0 || e == 0 {
        return Vec::new();
    }
    let mut mean = vec![0.0f64; e];
    for row in rows {
        mean.iter_mut()
            .zip(row)
            .for_each(|(m, &x)| *m += f64::from(x) / n as f64);
    }
    let centred: Vec<Vec<f64>> = (rows.iter())
        .map(|r| {
            r.iter()
                .zip(&mean)
                .map(|(&x, m)| f64::from(x) - m)
                .collect()
        })
        .collect();
    let mut cov = vec![vec![0.0f64; e]; e];
    for row in &centred {
        for a in 0..e {
            for b in 0..e {
                cov[a][b] += row[a] * row[b];
            }
        }
    }
    let mut components: Vec<Vec<f64>> = Vec::new();
    for k in 0..2 {
        let mut v: Vec<f64> = (0..e).map(|i| 1.0 + (i * (k + 3) % 7) as f64).collect();
        for _ in 0..200 {
            let mut next: Vec<f64> = (0..e)
                .map(|a| (0..e).map(|b| cov[a][b] * v[b]).sum())
                .collect();
            for c in &components {
                let along: f64 = next.iter().zip(c).map(|(x, y)| x * y).sum();
                next.iter_mut().zip(c).for_each(|(x, y)| *x -= along * y);
            }
            let norm = next.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-300);
            v = next.into_iter().map(|x| x / norm).collect();
        }
        components.push(v);
    }
    (centred.iter())
        .map(|row| {
            let on = |c: &Vec<f64>| row.iter().zip(c).map(|(x, y)| x * y).sum::<f64>();
            (on(&components[0]), on(&components[1]))
        })
        .collect()
}

/// `zero-shot`: each image's probability over `labels` (any words), as `[images][labels]`.
pub fn zero_shot<B: LabBackend>(
    trained: &Trained<Clip<B>>,
    labels: &[String],
    images: &[PathBuf],
    device: &B::Device,
) -> Result<Vec<Vec<f32>>> {
    if labels.is_empty() || labels.iter().any(|l| l.trim().is_empty()) {
        bail!("--labels has an empty label: give comma-separated words (\"a shirt,a shoe,a bag\")");
    }
    if images.is_empty() {
        bail!("no image given: name one or more PNG or JPEG files");
    }
    let size = trained.config.model_as::<ClipConfig>()?.image.image_size;
    let mut pixels = Vec::new();
    for path in images {
        pixels.extend(load_image(path, size)?.pixels);
    }
    zero_shot_pixels(trained, labels, &pixels, device)
}

/// [`zero_shot`] of images already read: `pixels` holds each `size × size` grey image (the
/// model's `image_size`) in turn.
pub fn zero_shot_pixels<B: LabBackend>(
    trained: &Trained<Clip<B>>,
    labels: &[String],
    pixels: &[u8],
    device: &B::Device,
) -> Result<Vec<Vec<f32>>> {
    if labels.is_empty() || labels.iter().any(|l| l.trim().is_empty()) {
        bail!("an empty label: give words (\"a shirt,a shoe,a bag\")");
    }
    let clip = trained.config.model_as::<ClipConfig>()?;
    let size = clip.image.image_size;
    let model = &trained.model;
    let e = clip.embed_dim;
    let max_tokens = trained.config.data.max_tokens;
    let texts = embed_captions(model, trained.tokenizer(), labels, max_tokens, device)?;
    let image_embeddings = embed_images(model, pixels, size, 64, device)?;
    let scale = floats(model.scale())?[0];
    Ok((image_embeddings.chunks(e))
        .map(|image| {
            let logits: Vec<f32> = texts.chunks(e).map(|t| scale * dot(image, t)).collect();
            let top = logits.iter().copied().fold(f32::MIN, f32::max);
            let exp: Vec<f32> = logits.iter().map(|l| (l - top).exp()).collect();
            let sum: f32 = exp.iter().sum();
            exp.into_iter().map(|x| x / sum).collect()
        })
        .collect())
}
