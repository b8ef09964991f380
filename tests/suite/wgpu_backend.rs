//! The wgpu backend (on a CPU through Mesa's lavapipe in CI) computes what ndarray computes,
//! trains, and runs the real `train` command.

use crate::common;

use burn::backend::{Autodiff, Wgpu};

use common::{
    cached_logit_difference, logit_difference_from_ndarray, overfit, small_lm, tiny_text_experiment,
};
use transformer_lab::config::LmConfig;

type Gpu = Wgpu<f32, i32>;

fn config() -> LmConfig {
    small_lm()
}

/// Whether wgpu has an adapter to run on. Without one (no GPU and no lavapipe) the test says so
/// and passes, unless `CI_EXPECT_WGPU` is set, as in CI, where that is a failure.
pub(crate) fn wgpu_runs() -> bool {
    if transformer_lab::backend::wgpu_adapter_present() {
        return true;
    }
    assert!(
        std::env::var_os("CI_EXPECT_WGPU").is_none(),
        "CI_EXPECT_WGPU is set but wgpu finds no Vulkan adapter (install mesa-vulkan-drivers)"
    );
    common::skip("wgpu finds no adapter: install mesa-vulkan-drivers and libvulkan1");
    false
}

/// The wgpu device for an in-process test that runs work on it, once the tests before it are
/// done with it (`None`: no adapter, skipped). burn 0.21's fusion server can lose a tensor's
/// handle when several threads drive one device at once (burn issue 4328, "Should have handle
/// for tensor", seen only with enough threads at once), which a test then meets as a failed
/// device call; the program drives a device from one thread, so the tests take turns. From the
/// first turn on, our kernels' outputs are poisoned
/// ([`transformer_lab::kernels::cube::poison_outputs`]).
pub(crate) fn wgpu_turn() -> Option<std::sync::MutexGuard<'static, ()>> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // Our kernels' outputs start as NaN in every in-process GPU test: an element a kernel
    // leaves unwritten (or reads before writing) shows here as it would on CUDA, whose new
    // memory is not zeroed, where wgpu's is.
    transformer_lab::kernels::cube::poison_outputs(true);
    // A test that failed holding it leaves nothing behind that the next one could trip on.
    wgpu_runs().then(|| TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
}

#[test]
fn wgpu_logits_equal_ndarray_logits() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let worst = logit_difference_from_ndarray::<Gpu>(&Default::default());
    assert!(worst < 1e-4, "wgpu and ndarray logits differ by {worst}");
}

#[test]
fn imported_gpt2_computes_transformers_logits_on_wgpu() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let gap = crate::gpt2::imported_logit_gap::<Gpu>(&Default::default());
    assert!(gap < 1e-4, "logits differ from transformers' by {gap}");
}

#[test]
fn cached_decoding_gives_the_uncached_logits_on_wgpu() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let (worst, at) = cached_logit_difference::<Gpu>(&Default::default());
    assert!(
        worst < 1e-5,
        "cached and uncached logits differ by {worst} ({at})"
    );
}

/// A translator's decoding steps on a GPU backend attend to the encoder memory through the
/// attention kernel, its key-padding mask as the kernel's padding: the cached decoder's logits
/// are those of the uncached pass.
#[test]
fn the_translator_s_cached_decoder_gives_the_uncached_logits_on_wgpu() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let diff = crate::seq2seq::cached_translator_difference::<Gpu>(&Default::default());
    assert!(diff < 1e-5, "cached logits differ by {diff}");
}

/// Continuous batching (sequences at different positions, joining and leaving) on a GPU
/// backend, whose decoding steps attend through the attention kernel with each row's columns
/// as its padding: each row's logits are those of its sequence alone.
#[test]
fn a_batch_of_sequences_at_different_positions_gives_each_the_logits_it_has_alone_on_wgpu() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    // One of the models (lavapipe takes minutes for all; ALiBi's bias over the padded columns
    // is checked by the cached-decoding test above, which runs every model).
    let models = ["full Learned norm_first=true"];
    let (worst, compared) =
        crate::cache::rows_logit_difference::<Gpu>(&Default::default(), |name| {
            models.contains(&name)
        });
    assert!(compared > 10, "{compared} rows compared");
    assert!(worst < 1e-4, "{worst}");
}

#[test]
fn a_tiny_model_trains_on_wgpu() {
    let Some(_turn) = wgpu_turn() else {
        return;
    };
    let (first, last) = overfit::<Autodiff<Gpu>>(&config(), 40, &Default::default());
    assert!(last < first / 4.0, "loss {first} -> {last} on wgpu");
}

