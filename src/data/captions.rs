//! Image–caption pairs for a contrastive model: captions made for the classes of MNIST and
//! Fashion-MNIST (several descriptions per class in varied templates, some templates and
//! synonyms held out of training), or a user's caption file (`image path<TAB>caption` per
//! line); the tokenized pairs and their batcher.

use super::images::{normalise_pixel, read_grey_image, shift, ImageSet};
use super::translation::pad_rows;
use super::{DatasetSpec, Special, Task, Tokenizer};
use anyhow::{bail, Context, Result};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use std::path::Path;
use std::sync::Arc;

/// How a class is described: the names used in training captions and the synonyms kept for
/// testing.
struct ClassWords {
    names: &'static [&'static str],
    held_out_names: &'static [&'static str],
}

/// The words and templates of one image dataset's captions.
struct CaptionScheme {
    dataset: &'static str,
    classes: [ClassWords; 10],
    templates: &'static [&'static str],
    held_out_templates: &'static [&'static str],
}

const fn words(
    names: &'static [&'static str],
    held_out_names: &'static [&'static str],
) -> ClassWords {
    ClassWords {
        names,
        held_out_names,
    }
}

const SCHEMES: [CaptionScheme; 2] = [
    CaptionScheme {
        dataset: "mnist",
        classes: [
            words(&["zero", "0", "nought"], &["number 0"]),
            words(&["one", "1"], &["number 1"]),
            words(&["two", "2"], &["number 2"]),
            words(&["three", "3"], &["number 3"]),
            words(&["four", "4"], &["number 4"]),
            words(&["five", "5"], &["number 5"]),
            words(&["six", "6"], &["number 6"]),
            words(&["seven", "7"], &["number 7"]),
            words(&["eight", "8"], &["number 8"]),
            words(&["nine", "9"], &["number 9"]),
        ],
        templates: &[
            "a handwritten {}",
            "the number {} written by hand",
            "a photo of the digit {}",
            "a scan of a handwritten {}",
            "a {} written in ink",
            "a hand drawn {}",
            "the digit {}",
            "a picture of a {}",
            "a messy {}",
            "a {} written with a pen",
        ],
        held_out_templates: &[
            "a drawing of the number {}",
            "a {} drawn by hand",
            "a picture of the digit {}",
            "a handwritten digit {}",
        ],
    },
    CaptionScheme {
        dataset: "fashion-mnist",
        classes: [
            words(&["t-shirt", "top", "tee shirt"], &["tee"]),
            words(
                &["trousers", "pair of trousers", "pants"],
                &["pair of pants"],
            ),
            words(&["pullover", "sweater", "jumper"], &["pullover sweater"]),
            words(&["dress", "summer dress", "gown"], &["summer gown"]),
            words(&["coat", "jacket", "winter coat"], &["winter jacket"]),
            words(&["sandal", "summer shoe", "open shoe"], &["open sandal"]),
            words(
                &["shirt", "button-up shirt", "blouse"],
                &["button-up blouse"],
            ),
            words(
                &["sneaker", "trainer", "running shoe"],
                &["running sneaker"],
            ),
            words(&["bag", "handbag", "purse"], &["small bag"]),
            words(
                &["ankle boot", "boot", "winter boot"],
                &["winter ankle boot"],
            ),
        ],
        templates: &[
            "a photo of a {}",
            "a picture of a {}",
            "a {} on a dark background",
            "a grey photo of a {}",
            "an image of a {}",
            "a small {}",
            "a product photo of a {}",
            "the {}",
            "a photo of the {}",
            "a {} for sale",
        ],
        held_out_templates: &[
            "a dark photo of the {}",
            "a picture of the small {}",
            "an image of the {}",
            "a grey picture of a {}",
        ],
    },
];

/// `template` with `{}` replaced by `name`, "a" before a vowel made "an".
fn fill(template: &str, name: &str) -> String {
    let text = template.replace("{}", name);
    let mut out: Vec<&str> = Vec::new();
    let words: Vec<&str> = text.split(' ').collect();
    for (i, word) in words.iter().enumerate() {
        let next_vowel = words
            .get(i + 1)
            .and_then(|w| w.chars().next())
            .is_some_and(|c| "aeiou".contains(c));
        match (*word, next_vowel) {
            ("a", true) => out.push("an"),
            ("an", false) => out.push("a"),
            _ => out.push(word),
        }
    }
    out.join(" ")
}

