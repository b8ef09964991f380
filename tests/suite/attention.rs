//! Scaled dot-product attention: the textbook example against an independent f64 computation,
//! rows summing to 1, masked weights exactly 0, and cross-attention over another sequence.

use burn::backend::NdArray;
use burn::module::Param;
use burn::prelude::*;
use burn::tensor::Distribution;
use transformer_lab::explain::{self, walkthrough};
use transformer_lab::inspect::heads::{
    gate_gradients, importance, prune_greedily, prune_in_order, removed_by_layer, spearman,
    HeldOut, HeldOutBatch,
};
use transformer_lab::kernels::LabBackend;
use transformer_lab::nn::{
    scaled_dot_product_attention, without_weights, AttentionMask, LayerCache, MultiHeadAttention,
    MultiHeadAttentionConfig,
};
use transformer_lab::nn::{AttentionLayers, RelativePosition};

type B = NdArray<f32>;

fn matmul(a: &[Vec<f64>], b: &[Vec<f64>]) -> Vec<Vec<f64>> {
    a.iter()
        .map(|row| {
            (0..b[0].len())
                .map(|j| row.iter().zip(b).map(|(x, bj)| x * bj[j]).sum())
                .collect()
        })
        .collect()
}

type Matrix = Vec<Vec<f64>>;

/// The textbook example computed by hand-written f64 loops, independent of burn:
/// (scaled scores, attention weights, output).
fn reference() -> (Matrix, Matrix, Matrix) {
    let x = vec![vec![1.0, 0.0], vec![0.0, 1.0], vec![1.0, 1.0]];
    let q = matmul(&x, &[vec![1.0, 1.0], vec![0.0, 1.0]]);
    let k = matmul(&x, &[vec![1.0, 0.0], vec![1.0, 1.0]]);
    let v = matmul(&x, &[vec![0.5, 1.0], vec![1.0, 0.0]]);
    let scores: Vec<Vec<f64>> = q
        .iter()
        .map(|qi| {
            k.iter()
                .map(|kj| (qi[0] * kj[0] + qi[1] * kj[1]) / 2f64.sqrt())
                .collect()
        })
        .collect();
    let weights: Vec<Vec<f64>> = scores
        .iter()
        .map(|row| {
            let z: f64 = row.iter().map(|s| s.exp()).sum();
            row.iter().map(|s| s.exp() / z).collect()
        })
        .collect();
    let output = matmul(&weights, &v);
    (scores, weights, output)
}

fn assert_close(actual: &[Vec<f32>], expected: &[Vec<f64>], what: &str) {
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        for (j, (a, e)) in a.iter().zip(e).enumerate() {
            assert!(
                (*a as f64 - e).abs() < 1e-5,
                "{what}[{i}][{j}] = {a}, expected {e}"
            );
        }
    }
}

#[test]
fn textbook_example_matches_independent_computation() {
    let parse = |name, text| explain::parse_matrix(name, text).unwrap();
    let w = walkthrough::<B>(
        &parse("X", explain::DEFAULT_X),
        &parse("W_Q", explain::DEFAULT_WQ),
        &parse("W_K", explain::DEFAULT_WK),
        &parse("W_V", explain::DEFAULT_WV),
        &Default::default(),
    )
    .unwrap();
    let (scores, weights, output) = reference();
    assert_eq!(w.q, vec![vec![1.0, 1.0], vec![0.0, 1.0], vec![1.0, 2.0]]);
    assert_eq!(w.k, vec![vec![1.0, 0.0], vec![1.0, 1.0], vec![2.0, 1.0]]);
    assert_eq!(w.v, vec![vec![0.5, 1.0], vec![1.0, 0.0], vec![1.5, 1.0]]);
    assert_close(&w.scores, &scores, "S");
    assert_close(&w.weights, &weights, "A");
    assert_close(&w.output, &output, "O");
    // Hand-rounded values of the first row, as printed by `explain`.
    assert!((w.weights[0][2] - 0.5760).abs() < 1e-4);
    assert!((w.output[0][0] - 1.2180).abs() < 1e-4);
}

