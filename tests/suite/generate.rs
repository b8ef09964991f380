//! Sampling: top-k 1 and a tiny top-p are greedy, samples never leave the top-k/top-p set,
//! the same seed gives the same text, and the penalties follow their published formulas.

use burn::backend::NdArray;
use rand::rngs::StdRng;
use rand::SeedableRng;
use transformer_lab::config::LmConfig;
use transformer_lab::generate::{
    check_prompt, generate, Decoding, Penalties, Sampler, Sampling, Seen,
};
use transformer_lab::nn::PositionKind;
use transformer_lab::nn::StackConfig;

type B = NdArray<f32>;

fn logits(seed: u64, n: usize) -> Vec<f32> {
    // A fixed pseudo-random logit vector (a tiny LCG, independent of the code under test).
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) as f32 / (1u64 << 31) as f32) * 8.0 - 4.0
        })
        .collect()
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |best, i| if v[i] > v[best] { i } else { best })
}

#[test]
fn top_k_one_and_tiny_top_p_are_greedy() {
    for seed in 0..20 {
        let l = logits(seed, 50);
        let greedy = Sampling {
            greedy: true,
            ..Sampling::default()
        };
        let top1 = Sampling {
            top_k: Some(1),
            ..Sampling::default()
        };
        let tiny_p = Sampling {
            top_p: Some(1e-9),
            ..Sampling::default()
        };
        let mut rng = StdRng::seed_from_u64(seed);
        for _ in 0..20 {
            assert_eq!(greedy.sample(&l, &mut rng), argmax(&l));
            assert_eq!(top1.sample(&l, &mut rng), argmax(&l));
            assert_eq!(tiny_p.sample(&l, &mut rng), argmax(&l));
        }
    }
}

#[test]
fn samples_stay_inside_the_top_k_set() {
    let l = logits(3, 40);
    let mut sorted = l.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let kth = sorted[4];
    let s = Sampling {
        top_k: Some(5),
        temperature: 2.0,
        ..Sampling::default()
    };
    let mut rng = StdRng::seed_from_u64(1);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..2000 {
        let t = s.sample(&l, &mut rng);
        assert!(l[t] >= kth, "token {t} is outside the top 5");
        seen.insert(t);
    }
    assert_eq!(
        seen.len(),
        5,
        "a flat temperature should reach all 5 candidates"
    );
}

#[test]
fn samples_stay_inside_the_nucleus() {
    let l = logits(9, 30);
    // Independent nucleus: softmax, sort, smallest prefix reaching p.
    let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
    let mut probs: Vec<(usize, f64)> = l
        .iter()
        .map(|&x| (x as f64).exp() / z)
        .enumerate()
        .collect();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1));
    let p = 0.6;
    let mut mass = 0.0;
    let nucleus: Vec<usize> = probs
        .iter()
        .take_while(|(_, q)| {
            let inside = mass < p;
            mass += q;
            inside
        })
        .map(|(i, _)| *i)
        .collect();
    let s = Sampling {
        top_p: Some(p),
        ..Sampling::default()
    };
    let candidates: Vec<usize> = s.candidates(&l).iter().map(|c| c.0).collect();
    assert_eq!(candidates, nucleus);
    let mut rng = StdRng::seed_from_u64(2);
    for _ in 0..2000 {
        assert!(nucleus.contains(&s.sample(&l, &mut rng)));
    }
}

#[test]
fn candidate_probabilities_are_a_distribution() {
    let l = logits(5, 20);
    for s in [
        Sampling::default(),
        Sampling {
            temperature: 0.5,
            top_k: Some(7),
            ..Sampling::default()
        },
        Sampling {
            top_p: Some(0.9),
            top_k: Some(10),
            ..Sampling::default()
        },
    ] {
        let total: f64 = s.candidates(&l).iter().map(|c| c.1).sum();
        assert!((total - 1.0).abs() < 1e-9);
    }
}

