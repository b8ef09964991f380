//! The encoder–decoder: causality of the decoder, no leak from source padding, the loss's
//! treatment of padding, greedy vs beam search, and the copy task solved end to end.

use burn::backend::{Autodiff, NdArray};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::prelude::*;
use transformer_lab::artifact::ArtifactDir;
use transformer_lab::config::{ExperimentConfig, Seq2SeqConfig};
use transformer_lab::data::Special;
use transformer_lab::kinds::{load_as, train};
use transformer_lab::models::{Seq2Seq, Seq2SeqBatch};
use transformer_lab::nn::StackConfig;
use transformer_lab::train::TrainRequest;
use transformer_lab::translate::{beam_search, greedy, translate_texts, Hypothesis, SearchConfig};

use crate::common::explicit_weights;

type B = NdArray<f32>;

fn tiny(vocab: usize) -> Seq2SeqConfig {
    Seq2SeqConfig {
        stack: StackConfig {
            d_model: 32,
            n_heads: 4,
            d_ff: 64,
            dropout: 0.0,
            ..Seq2SeqConfig::default().stack
        },
        src_vocab_size: vocab,
        tgt_vocab_size: vocab,
        encoder_layers: 2,
        decoder_layers: 2,
        max_len: 24,
        ..Seq2SeqConfig::default()
    }
}

fn model(seed: u64) -> Seq2Seq<B> {
    let device = Default::default();
    B::seed(&device, seed);
    tiny(20).init(&device)
}

fn ids(rows: &[&[i64]]) -> Tensor<B, 2, Int> {
    ids_on(rows, &Default::default())
}

fn ids_on<Bk: Backend>(rows: &[&[i64]], device: &Bk::Device) -> Tensor<Bk, 2, Int> {
    let n = rows[0].len();
    let flat: Vec<i64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_data(TensorData::new(flat, [rows.len(), n]), device)
}

fn max_abs_diff<Bk: Backend, const D: usize>(a: Tensor<Bk, D>, b: Tensor<Bk, D>) -> f32 {
    (a - b).abs().max().into_scalar().elem()
}

#[test]
fn decoder_positions_cannot_see_future_target_tokens() {
    let m = model(1);
    let memory = m.encode(ids(&[&[5, 6, 7, 8, 2], &[9, 10, 11, 2, 0]]));
    let a = m.decode(&memory, ids(&[&[1, 4, 5, 6, 7, 8], &[1, 9, 9, 9, 9, 9]]));
    let b = m.decode(&memory, ids(&[&[1, 4, 5, 16, 17, 18], &[1, 9, 9, 3, 4, 5]]));
    let prefix = |t: Tensor<B, 3>| t.slice([0..2, 0..3, 0..20]);
    assert!(max_abs_diff(prefix(a.logits.clone()), prefix(b.logits.clone())) < 1e-6);
    // …while a changed future does change the later positions (the test can fail).
    assert!(max_abs_diff(a.logits, b.logits) > 1e-3);
}

#[test]
fn source_padding_cannot_change_the_output() {
    let m = model(2);
    let target = ids(&[&[1, 4, 5, 6]]);
    let short = m.decode(&m.encode(ids(&[&[5, 6, 7, 2]])), target.clone());
    let padded = m.decode(&m.encode(ids(&[&[5, 6, 7, 2, 0, 0, 0]])), target.clone());
    assert!(max_abs_diff(short.logits.clone(), padded.logits) < 1e-5);
    // A real token in place of the padding does change it.
    let longer = m.decode(&m.encode(ids(&[&[5, 6, 7, 2, 9, 9, 9]])), target);
    assert!(max_abs_diff(short.logits, longer.logits) > 1e-4);
}

fn batch(source: &[&[i64]], target_in: &[&[i64]], target_out: &[&[i64]]) -> Seq2SeqBatch<B> {
    Seq2SeqBatch {
        source: ids(source),
        target_in: ids(target_in),
        target_out: ids(target_out),
    }
}

