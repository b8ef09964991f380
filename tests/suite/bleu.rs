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
