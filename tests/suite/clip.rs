//! CLIP: the symmetric InfoNCE loss against hand-computed values and its symmetry, the clamped
//! temperature, pooling at the end-of-text token, the class captions (held-out ones never in
//! training), retrieval recall and PCA, and a tiny model trained end to end on a caption file
//! of synthetic images that then classifies new images with `zero-shot`.

use crate::common::{assert_clean_error, run, stderr};
use burn::backend::NdArray;
use burn::module::Param;
use burn::prelude::*;
use std::path::Path;
use transformer_lab::config::ClipConfig;
use transformer_lab::data::ClassCaptions;
use transformer_lab::kinds::{pca_2d, recall_at};
use transformer_lab::models::{info_nce, l2_normalize};
use transformer_lab::nn::{pool, Pooling};

type B = NdArray<f32>;

fn matrix(rows: &[&[f32]]) -> Tensor<B, 2> {
    let n = rows.len();
    let values: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_data(
        TensorData::new(values, [n, rows[0].len()]),
        &Default::default(),
    )
}

fn scalar(t: Tensor<B, 1>) -> f32 {
    t.into_data().to_vec::<f32>().unwrap()[0]
}

#[test]
fn info_nce_matches_hand_computed_values() {
    // 2×2: rows (image → text) ln(1+e⁻²) and ln(1+e²)−... written out:
    // rows: −2 + ln(e²+1), −3 + ln(e+e³); columns: −2 + ln(e²+e), −3 + ln(1+e³).
    let two = matrix(&[&[2.0, 0.0], &[1.0, 3.0]]);
    let e = std::f64::consts::E;
    let rows = (-2.0 + (e.powi(2) + 1.0).ln()) + (-3.0 + (e + e.powi(3)).ln());
    let cols = (-2.0 + (e.powi(2) + e).ln()) + (-3.0 + (1.0 + e.powi(3)).ln());
    let expected = (rows / 2.0 + cols / 2.0) / 2.0;
    assert!((expected - 0.153_926_265_294_477_5).abs() < 1e-12);
    assert!((f64::from(scalar(info_nce(two))) - expected).abs() < 1e-6);
    // 3×3, computed independently (Python, float64).
    let three = matrix(&[&[1.0, 0.5, -1.0], &[0.0, 2.0, 1.0], &[3.0, -2.0, 0.5]]);
    assert!((scalar(info_nce(three)) - 1.164_789_9).abs() < 1e-5);
}

#[test]
fn info_nce_is_symmetric_in_images_and_texts_and_small_when_pairs_match() {
    let l = matrix(&[
        &[0.3, -1.2, 2.0, 0.1],
        &[1.5, 0.2, -0.7, 0.9],
        &[-0.4, 0.8, 0.6, -2.1],
        &[2.2, -0.3, 0.0, 1.1],
    ]);
    let (a, b) = (scalar(info_nce(l.clone())), scalar(info_nce(l.transpose())));
    assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    let aligned = Tensor::<B, 2>::eye(4, &Default::default()) * 20.0;
    assert!(scalar(info_nce(aligned)) < 1e-6);
    let uniform = Tensor::<B, 2>::zeros([4, 4], &Default::default());
    assert!((scalar(info_nce(uniform)) - 4f32.ln()).abs() < 1e-6);
}

