//! BLEU: hand-computed values, the 13a tokenizer, and the brevity penalty.

use transformer_lab::bleu::{corpus_bleu, tokenize_13a};

fn one(hyp: &str, reference: &str) -> f64 {
    corpus_bleu(&[hyp.to_string()], &[vec![reference.to_string()]]).score
}

#[test]
fn a_perfect_match_scores_100_and_no_overlap_scores_0() {
    let s = "the cat sat on the mat .";
    assert!((one(s, s) - 100.0).abs() < 1e-9);
    assert_eq!(
        one("dogs bark loudly at night", "the cat sat on the mat"),
        0.0
    );
    assert_eq!(
        corpus_bleu(&[String::new()], &[vec!["a reference".into()]]).score,
        0.0
    );
}

#[test]
fn hand_computed_precisions_and_brevity_penalty() {
    // hyp: "the cat sat on mat" (5 tokens); ref: "the cat sat on the mat" (6 tokens).
    // 1-grams 5/5, 2-grams 3/4 (the cat, cat sat, sat on), 3-grams 2/3, 4-grams 1/2.
    // BP = exp(1 − 6/5).
    let b = corpus_bleu(
        &["the cat sat on mat".to_string()],
        &[vec!["the cat sat on the mat".to_string()]],
    );
    let expected_bp = (1.0f64 - 6.0 / 5.0).exp();
    let geo = (1.0f64 * 0.75 * (2.0 / 3.0) * 0.5).powf(0.25);
    assert!((b.brevity_penalty - expected_bp).abs() < 1e-12);
    assert!((b.score - 100.0 * expected_bp * geo).abs() < 1e-9, "{b}");
    assert_eq!((b.hypothesis_len, b.reference_len), (5, 6));
    let p = b.precisions;
    assert!((p[0] - 100.0).abs() < 1e-9 && (p[1] - 75.0).abs() < 1e-9);
    // A longer hypothesis is not rewarded: BP = 1, precision falls instead.
    let long = corpus_bleu(
        &["the cat sat on the mat today".to_string()],
        &[vec!["the cat sat on the mat".to_string()]],
    );
    assert_eq!(long.brevity_penalty, 1.0);
}

#[test]
fn clipping_and_several_references() {
    // "the the the the" against "the cat": unigram precision is clipped to 1/4.
    let b = corpus_bleu(&["the the the the".into()], &[vec!["the cat".into()]]);
    assert!((b.precisions[0] - 25.0).abs() < 1e-9);
    // The closest reference length sets the brevity penalty; counts clip against any reference.
    let refs = vec!["a b c d e f g h".to_string(), "a b c d".to_string()];
    let b = corpus_bleu(&["a b c d".into()], &[refs]);
    assert_eq!(b.reference_len, 4);
    assert!((b.score - 100.0).abs() < 1e-9);
}

#[test]
fn corpus_bleu_pools_counts_over_sentences() {
    // Pooled: 1-grams (4+2)/(4+2) … unlike averaging sentence scores.
    let hyps = vec!["a b c d".to_string(), "x y".to_string()];
    let refs = vec![vec!["a b c d".to_string()], vec!["x y".to_string()]];
    assert!((corpus_bleu(&hyps, &refs).score - 100.0).abs() < 1e-9);
}

#[test]
fn tokenize_13a_splits_punctuation_like_mteval() {
    assert_eq!(
        tokenize_13a("Hello, world! It's 3.5 km-long (really)."),
        ["Hello", ",", "world", "!", "It's", "3.5", "km-long", "(", "really", ")", "."]
    );
    assert_eq!(
        tokenize_13a("1,000 and 5-6"),
        ["1,000", "and", "5", "-", "6"]
    );
    assert_eq!(
        tokenize_13a("a &amp; b &quot;c&quot;"),
        ["a", "&", "b", "\"", "c", "\""]
    );
    // 13a leaves apostrophes and word-internal dashes alone.
    assert_eq!(tokenize_13a("C'est l'été."), ["C'est", "l'été", "."]);
}

#[test]
fn a_hand_made_corpus_scores_what_sacrebleu_gives() {
    // Expected values from sacreBLEU 2.6.0, `sacrebleu.corpus_bleu(hyps, [refs1, refs2])`
    // (13a tokenization, exp smoothing): punctuation, quotes, a number, a hyphenated word,
    // a sentence with no 4-gram match, two references per sentence.
    let hyps: Vec<String> = [
        "The cat sat on the mat.",
        "A man is riding a horse, quickly!",
        "Two dogs play in the snow",
        "She said: \"it's 3.5 km-long\".",
        "nothing here matches",
    ]
    .map(String::from)
    .to_vec();
    let refs1 = [
        "The cat is sitting on the mat.",
        "A man rides a horse quickly.",
        "Two dogs are playing in the snow.",
        "She said: \"it is 3.5 km long\".",
        "a completely different sentence",
    ];
    let refs2 = [
        "A cat sat on the mat.",
        "A man is riding a brown horse!",
        "Two dogs play outside in snow",
        "She said it's 3.5 km-long.",
        "nothing matches here at all",
    ];
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    let two: Vec<Vec<String>> = refs1
        .iter()
        .zip(&refs2)
        .map(|(a, b)| vec![a.to_string(), b.to_string()])
        .collect();
    let b = corpus_bleu(&hyps, &two);
    assert!(close(b.score, 54.42009043215425), "{b}");
    let precisions = [
        97.05882352941177,
        72.41379310344827,
        50.0,
        31.57894736842105,
    ];
    assert!(
        b.precisions
            .iter()
            .zip(precisions)
            .all(|(&p, q)| close(p, q)),
        "{b}"
    );
    assert!(close(b.brevity_penalty, 0.9428731438548749), "{b}");
    assert_eq!((b.hypothesis_len, b.reference_len), (34, 36));
    // One reference each: a shorter effective reference length and lower precisions.
    let one: Vec<Vec<String>> = refs1.iter().map(|r| vec![r.to_string()]).collect();
    let b = corpus_bleu(&hyps, &one);
    assert!(close(b.score, 25.38714650246794), "{b}");
    assert!(close(b.brevity_penalty, 0.8890097654027757), "{b}");
    assert_eq!((b.hypothesis_len, b.reference_len), (34, 38));
    // A hypothesis shorter than four tokens has no 4-grams: sacreBLEU scores it 0, with the
    // zero 3-gram count smoothed to 100 / (2 · 1) = 50.
    let b = corpus_bleu(
        &["the the cat".into()],
        &[vec!["the cat sat on the mat".into()]],
    );
    assert_eq!(b.score, 0.0, "{b}");
    assert!(
        close(b.precisions[2], 50.0) && close(b.precisions[1], 50.0),
        "{b}"
    );
    assert!(close(b.brevity_penalty, 0.36787944117144233), "{b}");
}