#[test]
fn explain_rejects_mismatched_matrices() {
    let x = explain::parse_matrix("X", "1,0,0; 0,1,0").unwrap();
    let w = explain::parse_matrix("W", "1,0; 0,1").unwrap();
    assert!(walkthrough::<B>(&x, &w, &w, &w, &Default::default()).is_err());
    assert!(explain::parse_matrix("X", "1,0; 1").is_err());
    assert!(explain::parse_matrix("X", "1,a").is_err());
}

fn random(shape: [usize; 4]) -> Tensor<B, 4> {
    Tensor::random(
        shape,
        burn::tensor::Distribution::Normal(0.0, 1.0),
        &Default::default(),
    )
}

#[test]
fn weights_rows_sum_to_one_and_masked_entries_are_zero() {
    let device = Default::default();
    let (q, k, v) = (
        random([2, 3, 5, 4]),
        random([2, 3, 5, 4]),
        random([2, 3, 5, 4]),
    );
    let mask = AttentionMask::<B>::causal(5, &device);
    let (context, weights) = scaled_dot_product_attention(q, k, v, Some(&mask));
    assert_eq!(context.dims(), [2, 3, 5, 4]);
    let sums: Vec<f32> = weights.clone().sum_dim(3).into_data().to_vec().unwrap();
    assert!(
        sums.iter().all(|s| (s - 1.0).abs() < 1e-5),
        "row sums {sums:?}"
    );
    let w: Vec<f32> = weights.into_data().to_vec().unwrap();
    for (n, value) in w.iter().enumerate() {
        let (i, j) = ((n / 5) % 5, n % 5);
        if j > i {
            assert_eq!(*value, 0.0, "weight of future key {j} for query {i}");
        }
    }
}

#[test]
fn cross_attention_attends_over_the_memory_sequence() {
    let device = Default::default();
    let mha = MultiHeadAttentionConfig::new(8, 2).init::<B>(&device);
    let query = Tensor::<B, 3>::random([2, 3, 8], burn::tensor::Distribution::Default, &device);
    let memory = Tensor::<B, 3>::random([2, 7, 8], burn::tensor::Distribution::Default, &device);
    let out = mha.forward(query.clone(), memory.clone(), None);
    assert_eq!(out.context.dims(), [2, 3, 8]);
    assert_eq!(out.weights.unwrap().dims(), [2, 2, 3, 7]);
    // The queries' own values do not reach the output except through the attention weights:
    // changing the memory changes the context.
    let other = mha.forward(query, memory.mul_scalar(2.0), None);
    let diff: f32 = (out.context - other.context).abs().max().into_scalar();
    assert!(diff > 1e-4);
}

/// A 4-head layer of width 16 drawn from `seed`.
fn seeded_layer<L: LabBackend>(seed: u64) -> MultiHeadAttention<L> {
    fixed_layer(MultiHeadAttentionConfig::new(16, 4), seed)
}

/// The layer `config` builds (width 16, 4 heads), with fixed weights salted by `seed`.
fn fixed_layer<L: LabBackend>(
    config: MultiHeadAttentionConfig,
    seed: u64,
) -> MultiHeadAttention<L> {
    // Fixed weights, not the backend's random stream: tests running beside this one draw
    // from (and reseed) that stream too.
    let device = Default::default();
    let mut mha = config.init::<L>(&device);
    let fixed = |n: usize, salt: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * 0.73) + (salt as f32 * 1.91) + seed as f32).sin() * 0.3)
            .collect()
    };
    let layers = [
        &mut mha.query,
        &mut mha.key,
        &mut mha.value,
        &mut mha.output,
    ];
    for (k, layer) in layers.into_iter().enumerate() {
        let weight = Tensor::<L, 1>::from_floats(fixed(256, k).as_slice(), &device);
        layer.weight = Param::from_tensor(weight.reshape([16, 16]));
        let bias = Tensor::<L, 1>::from_floats(fixed(16, k + 10).as_slice(), &device);
        layer.bias = Some(Param::from_tensor(bias));
    }
    mha
}

