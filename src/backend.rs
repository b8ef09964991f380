//! The one place where a backend is chosen: cargo features decide which are compiled in, the
//! `--backend` flag picks among them.

use crate::cli::BackendKind;
use anyhow::{bail, Result};

/// The CPU backend.
#[cfg(feature = "ndarray")]
pub type Cpu = burn::backend::NdArray<f32>;

/// The GPU backend.
#[cfg(feature = "wgpu")]
pub type Gpu = burn::backend::Wgpu<f32, i32>;

/// Something to run on a backend chosen at run time.
pub trait BackendTask {
    /// Runs on backend `B` with device `device`.
    fn run<B: burn::tensor::backend::Backend>(self, device: B::Device) -> Result<()>;
}

/// The backend used when `--backend` is absent: the GPU one when compiled in.
pub fn default_backend() -> BackendKind {
    if cfg!(feature = "wgpu") {
        BackendKind::Wgpu
    } else {
        BackendKind::Ndarray
    }
}

/// Runs `task` on the chosen backend.
pub fn dispatch(kind: Option<BackendKind>, task: impl BackendTask) -> Result<()> {
    match kind.unwrap_or_else(default_backend) {
        #[cfg(feature = "ndarray")]
        BackendKind::Ndarray => task.run::<Cpu>(Default::default()),
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => task.run::<Gpu>(Default::default()),
        #[allow(unreachable_patterns)]
        other => bail!(
            "this binary was built without the {other:?} backend; rebuild with --features {}",
            format!("{other:?}").to_lowercase()
        ),
    }
}
