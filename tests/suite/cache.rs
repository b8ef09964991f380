//! Incremental decoding: the cache gives the logits of the uncached pass at every step up to
//! the context, for every mixer that has an incremental form; past the context it refills
//! from the last `context/2` tokens, and a model without one (Hyena) recomputes.

use crate::common::cached_logit_difference;
use burn::backend::NdArray;
use burn::prelude::*;
use transformer_lab::generate::{generate, next_token_probs, Decoder, Decoding, Sampling};
use transformer_lab::nn::{HyenaConfig, Mixer};

type B = NdArray<f32>;

#[test]
fn cached_decoding_gives_the_uncached_logits_on_ndarray() {
    let (worst, at) = cached_logit_difference::<B>(&Default::default());
    assert!(
        worst < 1e-5,
        "cached and uncached logits differ by {worst} ({at})"
    );
}

#[cfg(feature = "flex")]
#[test]
fn cached_decoding_gives_the_uncached_logits_on_flex() {
    let (worst, at) = cached_logit_difference::<burn::backend::Flex>(&Default::default());
    assert!(
        worst < 1e-5,
        "cached and uncached logits differ by {worst} ({at})"
    );
}

fn lm(mixer: Mixer, context: usize) -> transformer_lab::models::LanguageModel<B> {
    crate::common::mixer_lm(mixer, context)
}

fn argmax(probs: &[f32]) -> usize {
    (0..probs.len())
        .max_by(|&a, &b| probs[a].total_cmp(&probs[b]).then(b.cmp(&a)))
        .unwrap()
}

fn greedy() -> Sampling {
    Sampling {
        greedy: true,
        ..Sampling::default()
    }
}

#[test]
fn past_the_context_the_cache_refills_from_the_last_half_context() {
    let device = Default::default();
    let context = 8;
    let model = lm(Mixer::Full, context);
    let prompt = [1, 2, 3];
    let run = |decoding| {
        generate(
            &model,
            &prompt,
            30,
            &greedy(),
            0,
            decoding,
            &device,
            |_, _| Ok(()),
        )
        .unwrap()
    };
    let (cached, recomputed) = (run(Decoding::Cached), run(Decoding::Recompute));
    // Within the context both see the same tokens at the same positions.
    assert_eq!(cached[..=context], recomputed[..=context]);
    // Past it, each token is the argmax after the tokens since the last refill, which happens
    // when the cache would exceed the context and keeps the last context/2 tokens.
    let mut start = 0;
    for i in prompt.len()..cached.len() {
        if i - start > context {
            start = i - context / 2;
        }
        let probs = next_token_probs(&model, &cached[start..i], &device);
        assert_eq!(cached[i], argmax(&probs), "token {i} (window from {start})");
    }
    // The recomputing path slides: always the last `context` tokens.
    for i in prompt.len()..recomputed.len() {
        let probs = next_token_probs(&model, &recomputed[i.saturating_sub(context)..i], &device);
        assert_eq!(recomputed[i], argmax(&probs), "token {i}");
    }
}

#[test]
fn hyena_recomputes_its_window_and_local_attention_keeps_only_its_window() {
    let device = Default::default();
    let hyena = lm(Mixer::Hyena(HyenaConfig::default()), 8);
    assert!(!hyena.caches());
    let run = |model, decoding| {
        generate(
            model,
            &[4, 5],
            12,
            &greedy(),
            0,
            decoding,
            &device,
            |_, _| Ok(()),
        )
        .unwrap()
    };
    assert_eq!(
        run(&hyena, Decoding::Cached),
        run(&hyena, Decoding::Recompute)
    );

    // A local layer's cache holds at most `window` positions, whatever the length.
    let local = lm(Mixer::Local { window: 3 }, 16);
    let mut decoder = Decoder::new(
        &local,
        vec![vec![1, 2, 3, 4, 5], vec![5, 4, 3, 2, 1]],
        Decoding::Cached,
        &device,
    );
    for _ in 0..6 {
        let logits = decoder.next_logits();
        assert_eq!(logits.dims(), [2, 11]);
        decoder.push(&[7, 8]);
    }
    assert_eq!(decoder.tokens[1].len(), 11);
    assert_eq!(decoder.cache().unwrap().layers[0].kept(), 3);
}