/// A seeded layer, and a copy whose `W^O` rows for `head` are zero.
fn layer_and_copy_without(head: usize) -> (MultiHeadAttention<B>, MultiHeadAttention<B>) {
    let device = Default::default();
    let mha = seeded_layer::<B>(21);
    let mut zeroed = mha.clone();
    zeroed.output.weight = zeroed.output.weight.map(|w| {
        w.slice_assign(
            [head * 4..head * 4 + 4, 0..16],
            Tensor::zeros([4, 16], &device),
        )
    });
    (mha, zeroed)
}

fn max_diff(a: Tensor<B, 3>, b: Tensor<B, 3>) -> f32 {
    (a - b).abs().max().into_scalar()
}

/// A layer's outputs in its four forms: composed attention (with weights), the fused kernel,
/// cross-attention from a projected memory, and decoding position by position from a cache.
fn four_forms(
    m: &MultiHeadAttention<B>,
    x: &Tensor<B, 3>,
    memory: &Tensor<B, 3>,
) -> [Tensor<B, 3>; 4] {
    let [b, t, d] = x.dims();
    let causal = AttentionMask::<B>::causal(t, &x.device());
    let composed = m.forward(x.clone(), x.clone(), Some(&causal)).context;
    let fused = without_weights(|| m.forward_self(x.clone(), Some(&causal)).context);
    let cross = m.forward_memory(x.clone(), &m.memory(memory.clone(), None));
    let mut cache = LayerCache::default();
    let steps: Vec<_> = (0..t)
        .map(|i| m.forward_cached(x.clone().slice([0..b, i..i + 1, 0..d]), &mut cache))
        .collect();
    [composed, fused, cross, Tensor::cat(steps, 1)]
}

fn inputs() -> (Tensor<B, 3>, Tensor<B, 3>) {
    let device = Default::default();
    let x = Tensor::<B, 3>::random([2, 6, 16], Distribution::Normal(0.0, 1.0), &device);
    let memory = Tensor::<B, 3>::random([2, 9, 16], Distribution::Normal(0.0, 1.0), &device);
    (x, memory)
}

#[test]
fn a_gated_off_head_is_a_head_whose_output_rows_are_zero() {
    let (mut gated, zeroed) = layer_and_copy_without(2);
    let ungated = gated.clone();
    gated.set_head_gates(Some(vec![1.0, 1.0, 0.0, 1.0]));
    let (x, memory) = inputs();
    let forms = |m| four_forms(m, &x, &memory);
    let (got, want, full) = (forms(&gated), forms(&zeroed), forms(&ungated));
    for (i, ((g, w), f)) in got.into_iter().zip(want).zip(full).enumerate() {
        assert!(max_diff(g.clone(), w) < 1e-5, "form {i}");
        assert!(max_diff(g, f) > 1e-3, "form {i}: the head mattered");
    }
}

#[test]
fn a_layer_without_heads_computes_what_the_gated_layer_does() {
    let (mut gated, _) = layer_and_copy_without(0);
    let pruned = gated.without_heads(&[1, 3]);
    assert_eq!(pruned.n_heads(), 2);
    assert_eq!(pruned.query.weight.dims(), [16, 8]);
    assert_eq!(pruned.output.weight.dims(), [8, 16]);
    gated.set_head_gates(Some(vec![1.0, 0.0, 1.0, 0.0]));
    let (x, memory) = inputs();
    let (got, want) = (
        four_forms(&pruned, &x, &memory),
        four_forms(&gated, &x, &memory),
    );
    for (i, (g, w)) in got.into_iter().zip(want).enumerate() {
        assert!(max_diff(g, w) < 1e-5, "form {i}");
    }
    // Gates of kept heads stay with them.
    gated.set_head_gates(Some(vec![0.5, 0.0, 2.0, 0.0]));
    assert_eq!(
        gated.without_heads(&[1, 3]).head_gates(),
        Some(&[0.5, 2.0][..])
    );

    // With ALiBi the heads left keep their own slopes, pruned once or twice.
    let config = MultiHeadAttentionConfig::new(16, 4).with_relative(RelativePosition::Alibi);
    let mut gated = fixed_layer::<B>(config, 3);
    // Heads 0 and 2 left: slopes 2^-2, 2^-6, where a 2-head layer's own would be 2^-4, 2^-8.
    let pruned = gated.without_heads(&[1]).without_heads(&[2]);
    gated.set_head_gates(Some(vec![1.0, 0.0, 1.0, 0.0]));
    let (got, want) = (
        four_forms(&pruned, &x, &memory),
        four_forms(&gated, &x, &memory),
    );
    for i in [0, 1, 3] {
        let diff = max_diff(got[i].clone(), want[i].clone());
        assert!(diff < 1e-5, "alibi form {i}: {diff}");
    }
}

