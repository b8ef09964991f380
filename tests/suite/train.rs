//! Optimisation pieces: the warmup + cosine schedule (nanoGPT's `get_lr`), the Noam schedule,
//! resuming a schedule, clipping by the global gradient norm, and the mean of accumulated
//! gradients.

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::GradientsParams;
use burn::prelude::*;
use transformer_lab::config::LmConfig;
use transformer_lab::models::LanguageModel;
use transformer_lab::nn::StackConfig;
use transformer_lab::train::{batch_nll, clip_global_norm, WarmupSchedule};

type B = NdArray<f32>;
type AB = Autodiff<B>;

#[test]
fn schedule_warms_up_then_decays_like_nanogpt() {
    let mut s = WarmupSchedule::new(1e-3, 1e-4, 100, 2000);
    let lrs: Vec<f64> = (0..2100).map(|_| s.step()).collect();
    assert!((lrs[0] - 1e-3 / 101.0).abs() < 1e-12);
    assert!((lrs[99] - 1e-3 * 100.0 / 101.0).abs() < 1e-12);
    assert!((lrs[100] - 1e-3).abs() < 1e-12, "peak right after warmup");
    // Halfway through the decay the cosine is at its midpoint.
    assert!((lrs[1050] - 5.5e-4).abs() < 1e-9);
    assert!((lrs[2000] - 1e-4).abs() < 1e-12);
    assert!((lrs[2099] - 1e-4).abs() < 1e-12);
    assert!(lrs[100..2000].windows(2).all(|w| w[1] <= w[0]));
}

#[test]
fn noam_schedule_peaks_after_warmup_then_decays_as_inverse_square_root() {
    let s = WarmupSchedule::noam(1e-3, 400);
    assert!(
        (s.at(399) - 1e-3).abs() < 1e-15,
        "the peak is lr, at step n = warmup"
    );
    assert!((s.at(199) - 0.5e-3).abs() < 1e-15, "linear warmup");
    assert!(s.at(398) < s.at(399) && s.at(400) < s.at(399));
    // Four times the steps, half the rate: lr ∝ 1/√step.
    assert!((s.at(1599) / s.at(399) - 0.5).abs() < 1e-12);
    // With lr = (d·warmup)^-½ it is the paper's d^-½·min(step^-½, step·warmup^-1.5).
    let (d, warmup) = (512.0f64, 4000usize);
    let paper = |step: f64| d.powf(-0.5) * step.powf(-0.5).min(step * (warmup as f64).powf(-1.5));
    let s = WarmupSchedule::noam((d * warmup as f64).powf(-0.5), warmup);
    for step in [4000usize, 10_000, 100_000] {
        assert!((s.at(step - 1) - paper(step as f64)).abs() < 1e-9);
    }
}

#[test]
fn schedule_resumes_from_its_record() {
    let mut full = WarmupSchedule::new(1e-3, 1e-4, 10, 100);
    let mut first = full.clone();
    (0..37).for_each(|_| {
        full.step();
        first.step();
    });
    let record = first.to_record::<B>();
    let mut resumed = WarmupSchedule::new(1e-3, 1e-4, 10, 100).load_record::<B>(record);
    for _ in 0..70 {
        assert_eq!(resumed.step(), full.step());
    }
}

struct GradNorm<'a> {
    grads: &'a GradientsParams,
    sum: f64,
}

impl ModuleVisitor<AB> for GradNorm<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        if let Some(g) = self.grads.get::<B, D>(param.id) {
            self.sum += g.square().sum().into_scalar() as f64;
        }
    }
}

fn norm(model: &LanguageModel<AB>, grads: &GradientsParams) -> f64 {
    let mut v = GradNorm { grads, sum: 0.0 };
    model.visit(&mut v);
    v.sum.sqrt()
}

/// A one-layer language model of width 16 and a sequence of 8 tokens for it.
fn tiny_lm() -> (LanguageModel<AB>, Tensor<AB, 2, Int>) {
    let device = Default::default();
    let config = LmConfig {
        stack: StackConfig {
            d_model: 16,
            n_heads: 2,
            ..LmConfig::default().stack
        },
        vocab_size: 7,
        n_layers: 1,
        context: 8,
        ..LmConfig::default()
    };
    let inputs = Tensor::<AB, 2, Int>::from_data([[1, 2, 3, 4, 5, 6, 0, 1]], &device);
    (config.init(&device), inputs)
}

