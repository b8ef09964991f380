//! `predict`, `classify` and `embed` through the real binary, on artifacts written here, and
//! one clear error line (never a panic) for each bad input.

use crate::common::{assert_clean_error, classifier_artifact, run, stderr, vit_artifact};

#[test]
fn classify_prints_a_label_and_probability_and_rejects_empty_text() {
    let dir = tempfile::tempdir().unwrap();
    classifier_artifact(dir.path());
    let out = run(
        dir.path(),
        &[
            "classify",
            "--artifact-dir",
            "art",
            "a good movie",
            "a bad movie",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    for line in lines {
        let fields: Vec<&str> = line.split('\t').collect();
        assert!(["negative", "positive"].contains(&fields[0]), "{line}");
        let p: f64 = fields[1].parse().unwrap();
        assert!(
            (0.5..=1.0).contains(&p),
            "the top class of two has p >= 0.5: {line}"
        );
    }
    assert_clean_error(
        &run(
            dir.path(),
            &["classify", "--artifact-dir", "art", "fine", "  "],
        ),
        "empty",
    );
}

#[test]
fn embed_compares_contexts_and_names_sentences_without_the_word() {
    let dir = tempfile::tempdir().unwrap();
    classifier_artifact(dir.path());
    let out = run(
        dir.path(),
        &[
            "embed",
            "--artifact-dir",
            "art",
            "--word",
            "bank",
            "money at the bank",
            "the bank of the river",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let pair = stdout
        .lines()
        .find(|l| l.contains("[1] vs [2]"))
        .expect(&stdout);
    // The static embedding of the same word is the same vector: similarity exactly 1.
    assert!(pair.trim_end().ends_with("(1.000)"), "{pair}");
    let contextual: f64 = pair
        .split(": ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        contextual < 0.9999,
        "context must change the vector: {pair}"
    );
    let out = run(
        dir.path(),
        &[
            "embed",
            "--artifact-dir",
            "art",
            "--word",
            "bank",
            "money at the bank",
            "a good movie",
        ],
    );
    assert_clean_error(&out, "sentence 2");
}

#[test]
fn predict_classifies_an_image_file_and_rejects_a_non_image() {
    let dir = tempfile::tempdir().unwrap();
    vit_artifact(dir.path());
    // A 40×30 black-on-white picture: resized to 28×28 and inverted.
    let picture = image::GrayImage::from_fn(40, 30, |x, y| {
        image::Luma([if (10..30).contains(&x) && (12..16).contains(&y) {
            0
        } else {
            255
        }])
    });
    picture.save(dir.path().join("digit.png")).unwrap();
    let out = run(
        dir.path(),
        &[
            "predict",
            "--artifact-dir",
            "art",
            "digit.png",
            "--top",
            "2",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with("digit.png: ") && stdout.contains("inverted"),
        "{stdout}"
    );
    assert_eq!(stdout.matches('%').count(), 2, "{stdout}");
    std::fs::write(dir.path().join("notes.png"), "not an image").unwrap();
    assert_clean_error(
        &run(
            dir.path(),
            &["predict", "--artifact-dir", "art", "notes.png"],
        ),
        "notes.png",
    );
    assert_clean_error(
        &run(
            dir.path(),
            &["predict", "--artifact-dir", "art", "missing.png"],
        ),
        "missing.png",
    );
}

#[test]
fn commands_for_the_wrong_model_kind_say_what_the_artifact_holds() {
    let dir = tempfile::tempdir().unwrap();
    vit_artifact(dir.path());
    assert_clean_error(
        &run(dir.path(), &["classify", "--artifact-dir", "art", "hello"]),
        "vit",
    );
    assert_clean_error(
        &run(
            dir.path(),
            &[
                "embed",
                "--artifact-dir",
                "art",
                "--word",
                "a",
                "a b",
                "a c",
            ],
        ),
        "vit",
    );
}