#[test]
fn gate_gradients_are_the_derivative_of_the_loss_in_each_gate() {
    type A = burn::backend::Autodiff<B>;
    let device = Default::default();
    let mha = seeded_layer::<A>(5);
    let x = Tensor::<A, 3>::random([2, 5, 16], Distribution::Normal(0.0, 1.0), &device);
    let w = Tensor::<A, 3>::random([2, 5, 16], Distribution::Normal(0.0, 1.0), &device);
    let causal = AttentionMask::<A>::causal(5, &device);
    let loss = |m: &MultiHeadAttention<A>| {
        (m.forward(x.clone(), x.clone(), Some(&causal)).context * w.clone()).sum()
    };
    let grads = loss(&mha).backward();
    let analytic = mha.gate_gradients(&grads).expect("W^O has a gradient");
    // The loss is linear in each gate: a central difference is exact up to rounding.
    for (h, &g) in analytic.iter().enumerate() {
        let at = |gate: f32| {
            let mut m = mha.clone();
            let mut gates = vec![1.0; 4];
            gates[h] = gate;
            m.set_head_gates(Some(gates));
            loss(&m).into_scalar()
        };
        let numeric = (at(1.5) - at(0.5)) / 1.0;
        assert!(
            (numeric - g).abs() < 1e-3 * (1.0 + g.abs()),
            "head {h}: {numeric} vs {g}"
        );
    }
    assert!(analytic.iter().all(|g| g.abs() > 1e-4), "{analytic:?}");
}

#[derive(Module, Debug)]
struct OneLayer<B: LabBackend> {
    attention: MultiHeadAttention<B>,
}

impl<B: LabBackend> AttentionLayers<B> for OneLayer<B> {
    fn attention_layers(&mut self) -> Vec<(String, &mut MultiHeadAttention<B>)> {
        vec![("layer 0".into(), &mut self.attention)]
    }
}