#[test]
fn the_loss_is_cross_entropy_over_real_tokens_only() {
    let m = model(3);
    let plain = batch(&[&[5, 6, 2]], &[&[1, 7, 8]], &[&[7, 8, 2]]);
    let padded = batch(&[&[5, 6, 2]], &[&[1, 7, 8, 0, 0]], &[&[7, 8, 2, 0, 0]]);
    let (loss, logits, targets) = m.loss(&plain, 0.0);
    let (loss_padded, _, _) = m.loss(&padded, 0.0);
    let loss = loss.into_scalar();
    assert!((loss - loss_padded.into_scalar()).abs() < 1e-6);
    // Without padding and smoothing it is burn's cross-entropy.
    let reference = CrossEntropyLossConfig::new()
        .init(&Default::default())
        .forward(logits, targets)
        .into_scalar();
    assert!((loss - reference).abs() < 1e-6);
    // Smoothing ε mixes in the mean negative log-probability over the vocabulary.
    let (smoothed, logits, _) = m.loss(&plain, 0.1);
    let uniform = -burn::tensor::activation::log_softmax(logits, 1)
        .mean()
        .into_scalar();
    assert!((smoothed.into_scalar() - (0.9 * loss + 0.1 * uniform)).abs() < 1e-5);
}

fn search(beam_size: usize) -> SearchConfig {
    SearchConfig {
        beam_size,
        length_penalty: 0.6,
        max_len: 12,
        cached: true,
    }
}

#[test]
fn the_cached_decoder_gives_the_logits_of_the_whole_prefix() {
    let diff = cached_translator_difference::<B>(&Default::default());
    assert!(diff < 1e-5, "cached logits differ by {diff}");
}

/// The largest difference, over two seeds, between a tiny translator's logits decoded from its
/// cache (a 3-token prefill, then one token at a time) and one uncached pass, on `Bk`. The
/// second source sentence is padded, so the cross-attention's key-padding mask counts.
pub(crate) fn cached_translator_difference<Bk: transformer_lab::kernels::LabBackend>(
    device: &Bk::Device,
) -> f32 {
    let ids = |rows: &[&[i64]]| ids_on::<Bk>(rows, device);
    let sources = ids(&[&[5, 6, 7, 8, 2], &[9, 10, 2, 0, 0]]);
    let targets = ids(&[&[1, 5, 9, 12, 4, 7, 7], &[1, 13, 3, 8, 8, 11, 6]]);
    let mut worst = 0.0f32;
    for seed in [4, 5] {
        Bk::seed(device, seed);
        let m: Seq2Seq<Bk> = tiny(20).init(device);
        let memory = m.encode(sources.clone());
        let whole = m.decode(&memory, targets.clone()).logits; // [2, 7, v]
        let mut cache = m.new_cache(&memory);
        let mut rows = vec![m.decode_cached(targets.clone().slice([0..2, 0..3]), &mut cache)];
        for i in 3..7 {
            rows.push(m.decode_cached(targets.clone().slice([0..2, i..i + 1]), &mut cache));
        }
        worst = worst.max(max_abs_diff(Tensor::cat(rows, 1), whole));
    }
    worst
}

/// Four padded source sentences.
fn four_sources() -> Tensor<B, 2, Int> {
    ids(&[
        &[5, 6, 7, 8, 2],
        &[9, 10, 2, 0, 0],
        &[11, 12, 13, 2, 0],
        &[4, 4, 4, 4, 2],
    ])
}

#[test]
fn greedy_and_beam_search_translate_the_same_with_and_without_the_cache() {
    let sources = four_sources();
    for seed in [4, 5, 6] {
        let m = model(seed);
        for k in [1, 4] {
            let decode = |cached| {
                let search = SearchConfig {
                    cached,
                    ..search(k)
                };
                if k == 1 {
                    greedy(&m, sources.clone(), &search)
                } else {
                    beam_search(&m, sources.clone(), &search)
                }
            };
            for (c, r) in decode(true).iter().zip(&decode(false)) {
                assert_eq!(c.tokens, r.tokens, "seed {seed}, beam {k}");
                assert!(
                    (c.score - r.score).abs() < 1e-4,
                    "seed {seed}, beam {k}: {c:?} vs {r:?}"
                );
            }
        }
    }
}