/// In half precision (f16: lavapipe has 16-bit floats), recorded in the run's config.
#[test]
fn the_train_command_runs_on_wgpu() {
    if !wgpu_runs() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tiny_text_experiment(
        dir.path(),
        r#"{"batch_size": 8, "steps": 80, "steps_per_epoch": 40, "eval_batches": 2, "warmup_steps": 5, "lr": 0.01}"#,
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_transformer-lab"))
        .args([
            "--backend",
            "wgpu",
            "train",
            "-e",
            "tiny.json",
            "--artifact-dir",
            "art",
            "--precision",
            "f16",
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
    // The characters' frequencies alone give 2.38 nats; the text repeats, so a model that
    // reads its context goes far below (measured 1.06 after 80 steps).
    let unigram = common::unigram_entropy(common::TINY_TEXT.chars());
    assert!(
        valid[1] < unigram - 1.0,
        "validation loss on wgpu in f16: {valid:?}, not below the unigram {unigram:.2} − 1"
    );
    let config = std::fs::read_to_string(dir.path().join("art/config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(config["train"]["precision"], "f16", "{config}");
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

/// On a machine without a desktop session (no `XDG_RUNTIME_DIR`), Mesa's device-select layer
/// (installed with lavapipe) printed "error: XDG_RUNTIME_DIR is invalid or not set in the
/// environment." as each Vulkan instance started: ten such lines before `doctor`'s table.
#[test]
fn a_gpu_command_without_a_desktop_session_prints_no_stray_error() {
    if !wgpu_runs() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_transformer-lab"))
        .args(["--backend", "wgpu", "doctor", "--only", "gelu"])
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("NODEVICE_SELECT")
        .env("TRANSFORMER_LAB_CACHE_DIR", dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        !stderr.lines().any(|l| l.starts_with("error")),
        "a stray error line: {stderr}"
    );
}

#[test]
fn without_an_adapter_wgpu_is_one_clear_error() {
    // A Vulkan loader pointed at no driver finds no adapter, on any machine.
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_transformer-lab"))
        .args(["--backend", "wgpu", "explain"])
        .env("VK_ICD_FILENAMES", dir.path().join("none.json"))
        .env("VK_DRIVER_FILES", dir.path().join("none.json"))
        .output()
        .unwrap();
    common::assert_clean_error(&out, "wgpu finds no Vulkan device");
}

#[test]
fn the_gpu_backend_is_fused_exactly_when_the_fusion_feature_is_on() {
    // burn's features reach burn-wgpu only through ours (burn's defaults are off here).
    let name = std::any::type_name::<transformer_lab::backend::Gpu>();
    assert_eq!(name.contains("Fusion<"), cfg!(feature = "fusion"), "{name}");
}

/// `TRANSFORMER_LAB_MATMUL` names one of burn's matmul kernels for every product of the linear
/// layers: the run says so and trains; a name no kernel has is one warning, and autotune
/// chooses — the same losses, to the products' rounding. (That the named kernel makes every
/// product is tested in-process: gpu_a_named_matmul_kernel_makes_every_product_of_a_linear_layer.)
#[test]
fn a_matmul_kernel_named_for_the_products_is_said_and_an_unknown_one_warned_of_on_wgpu() {
    if !wgpu_runs() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tiny_text_experiment(
        dir.path(),
        r#"{"batch_size": 8, "steps": 12, "steps_per_epoch": 12, "eval_batches": 1, "warmup_steps": 3, "lr": 0.01}"#,
    );
    let train = |kernel: &str, art: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_transformer-lab"))
            .args(["--backend", "wgpu", "train", "-e", "tiny.json"])
            .args(["--artifact-dir", art])
            .env(transformer_lab::kernels::MATMUL_ENV, kernel)
            .current_dir(dir.path())
            .output()
            .unwrap();
        let (log, err) = (
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        );
        assert!(out.status.success(), "{log}\n{err}");
        let valid = common::valid_losses(&log);
        assert_eq!(valid.len(), 1, "{log}");
        (valid[0], err)
    };
    let (named, err) = train("matmul_double_unit_min_tile_size", "named");
    assert!(
        err.contains("products by matmul_double_unit_min_tile_size"),
        "{err}"
    );
    let (unknown, err) = train("no_such_kernel", "unknown");
    let warnings: Vec<_> = err.lines().filter(|l| l.starts_with("warning:")).collect();
    assert!(
        warnings.len() == 1 && warnings[0].contains("no_such_kernel names no matmul kernel"),
        "{err}"
    );
    assert!(
        ((named - unknown) / unknown).abs() < 1e-3,
        "validation loss {named} with the named kernel, {unknown} as autotuned"
    );
}