/// The captions of every class of the image datasets in `datasets`, numbered in order (the
/// first dataset's classes, then the next one's).
#[derive(Clone, Debug)]
pub struct ClassCaptions {
    /// Each dataset with the range of class numbers it holds.
    pub datasets: Vec<(String, std::ops::Range<usize>)>,
    /// Class names as the datasets declare them.
    pub names: Vec<String>,
    /// Per class, the training captions: training templates × training names.
    pub train: Vec<Vec<String>>,
    /// Per class, the held-out captions: held-out templates × every name, held-out synonyms
    /// included — none of them appears in training.
    pub held_out: Vec<Vec<String>>,
}

impl ClassCaptions {
    /// The captions of `datasets` (`mnist`, `fashion-mnist`).
    pub fn of(datasets: &[&str]) -> Result<Self> {
        let mut out = ClassCaptions {
            datasets: Vec::new(),
            names: Vec::new(),
            train: Vec::new(),
            held_out: Vec::new(),
        };
        for &dataset in datasets {
            let scheme = SCHEMES
                .iter()
                .find(|s| s.dataset == dataset)
                .with_context(|| {
                    format!("no captions are written for {dataset}: use mnist, fashion-mnist, or a captions_file")
                })?;
            let first = out.names.len();
            out.names.extend(DatasetSpec::find(dataset)?.classes);
            out.datasets
                .push((dataset.to_string(), first..out.names.len()));
            for class in &scheme.classes {
                let all_names = class.names.iter().chain(class.held_out_names);
                let train: Vec<String> = (scheme.templates.iter())
                    .flat_map(|t| class.names.iter().map(|n| fill(t, n)))
                    .collect();
                let held_out: Vec<String> = (scheme.held_out_templates.iter())
                    .flat_map(|t| all_names.clone().map(|n| fill(t, n)))
                    .filter(|c| !train.contains(c))
                    .collect();
                out.train.push(train);
                out.held_out.push(held_out);
            }
        }
        Ok(out)
    }
}

/// The image datasets named by a contrastive experiment's `dataset` (`mnist+fashion-mnist`).
pub fn caption_datasets(dataset: &str) -> Result<Vec<&str>> {
    let names: Vec<&str> = dataset.split('+').map(str::trim).collect();
    for name in &names {
        if Task::of(name) != Some(Task::Images) {
            bail!(
                "data: {name} is not an image dataset: a clip model trains on mnist, fashion-mnist or \
                 both (mnist+fashion-mnist), or on a captions_file"
            );
        }
    }
    Ok(names)
}

/// Images with captions, not yet tokenized: one pool of captions per image (a class's
/// captions, shared by its images, or a caption file's one caption).
#[derive(Clone, Debug)]
pub struct CaptionSplit {
    /// Image side in pixels.
    pub size: usize,
    /// `len · size²` pixels, 0 = background.
    pub pixels: Vec<u8>,
    /// Per image, what a match means: its class, or its own number for a caption file.
    pub groups: Vec<usize>,
    /// Per image, which pool its captions come from.
    pub pool_of: Vec<usize>,
    /// The pools of captions.
    pub pools: Vec<Vec<String>>,
}

impl CaptionSplit {
    /// Keeps the first `n` images.
    pub fn truncate(&mut self, n: usize) {
        let n = n.min(self.len());
        self.pixels.truncate(n * self.size * self.size);
        self.groups.truncate(n);
        self.pool_of.truncate(n);
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// Whether there are no images.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Every distinct caption, for fitting a tokenizer.
    pub fn captions(&self) -> impl Iterator<Item = &str> + Send {
        self.pools.iter().flatten().map(String::as_str)
    }

    fn from_images(set: &ImageSet, offset: usize, pools: &[Vec<String>]) -> Self {
        let classes: Vec<usize> = set.labels.iter().map(|&l| offset + l as usize).collect();
        CaptionSplit {
            size: set.rows,
            pixels: set.pixels.to_vec(),
            groups: classes.clone(),
            pool_of: classes,
            pools: pools.to_vec(),
        }
    }

    fn append(&mut self, other: CaptionSplit) {
        self.pixels.extend(other.pixels);
        self.groups.extend(other.groups);
        self.pool_of.extend(other.pool_of);
    }
}

/// A contrastive experiment's data: training, validation and test splits and, for captions
/// made for classes, the class captions.
#[derive(Clone, Debug)]
pub struct CaptionCorpus {
    /// Training pairs (training captions).
    pub train: CaptionSplit,
    /// Validation pairs (held-out captions for class captions).
    pub valid: CaptionSplit,
    /// Test pairs (held-out captions for class captions).
    pub test: CaptionSplit,
    /// The class captions, when the captions describe classes.
    pub classes: Option<ClassCaptions>,
}

impl CaptionCorpus {
    /// The images of the datasets in `dataset` (`mnist+fashion-mnist`) with captions made for
    /// their classes; a seeded `valid_fraction` of each training set is held out.
    pub fn for_classes(
        dataset: &str,
        data_dir: &Path,
        valid_fraction: f64,
        train_examples: Option<usize>,
        seed: u64,
    ) -> Result<Self> {
        let names = caption_datasets(dataset)?;
        let classes = ClassCaptions::of(&names)?;
        let mut splits: Option<[CaptionSplit; 3]> = None;
        for (name, range) in &classes.datasets {
            let (train, test) = ImageSet::load(name, data_dir)?;
            let (train, valid) = train.split(valid_fraction, seed);
            let train = train.first(train_examples);
            let offset = range.start;
            let made = [
                CaptionSplit::from_images(&train, offset, &classes.train),
                CaptionSplit::from_images(&valid, offset, &classes.held_out),
                CaptionSplit::from_images(&test, offset, &classes.held_out),
            ];
            splits = Some(match splits {
                None => made,
                Some(mut have) => {
                    if have[0].size != made[0].size {
                        bail!("data: the datasets in {dataset} have images of different sizes");
                    }
                    for (into, more) in have.iter_mut().zip(made) {
                        into.append(more);
                    }
                    have
                }
            });
        }
        let [train, valid, test] = splits.context("data: no dataset named")?;
        Ok(Self {
            train,
            valid,
            test,
            classes: Some(classes),
        })
    }