#[test]
fn beam_size_one_is_greedy_and_wider_beams_never_score_lower() {
    let sources = four_sources();
    for seed in [4, 5, 6] {
        let m = model(seed);
        let greedy = greedy(&m, sources.clone(), &search(1));
        let beam1 = beam_search(&m, sources.clone(), &search(1));
        for (g, b) in greedy.iter().zip(&beam1) {
            assert_eq!(g.tokens, b.tokens, "seed {seed}");
            assert!(
                (g.score - b.score).abs() < 1e-4,
                "seed {seed}: {g:?} vs {b:?}"
            );
            assert!(g.tokens.iter().all(|&t| t > Special::Unk.id()), "{g:?}");
        }
        let mut previous = beam1;
        for k in [2, 4, 8] {
            let wider = beam_search(&m, sources.clone(), &search(k));
            for (narrow, wide) in previous.iter().zip(&wider) {
                assert!(
                    wide.score >= narrow.score - 1e-9,
                    "seed {seed}, beam {k}: {} < {}",
                    wide.score,
                    narrow.score
                );
            }
            previous = wider;
        }
    }
}

#[test]
fn the_copy_task_is_solved_exactly_by_greedy_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let config = ExperimentConfig::parse(
        r#"{
          "name": "copy-test", "seed": 7,
          "model": {"kind": "seq2seq", "d_model": 32, "n_heads": 4, "encoder_layers": 2,
                    "decoder_layers": 2, "d_ff": 64, "max_len": 16, "dropout": 0.0},
          "data": {"dataset": "copy", "tokenizer": "bpe", "bpe_vocab_size": 300, "max_tokens": 16,
                   "copy": {"symbols": 6, "min_len": 2, "max_len": 5, "train_pairs": 4000}},
          "train": {"batch_size": 32, "steps": 600, "steps_per_epoch": 300, "eval_batches": 2,
                    "lr": 0.003, "min_lr": 0.0003, "warmup_steps": 40, "beta2": 0.98,
                    "weight_decay": 0.0}
        }"#,
    )
    .unwrap();
    config.validate().unwrap();
    let artifact = ArtifactDir::new(dir.path().join("copy"));
    train::<Autodiff<B>>(
        TrainRequest {
            config: Some(config.clone()),
            artifact: artifact.clone(),
            data_dir: dir.path().to_path_buf(),
            resume: false,
            force: false,
            plain: true,
            precision: None,
            lr: None,
            devices: None,
            nodes: None,
        },
        Default::default(),
    )
    .unwrap();
    let device = Default::default();
    let trained = load_as::<Seq2SeqConfig, B>(&artifact, &device).unwrap();
    let test = transformer_lab::data::translation::copy_task(&config.data.copy, config.seed).test;
    let sources: Vec<String> = test.iter().take(100).map(|t| t.source.clone()).collect();
    let (out, truncated) = translate_texts(
        &trained.model,
        trained.tokenizers(),
        &sources,
        &search(1),
        50,
        config.data.max_tokens,
        &device,
    )
    .unwrap();
    assert!(truncated.is_empty());
    let wrong: Vec<_> = sources.iter().zip(&out).filter(|(s, o)| s != o).collect();
    assert!(
        wrong.is_empty(),
        "{} of 100 copied wrongly: {wrong:?}",
        wrong.len()
    );
    // `eval` scores those exact copies 100 BLEU, greedy and with a beam.
    for beam in ["1", "3"] {
        let out = crate::common::run(
            dir.path(),
            &[
                "eval",
                "--artifact-dir",
                "copy",
                "--limit",
                "100",
                "--beam",
                beam,
            ],
        );
        let printed = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}", crate::common::stderr(&out));
        assert!(
            printed.contains("BLEU = 100.00 100.0/100.0/100.0/100.0"),
            "beam {beam}: {printed}"
        );
    }
}

#[test]
fn special_ids_are_the_first_four() {
    assert_eq!(
        Special::ALL.map(Special::id),
        [0, 1, 2, 3],
        "pad, bos, eos, unk"
    );
}

// ---- Beam search against independent references ----

