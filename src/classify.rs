//! Using trained classifiers: class probabilities for image files and texts, and test-set
//! accuracy with a confusion matrix.

use crate::artifact::Trained;
use crate::data::images::normalise_pixel;
use crate::data::sentiment::encode_sentence;
use crate::data::translation::pad_rows;
use crate::data::{ImageSet, SentimentCorpus};
use crate::kernels::LabBackend;
use crate::models::{TextClassifier, VisionTransformer};
use anyhow::{bail, Result};
use burn::prelude::*;
use burn::tensor::activation::softmax;
use std::path::Path;

/// The class names of a classification dataset, by index (its declaration's `classes`).
pub fn class_names(dataset: &str) -> Result<Vec<String>> {
    let classes = crate::data::DatasetSpec::find(dataset)?.classes;
    if classes.is_empty() {
        bail!("{dataset} declares no classes (datasets/{dataset}.json)");
    }
    Ok(classes)
}

/// A grey image prepared for the model.
#[derive(Clone, Debug)]
pub struct PreparedImage {
    /// `size · size` pixels, 0 = background.
    pub pixels: Vec<u8>,
    /// Whether the image was inverted (it had a light background; the datasets' is dark).
    pub inverted: bool,
}

/// Reads a PNG or JPEG file of any size as the model's `size × size` grey input: converted to
/// grey, resized, and inverted when its border is mostly light (MNIST-style images are light
/// strokes on a dark background).
pub fn load_image(path: &Path, size: usize) -> Result<PreparedImage> {
    let (pixels, inverted) = crate::data::images::read_grey_image(path, size)?;
    Ok(PreparedImage { pixels, inverted })
}

/// [`load_image`] of an image file's bytes (an upload); `name` names it in errors.
pub fn image_from_bytes(bytes: &[u8], name: &str, size: usize) -> Result<PreparedImage> {
    let (pixels, inverted) = crate::data::images::grey_image_from_bytes(bytes, name, size)?;
    Ok(PreparedImage { pixels, inverted })
}

/// Class probabilities of images, `[b, classes]`.
pub fn image_probabilities<B: LabBackend>(
    trained: &Trained<VisionTransformer<B>>,
    images: &[Vec<u8>],
    size: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    let values: Vec<f32> = images
        .iter()
        .flatten()
        .map(|&p| normalise_pixel(p))
        .collect();
    let batch = Tensor::from_data(
        TensorData::new(values, [images.len(), 1, size, size]),
        device,
    );
    softmax(trained.model.forward(batch).logits, 1)
}