/// The largest difference between a language model's logits with the weights returned (the
/// composed attention) and without (the fused kernel), and whether each path returned them.
fn fused_inference_difference<Bk: transformer_lab::kernels::LabBackend>() -> f32 {
    use transformer_lab::nn::{without_weights, PositionKind};
    let device = Default::default();
    let mut worst = 0.0f32;
    for position in [PositionKind::Learned, PositionKind::Rope] {
        let model = transformer_lab::config::LmConfig {
            stack: transformer_lab::nn::StackConfig {
                d_model: 16,
                n_heads: 2,
                ..transformer_lab::config::LmConfig::default().stack
            },
            vocab_size: 11,
            n_layers: 2,
            context: 12,
            position,
            ..transformer_lab::config::LmConfig::default()
        }
        .init::<Bk>(&device);
        let ids: Vec<i64> = (0..24).map(|i| (i * 7 % 11) as i64).collect();
        let tokens = Tensor::<Bk, 2, Int>::from_data(TensorData::new(ids, [2, 12]), &device);
        let composed = model.forward(tokens.clone());
        let fused = without_weights(|| model.forward(tokens));
        assert_eq!(
            composed.attention.len(),
            2,
            "inspection gets every layer's weights"
        );
        assert!(
            fused.attention.is_empty(),
            "the fused kernel builds no weights"
        );
        let diff: f32 = (composed.logits - fused.logits)
            .abs()
            .max()
            .into_scalar()
            .elem();
        worst = worst.max(diff);
    }
    worst
}

#[test]
fn inference_without_weights_runs_the_fused_kernel_and_gives_the_same_logits() {
    let worst = fused_inference_difference::<B>();
    assert!(
        worst < 1e-5,
        "ndarray: fused and composed logits differ by {worst}"
    );
    #[cfg(feature = "flex")]
    {
        let worst = fused_inference_difference::<burn::backend::Flex>();
        assert!(
            worst < 1e-5,
            "flex: fused and composed logits differ by {worst}"
        );
    }
}

/// Training's validation step (burn's `InferenceStep`, every kind's through one macro) reads
/// the loss and logits only, so it must run attention as the fused kernel, as `eval` does: its
/// logits are, bit for bit, those of the weight-free pass and not those of the pass that builds
/// every head's weights (what validation ran before, at twice the cost).
#[cfg(feature = "flex")]
#[test]
fn the_validation_step_runs_attention_as_the_fused_kernel() {
    use burn::backend::Flex;
    use burn::train::InferenceStep;
    use transformer_lab::config::LmConfig;
    use transformer_lab::data::text::LmBatch;
    use transformer_lab::kinds::ModelKind;
    use transformer_lab::nn::without_weights;
    let device = Default::default();
    let config = crate::common::small_lm();
    let model = config.init::<Flex>(&device);
    let (vocab, context) = (config.vocab_size as i64, config.context);
    let ids = |shift: i64| -> Tensor<Flex, 2, Int> {
        let ids: Vec<i64> = (0..3 * context as i64)
            .map(|i| (i + shift) * 7 % vocab)
            .collect();
        Tensor::from_data(TensorData::new(ids, [3, context]), &device)
    };
    let batch = LmBatch {
        inputs: ids(0),
        targets: ids(1),
    };
    let bits = |logits: Tensor<Flex, 2>| -> Vec<u32> {
        let values = logits.into_data().to_vec::<f32>().unwrap();
        values.into_iter().map(f32::to_bits).collect()
    };
    let composed = bits(<LmConfig as ModelKind>::loss(&model, batch.clone()).1);
    let fused = bits(without_weights(|| <LmConfig as ModelKind>::loss(&model, batch.clone())).1);
    assert_ne!(
        composed, fused,
        "the two attention paths give the same bits here: this test could not tell them apart"
    );
    let validation = bits(model.step(batch).output);
    assert!(
        validation == fused,
        "validation's logits are not the fused kernel's (are they the composed pass's? {})",
        validation == composed
    );
}