fn tiny() -> ClipConfig {
    let mut config: ClipConfig = serde_json::from_str(
        r#"{"embed_dim": 8,
            "image": {"image_size": 8, "patch_size": 4, "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32},
            "text": {"vocab_size": 20, "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32, "max_len": 8}}"#,
    )
    .unwrap();
    config.validate().unwrap();
    config.text.vocab_size = 20;
    config
}

#[test]
fn the_temperature_starts_at_its_setting_and_the_scale_is_clamped_at_100() {
    let device = Default::default();
    let mut model = tiny().init::<B>(&device);
    assert!((scalar(model.scale()) - 1.0 / 0.07).abs() < 1e-3);
    model.logit_scale = Param::from_tensor(Tensor::from_floats([1000f32.ln()], &device));
    assert!((scalar(model.scale()) - 100.0).abs() < 1e-4);
    // The scale multiplies the cosine similarities: identical pairs give exactly the scale.
    let images = Tensor::<B, 4>::ones([2, 1, 8, 8], &device);
    let tokens =
        Tensor::<B, 2, Int>::from_data(TensorData::new(vec![1i64, 5, 2, 1, 5, 2], [2, 3]), &device);
    let logits = model.forward(images, tokens).logits; // [2, 2]
    let values = logits.into_data().to_vec::<f32>().unwrap();
    assert!(values.iter().all(|v| v.abs() <= 100.0 + 1e-3), "{values:?}");
    assert!((values[0] - values[3]).abs() < 1e-4);
}

#[test]
fn embeddings_are_unit_length_and_last_pooling_reads_the_last_real_token() {
    let x = matrix(&[&[3.0, 4.0], &[-1.0, 0.0]]);
    let unit = l2_normalize(x).into_data().to_vec::<f32>().unwrap();
    assert!(
        (unit[0] - 0.6).abs() < 1e-6
            && (unit[1] - 0.8).abs() < 1e-6
            && (unit[2] + 1.0).abs() < 1e-6
    );
    let device = Default::default();
    let states = Tensor::<B, 3>::from_data(
        TensorData::new((0..12).map(|v| v as f32).collect::<Vec<_>>(), [2, 3, 2]),
        &device,
    );
    // Row 0 has two real tokens, row 1 three.
    let padding = Tensor::<B, 2, Bool>::from_data(
        TensorData::new(vec![false, false, true, false, false, false], [2, 3]),
        &device,
    );
    let pooled = pool(states, Pooling::Last, Some(padding))
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(pooled, vec![2.0, 3.0, 10.0, 11.0]);
}

#[test]
fn held_out_captions_never_appear_in_training_and_read_naturally() {
    let captions = ClassCaptions::of(&["mnist", "fashion-mnist"]).unwrap();
    assert_eq!(captions.names.len(), 20);
    assert_eq!(captions.datasets[1].1, 10..20);
    let train: std::collections::HashSet<&String> = captions.train.iter().flatten().collect();
    for (class, held) in captions.held_out.iter().enumerate() {
        assert!(held.len() >= 4, "class {class}: {held:?}");
        assert!(captions.train[class].len() >= 10);
        for caption in held {
            assert!(
                !train.contains(caption),
                "{caption:?} is also a training caption"
            );
        }
    }
    let all: Vec<&String> = captions
        .train
        .iter()
        .chain(&captions.held_out)
        .flatten()
        .collect();
    assert!(all.iter().any(|c| c.as_str() == "an ankle boot for sale"));
    assert!(all
        .iter()
        .any(|c| c.as_str() == "the number 7 written by hand"));
    assert!(!all
        .iter()
        .any(|c| c.contains(" a ankle") || c.contains("{}")));
    assert!(ClassCaptions::of(&["sst2"]).is_err());
}

#[test]
fn recall_counts_a_hit_when_the_top_k_holds_the_querys_group() {
    // Three pairs in 2-D: image 0 is nearest text 1 (another group), images 1 and 2 their own.
    let images = [1.0, 0.0, 0.0, 1.0, -1.0, 0.0];
    let texts = [0.6, -0.8, 0.8, 0.6, -1.0, 0.0];
    let [(i1, i5), (t1, t5)] = recall_at(&images, &texts, &[0, 1, 2], 2);
    assert!((i1 - 2.0 / 3.0).abs() < 1e-9, "{i1}");
    assert_eq!((i5, t5), (1.0, 1.0));
    // Text 1 is nearest image 0 (another group).
    assert!((t1 - 2.0 / 3.0).abs() < 1e-9, "{t1}");
    // A hit is any item of the group: image 0 retrieving text 1 of its own group counts.
    let [(i1, _), _] = recall_at(&images, &texts, &[0, 0, 2], 2);
    assert_eq!(i1, 1.0);
}

#[test]
fn pca_finds_the_plane_the_points_lie_in() {
    // Points on the plane spanned by (1,1,0,0)/√2 and (0,0,1,-1)/√2, spread 3:1.
    let rows: Vec<Vec<f32>> = (0..40)
        .map(|i| {
            let (a, b) = (
                ((i * 7) % 13) as f32 - 6.0,
                ((i * 5) % 11) as f32 / 3.0 - 1.5,
            );
            vec![a, a, b, -b]
        })
        .collect();
    let projected = pca_2d(&rows);
    let total: f64 = rows
        .iter()
        .map(|r| {
            let mean = |k: usize| rows.iter().map(|r| f64::from(r[k])).sum::<f64>() / 40.0;
            (0..4)
                .map(|k| (f64::from(r[k]) - mean(k)).powi(2))
                .sum::<f64>()
        })
        .sum();
    let kept: f64 = projected.iter().map(|(x, y)| x * x + y * y).sum();
    assert!((kept - total).abs() < 1e-6 * total, "{kept} of {total}");
    let first: f64 = projected.iter().map(|(x, _)| x * x).sum();
    assert!(first > 0.5 * total);
}

/// A 8×8 grey PNG with a bright bar: `kind` 0 top row, 1 bottom row, 2 left column, 3 right
/// column (rows/columns 1 and 6 at `shift`), faint noise elsewhere.
fn bar_png(path: &Path, kind: usize, variant: usize) {
    let mut image = image::GrayImage::new(8, 8);
    let line = if variant.is_multiple_of(2) {
        [0, 1]
    } else {
        [1, 2]
    };
    for (x, y, p) in image.enumerate_pixels_mut() {
        let (x, y) = (x as usize, y as usize);
        let on = match kind {
            0 => line.contains(&y),
            1 => line.contains(&(7 - y)),
            2 => line.contains(&x),
            _ => line.contains(&(7 - x)),
        };
        let noise = ((x * 31 + y * 17 + variant * 13) % 23) as u8;
        *p = image::Luma([if on { 230 - noise } else { noise }]);
    }
    image.save(path).unwrap();
}

const BARS: [[&str; 2]; 4] = [
    ["a bar at the top", "a line along the top"],
    ["a bar at the bottom", "a line along the bottom"],
    ["a bar on the left", "a line down the left"],
    ["a bar on the right", "a line down the right"],
];

#[test]
fn a_tiny_clip_trained_on_a_caption_file_classifies_new_images_zero_shot() {
    let dir = tempfile::tempdir().unwrap();
    let pairs = dir.path().join("pairs");
    std::fs::create_dir(&pairs).unwrap();
    let mut lines = String::from("# image\tcaption\n");
    for variant in 0..12 {
        for (kind, captions) in BARS.iter().enumerate() {
            let name = format!("{kind}-{variant}.png");
            bar_png(&pairs.join(&name), kind, variant);
            // Both wordings go with both bar positions (the parity of the variant): what the
            // zero-shot check below asks of new images was seen in training.
            lines += &format!("{name}\t{}\n", captions[(variant / 2) % 2]);
        }
    }
    std::fs::write(pairs.join("captions.tsv"), lines).unwrap();
    let config = r#"{"name": "bars", "seed": 7,
        "model": {"kind": "clip", "embed_dim": 16,
          "image": {"image_size": 8, "patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64},
          "text": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_len": 12}},
        "data": {"captions_file": "pairs/captions.tsv", "tokenizer": "bpe", "bpe_vocab_size": 300,
                 "max_tokens": 12, "valid_fraction": 0.1, "test_fraction": 0.1},
        "train": {"batch_size": 16, "steps": 300, "steps_per_epoch": 100, "eval_batches": 2,
                  "lr": 0.003, "min_lr": 0.0003, "warmup_steps": 10, "num_workers": 1}}"#;
    std::fs::write(dir.path().join("bars.json"), config).unwrap();
    let out = run(
        dir.path(),
        &["train", "-e", "bars.json", "--artifact-dir", "art"],
    );
    assert!(out.status.success(), "{}", stderr(&out));

    // New images (variants never trained on), labels worded as in training or not at all.
    for kind in 0..4 {
        bar_png(&dir.path().join(format!("new-{kind}.png")), kind, 20 + kind);
    }
    let labels = "a bar at the top,a bar at the bottom,a bar on the left,a bar on the right";
    let images: Vec<String> = (0..4).map(|k| format!("new-{k}.png")).collect();
    let mut args = vec!["zero-shot", "--artifact-dir", "art", "--labels", labels];
    args.extend(images.iter().map(String::as_str));
    let out = run(dir.path(), &args);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    // Each image's block lists the labels most likely first.
    let blocks: Vec<&str> = text.split("new-").skip(1).collect();
    assert_eq!(blocks.len(), 4, "{text}");
    for (kind, block) in blocks.iter().enumerate() {
        let first = block.lines().nth(1).unwrap_or_default();
        assert!(first.contains(BARS[kind][0]), "image {kind}: {block}");
        let share: f64 = first
            .trim()
            .rsplit(' ')
            .next()
            .unwrap()
            .trim_end_matches('%')
            .trim()
            .parse()
            .unwrap();
        assert!(share > 50.0, "image {kind}: {block}");
    }

    // eval: retrieval on the held-out pairs, and the pictures.
    let out = run(dir.path(), &["eval", "--artifact-dir", "art"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains("retrieval over") && text.contains("own pair"),
        "{text}"
    );
    assert!(dir.path().join("art/similarity.png").is_file());
    assert!(dir.path().join("art/embeddings.png").is_file());

    // attention and embed reach both encoders.
    let out = run(
        dir.path(),
        &["attention", "--artifact-dir", "art", "new-0.png"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let out = run(
        dir.path(),
        &["attention", "--artifact-dir", "art", "a bar at the top"],
    );
    assert!(out.status.success(), "{}", stderr(&out));

    // Bad requests: one error line each.
    let out = run(
        dir.path(),
        &[
            "zero-shot",
            "--artifact-dir",
            "art",
            "--labels",
            "a bar,",
            "new-0.png",
        ],
    );
    assert_clean_error(&out, "empty label");
    std::fs::write(dir.path().join("notes.png"), "not an image").unwrap();
    let out = run(
        dir.path(),
        &[
            "zero-shot",
            "--artifact-dir",
            "art",
            "--labels",
            "a,b",
            "notes.png",
        ],
    );
    assert_clean_error(&out, "not a readable PNG or JPEG");
    std::fs::write(pairs.join("bad.tsv"), "0-0.png a bar with no tab\n").unwrap();
    let bad = config.replace("pairs/captions.tsv", "pairs/bad.tsv");
    std::fs::write(dir.path().join("bad.json"), bad).unwrap();
    let out = run(
        dir.path(),
        &["train", "-e", "bad.json", "--artifact-dir", "bad"],
    );
    assert_clean_error(&out, "bad.tsv:1: expected an image path, a tab");
}

#[test]
fn each_tower_is_its_own_models_config_and_keeps_its_own_pruned_heads_old_layouts_included() {
    // The layout older builds wrote: both towers' pruned heads in the image tower's list, by the
    // whole model's layer names.
    let old: ClipConfig = serde_json::from_str(
        r#"{"embed_dim": 8,
            "image": {"image_size": 8, "patch_size": 4, "d_model": 16, "n_layers": 1, "n_heads": 2,
                      "d_ff": 32, "pruned_heads": {"image layer 0": [1], "text layer 0": [0]}},
            "text": {"vocab_size": 20, "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32,
                     "max_len": 8}}"#,
    )
    .unwrap();
    old.validate().unwrap();
    let own = |layer: &str, heads: Vec<usize>| {
        std::collections::BTreeMap::from([(layer.to_string(), heads)])
    };
    assert_eq!(old.image.stack.pruned_heads, own("layer 0", vec![1]));
    assert_eq!(old.text.stack.pruned_heads, own("layer 0", vec![0]));
    let whole = old.pruned_heads();
    let mut expected = own("image layer 0", vec![1]);
    expected.extend(own("text layer 0", vec![0]));
    assert_eq!(whole, expected);
    // The model built from it has lost exactly those heads.
    let mut model = old.init::<B>(&Default::default());
    transformer_lab::nn::remove_heads(&mut model, &whole).unwrap();
    assert_eq!(transformer_lab::nn::pruned_heads(&mut model), whole);

    // Written per tower, without the projection's width, and read back the same.
    let text = serde_json::to_string(&old).unwrap();
    assert!(
        !text.contains("n_classes") && !text.contains("text layer"),
        "{text}"
    );
    let again: ClipConfig = serde_json::from_str(&text).unwrap();
    assert_eq!(again, old);
    assert_eq!((again.image.n_classes, again.text.n_classes), (8, 8));

    // A tower's omitted fields take the tower's defaults, not its model's.
    let bare: ClipConfig = serde_json::from_str(r#"{"embed_dim": 8}"#).unwrap();
    assert_eq!(bare.text.pool, transformer_lab::nn::Pooling::Last);
    assert_eq!((bare.image.patch_size, bare.text.max_len), (7, 24));
    assert_eq!(
        (bare.image.stack.dropout, bare.text.stack.dropout),
        (0.0, 0.0)
    );
    // And what a tower does not have is refused.
    let err = serde_json::from_str::<ClipConfig>(r#"{"image": {"n_classes": 10}}"#).unwrap_err();
    assert!(
        err.to_string().contains("`n_classes` is not a tower's"),
        "{err}"
    );
}
