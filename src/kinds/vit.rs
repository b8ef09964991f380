//! The Vision Transformer kind: cross-entropy over class scores of (optionally shifted) images,
//! test accuracy with a confusion matrix, attention over an image's patches to inspect.

use super::{held_out_batches, EvalRequest, HeldOutRequest, ModelKind};
use crate::artifact::{Tokenizers, Trained};
use crate::classify::{class_names, evaluate_vit, load_image, report_confusion};
use crate::config::{DataConfig, ExperimentConfig, ModelConfig, ModelSection, VitConfig};
use crate::data::{DatasetSpec, ImageBatch, ImageBatcher, ImageSet, Task};
use crate::inspect::heads::HeldOut;
use crate::inspect::{
    image_statistics, predicted_class, vit_attention, AttentionMaps, GroupStats, ImageInput,
    TextModel,
};
use crate::kernels::{LabAutodiff, LabBackend};
use crate::models::VisionTransformer;
use crate::nn::StackConfig;
use crate::train::speed::{bench_training, BenchPlan, BenchReport};
use crate::train::{
    launch, supervised_steps, train_loader, unseeded, Session, Throughput, TrainReport,
};
use anyhow::{bail, Result};
use std::path::Path;
use std::sync::Arc;

supervised_steps!(VisionTransformer, ImageBatch, |model, batch| model
    .loss(batch.images, batch.labels));

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
}

impl ModelKind for VitConfig {
    type Model<B: LabBackend> = VisionTransformer<B>;

    fn build<B: LabBackend>(&self, device: &B::Device) -> VisionTransformer<B> {
        self.init(device)
    }

    fn stack(&self) -> &StackConfig {
        &self.stack
    }

    fn stack_mut(&mut self) -> &mut StackConfig {
        &mut self.stack
    }

    fn held_out<B: LabBackend>(
        trained: &Trained<VisionTransformer<B>>,
        request: &HeldOutRequest,
        device: &B::Device,
    ) -> Result<HeldOut<'static, B, VisionTransformer<B>>> {
        let config = &trained.config;
        let (train_set, _) = ImageSet::load(&config.data.dataset, &request.data_dir)?;
        let (_, valid) = train_set.split(config.data.valid_fraction, config.seed);
        let batcher = ImageBatcher::new(valid.rows, valid.cols, 0, config.seed);
        let loss = |m: &VisionTransformer<B>, b: ImageBatch<B>| m.loss(b.images, b.labels);
        let (n, batches) = held_out_batches(&valid, request, batcher, device, loss)?;
        Ok(HeldOut {
            what: format!("{n} validation images"),
            batches,
            accuracy: true,
        })
    }

    fn activation_floats(&self, _data: &DataConfig) -> f64 {
        self.stack.activation_floats(self.n_layers, self.n_tokens())
    }

    fn train<B: LabAutodiff>(
        &self,
        config: ExperimentConfig,
        _tokenizers: Option<Tokenizers>,
        session: &Session,
        data_dir: &Path,
        device: B::Device,
    ) -> Result<TrainReport> {
        let (train_set, test) = ImageSet::load(&config.data.dataset, data_dir)?;
        let (train_set, valid) = train_set.split(config.data.valid_fraction, config.seed);
        let train_set = train_set.first(config.data.train_examples);
        println!(
            "{}: {} training, {} validation, {} test images of {}×{}; {} patches of {}×{} per image",
            config.data.dataset,
            train_set.len(),
            valid.len(),
            test.len(),
            train_set.rows,
            train_set.cols,
            self.n_tokens() - 1,
            self.patch_size,
            self.patch_size
        );
        session.begin(&config, None, self.activation_floats(&config.data))?;
        crate::kernels::seed::<B>(&device, config.seed);
        let (rows, cols) = (train_set.rows, train_set.cols);
        let augmenting = ImageBatcher::new(rows, cols, config.data.augment_shift, config.seed);
        let plain = ImageBatcher::new(rows, cols, 0, config.seed);
        let loaders = session.loaders(
            &config,
            &device,
            train_set,
            Arc::new(move |items, seed, device: &B::Device| {
                augmenting.batch_seeded(items, seed, device)
            }),
            valid,
            unseeded(plain),
            None,
        );
        let throughput = Throughput {
            per_step: config.train.batch_size,
            unit: "img",
        };
        let model = self.init::<B>(&device);
        launch(&config, session, model, loaders, None, false, throughput)
    }

    fn bench<B: LabAutodiff>(
        &self,
        config: ExperimentConfig,
        data_dir: &Path,
        plan: BenchPlan,
        device: &B::Device,
    ) -> Result<BenchReport> {
        let (train_set, _) = ImageSet::load(&config.data.dataset, data_dir)?;
        let (train_set, _) = train_set.split(config.data.valid_fraction, config.seed);
        let train_set = train_set.first(config.data.train_examples);
        let (rows, cols) = (train_set.rows, train_set.cols);
        let augmenting = ImageBatcher::new(rows, cols, config.data.augment_shift, config.seed);
        let batcher = Arc::new(move |items, seed, device: &B::Device| {
            augmenting.batch_seeded(items, seed, device)
        });
        let loader = train_loader(&config, device, train_set, batcher, Arc::default(), None);
        let images = |batch: &ImageBatch<B>| batch.images.dims()[0];
        let init = || self.init::<B>(device);
        let loss = |model: &VisionTransformer<B>, batch: ImageBatch<B>| {
            model.loss(batch.images, batch.labels).0
        };
        bench_training(&config, plan, &loader, "images", images, init, loss, device)
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