/// Class probabilities of texts, `[b, classes]`. Empty texts are an error.
pub fn text_probabilities<B: LabBackend>(
    trained: &Trained<TextClassifier<B>>,
    texts: &[String],
    device: &B::Device,
) -> Result<Tensor<B, 2>> {
    let max_tokens = trained.config.data.max_tokens;
    let rows = texts
        .iter()
        .enumerate()
        .map(|(i, text)| {
            if text.trim().is_empty() {
                bail!("text {} is empty: there is nothing to classify", i + 1);
            }
            encode_sentence(trained.tokenizer(), text, max_tokens)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(softmax(
        trained.model.forward(pad_rows(&rows, device)).logits,
        1,
    ))
}

/// Counts of (true class, predicted class) over a test set.
#[derive(Clone, Debug)]
pub struct Confusion {
    /// Class names.
    pub classes: Vec<String>,
    /// `counts[true][predicted]`.
    pub counts: Vec<Vec<usize>>,
}

impl Confusion {
    fn new(classes: Vec<String>) -> Self {
        let n = classes.len();
        Self {
            classes,
            counts: vec![vec![0; n]; n],
        }
    }

    fn add(&mut self, truth: &[usize], predicted: &[usize]) {
        for (&t, &p) in truth.iter().zip(predicted) {
            self.counts[t][p] += 1;
        }
    }

    /// Examples counted.
    pub fn total(&self) -> usize {
        self.counts.iter().flatten().sum()
    }

    /// Share of examples on the diagonal.
    pub fn accuracy(&self) -> f64 {
        let right: usize = (0..self.classes.len()).map(|i| self.counts[i][i]).sum();
        right as f64 / self.total().max(1) as f64
    }
}

/// Arg-max class of each row of `scores`, `[b, classes]` → `b` indices.
fn predictions<B: LabBackend>(scores: Tensor<B, 2>) -> Result<Vec<usize>> {
    let [b, _] = scores.dims();
    let ids = scores.argmax(1).reshape([b]).into_data();
    Ok(ids
        .convert::<i64>()
        .into_vec::<i64>()
        .map_err(|e| anyhow::anyhow!("cannot read predictions: {e:?}"))?
        .into_iter()
        .map(|i| i as usize)
        .collect())
}

/// Test-set confusion of a ViT (the official 10,000 test images).
pub fn evaluate_vit<B: LabBackend>(
    trained: &Trained<VisionTransformer<B>>,
    data_dir: &Path,
    batch_size: usize,
    limit: Option<usize>,
    device: &B::Device,
) -> Result<Confusion> {
    let (_, test) = ImageSet::load(&trained.config.data.dataset, data_dir)?;
    let n = test.len().min(limit.unwrap_or(usize::MAX));
    let size = test.rows;
    let mut confusion = Confusion::new(class_names(&trained.config.data.dataset)?);
    for start in (0..n).step_by(batch_size) {
        let end = (start + batch_size).min(n);
        let images: Vec<Vec<u8>> = (start..end)
            .map(|i| test.pixels[i * size * size..(i + 1) * size * size].to_vec())
            .collect();
        let truth: Vec<usize> = test.labels[start..end]
            .iter()
            .map(|&l| l as usize)
            .collect();
        let predicted = predictions(image_probabilities(trained, &images, size, device))?;
        confusion.add(&truth, &predicted);
    }
    Ok(confusion)
}

/// Test-split confusion of a text classifier (GLUE dev for SST-2).
pub fn evaluate_classifier<B: LabBackend>(
    trained: &Trained<TextClassifier<B>>,
    data_dir: &Path,
    batch_size: usize,
    limit: Option<usize>,
    device: &B::Device,
) -> Result<Confusion> {
    let data = &trained.config.data;
    let corpus = SentimentCorpus::load(
        &data.dataset,
        data_dir,
        data.valid_fraction,
        data.test_fraction,
        trained.config.seed,
    )?;
    let mut test = corpus.test;
    test.truncate(limit.unwrap_or(usize::MAX));
    let mut confusion = Confusion::new(class_names(&data.dataset)?);
    for chunk in test.chunks(batch_size) {
        let texts: Vec<String> = chunk.iter().map(|row| row.text.clone()).collect();
        let truth: Vec<usize> = chunk.iter().map(|row| row.label).collect();
        let predicted = predictions(text_probabilities(trained, &texts, device)?)?;
        confusion.add(&truth, &predicted);
    }
    Ok(confusion)
}

/// The `k` most probable classes of one row of probabilities, best first.
pub fn top_classes(probabilities: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut ranked: Vec<(usize, f32)> = probabilities.iter().copied().enumerate().collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    ranked.truncate(k);
    ranked
}

/// Runs `evaluate` (a classifier's test-set confusion), prints its accuracy on `what` ("test
/// images") and writes the confusion matrix as a PNG to `output` (default: `confusion.png` in
/// `artifact_dir`).
pub fn report_confusion(
    config: &crate::config::ExperimentConfig,
    what: &str,
    output: Option<&Path>,
    artifact_dir: &Path,
    evaluate: impl FnOnce() -> Result<Confusion>,
) -> Result<()> {
    let began = std::time::Instant::now();
    let confusion = evaluate()?;
    let seconds = began.elapsed().as_secs_f64();
    let accuracy = 100.0 * confusion.accuracy();
    println!(
        "{}: test accuracy {accuracy:.2}% on {} {what} of {} ({seconds:.1} s)",
        config.name,
        confusion.total(),
        config.data.dataset
    );
    let path = output.map_or_else(|| artifact_dir.join("confusion.png"), Path::to_path_buf);
    let title = format!(
        "{} on {}: {accuracy:.2}% of {}",
        config.name,
        config.data.dataset,
        confusion.total()
    );
    crate::plot::confusion_png(&path, &title, &confusion.classes, &confusion.counts)?;
    println!("confusion matrix written to {}", path.display());
    Ok(())
}