    /// The pairs of a caption file (`image path<TAB>caption` per line, paths relative to the
    /// file's folder; blank lines and lines starting with `#` skipped), images read as grey
    /// `size × size`, seeded validation and test shares held out.
    pub fn from_file(
        path: &Path,
        size: usize,
        valid_fraction: f64,
        test_fraction: f64,
        seed: u64,
    ) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the captions file {}", path.display()))?;
        let folder = path.parent().unwrap_or(Path::new("."));
        let mut pairs: Vec<(Vec<u8>, String)> = Vec::new();
        for (number, line) in text.lines().enumerate() {
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let at = || format!("{}:{}", path.display(), number + 1);
            let Some((image, caption)) = line.split_once('\t') else {
                bail!("{}: expected an image path, a tab, then its caption", at());
            };
            let caption = caption.trim();
            if caption.is_empty() || image.trim().is_empty() {
                bail!("{}: empty image path or caption", at());
            }
            let (pixels, _) = read_grey_image(&folder.join(image.trim()), size).with_context(at)?;
            pairs.push((pixels, caption.to_string()));
        }
        let n = pairs.len();
        let held = |fraction: f64| ((n as f64) * fraction).round().max(1.0) as usize;
        let (n_valid, n_test) = (held(valid_fraction), held(test_fraction));
        if n < n_valid + n_test + 2 {
            bail!(
                "{}: {n} pairs are too few to hold out validation and test pairs (at least {})",
                path.display(),
                n_valid + n_test + 2
            );
        }
        pairs.shuffle(&mut StdRng::seed_from_u64(seed));
        let split = |pairs: &[(Vec<u8>, String)]| CaptionSplit {
            size,
            pixels: pairs.iter().flat_map(|(p, _)| p.iter().copied()).collect(),
            groups: (0..pairs.len()).collect(),
            pool_of: (0..pairs.len()).collect(),
            pools: pairs.iter().map(|(_, c)| vec![c.clone()]).collect(),
        };
        Ok(Self {
            test: split(&pairs[..n_test]),
            valid: split(&pairs[n_test..n_test + n_valid]),
            train: split(&pairs[n_test + n_valid..]),
            classes: None,
        })
    }
}

/// Token ids of a caption as the text encoder reads it: `<s> … </s>`, cut to `max_tokens`.
pub fn caption_tokens(tokenizer: &Tokenizer, caption: &str, max_tokens: usize) -> Result<Vec<u32>> {
    let mut ids = vec![Special::Bos.id() as u32];
    let words = tokenizer.encode(caption)?;
    ids.extend(
        words
            .into_iter()
            .take(max_tokens.saturating_sub(2))
            .map(|id| id as u32),
    );
    ids.push(Special::Eos.id() as u32);
    Ok(ids)
}

/// Tokenized image–caption pairs.
#[derive(Clone, Debug)]
pub struct EncodedCaptions {
    size: usize,
    pixels: Arc<Vec<u8>>,
    groups: Arc<Vec<usize>>,
    pool_of: Arc<Vec<usize>>,
    pools: Vec<Arc<Vec<Vec<u32>>>>,
}