/// The largest difference, over every mixer that keeps keys and values and every position
/// encoding, between the logits a batch of sequences at different positions gives each row
/// (`forward_rows`: continuous batching, sequences joining and leaving between steps) and the
/// logits of one uncached pass over that row's sequence alone (of decoding it alone, once a
/// rolling cache is past the context).
pub(crate) fn rows_logit_difference<B: transformer_lab::kernels::LabBackend>(
    device: &B::Device,
    models: impl Fn(&str) -> bool,
) -> (f32, usize) {
    let (vocab, context) = (11, 12);
    let mut worst = 0.0f32;
    let mut compared = 0;
    crate::common::each_decoder_lm::<B>(vocab, context, device, |name, model| {
        if !models(&name) {
            return;
        }
        if !model.batches() {
            assert!(name.starts_with("linear"), "{name} batches");
            return;
        }
        // (step it joins at, its prompt); rolling models decode past the context.
        let steps = if model.rolls() { 22 } else { 7 };
        let joins: [(usize, Vec<usize>); 3] = [
            (0, vec![3, 1, 4, 1, 5]),
            (2, vec![9, 2]),
            (4, vec![6, 5, 3, 5, 8, 9, 7]),
        ];
        let leaves_at = 5; // the first sequence leaves here
        let mut batch = model.new_rows_cache();
        let mut live: Vec<Vec<usize>> = Vec::new(); // the batch's sequences, in row order
        let mut next_rows: Vec<usize> = Vec::new();
        // Within the context: one uncached pass. Past it (a rolling cache): decoding the
        // sequence alone, each layer over its last `context` positions (which within the
        // context is the uncached pass: tested above).
        let reference = |seq: &[usize]| -> Tensor<B, 1> {
            let n = seq.len();
            let input = |part: &[usize]| {
                let ids: Vec<i64> = part.iter().map(|&t| t as i64).collect();
                Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, part.len()]), device)
            };
            if n <= context {
                return model
                    .forward(input(seq))
                    .logits
                    .slice([0..1, n - 1..n])
                    .reshape([vocab]);
            }
            let mut alone = model.new_cache();
            let mut logits = model.forward_cached(input(&seq[..context]), &mut alone);
            for i in context..n {
                logits = model.forward_cached(input(&seq[i..=i]), &mut alone);
            }
            logits.slice([0..1, 0..1]).reshape([vocab])
        };
        for step in 0..steps {
            if step == leaves_at {
                let rows: Vec<usize> = (1..live.len()).collect();
                batch.keep(&rows, device);
                live.remove(0);
                next_rows.remove(0);
            }
            for (_, prompt) in joins.iter().filter(|(at, _)| *at == step) {
                let mut single = model.new_cache();
                let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
                let input =
                    Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, prompt.len()]), device);
                model.forward_cached(input, &mut single);
                batch.join(&single);
                live.push(prompt.clone());
                next_rows.push((step * 5 + live.len()) % vocab);
            }
            // Every row takes its next token and the batch gives the logits after it.
            for (seq, &token) in live.iter_mut().zip(&next_rows) {
                seq.push(token);
            }
            let ids: Vec<i64> = next_rows.iter().map(|&t| t as i64).collect();
            let tokens = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [live.len()]), device);
            let logits = model.forward_rows(tokens, &mut batch); // [b, v]
            for (r, seq) in live.iter().enumerate() {
                let row = logits.clone().narrow(0, r, 1).reshape([vocab]);
                let diff: f32 = (row - reference(seq)).abs().max().into_scalar().elem();
                assert!(
                    diff < 1e-4,
                    "{name}: step {step}, row {r} (length {}) differs by {diff}",
                    seq.len()
                );
                worst = worst.max(diff);
                compared += 1;
            }
            next_rows = (0..live.len())
                .map(|r| (step * 3 + r * 7 + 1) % vocab)
                .collect();
        }
        assert!(
            !model.rolls() || batch.columns() <= context,
            "{name}: a rolling batch keeps {} columns",
            batch.columns()
        );
    });
    (worst, compared)
}