#[test]
fn clipping_rescales_all_gradients_together() {
    let (model, inputs) = tiny_lm();
    let grads_of = || {
        let logits = model.forward(inputs.clone()).logits;
        GradientsParams::from_grads(logits.powi_scalar(2).sum().backward(), &model)
    };
    let before = norm(&model, &grads_of());
    assert!(
        before > 0.5,
        "test needs a gradient norm above the clip, got {before}"
    );
    let clipped = clip_global_norm::<AB, _>(&model, grads_of(), 0.5);
    assert!((norm(&model, &clipped) - 0.5).abs() < 1e-4);
    // Directions are kept: every gradient is scaled by the same factor.
    let (raw, clipped_again) = (
        grads_of(),
        clip_global_norm::<AB, _>(&model, grads_of(), 0.5),
    );
    let id = model.token_embedding.weight.id;
    let ratio =
        clipped_again.get::<B, 2>(id).unwrap() / raw.get::<B, 2>(id).unwrap().add_scalar(1e-30);
    let factor = 0.5 / before;
    let worst: f32 = (ratio.sub_scalar(factor as f32)).abs().max().into_scalar();
    assert!(worst < 1e-3, "embedding gradient scaled unevenly ({worst})");
    // Below the threshold nothing changes.
    let untouched = clip_global_norm::<AB, _>(&model, grads_of(), 1e9);
    assert!((norm(&model, &untouched) - before).abs() < 1e-6 * before);
}

/// Every float parameter of `model`, in visiting order.
fn parameters(model: &LanguageModel<AB>) -> Vec<f32> {
    struct Values(Vec<f32>);
    impl ModuleVisitor<AB> for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            self.0
                .extend(param.val().inner().into_data().to_vec::<f32>().unwrap());
        }
    }
    let mut values = Values(Vec::new());
    model.visit(&mut values);
    values.0
}

#[test]
fn an_accumulating_optimizer_steps_on_the_mean_of_the_gradients_it_is_handed() {
    use burn::optim::{Optimizer, SgdConfig};
    use transformer_lab::config::TrainConfig;
    use transformer_lab::train::{reference_adamw, ReferenceOptimizer};
    let (model, inputs) = tiny_lm();
    // The gradients of `times` batches alike, added up: `times · g`.
    let grads = |times: f32| {
        let logits = model.forward(inputs.clone()).logits;
        let loss = logits.powi_scalar(2).sum().mul_scalar(times);
        GradientsParams::from_grads(loss.backward(), &model)
    };
    let g_norm = norm(&model, &grads(1.0));
    let largest = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    let start = parameters(&model);
    // SGD (whose step is as large as the gradient) and AdamW with an ε as large as the
    // gradients (so that its step depends on their scale), each with clipping off, clipping
    // that acts (below the norm of `g`) and clipping that acts only on `3 · g`.
    for clip in [0.0, (g_norm / 2.0) as f32, (g_norm * 2.0) as f32] {
        let sgd =
            || ReferenceOptimizer::new(SgdConfig::new().init::<AB, LanguageModel<AB>>(), 0.0, clip);
        let adamw = |n: usize| {
            let train = TrainConfig {
                epsilon: 1.0,
                grad_clip: clip,
                grad_accumulation: n,
                ..TrainConfig::default()
            };
            reference_adamw::<AB, LanguageModel<AB>>(&train)
        };
        let one = parameters(&sgd().step(0.1, model.clone(), grads(1.0)));
        let mean = parameters(&sgd().averaging(3).step(0.1, model.clone(), grads(3.0)));
        let sum = parameters(&sgd().step(0.1, model.clone(), grads(3.0)));
        let adamw_one = parameters(&adamw(1).step(0.1, model.clone(), grads(1.0)));
        let adamw_mean = parameters(&adamw(3).step(0.1, model.clone(), grads(3.0)));
        let adamw_sum = parameters(&adamw(1).step(0.1, model.clone(), grads(3.0)));
        for (name, one, mean, sum) in [
            ("sgd", one, mean, sum),
            ("adamw", adamw_one, adamw_mean, adamw_sum),
        ] {
            let moved = largest(&start, &one);
            assert!(moved > 1e-3, "{name}, clip {clip}: the step moved {moved}");
            let off = largest(&one, &mean);
            assert!(off < 1e-6 * moved.max(1.0), "{name}, clip {clip}: {off}");
            // Where clipping to a norm below `g`'s makes `3 · g` and `g` the same step, the sum
            // gives it too; otherwise the sum takes another.
            if clip != (g_norm / 2.0) as f32 {
                let apart = largest(&one, &sum);
                assert!(
                    apart > 1e-4 * moved,
                    "{name}, clip {clip}: the sum's step {apart}"
                );
            }
        }
    }
}