/// One image, what a match means, and the captions it may be paired with.
#[derive(Clone, Debug)]
pub struct CaptionItem {
    /// `size²` pixels.
    pub pixels: Vec<u8>,
    /// Its class (or own number).
    pub group: usize,
    /// Token rows of its possible captions (one is drawn per batch).
    pub captions: Arc<Vec<Vec<u32>>>,
}

impl EncodedCaptions {
    /// Tokenizes every pool of `split`.
    pub fn encode(split: &CaptionSplit, tokenizer: &Tokenizer, max_tokens: usize) -> Result<Self> {
        let pools = (split.pools.iter())
            .map(|pool| {
                let rows = pool
                    .iter()
                    .map(|c| caption_tokens(tokenizer, c, max_tokens));
                Ok(Arc::new(rows.collect::<Result<Vec<_>>>()?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            size: split.size,
            pixels: Arc::new(split.pixels.clone()),
            groups: Arc::new(split.groups.clone()),
            pool_of: Arc::new(split.pool_of.clone()),
            pools,
        })
    }

    /// Image side in pixels.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Every caption's length in tokens, for batching by length.
    pub fn lengths(&self) -> Vec<usize> {
        (self.pool_of.iter())
            .map(|&p| self.pools[p].iter().map(Vec::len).max().unwrap_or(0))
            .collect()
    }
}

impl Dataset<CaptionItem> for EncodedCaptions {
    fn get(&self, index: usize) -> Option<CaptionItem> {
        let s = self.size * self.size;
        Some(CaptionItem {
            pixels: self.pixels.get(index * s..(index + 1) * s)?.to_vec(),
            group: *self.groups.get(index)?,
            captions: self.pools[self.pool_of[index]].clone(),
        })
    }

    fn len(&self) -> usize {
        self.groups.len()
    }
}

/// A batch of image–caption pairs.
#[derive(Clone, Debug)]
pub struct CaptionBatch<B: Backend> {
    /// `[b, 1, size, size]` pixels scaled to `[-1, 1]`.
    pub images: Tensor<B, 4>,
    /// `[b, t]` caption tokens, `<s> … </s>`, `<pad>` on the right.
    pub tokens: Tensor<B, 2, Int>,
    /// `[b]` what a match means (class, or pair number).
    pub groups: Tensor<B, 1, Int>,
}

/// Turns [`CaptionItem`]s into a [`CaptionBatch`]: each image (shifted by up to `max_shift`
/// pixels each way when augmenting) with one of its captions, both drawn from the batcher's
/// seed and the batch's own.
#[derive(Clone, Debug)]
pub struct CaptionBatcher {
    size: usize,
    max_shift: usize,
    seed: u64,
}

impl CaptionBatcher {
    /// A batcher for `size × size` images; `max_shift` 0 means no augmentation.
    pub fn new(size: usize, max_shift: usize, seed: u64) -> Self {
        Self {
            size,
            max_shift,
            seed,
        }
    }

    /// The batch of `items`, its captions and shifts drawn from `batch_seed`.
    pub fn batch_seeded<B: Backend>(
        &self,
        items: Vec<CaptionItem>,
        batch_seed: u64,
        device: &B::Device,
    ) -> CaptionBatch<B> {
        let s = self.size;
        let mut rng =
            StdRng::seed_from_u64(self.seed ^ batch_seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut values = Vec::with_capacity(items.len() * s * s);
        let mut rows: Vec<&[u32]> = Vec::with_capacity(items.len());
        for item in &items {
            let pixels = if self.max_shift > 0 {
                let m = self.max_shift as i32;
                let (dy, dx) = (rng.random_range(-m..=m), rng.random_range(-m..=m));
                shift(&item.pixels, s, s, dy as isize, dx as isize)
            } else {
                item.pixels.clone()
            };
            values.extend(pixels.into_iter().map(normalise_pixel));
            let choice = rng.random_range(0..item.captions.len());
            rows.push(&item.captions[choice]);
        }
        let b = items.len();
        let groups: Vec<i64> = items.iter().map(|item| item.group as i64).collect();
        CaptionBatch {
            images: Tensor::from_data(TensorData::new(values, [b, 1, s, s]), device),
            tokens: pad_rows(&rows, device),
            groups: Tensor::from_data(TensorData::new(groups, [b]), device),
        }
    }
}

impl<B: Backend> Batcher<B, CaptionItem, CaptionBatch<B>> for CaptionBatcher {
    fn batch(&self, items: Vec<CaptionItem>, device: &B::Device) -> CaptionBatch<B> {
        self.batch_seeded(items, 0, device)
    }
}
