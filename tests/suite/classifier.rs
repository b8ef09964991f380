//! The encoder classifier: padding cannot change a prediction, and contextual word vectors
//! differ by sentence while static ones cannot.

use burn::backend::NdArray;
use burn::prelude::*;
use transformer_lab::config::ClassifierConfig;
use transformer_lab::embed::{cosine, find_word};
use transformer_lab::models::TextClassifier;
use transformer_lab::nn::Pooling;
use transformer_lab::nn::StackConfig;

type B = NdArray<f32>;

fn model(pool: Pooling) -> TextClassifier<B> {
    ClassifierConfig {
        stack: StackConfig {
            d_model: 16,
            n_heads: 2,
            d_ff: 32,
            dropout: 0.0,
            ..ClassifierConfig::default().stack
        },
        vocab_size: 20,
        n_classes: 3,
        n_layers: 2,
        max_len: 12,
        pool,
        ..ClassifierConfig::default()
    }
    .init(&Default::default())
}

fn rows(ids: Vec<i64>, n: usize) -> Tensor<B, 2, Int> {
    let b = ids.len() / n;
    Tensor::from_data(TensorData::new(ids, [b, n]), &Default::default())
}

#[test]
fn padding_cannot_change_a_prediction() {
    for pool in [Pooling::Cls, Pooling::Mean] {
        let model = model(pool);
        // <s> 5 6 7 alone, and padded to 8 beside a longer sentence.
        let alone = model.forward(rows(vec![1, 5, 6, 7], 4)).logits;
        let padded = model
            .forward(rows(
                vec![1, 5, 6, 7, 0, 0, 0, 0, 1, 9, 8, 7, 6, 5, 4, 3],
                8,
            ))
            .logits
            .slice([0..1, 0..3]);
        alone
            .into_data()
            .assert_approx_eq::<f32>(&padded.into_data(), burn::tensor::Tolerance::absolute(1e-5));
        // And the padding tokens' own values do not matter (a pad id is a pad id): what
        // changes the output is a real token in their place.
        let other = model.forward(rows(vec![1, 5, 6, 7, 0, 0, 9, 0], 8)).logits;
        let same = model.forward(rows(vec![1, 5, 6, 7, 0, 0, 0, 0], 8)).logits;
        let diff: f32 = (other - same).abs().max().into_scalar();
        assert!(diff > 1e-5, "a real token must change the output");
    }
}

#[test]
fn find_word_matches_whole_words_ignoring_case() {
    assert_eq!(
        find_word("We sat on the Bank of the river", "bank"),
        Some((14, 18))
    );
    assert_eq!(find_word("the banks were closed", "bank"), None);
    assert_eq!(find_word("bank!", "bank"), Some((0, 4)));
    assert_eq!(find_word("an embankment", "bank"), None);
}

#[test]
fn cosine_similarity_of_known_vectors() {
    assert!((cosine(&[1.0, 0.0], &[1.0, 0.0]) - 1.0).abs() < 1e-12);
    assert!(cosine(&[1.0, 0.0], &[0.0, 2.0]).abs() < 1e-12);
    assert!((cosine(&[1.0, 1.0], &[-1.0, -1.0]) + 1.0).abs() < 1e-12);
}