#[test]
fn the_same_seed_gives_the_same_text() {
    let device = Default::default();
    let config = LmConfig {
        stack: StackConfig {
            d_model: 16,
            n_heads: 2,
            ..LmConfig::default().stack
        },
        vocab_size: 20,
        n_layers: 1,
        context: 8,
        ..LmConfig::default()
    };
    let model = config.init::<B>(&device);
    let sampling = Sampling::default();
    let run = |seed| {
        generate(
            &model,
            &[1, 2, 3],
            30,
            &sampling,
            seed,
            Decoding::Cached,
            &device,
            |_, _| Ok(()),
        )
        .unwrap()
    };
    let a = run(11);
    assert_eq!(a.len(), 33, "prompt + 30 new tokens, past the context of 8");
    assert_eq!(a, run(11));
    assert_ne!(a, run(12));
    let mut streamed = Vec::new();
    generate(
        &model,
        &[1, 2, 3],
        30,
        &sampling,
        11,
        Decoding::Cached,
        &device,
        |t, _| {
            streamed.push(t);
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(streamed, a[3..]);
}

#[test]
fn prompts_are_checked_against_the_context() {
    assert!(check_prompt(8, 8, PositionKind::Learned).is_ok());
    assert!(check_prompt(9, 8, PositionKind::Learned).is_err());
    assert!(check_prompt(9, 8, PositionKind::Sinusoidal).is_ok());
    assert!(check_prompt(0, 8, PositionKind::Sinusoidal).is_err());
    assert!(Sampling {
        top_p: Some(1.5),
        ..Sampling::default()
    }
    .validate()
    .is_err());
    assert!(Sampling {
        top_k: Some(0),
        ..Sampling::default()
    }
    .validate()
    .is_err());
    assert!(Sampling {
        temperature: -1.0,
        ..Sampling::default()
    }
    .validate()
    .is_err());
}

/// The distribution a sampler must draw from, computed independently: softmax of the logits
/// over the temperature, the `k` most likely kept, then the smallest most-likely-first prefix
/// whose mass reaches `p`, renormalised after each cut. Returns `(token, probability)`.
fn exact_distribution(
    logits: &[f32],
    temperature: f64,
    top_k: Option<usize>,
    top_p: Option<f64>,
) -> Vec<(usize, f64)> {
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| (l as f64 / temperature).exp())
        .collect();
    let mut ranked: Vec<usize> = (0..logits.len()).collect();
    ranked.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]));
    ranked.truncate(top_k.unwrap_or(logits.len()));
    let total: f64 = ranked.iter().map(|&i| weights[i]).sum();
    let mut dist: Vec<(usize, f64)> = ranked.iter().map(|&i| (i, weights[i] / total)).collect();
    if let Some(p) = top_p {
        let mut kept = 0;
        let mut mass = 0.0;
        while mass < p {
            mass += dist[kept].1;
            kept += 1;
        }
        dist.truncate(kept);
        dist.iter_mut().for_each(|d| d.1 /= mass);
    }
    dist
}

/// The chi-square statistic's 99.9% quantile for `df` degrees of freedom (Wilson–Hilferty;
/// within 1% of the tables for df ≥ 2).
fn chi_square_999(df: usize) -> f64 {
    let df = df as f64;
    let z = 3.0902; // the standard normal's 99.9% quantile
    df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3)
}

