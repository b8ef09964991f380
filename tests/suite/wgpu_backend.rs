//! The wgpu backend (on a CPU through Mesa's lavapipe in CI) computes what ndarray computes,
//! trains, and runs the real `train` command.

use crate::common;

use burn::backend::{Autodiff, NdArray, Wgpu};
use burn::module::Module;

use common::{batch, overfit, small_lm};
use transformer_lab::artifact::{load_weights, ArtifactRecorder};
use transformer_lab::config::LmConfig;

type Cpu = NdArray<f32>;
type Gpu = Wgpu<f32, i32>;

fn config() -> LmConfig {
    small_lm()
}

#[test]
fn wgpu_logits_equal_ndarray_logits() {
    let cpu = Default::default();
    let gpu = Default::default();
    let model = config().init::<Cpu>(&cpu);
    let expected = model.forward(batch::<Cpu>(&cpu).inputs).logits;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model");
    model
        .save_file(path.clone(), &ArtifactRecorder::default())
        .unwrap();
    let on_gpu = load_weights(config().init::<Gpu>(&gpu), &path, &gpu).unwrap();
    let actual = on_gpu.forward(batch::<Gpu>(&gpu).inputs).logits;
    let a: Vec<f32> = expected.into_data().to_vec().unwrap();
    let b: Vec<f32> = actual.into_data().convert::<f32>().to_vec().unwrap();
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(worst < 1e-4, "wgpu and ndarray logits differ by {worst}");
}

#[test]
fn a_tiny_model_trains_on_wgpu() {
    let (first, last) = overfit::<Autodiff<Gpu>>(&config(), 40, &Default::default());
    assert!(last < first / 4.0, "loss {first} -> {last} on wgpu");
}

#[test]
fn the_train_command_runs_on_wgpu() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("corpus.txt"),
        "to be or not to be, that is the question. ".repeat(40),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("tiny.json"),
        r#"{"model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 16},
            "data": {"text_file": "corpus.txt"},
            "train": {"batch_size": 8, "steps": 40, "steps_per_epoch": 20, "eval_batches": 2, "warmup_steps": 5, "lr": 0.01}}"#,
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_transformer-lab"))
        .args([
            "--backend",
            "wgpu",
            "train",
            "-e",
            "tiny.json",
            "--artifact-dir",
            "art",
        ])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{log}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let valid = common::valid_losses(&log);
    assert_eq!(valid.len(), 2, "{log}");
    assert!(
        valid[1] < 2.5,
        "validation loss after 40 steps on wgpu: {valid:?}"
    );
}

#[test]
fn the_default_backend_is_wgpu_only_on_a_hardware_gpu() {
    use transformer_lab::backend::{cpu_default, default_backend, hardware_gpu_present};
    use transformer_lab::cli::BackendKind;
    // lavapipe (what CI has) is a CPU adapter: wgpu works there but a CPU backend is faster.
    let expected = if hardware_gpu_present() {
        BackendKind::Wgpu
    } else {
        cpu_default()
    };
    assert_eq!(
        cpu_default(),
        BackendKind::Flex,
        "flex is compiled in by default"
    );
    assert_eq!(default_backend(), expected);
    if std::env::var_os("CI_EXPECT_NO_GPU").is_some() {
        assert!(!hardware_gpu_present());
    }
}
