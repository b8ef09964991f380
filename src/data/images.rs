//! Image classification data: the IDX files of MNIST and Fashion-MNIST, a seeded validation
//! split, and a batcher with optional random-shift augmentation.

use super::DatasetSpec;
use anyhow::{bail, Context, Result};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::prelude::*;
use flate2::read::GzDecoder;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

/// Magic number of an IDX file of u8 images (`0x00000803`: u8, 3 dimensions).
const IMAGES_MAGIC: u32 = 0x0803;
/// Magic number of an IDX file of u8 labels (`0x00000801`: u8, 1 dimension).
const LABELS_MAGIC: u32 = 0x0801;

/// Grey images of one size with their class labels.
#[derive(Clone, Debug)]
pub struct ImageSet {
    /// Pixel rows per image.
    pub rows: usize,
    /// Pixel columns per image.
    pub cols: usize,
    /// `len · rows · cols` pixels, row-major, 0 = background.
    pub pixels: Arc<Vec<u8>>,
    /// One label per image.
    pub labels: Arc<Vec<u8>>,
}

/// One image and its label.
#[derive(Clone, Debug)]
pub struct ImageItem {
    /// `rows · cols` pixels.
    pub pixels: Vec<u8>,
    /// Class index.
    pub label: usize,
}

impl ImageSet {
    /// Reads a pair of IDX files (gzip-compressed when the name ends in `.gz`).
    pub fn read_idx(images: &Path, labels: &Path) -> Result<Self> {
        let (dims, pixels) = read_idx_file(images, IMAGES_MAGIC, 3)?;
        let (label_dims, labels_data) = read_idx_file(labels, LABELS_MAGIC, 1)?;
        if label_dims[0] != dims[0] {
            bail!(
                "{} holds {} images but {} holds {} labels",
                images.display(),
                dims[0],
                labels.display(),
                label_dims[0]
            );
        }
        Ok(Self {
            rows: dims[1],
            cols: dims[2],
            pixels: Arc::new(pixels),
            labels: Arc::new(labels_data),
        })
    }

    /// The `train` (60,000) and `test` (10,000) sets of a declared IDX dataset (`mnist`,
    /// `fashion-mnist`), downloaded and verified when absent.
    pub fn load(dataset: &str, data_dir: &Path) -> Result<(Self, Self)> {
        let spec = DatasetSpec::find(dataset)?;
        let paths = spec.ensure(data_dir)?;
        let find = |stem: &str| {
            paths
                .iter()
                .find(|p| p.to_string_lossy().contains(stem))
                .with_context(|| format!("{dataset} declares no {stem} file"))
        };
        let train = Self::read_idx(find("train-images")?, find("train-labels")?)?;
        let test = Self::read_idx(find("t10k-images")?, find("t10k-labels")?)?;
        Ok((train, test))
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Splits off a seeded `fraction` of the images (the second set) for validation.
    pub fn split(&self, fraction: f64, seed: u64) -> (Self, Self) {
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.shuffle(&mut StdRng::seed_from_u64(seed));
        let held = ((self.len() as f64) * fraction).round() as usize;
        let (valid, train) = order.split_at(held);
        (self.select(train), self.select(valid))
    }

    /// The first `n` images (all with `None`): a seeded split's are a random sample.
    pub fn first(&self, n: Option<usize>) -> Self {
        match n {
            Some(n) if n < self.len() => self.select(&(0..n).collect::<Vec<_>>()),
            _ => self.clone(),
        }
    }

    /// The images at `indices`, in that order.
    pub fn select(&self, indices: &[usize]) -> Self {
        let size = self.rows * self.cols;
        let mut pixels = Vec::with_capacity(indices.len() * size);
        for &i in indices {
            pixels.extend_from_slice(&self.pixels[i * size..(i + 1) * size]);
        }
        Self {
            rows: self.rows,
            cols: self.cols,
            pixels: Arc::new(pixels),
            labels: Arc::new(indices.iter().map(|&i| self.labels[i]).collect()),
        }
    }
}

impl Dataset<ImageItem> for ImageSet {
    fn get(&self, index: usize) -> Option<ImageItem> {
        let size = self.rows * self.cols;
        let label = *self.labels.get(index)?;
        Some(ImageItem {
            pixels: self.pixels[index * size..(index + 1) * size].to_vec(),
            label: label as usize,
        })
    }