#[test]
fn temperature_top_k_and_top_p_draw_from_the_exact_distribution() {
    let l = logits(21, 12);
    let settings = [
        (1.0, None, None),
        (0.5, None, None),
        (2.5, None, None),
        (1.0, Some(4), None),
        (0.7, None, Some(0.8)),
        (1.5, Some(6), Some(0.9)),
    ];
    let draws = 40_000;
    for (case, (temperature, top_k, top_p)) in settings.into_iter().enumerate() {
        let expected = exact_distribution(&l, temperature, top_k, top_p);
        let s = Sampling {
            temperature,
            top_k,
            top_p,
            ..Sampling::default()
        };
        // The candidates are that distribution, to rounding.
        let got = s.candidates(&l);
        assert_eq!(got.len(), expected.len(), "case {case}: {got:?}");
        for ((t, p), (u, q)) in got.iter().zip(&expected) {
            assert_eq!(t, u, "case {case}");
            assert!((p - q).abs() < 1e-9, "case {case}: token {t}: {p} vs {q}");
        }
        // And the draws follow it: Pearson's chi-square over the kept tokens (tokens outside
        // them must never appear) below its 99.9% quantile, on a fixed seed.
        let mut counts = vec![0usize; l.len()];
        let mut rng = StdRng::seed_from_u64(100 + case as u64);
        for _ in 0..draws {
            counts[s.sample(&l, &mut rng)] += 1;
        }
        let inside: usize = expected.iter().map(|&(t, _)| counts[t]).sum();
        assert_eq!(inside, draws, "case {case}: a token outside the kept set");
        // Bins of at least 5 expected draws (the test's validity condition): the rarest
        // tokens pool into one bin, merged into the last token's if still too small.
        let mut bins: Vec<(f64, f64)> = Vec::new(); // (observed, expected)
        let mut pool = (0.0, 0.0);
        for &(token, p) in &expected {
            let e = p * draws as f64;
            if e >= 5.0 {
                bins.push((counts[token] as f64, e));
            } else {
                pool = (pool.0 + counts[token] as f64, pool.1 + e);
            }
        }
        if pool.1 >= 5.0 {
            bins.push(pool);
        } else if let Some(last) = bins.last_mut() {
            *last = (last.0 + pool.0, last.1 + pool.1);
        }
        let chi2: f64 = bins.iter().map(|(o, e)| (o - e).powi(2) / e).sum();
        let limit = chi_square_999(bins.len().max(2) - 1);
        assert!(
            chi2 < limit,
            "case {case} (T {temperature}, k {top_k:?}, p {top_p:?}): chi-square {chi2:.1} ≥ {limit:.1}; counts {counts:?}, expected {expected:?}"
        );
    }
}

/// The penalties' formulas, worked by hand on five logits after the prompt `[0, 2]` and the
/// generated tokens `3, 3, 1`.
#[test]
fn penalties_change_the_logits_as_their_formulas_say() {
    let logits = [2.0f32, -1.0, 0.5, 3.0, 1.0];
    let mut seen = Seen::new(&[0, 2]);
    for token in [3, 3, 1] {
        seen.push(token);
    }
    let penalties = Penalties {
        repetition: 2.0,
        frequency: 0.5,
        presence: 0.25,
        bias: vec![(4, -100.0), (2, 1.0)],
    };
    let mut got = logits;
    penalties.apply(&mut got, &seen);
    let want = [
        2.0 / 2.0,                    // in the prompt: divided (positive)
        -2.0 - 0.5 - 0.25,            // generated once: −1 multiplied (negative), then 1·F + P
        0.5 / 2.0 + 1.0,              // in the prompt, biased +1
        3.0 / 2.0 - 2.0 * 0.5 - 0.25, // generated twice
        1.0 - 100.0,                  // never seen, biased −100
    ];
    assert_eq!(got, want);
    // One at a time: the prompt counts for repetition only; frequency counts each draw.
    let only = |p: Penalties| {
        let mut l = logits;
        p.apply(&mut l, &seen);
        l
    };
    let frequency = only(Penalties {
        frequency: 1.0,
        ..Penalties::default()
    });
    assert_eq!(frequency, [2.0, -2.0, 0.5, 1.0, 1.0]);
    let presence = only(Penalties {
        presence: 1.0,
        ..Penalties::default()
    });
    assert_eq!(presence, [2.0, -2.0, 0.5, 2.0, 1.0]);
    let repetition = only(Penalties {
        repetition: 0.5,
        ..Penalties::default()
    });
    assert_eq!(repetition, [4.0, -0.5, 1.0, 6.0, 1.0]);
    assert_eq!(only(Penalties::default()), logits);

    // A sampler draws from the penalised logits and counts what it draws: greedy on
    // [1, -2.75, 1.25, 0.25, -99] takes token 2, which then carries 1·F + P = 0.75 and the
    // prompt's division: 0.5/2 + 1 − 0.75 = 0.5, so token 0 (1.0) comes next.
    let sampling = Sampling {
        greedy: true,
        penalties,
        ..Sampling::default()
    };
    // (The sampler draws 3, 3, 1 first from logits that leave it no choice.)
    let after_331 = |sampling: &Sampling, seed: u64| {
        let mut sampler = Sampler::new(sampling.clone(), seed, &[0, 2]);
        for token in [3, 3, 1] {
            let mut forcing = [0.0f32; 5];
            forcing[token] = 1000.0;
            assert_eq!(sampler.next(&forcing), token);
        }
        sampler
    };
    let mut sampler = after_331(&sampling, 0);
    assert_eq!(sampler.next(&logits), 2);
    assert_eq!(sampler.next(&logits), 0);
    // Temperature and the cuts act on the penalised logits: the kept distribution is the
    // softmax of `want` at that temperature.
    let warm = Sampling {
        temperature: 0.5,
        greedy: false,
        ..sampling
    };
    let expected = exact_distribution(&want, 0.5, None, None);
    let mut counts = [0usize; 5];
    let draws = 20_000;
    for seed in 0..draws {
        counts[after_331(&warm, seed).next(&logits)] += 1;
    }
    for (token, p) in expected {
        let share = counts[token] as f64 / draws as f64;
        assert!(
            (share - p).abs() < 0.015,
            "token {token}: drawn {share}, expected {p}"
        );
    }
}