#[test]
fn weight_decay_shrinks_matrices_but_not_layer_norm_gains() {
    use burn::optim::{Optimizer, SgdConfig};
    use transformer_lab::train::ReferenceOptimizer;
    let device = Default::default();
    let config = LmConfig {
        stack: StackConfig {
            d_model: 8,
            n_heads: 2,
            ..LmConfig::default().stack
        },
        vocab_size: 7,
        n_layers: 1,
        context: 4,
        ..LmConfig::default()
    };
    let model: LanguageModel<AB> = config.init(&device);
    let embedding_before = model.token_embedding.weight.val().inner();
    // A step with no gradients: only the decay acts, and SGD itself changes nothing.
    let mut optim =
        ReferenceOptimizer::new(SgdConfig::new().init::<AB, LanguageModel<AB>>(), 0.5, 0.0);
    let after = optim.step(0.1, model, GradientsParams::new());
    let embedding_after = after.token_embedding.weight.val().inner();
    let ratio: Vec<f32> = (embedding_after / embedding_before)
        .into_data()
        .to_vec()
        .unwrap();
    assert!(
        ratio.iter().all(|r| (r - 0.95).abs() < 1e-5),
        "θ·(1 − lr·λ) = θ·0.95"
    );
    let mut norms = Vec::new();
    struct Gains<'a>(&'a mut Vec<f32>);
    impl ModuleVisitor<AB> for Gains<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if D == 1 {
                self.0
                    .extend(param.val().inner().into_data().to_vec::<f32>().unwrap());
            }
        }
    }
    after.visit(&mut Gains(&mut norms));
    assert!(
        !norms.is_empty() && norms.iter().all(|g| *g == 1.0),
        "LayerNorm gains stay 1"
    );
}

#[test]
fn batches_by_length_read_the_same_items_with_less_padding() {
    use burn::data::dataset::InMemDataset;
    use std::sync::Arc;
    use transformer_lab::train::{mix, padding_fraction, replacement_batches, Draw, EpochLoader};
    // By hand: lengths 2 and 4 in one batch pad 2 of 8 positions.
    assert_eq!(padding_fraction(&[vec![0, 1]], &[2, 4]), 0.25);
    let n = 5000;
    let lengths: Vec<usize> = (0..n).map(|i| 1 + (i * 7919) % 60).collect();
    let (batches, size, seed) = (40, 32, 17);
    let plain = replacement_batches(n, batches, size, seed, None);
    let grouped = replacement_batches(n, batches, size, seed, Some(&lengths));
    assert_eq!(plain.len(), batches);
    assert!(plain.iter().all(|b| b.len() == size));
    // As many batches of the same items (so the same tokens per epoch), reproducibly.
    assert_eq!(grouped.len(), batches);
    let sorted = |v: &[Vec<usize>]| {
        let mut v = v.concat();
        v.sort();
        v
    };
    assert_eq!(sorted(&plain), sorted(&grouped));
    assert_eq!(
        grouped,
        replacement_batches(n, batches, size, seed, Some(&lengths))
    );
    // Each batch holds about the same tokens (more short items, fewer long ones); the batches
    // come in shuffled order, with little padding left.
    let tokens = |b: &Vec<usize>| b.iter().map(|&i| lengths[i]).sum::<usize>();
    let mean = grouped.iter().map(tokens).sum::<usize>() / batches;
    for batch in &grouped {
        let ls: Vec<usize> = batch.iter().map(|&i| lengths[i]).collect();
        let hi = *ls.iter().max().unwrap();
        assert!(
            tokens(batch).abs_diff(mean) <= hi,
            "{} tokens, mean {mean}",
            tokens(batch)
        );
    }
    let longest: Vec<usize> = grouped
        .iter()
        .map(|b| b.iter().map(|&i| lengths[i]).max().unwrap())
        .collect();
    assert!(longest.windows(2).any(|w| w[0] > w[1]), "{longest:?}");
    let (before, after) = (
        padding_fraction(&plain, &lengths),
        padding_fraction(&grouped, &lengths),
    );
    assert!(before > 0.4 && after < 0.1, "{before} → {after}");
    // The training loader serves exactly that draw for each epoch.
    let loader = EpochLoader::<NdArray, usize, Vec<usize>>::new(
        InMemDataset::new((0..n).collect()),
        Arc::new(|items, _, _| items),
        Default::default(),
        Draw::Replacement { batches },
        size,
        2,
        seed,
        Arc::default(),
    )
    .by_length(lengths.clone());
    for epoch in [1, 2] {
        let expected = replacement_batches(n, batches, size, mix(seed, epoch), Some(&lengths));
        assert_eq!(loader.batches(epoch as usize), expected);
    }
}