    fn len(&self) -> usize {
        self.labels.len()
    }
}

/// Reads an IDX file: the magic number (type and rank), one big-endian u32 per dimension,
/// then the data. Returns the dimensions and the data.
fn read_idx_file(path: &Path, magic: u32, rank: usize) -> Result<(Vec<usize>, Vec<u8>)> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut bytes = Vec::new();
    let read = if path.extension().is_some_and(|e| e == "gz") {
        GzDecoder::new(file).read_to_end(&mut bytes)
    } else {
        std::io::BufReader::new(file).read_to_end(&mut bytes)
    };
    read.with_context(|| format!("cannot read {} (corrupt or truncated?)", path.display()))?;
    let header = 4 * (1 + rank);
    if bytes.len() < 4 {
        bail!("{}: too short for an IDX header", path.display());
    }
    let word = |i: usize| u32::from_be_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    if word(0) != magic {
        bail!(
            "{}: not an IDX file of u8 {}: magic {:#010x}, expected {:#010x}",
            path.display(),
            if rank == 1 { "labels" } else { "images" },
            word(0),
            magic
        );
    }
    if bytes.len() < header {
        bail!(
            "{}: too short for an IDX header (truncated?)",
            path.display()
        );
    }
    let dims: Vec<usize> = (0..rank).map(|d| word(4 + 4 * d) as usize).collect();
    let expected = dims.iter().product::<usize>();
    let data = bytes.split_off(header);
    if data.len() != expected {
        bail!(
            "{}: the header promises {:?} = {expected} bytes of data but the file holds {} (truncated?)",
            path.display(),
            dims,
            data.len()
        );
    }
    Ok((dims, data))
}

/// A batch of images.
#[derive(Clone, Debug)]
pub struct ImageBatch<B: Backend> {
    /// `[b, 1, rows, cols]` pixels scaled to `[-1, 1]`.
    pub images: Tensor<B, 4>,
    /// `[b]` class indices.
    pub labels: Tensor<B, 1, Int>,
}

/// Turns [`ImageItem`]s into an [`ImageBatch`]; with augmentation, shifts each image by a
/// random whole number of pixels (up to `max_shift` each way, zero fill), drawn from the
/// batcher's seed and the batch's own ([`ImageBatcher::batch_seeded`]).
#[derive(Clone, Debug)]
pub struct ImageBatcher {
    rows: usize,
    cols: usize,
    max_shift: usize,
    seed: u64,
}

impl ImageBatcher {
    /// A batcher for `rows × cols` images; `max_shift` 0 means no augmentation.
    pub fn new(rows: usize, cols: usize, max_shift: usize, seed: u64) -> Self {
        Self {
            rows,
            cols,
            max_shift,
            seed,
        }
    }

