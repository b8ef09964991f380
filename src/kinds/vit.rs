//! The Vision Transformer kind: cross-entropy over class scores of (optionally shifted) images,
//! test accuracy with a confusion matrix, attention over an image's patches to inspect.

use super::{EvalRequest, ModelKind, Prepared, TrainAndHeldOut};
use crate::artifact::{Tokenizers, Trained};
use crate::classify::{class_names, evaluate_vit, load_image, report_confusion};
use crate::config::{DataConfig, ExperimentConfig, ModelConfig, ModelSection, VitConfig};
use crate::data::{DatasetSpec, ImageBatch, ImageBatcher, ImageItem, ImageSet, Task};
use crate::inspect::heads::LossOutput;
use crate::inspect::{
    image_statistics, predicted_class, vit_attention, AttentionMaps, GroupStats, ImageInput,
    TextModel,
};
use crate::kernels::LabBackend;
use crate::models::VisionTransformer;
use crate::nn::StackConfig;
use crate::train::LaunchOptions;
use anyhow::{bail, Result};
use std::path::Path;

supervised_steps!(VisionTransformer, VitConfig);

impl ModelSection for VitConfig {
    const KIND: &'static str = "vit";
    const DESCRIPTION: &'static str = "vision transformer";
    const COMMAND: &'static str = "predict";

    fn validate(&self, data: &DataConfig) -> Result<()> {
        VitConfig::validate(self)?;
        if Task::of(&data.dataset) != Some(Task::Images) {
            bail!(
                "data: a vit needs an image dataset (mnist or fashion-mnist), not {}",
                data.dataset
            );
        }
        let classes = DatasetSpec::find(&data.dataset)?.classes.len();
        if self.image_size != 28 || self.channels != 1 || self.n_classes != classes {
            bail!(
                "model: {} images are 28×28 grey with {classes} classes: set image_size 28, channels 1, n_classes {classes}",
                data.dataset
            );
        }
        Ok(())
    }

    fn vocab_sizes(&self) -> (usize, usize) {
        (0, 0)
    }

    fn with_vocab_sizes(&self, _source: usize, _target: usize) -> ModelConfig {
        ModelConfig::Vit(self.clone())
    }

    fn of(model: &ModelConfig) -> Option<&Self> {
        match model {
            ModelConfig::Vit(section) => Some(section),
            _ => None,
        }
    }
}

impl ModelKind for VitConfig {
    type Model<B: LabBackend> = VisionTransformer<B>;
    type Item = ImageItem;
    type Split = ImageSet;
    type Batcher = TrainAndHeldOut<ImageBatcher>;
    type Batch<B: LabBackend> = ImageBatch<B>;

    fn build<B: LabBackend>(&self, device: &B::Device) -> VisionTransformer<B> {
        self.init(device)
    }

    fn stack(&self) -> &StackConfig {
        &self.stack
    }

    fn stack_mut(&mut self) -> &mut StackConfig {
        &mut self.stack
    }

    fn activation_floats(&self, _data: &DataConfig) -> f64 {
        self.stack.activation_floats(self.n_layers, self.n_tokens())
    }

    fn prepare(
        config: ExperimentConfig,
        _tokenizers: Option<Tokenizers>,
        data_dir: &Path,
    ) -> Result<Prepared<Self>> {
        let vit = config.model_as::<VitConfig>()?;
        let data = &config.data;
        let (train, test) = ImageSet::load(&data.dataset, data_dir)?;
        let (train, valid) = train.split(data.valid_fraction, config.seed);
        let train = train.first(data.train_examples);
        let summary = format!(
            "{}: {} training, {} validation, {} test images of {}×{}; {} patches of {}×{} per image",
            data.dataset,
            train.len(),
            valid.len(),
            test.len(),
            train.rows,
            train.cols,
            vit.n_tokens() - 1,
            vit.patch_size,
            vit.patch_size
        );
        let (rows, cols) = (train.rows, train.cols);
        Ok(Prepared {
            tokenizers: None,
            summary: Some(summary),
            train,
            valid,
            batcher: TrainAndHeldOut {
                train: ImageBatcher::new(rows, cols, data.augment_shift, config.seed),
                held_out: ImageBatcher::new(rows, cols, 0, config.seed),
            },
            lengths: None,
            padding: Vec::new(),
            launch: LaunchOptions::items(config.train.batch_size, "img", "images"),
            valid_items: "validation images".into(),
            accuracy: true,
            config,
        })
    }

    fn batch<B: LabBackend>(
        batcher: &TrainAndHeldOut<ImageBatcher>,
        items: Vec<ImageItem>,
        draw: Option<u64>,
        device: &B::Device,
    ) -> ImageBatch<B> {
        match draw {
            Some(seed) => batcher.train.batch_seeded(items, seed, device),
            None => batcher.held_out.batch_seeded(items, 0, device),
        }
    }

    fn loss<B: LabBackend>(model: &VisionTransformer<B>, batch: ImageBatch<B>) -> LossOutput<B> {
        model.loss(batch.images, batch.labels)
    }

    fn units<B: LabBackend>(batch: &ImageBatch<B>) -> usize {
        batch.images.dims()[0]
    }

    fn eval<B: LabBackend>(
        trained: &Trained<VisionTransformer<B>>,
        request: &EvalRequest,
        device: &B::Device,
    ) -> Result<()> {
        report_confusion(
            &trained.config,
            "test images",
            request.output.as_deref(),
            &request.artifact_dir,
            || {
                let (data_dir, limit) = (&request.data_dir, request.limit);
                evaluate_vit(trained, data_dir, request.batch_size, limit, device)
            },
        )
    }

    fn attention<B: LabBackend>(
        trained: &Trained<VisionTransformer<B>>,
        input: &str,
        _target: Option<&str>,
        device: &B::Device,
    ) -> Result<AttentionMaps> {
        let size = trained.config.model_as::<VitConfig>()?.image_size;
        let image = load_image(Path::new(input), size)?;
        image_maps(trained, input, image.pixels, device)
    }

    fn statistics<B: LabBackend>(
        trained: &Trained<VisionTransformer<B>>,
        maps: &AttentionMaps,
        seed: u64,
        device: &B::Device,
    ) -> Result<Vec<GroupStats>> {
        image_statistics(maps, seed, |image, patches| {
            Ok(vit_attention(&trained.model, image, Some(patches), device)?.0)
        })
    }

    fn text_model<B: LabBackend>(
        trained: &Trained<VisionTransformer<B>>,
    ) -> Result<TextModel<'_, B>> {
        bail!(
            "{} is a vit model: it reads an image, not text; for a ViT use `attention` with an \
             image",
            trained.config.name
        )
    }
}

/// The attention maps of a ViT on one image already read (`image_size²` grey pixels, as
/// [`crate::classify::PreparedImage`] holds them); `input` names it.
pub fn image_maps<B: LabBackend>(
    trained: &Trained<VisionTransformer<B>>,
    input: &str,
    pixels: Vec<u8>,
    device: &B::Device,
) -> Result<AttentionMaps> {
    let vit = trained.config.model_as::<VitConfig>()?;
    let image = ImageInput {
        size: vit.image_size,
        patch_size: vit.patch_size,
        pixels,
    };
    let classes = class_names(&trained.config.data.dataset)?;
    let (group, logits) = vit_attention(&trained.model, &image, None, device)?;
    let mut maps = AttentionMaps::new(&trained.config.name, VitConfig::KIND, input);
    maps.output = Some(predicted_class(logits, &classes));
    maps.groups.push(group);
    maps.image = Some(image);
    Ok(maps)
}