#[test]
fn penalty_settings_are_checked() {
    for penalties in [
        Penalties {
            repetition: 0.0,
            ..Penalties::default()
        },
        Penalties {
            repetition: f32::NAN,
            ..Penalties::default()
        },
        Penalties {
            frequency: 2.5,
            ..Penalties::default()
        },
        Penalties {
            presence: -3.0,
            ..Penalties::default()
        },
    ] {
        let sampling = Sampling {
            penalties,
            ..Sampling::default()
        };
        assert!(sampling.validate().is_err(), "{sampling:?}");
    }
}

/// `generate` with penalties, through the key–value cache, against a loop written here: the
/// whole sequence's forward pass, the penalties by their formulas over the tokens so far, and
/// the argmax.
#[test]
fn generation_applies_the_penalties_at_every_step() {
    use burn::prelude::*;
    let device = Default::default();
    let config = LmConfig {
        context: 64,
        ..crate::common::small_lm()
    };
    let model = config.init::<B>(&device);
    let prompt = [1usize, 2, 3, 1];
    let (repetition, frequency, presence) = (3.0f32, 0.4f32, 0.3f32);
    let sampling = Sampling {
        greedy: true,
        penalties: Penalties {
            repetition,
            frequency,
            presence,
            bias: vec![(5, -100.0)],
        },
        ..Sampling::default()
    };
    let out = generate(
        &model,
        &prompt,
        40,
        &sampling,
        0,
        Decoding::Cached,
        &device,
        |_, _| Ok(()),
    )
    .unwrap();
    let mut tokens = prompt.to_vec();
    let (mut changed, mut plain_repeats) = (0, 0);
    for _ in 0..40 {
        let t = tokens.len();
        let input = Tensor::<B, 2, Int>::from_data(
            TensorData::new(tokens.iter().map(|&x| x as i64).collect(), [1, t]),
            &device,
        );
        let row: Vec<f32> = (model.forward(input).logits)
            .slice([0..1, t - 1..t])
            .into_data()
            .to_vec()
            .unwrap();
        let mut penalised = row.clone();
        for (id, l) in penalised.iter_mut().enumerate() {
            let generated = tokens[prompt.len()..].iter().filter(|&&x| x == id).count();
            if tokens.contains(&id) {
                *l = if *l > 0.0 {
                    *l / repetition
                } else {
                    *l * repetition
                };
            }
            if generated > 0 {
                *l -= generated as f32 * frequency + presence;
            }
            if id == 5 {
                *l -= 100.0;
            }
        }
        let next = argmax(&penalised);
        changed += usize::from(next != argmax(&row));
        plain_repeats += usize::from(tokens[prompt.len()..].contains(&argmax(&row)));
        tokens.push(next);
    }
    assert_eq!(out, tokens);
    assert!(
        !out[prompt.len()..].contains(&5),
        "a banned token was drawn"
    );
    assert!(
        changed > 0 && plain_repeats > 0,
        "the penalties never mattered"
    );
}