    /// The batch of `items`, its shifts drawn from `batch_seed` (with the batcher's seed), so
    /// the same batch is shifted the same way whenever and on whichever thread it is made.
    pub fn batch_seeded<B: Backend>(
        &self,
        items: Vec<ImageItem>,
        batch_seed: u64,
        device: &B::Device,
    ) -> ImageBatch<B> {
        let (rows, cols) = (self.rows, self.cols);
        let mut rng = (self.max_shift > 0).then(|| {
            StdRng::seed_from_u64(self.seed ^ batch_seed.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        });
        let mut values = Vec::with_capacity(items.len() * rows * cols);
        for item in &items {
            let pixels = match rng.as_mut() {
                Some(rng) => {
                    let m = self.max_shift as i32;
                    let (dy, dx) = (rng.random_range(-m..=m), rng.random_range(-m..=m));
                    shift(&item.pixels, rows, cols, dy as isize, dx as isize)
                }
                None => item.pixels.clone(),
            };
            values.extend(pixels.into_iter().map(normalise_pixel));
        }
        let labels: Vec<i64> = items.iter().map(|item| item.label as i64).collect();
        ImageBatch {
            images: Tensor::from_data(
                TensorData::new(values, [items.len(), 1, rows, cols]),
                device,
            ),
            labels: Tensor::from_data(TensorData::new(labels, [items.len()]), device),
        }
    }
}

/// Pixels `[0, 255]` → `[-1, 1]`, the model's input scale.
pub fn normalise_pixel(p: u8) -> f32 {
    p as f32 / 127.5 - 1.0
}

/// `pixels` moved by `(dy, dx)`, with zeros where nothing moved in.
pub(crate) fn shift(pixels: &[u8], rows: usize, cols: usize, dy: isize, dx: isize) -> Vec<u8> {
    let mut out = vec![0u8; pixels.len()];
    for r in 0..rows {
        let source_r = r as isize - dy;
        if source_r < 0 || source_r >= rows as isize {
            continue;
        }
        for c in 0..cols {
            let source_c = c as isize - dx;
            if source_c >= 0 && source_c < cols as isize {
                out[r * cols + c] = pixels[source_r as usize * cols + source_c as usize];
            }
        }
    }
    out
}

impl<B: Backend> Batcher<B, ImageItem, ImageBatch<B>> for ImageBatcher {
    fn batch(&self, items: Vec<ImageItem>, device: &B::Device) -> ImageBatch<B> {
        self.batch_seeded(items, 0, device)
    }
}

/// Reads a PNG or JPEG file of any size as a `size × size` grey image: converted to grey,
/// resized, and inverted when its border is mostly light (MNIST-style images are light strokes
/// on a dark background). Returns the pixels (0 = background) and whether it was inverted.
pub fn read_grey_image(path: &Path, size: usize) -> Result<(Vec<u8>, bool)> {
    let image = image::ImageReader::open(path)
        .with_context(|| format!("cannot open {}", path.display()))?
        .with_guessed_format()
        .with_context(|| format!("cannot read {}", path.display()))?
        .decode()
        .with_context(|| format!("{} is not a readable PNG or JPEG image", path.display()))?;
    Ok(grey_input(&image, size))
}

/// [`read_grey_image`] of a file's bytes (an upload); `name` names it in errors.
pub fn grey_image_from_bytes(bytes: &[u8], name: &str, size: usize) -> Result<(Vec<u8>, bool)> {
    let mut reader = image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .with_context(|| format!("cannot read {name}"))?;
    // A small file can claim a huge image; an upload gets at most 8192 × 8192 pixels.
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(8192);
    limits.max_image_height = Some(8192);
    reader.limits(limits);
    let image = reader
        .decode()
        .with_context(|| format!("{name} is not a readable PNG or JPEG image"))?;
    Ok(grey_input(&image, size))
}

fn grey_input(image: &image::DynamicImage, size: usize) -> (Vec<u8>, bool) {
    let (side, filter) = (size as u32, image::imageops::FilterType::Triangle);
    let grey = image::imageops::resize(&image.to_luma8(), side, side, filter);
    let mut pixels = grey.into_raw();
    let border: Vec<u8> = (0..size)
        .flat_map(|i| [i, (size - 1) * size + i, i * size, i * size + size - 1])
        .map(|k| pixels[k])
        .collect();
    let light = border.iter().map(|&p| p as f64).sum::<f64>() / border.len() as f64 > 127.5;
    if light {
        pixels.iter_mut().for_each(|p| *p = 255 - *p);
    }
    (pixels, light)
}