#[test]
fn a_batch_of_sequences_at_different_positions_gives_each_the_logits_it_has_alone_on_ndarray() {
    let (worst, compared) = rows_logit_difference::<B>(&Default::default(), |_| true);
    assert!(compared > 300, "{compared} rows compared");
    assert!(worst < 1e-4, "{worst}");
}

#[cfg(feature = "flex")]
#[test]
fn a_batch_of_sequences_at_different_positions_gives_each_the_logits_it_has_alone_on_flex() {
    let (worst, compared) =
        rows_logit_difference::<burn::backend::Flex>(&Default::default(), |_| true);
    assert!(compared > 300, "{compared} rows compared");
    assert!(worst < 1e-4, "{worst}");
}

/// The key–value columns a decode appends to: after any sequence of appends (one column or
/// several), drops from the front and choices of rows, the live columns are exactly those of
/// concatenating everything appended and cutting it the same way (a list of columns kept on
/// the side), while the buffers grow geometrically: a few copies of the whole for 300 appends.
#[test]
fn key_value_columns_hold_what_was_appended_and_grow_geometrically() {
    let pushes = columns_case::<burn::backend::Flex>(&Default::default());
    assert_eq!(pushes, 300);
}

/// The body of the test above on backend `F` → how many appends it made.
pub(crate) fn columns_case<F: transformer_lab::kernels::LabBackend>(device: &F::Device) -> usize {
    use transformer_lab::nn::Columns;
    let device = device.clone();
    let (b, h, k) = (3, 2, 4);
    // Column c of row r, head i, channel e: a value that names them all.
    let column = |r: usize, c: usize| -> Vec<f32> {
        (0..h * k)
            .map(|e| (r * 100_000 + c * 10 + e % k) as f32 + (e / k) as f32 * 0.5)
            .collect()
    };
    // [b, h, n, k] for columns `cs` of each row `rows[r]`.
    let tensor = |rows: &[usize], cs: &[usize]| {
        let mut data = vec![0.0; rows.len() * h * cs.len() * k];
        for (ri, &r) in rows.iter().enumerate() {
            for (j, &c) in cs.iter().enumerate() {
                for (e, x) in column(r, c).into_iter().enumerate() {
                    let (head, ch) = (e / k, e % k);
                    data[((ri * h + head) * cs.len() + j) * k + ch] = x;
                }
            }
        }
        Tensor::<F, 4>::from_data(TensorData::new(data, [rows.len(), h, cs.len(), k]), &device)
    };
    let mut rows: Vec<usize> = (0..b).collect();
    let mut live: Vec<usize> = (0..2).collect();
    let mut columns = Columns::new(tensor(&rows, &live), tensor(&rows, &live).mul_scalar(-1.0));
    let mut next = 2;
    let mut capacities = vec![];
    for step in 0..300 {
        let n = if step % 37 == 0 { 5 } else { 1 };
        let new: Vec<usize> = (next..next + n).collect();
        next += n;
        columns = columns.push(tensor(&rows, &new), tensor(&rows, &new).mul_scalar(-1.0));
        live.extend(new);
        if step % 50 == 49 {
            columns.drop_front(7);
            live.drain(..7);
        }
        if step == 150 {
            // Beam search keeps rows 2, 0, 0 (the same row twice).
            let ids =
                Tensor::<F, 1, Int>::from_data(TensorData::new(vec![2i64, 0, 0], [3]), &device);
            columns.select(ids);
            rows = vec![rows[2], rows[0], rows[0]];
        }
        assert_eq!(columns.len(), live.len());
        if step % 23 == 0 || step == 299 {
            let (keys, values) = columns.views();
            let expected = tensor(&rows, &live);
            keys.into_data()
                .assert_eq(&expected.clone().into_data(), true);
            values
                .into_data()
                .assert_eq(&expected.mul_scalar(-1.0).into_data(), true);
        }
        if capacities.last() != Some(&columns.capacity()) {
            capacities.push(columns.capacity());
        }
    }
    assert!(
        capacities.len() <= 12,
        "the buffers were reallocated {} times for 300 appends: {capacities:?}",
        capacities.len()
    );
    300
}