#[test]
fn a_copied_head_and_a_dead_head_are_worth_what_they_should_be() {
    type A = burn::backend::Autodiff<B>;
    let device = Default::default();
    let mha = seeded_layer::<A>(8);
    // Head 1 is a copy of head 0 (same projections, same W^O rows); head 3 writes nothing.
    let copy_columns = |p: Param<Tensor<A, 2>>| {
        p.map(|w| {
            let head0 = w.clone().slice([0..16, 0..4]);
            w.slice_assign([0..16, 4..8], head0)
        })
    };
    let mut model = OneLayer { attention: mha };
    let a = &mut model.attention;
    a.query.weight = copy_columns(a.query.weight.clone());
    a.key.weight = copy_columns(a.key.weight.clone());
    a.value.weight = copy_columns(a.value.weight.clone());
    for bias in [&mut a.query.bias, &mut a.key.bias, &mut a.value.bias] {
        *bias = bias.take().map(|b| {
            b.map(|b| {
                let head0 = b.clone().narrow(0, 0, 4);
                Tensor::cat(vec![head0.clone(), head0, b.narrow(0, 8, 8)], 0)
            })
        });
    }
    a.output.weight = a.output.weight.clone().map(|w| {
        let head0 = w.clone().slice([0..4, 0..16]);
        w.slice_assign([4..8, 0..16], head0)
            .slice_assign([12..16, 0..16], Tensor::zeros([4, 16], &device))
    });
    let batches: Vec<(Tensor<A, 3>, Tensor<A, 3>)> = (0..3)
        .map(|i| {
            // Fixed inputs: the backend's shared random stream depends on which tests run beside.
            let wave = |phase: f32| {
                let v: Vec<f32> = (0..160)
                    .map(|j| (j as f32 * 0.37 + phase).sin() * 2.0)
                    .collect();
                Tensor::<A, 1>::from_floats(v.as_slice(), &device).reshape([2, 5, 16])
            };
            (wave(i as f32), wave(10.0 + i as f32))
        })
        .collect();
    let causal = AttentionMask::<A>::causal(5, &device);
    let held_out = HeldOut {
        what: "sine waves".into(),
        accuracy: false,
        batches: batches
            .into_iter()
            .map(|(x, y)| -> HeldOutBatch<'_, A, OneLayer<A>> {
                let causal = &causal;
                Box::new(move |m: &OneLayer<A>| {
                    let out = m
                        .attention
                        .forward(x.clone(), x.clone(), Some(causal))
                        .context;
                    let loss = (out - y.clone()).powf_scalar(2.0).mean();
                    // A regression: no logits to score, one "target" per batch.
                    (
                        loss,
                        Tensor::zeros([1, 1], &x.device()),
                        Tensor::zeros([1], &x.device()),
                    )
                })
            })
            .collect(),
    };
    let gradients = gate_gradients(&model, &held_out);
    let (full, heads) = importance(&model, &held_out, &gradients);
    let full = full.loss;
    assert!(full > 0.0);
    assert_eq!(heads.len(), 4);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * (1.0 + a.abs());
    // The copies are worth the same, by either measure, and something.
    assert!(close(heads[0].delta, heads[1].delta), "{heads:?}");
    assert!(close(heads[0].gradient, heads[1].gradient), "{heads:?}");
    assert!(
        heads[0].delta.abs() > 1e-5 && heads[0].gradient > 1e-5,
        "{heads:?}"
    );
    // The dead head is worth nothing.
    assert!(
        heads[3].delta.abs() < 1e-6 && heads[3].gradient < 1e-6,
        "{heads:?}"
    );
    assert!(heads.iter().all(|h| close(h.masked.loss, full + h.delta)));

    // Greedy pruning first takes the head whose removal hurts least (the dead one at no cost,
    // unless dropping a copy even helps), and stops with one head left.
    let curve = prune_greedily(&model, &held_out, 10, |_| {});
    assert_eq!(curve.len(), 4, "three of four heads can go: {curve:?}");
    let least = heads
        .iter()
        .min_by(|a, b| a.masked.loss.total_cmp(&b.masked.loss))
        .unwrap();
    assert_eq!(curve[1].head, Some(("layer 0".to_string(), least.head)));
    assert!(close(curve[1].score.loss, least.masked.loss), "{curve:?}");
    assert!(curve[1].score.loss <= full + 1e-6, "{curve:?}");
    assert_eq!(curve[3].fraction, 0.75);
    // Each point is the loss with exactly the heads removed so far gated off.
    let mut gated = model.clone();
    let removed = removed_by_layer(&curve, 3)["layer 0"].clone();
    let kept = (0..4).find(|h| !removed.contains(h)).unwrap();
    let mut gates = vec![0.0; 4];
    gates[kept] = 1.0;
    gated.attention.set_head_gates(Some(gates));
    assert!(close(held_out.score(&gated).loss, curve[3].score.loss));
    // A fixed order skips what would empty the layer.
    let order: Vec<(String, usize)> = (0..4).map(|h| ("layer 0".to_string(), h)).collect();
    let fixed = prune_in_order(&model, &held_out, &order, 10);
    assert_eq!(fixed.len(), 4);
    assert_eq!(fixed[3].head, Some(("layer 0".to_string(), 2)));
}

#[test]
fn spearman_ranks_with_ties() {
    assert_eq!(spearman(&[1.0, 2.0, 3.0], &[10.0, 20.0, 40.0]), Some(1.0));
    assert_eq!(spearman(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]), Some(-1.0));
    let tied = spearman(&[1.0, 1.0, 2.0], &[1.0, 2.0, 3.0]).unwrap();
    assert!((tied - 1.5 / 3f64.sqrt()).abs() < 1e-12, "{tied}");
    assert_eq!(spearman(&[1.0, 1.0], &[1.0, 2.0]), None);
}