/// The next-token log-probabilities the search chooses from, after `prefix` (which starts
/// with `<s>`), from a full uncached decode and a host-side log-softmax over the words and
/// `</s>` (`<pad>`, `<s>`, `<unk>` can never come next).
fn next_log_probs(m: &Seq2Seq<B>, source: &[i64], prefix: &[usize]) -> Vec<f64> {
    let memory = m.encode(ids(&[source]));
    let target: Vec<i64> = prefix.iter().map(|&t| t as i64).collect();
    let logits = m.decode(&memory, ids(&[&target])).logits; // [1, t, v]
    let [_, t, v] = logits.dims();
    let last: Vec<f32> = logits
        .slice([0..1, t - 1..t, 0..v])
        .into_data()
        .to_vec()
        .unwrap();
    let allowed = |id: usize| id == Special::Eos.id() || id > Special::Unk.id();
    let max = (0..v)
        .filter(|&i| allowed(i))
        .map(|i| last[i] as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = (0..v)
        .filter(|&i| allowed(i))
        .map(|i| (last[i] as f64 - max).exp())
        .sum();
    (0..v)
        .map(|i| {
            if allowed(i) {
                last[i] as f64 - max - z.ln()
            } else {
                f64::NEG_INFINITY
            }
        })
        .collect()
}

/// GNMT's length penalty, written out.
fn penalty(generated: usize, alpha: f64) -> f64 {
    ((5.0 + generated as f64) / 6.0).powf(alpha)
}

/// Every hypothesis of at most `max_len` generated tokens — words then `</s>`, or `max_len`
/// words cut off — scored; the best `(tokens, score)`.
fn exhaustive_best(
    m: &Seq2Seq<B>,
    source: &[i64],
    max_len: usize,
    alpha: f64,
) -> (Vec<usize>, f64) {
    let words: Vec<usize> = (Special::Unk.id() + 1..m.tgt_vocab_size()).collect();
    let eos = Special::Eos.id();
    let mut best = (Vec::new(), f64::NEG_INFINITY);
    // Depth-first over word prefixes: each prefix ends with `</s>` here, or grows.
    let mut stack = vec![(Vec::<usize>::new(), 0.0f64)];
    while let Some((words_so_far, log_prob)) = stack.pop() {
        let mut prefix = vec![Special::Bos.id()];
        prefix.extend(&words_so_far);
        let next = next_log_probs(m, source, &prefix);
        let n = words_so_far.len();
        let ended = log_prob + next[eos];
        if ended / penalty(n + 1, alpha) > best.1 {
            best = (words_so_far.clone(), ended / penalty(n + 1, alpha));
        }
        for &w in &words {
            let mut longer = words_so_far.clone();
            longer.push(w);
            let lp = log_prob + next[w];
            if n + 1 == max_len {
                // Cut off at the limit without `</s>`.
                if lp / penalty(max_len, alpha) > best.1 {
                    best = (longer, lp / penalty(max_len, alpha));
                }
            } else {
                stack.push((longer, lp));
            }
        }
    }
    best
}

/// Textbook beam search over one sentence, one uncached decode per hypothesis: expand every
/// live hypothesis by every token, best first; `</s>` ends a hypothesis, the first `k` others
/// live on; stop at `max_len`, or once `k` have ended and no live one scores above the worst
/// of them at the current length.
fn reference_beam(
    m: &Seq2Seq<B>,
    source: &[i64],
    k: usize,
    max_len: usize,
    alpha: f64,
) -> (Vec<usize>, f64) {
    let eos = Special::Eos.id();
    let mut live = vec![(vec![Special::Bos.id()], 0.0f64)];
    let mut ended: Vec<(Vec<usize>, f64)> = Vec::new(); // (tokens, score)
    for step in 1..=max_len {
        let mut expansions = Vec::new();
        for (prefix, log_prob) in &live {
            for (token, lp) in next_log_probs(m, source, prefix).into_iter().enumerate() {
                if lp.is_finite() {
                    let mut longer = prefix.clone();
                    longer.push(token);
                    expansions.push((longer, log_prob + lp));
                }
            }
        }
        expansions.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut next = Vec::new();
        for (hyp, log_prob) in expansions {
            if next.len() == k {
                break;
            }
            if *hyp.last().unwrap() == eos {
                ended.push((
                    hyp[1..hyp.len() - 1].to_vec(),
                    log_prob / penalty(step, alpha),
                ));
            } else {
                next.push((hyp, log_prob));
            }
        }
        if step == max_len {
            for (hyp, log_prob) in next.drain(..) {
                ended.push((hyp[1..].to_vec(), log_prob / penalty(step, alpha)));
            }
        }
        live = next;
        let worst = ended.iter().map(|e| e.1).fold(f64::INFINITY, f64::min);
        let best_live = live.iter().map(|l| l.1).fold(f64::NEG_INFINITY, f64::max);
        if live.is_empty() || (ended.len() >= k && best_live / penalty(step, alpha) <= worst) {
            break;
        }
    }
    ended
        .into_iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap()
}

/// Tiny translators whose outputs are short: `words` target words, source sentences of them.
fn tiny_search_cases(words: usize) -> Vec<(Seq2Seq<B>, Vec<Vec<i64>>)> {
    let device = Default::default();
    let first = Special::Unk.id() as i64 + 1;
    let w = |i: i64| first + i % words as i64;
    (0..6)
        .map(|seed| {
            let model = explicit_weights(tiny(4 + words).init(&device), 40 + seed);
            let sources = (0..4)
                .map(|s| {
                    let len = 2 + (s + seed as i64) % 3;
                    let mut ids: Vec<i64> =
                        (0..len).map(|i| w(i * (s + 1) + seed as i64)).collect();
                    ids.push(Special::Eos.id() as i64);
                    ids
                })
                .collect();
            (model, sources)
        })
        .collect()
}

/// Pads source rows into one batch.
fn padded(sources: &[Vec<i64>]) -> Tensor<B, 2, Int> {
    let n = sources.iter().map(Vec::len).max().unwrap();
    let rows: Vec<Vec<i64>> = sources
        .iter()
        .map(|s| {
            let mut row = s.clone();
            row.resize(n, Special::Pad.id() as i64);
            row
        })
        .collect();
    let refs: Vec<&[i64]> = rows.iter().map(Vec::as_slice).collect();
    ids(&refs)
}

/// Beam search of `search` and greedy decoding over the padded batch of `sources`, each
/// sentence's beam result held to `reference(source)`'s `(tokens, score)`; per sentence,
/// `(greedy's hypothesis, the reference's)`.
fn checked_against(
    model: &Seq2Seq<B>,
    sources: &[Vec<i64>],
    search: SearchConfig,
    reference: impl Fn(&[i64]) -> (Vec<usize>, f64),
) -> Vec<(Hypothesis, (Vec<usize>, f64))> {
    let found = beam_search(model, padded(sources), &search);
    let greedy = greedy(
        model,
        padded(sources),
        &SearchConfig {
            beam_size: 1,
            ..search
        },
    );
    sources
        .iter()
        .zip(found)
        .zip(greedy)
        .map(|((source, hyp), g)| {
            let (tokens, score) = reference(source);
            let what = format!(
                "{source:?}, k {}, α {}",
                search.beam_size, search.length_penalty
            );
            assert_eq!(hyp.tokens, tokens, "{what}: {hyp:?} vs {score}");
            assert!(
                (hyp.score - score).abs() < 1e-4,
                "{what}: {hyp:?} vs {score}"
            );
            (g, (tokens, score))
        })
        .collect()
}

#[test]
fn a_beam_as_wide_as_every_prefix_finds_the_exhaustive_optimum() {
    // (target words, max_len): a beam of words^(max_len − 1) keeps every prefix that can still
    // grow at the last step, so nothing is pruned and the search is exact.
    let mut greedy_was_worse = 0;
    for (words, max_len) in [(2usize, 4usize), (3, 3)] {
        let k = words.pow(max_len as u32 - 1);
        for (model, sources) in tiny_search_cases(words) {
            for alpha in [0.0, 1.0] {
                let search = SearchConfig {
                    beam_size: k,
                    length_penalty: alpha,
                    max_len,
                    cached: true,
                };
                let exhaustive = |source: &[i64]| exhaustive_best(&model, source, max_len, alpha);
                for (g, (_, best)) in checked_against(&model, &sources, search, exhaustive) {
                    greedy_was_worse += usize::from(g.score < best - 1e-4);
                }
            }
        }
    }
    // The cases include some where greedy decoding misses the optimum (else a beam search
    // degraded to greedy would pass).
    assert!(
        greedy_was_worse >= 3,
        "greedy missed the optimum only {greedy_was_worse} times"
    );
}

#[test]
fn narrow_beams_match_a_textbook_beam_search() {
    let mut differs_from_greedy = 0;
    for (model, sources) in tiny_search_cases(3) {
        for (k, alpha) in [(2, 0.6), (3, 0.0)] {
            let search = SearchConfig {
                beam_size: k,
                length_penalty: alpha,
                max_len: 6,
                cached: true,
            };
            let textbook = |source: &[i64]| reference_beam(&model, source, k, 6, alpha);
            for (g, (tokens, _)) in checked_against(&model, &sources, search, textbook) {
                differs_from_greedy += usize::from(g.tokens != tokens);
            }
        }
    }
    assert!(
        differs_from_greedy >= 3,
        "beam differed from greedy only {differs_from_greedy} times"
    );
}