#[test]
fn batches_are_made_on_the_training_thread_in_order() {
    // Loader threads only read items: a GPU backend gives each thread its own stream, and
    // tensors made on a loader thread that ends with its epoch corrupted validations on wgpu.
    use burn::data::dataloader::DataLoader;
    use burn::data::dataset::InMemDataset;
    use std::sync::{Arc, Mutex};
    use transformer_lab::train::{BatchFn, Draw, EpochLoader};

    let made_on = Arc::new(Mutex::new(Vec::new()));
    let record = made_on.clone();
    let batch: BatchFn<B, usize, (Vec<usize>, u64)> = Arc::new(move |items, seed, _device| {
        record.lock().unwrap().push(std::thread::current().id());
        (items, seed)
    });
    let epoch = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let loader = |workers| {
        EpochLoader::<B, _, _>::new(
            InMemDataset::new((0..60).collect::<Vec<usize>>()),
            batch.clone(),
            Default::default(),
            Draw::Replacement { batches: 7 },
            4,
            workers,
            9,
            epoch.clone(),
        )
    };
    let one: Vec<_> = loader(1).iter().collect();
    epoch.store(0, std::sync::atomic::Ordering::SeqCst);
    let three: Vec<_> = loader(3).iter().collect();
    assert_eq!(one.len(), 7);
    assert_eq!(
        one, three,
        "the same batches, in order, whatever the number of workers"
    );
    let here = std::thread::current().id();
    let made_on = made_on.lock().unwrap();
    assert_eq!(made_on.len(), 14);
    assert!(
        made_on.iter().all(|&id| id == here),
        "a batch made on a loader thread"
    );
}

/// The training perplexity's sums (`exp` of the mean negative log-likelihood): each counted
/// row's `−log softmax(row)[target]` against its value worked out by hand, in `f64`; rows whose
/// target is the padding or outside the classes count for nothing, and logits far beyond
/// `exp`'s range give finite terms.
#[test]
fn perplexity_sums_the_negative_log_likelihood_of_each_counted_row() {
    let (e, pad) = (std::f64::consts::E, Some(2));
    let logits: [[f32; 3]; 7] = [
        [0.0, 0.0, 0.0],       // target 1: ln 3
        [3.0, 2.0, 1.0],       // target 0: ln(1 + e⁻¹ + e⁻²)
        [5.0, -5.0, 0.0],      // target 2, the padding: not counted
        [1000.0, 0.0, 0.0],    // target 0: ln(1 + 2e⁻¹⁰⁰⁰) = 0
        [100.0, 101.0, 102.0], // target 0: ln(1 + e + e²)
        [1.0, 1.0, 1.0],       // target 7: no such class, not counted
        [1.0, 1.0, 1.0],       // target −1: not counted
    ];
    let targets = [1, 0, 2, 0, 0, 7, -1];
    let expected = [
        3f64.ln(),
        (1.0 + e.recip() + e.powi(-2)).ln(),
        0.0,
        (1.0 + e + e * e).ln(),
    ];
    let flat: Vec<f32> = logits.iter().flatten().copied().collect();
    let sums = batch_nll(&flat, 3, &targets, pad);
    assert_eq!(sums.tokens, 4, "the counted rows");
    let want: f64 = expected.iter().sum();
    assert!(
        (sums.nll - want).abs() <= 1e-6 * want,
        "Σ −log p(target) = {}, by hand {want}",
        sums.nll
    );
    // Without padding the third row counts too: ln(e⁵ + e⁻⁵ + 1) − 0 = 5 + ln(1 + e⁻¹⁰ + e⁻⁵).
    let sums = batch_nll(&flat, 3, &targets, None);
    assert_eq!(sums.tokens, 5);
    let want = want + 5.0 + (1.0 + (-10f64).exp() + (-5f64).exp()).ln();
    assert!(
        (sums.nll - want).abs() <= 1e-6 * want,
        "{} against {want}",
        sums.nll
    );
}
