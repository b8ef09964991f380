//! The one place where a backend is chosen: cargo features decide which are compiled in, the
//! `--backend` flag picks among them.

use crate::cli::BackendKind;
use crate::kernels::LabBackend;
use anyhow::{bail, Result};

/// The CPU backend.
#[cfg(feature = "ndarray")]
pub type Cpu = burn::backend::NdArray<f32>;

/// burn's newer pure-Rust CPU backend.
#[cfg(feature = "flex")]
pub type Flex = burn::backend::Flex;

/// The GPU backend.
#[cfg(feature = "wgpu")]
pub type Gpu = burn::backend::Wgpu<f32, i32>;

/// Something to run on a backend chosen at run time.
pub trait BackendTask {
    /// Runs on backend `B` with device `device`.
    fn run<B: LabBackend>(self, device: B::Device) -> Result<()>;
}

/// The backend used when `--backend` is absent: wgpu when it is compiled in and a hardware GPU
/// is present; otherwise the fastest CPU backend compiled in (flex, then ndarray), which on a
/// CPU is several times faster than wgpu running through a software Vulkan driver (lavapipe).
pub fn default_backend() -> BackendKind {
    #[cfg(feature = "wgpu")]
    if !(cfg!(feature = "ndarray") || cfg!(feature = "flex")) || hardware_gpu_present() {
        return BackendKind::Wgpu;
    }
    cpu_default()
}

/// The CPU backend used by default: flex when compiled in (measured faster), else ndarray.
pub fn cpu_default() -> BackendKind {
    if cfg!(feature = "flex") {
        BackendKind::Flex
    } else {
        BackendKind::Ndarray
    }
}

/// Whether wgpu sees a real (discrete, integrated or virtual) GPU, not just a CPU adapter.
#[cfg(feature = "wgpu")]
pub fn hardware_gpu_present() -> bool {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::all(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    // Enumeration is async in wgpu's API but completes at once on native platforms.
    let mut adapters = std::pin::pin!(instance.enumerate_adapters(wgpu::Backends::all()));
    let mut cx = Context::from_waker(Waker::noop());
    let adapters = loop {
        match adapters.as_mut().poll(&mut cx) {
            Poll::Ready(adapters) => break adapters,
            Poll::Pending => std::thread::yield_now(),
        }
    };
    adapters.iter().any(|adapter| {
        matches!(
            adapter.get_info().device_type,
            wgpu::DeviceType::DiscreteGpu
                | wgpu::DeviceType::IntegratedGpu
                | wgpu::DeviceType::VirtualGpu
        )
    })
}

/// Runs `task` on the chosen backend.
pub fn dispatch(kind: Option<BackendKind>, task: impl BackendTask) -> Result<()> {
    match kind.unwrap_or_else(default_backend) {
        #[cfg(feature = "ndarray")]
        BackendKind::Ndarray => task.run::<Cpu>(Default::default()),
        #[cfg(feature = "flex")]
        BackendKind::Flex => task.run::<Flex>(Default::default()),
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => task.run::<Gpu>(Default::default()),
        #[allow(unreachable_patterns)]
        other => bail!(
            "this binary was built without the {other:?} backend; rebuild with --features {}",
            format!("{other:?}").to_lowercase()
        ),
    }
}
