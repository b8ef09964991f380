//! The one place where a backend is chosen: cargo features decide which are compiled in, the
//! `--backend` flag picks among them.

use anyhow::{bail, Result};

/// The compute backends a binary can be built with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// CPU, pure Rust (cargo feature `ndarray`).
    Ndarray,
    /// CPU, pure Rust: burn's newer flex backend (cargo feature `flex`; the CPU default).
    Flex,
    /// GPU through wgpu: Vulkan, Metal or DX12 (cargo feature `wgpu`).
    Wgpu,
}

/// The CPU backend.
#[cfg(feature = "ndarray")]
pub type Cpu = burn::backend::NdArray<f32>;

/// burn's newer pure-Rust CPU backend.
#[cfg(feature = "flex")]
pub type Flex = burn::backend::Flex;

/// The GPU backend.
#[cfg(feature = "wgpu")]
pub type Gpu = burn::backend::Wgpu<f32, i32>;

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

/// The adapters of the graphics API burn's wgpu backend runs on (Metal on macOS, else Vulkan).
#[cfg(feature = "wgpu")]
fn wgpu_adapters() -> Vec<wgpu::Adapter> {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let api = if cfg!(target_os = "macos") {
        wgpu::Backends::METAL
    } else {
        wgpu::Backends::VULKAN
    };
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: api,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    // Enumeration is async in wgpu's API but completes at once on native platforms.
    let mut adapters = std::pin::pin!(instance.enumerate_adapters(api));
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        match adapters.as_mut().poll(&mut cx) {
            Poll::Ready(adapters) => return adapters,
            Poll::Pending => std::thread::yield_now(),
        }
    }
}

/// Whether wgpu finds any adapter (a GPU, or a CPU driver such as lavapipe) to run on.
#[cfg(feature = "wgpu")]
pub fn wgpu_adapter_present() -> bool {
    !wgpu_adapters().is_empty()
}

/// Whether wgpu sees a real (discrete, integrated or virtual) GPU, not just a CPU adapter.
#[cfg(feature = "wgpu")]
pub fn hardware_gpu_present() -> bool {
    wgpu_adapters().iter().any(|adapter| {
        matches!(
            adapter.get_info().device_type,
            wgpu::DeviceType::DiscreteGpu
                | wgpu::DeviceType::IntegratedGpu
                | wgpu::DeviceType::VirtualGpu
        )
    })
}

/// Fails with one line saying why `kind` cannot run: a backend left out of this build, or wgpu
/// without any adapter.
pub fn check_available(kind: BackendKind) -> Result<()> {
    let compiled = match kind {
        BackendKind::Ndarray => cfg!(feature = "ndarray"),
        BackendKind::Flex => cfg!(feature = "flex"),
        BackendKind::Wgpu => cfg!(feature = "wgpu"),
    };
    if !compiled {
        bail!(
            "this binary was built without the {kind:?} backend; rebuild with --features {}",
            format!("{kind:?}").to_lowercase()
        );
    }
    #[cfg(feature = "wgpu")]
    if kind == BackendKind::Wgpu && !wgpu_adapter_present() {
        bail!(
            "--backend wgpu: wgpu finds no {} device (no GPU driver installed); install \
             one (without a GPU, Mesa's lavapipe: apt-get install mesa-vulkan-drivers \
             libvulkan1) or use --backend {}",
            if cfg!(target_os = "macos") {
                "Metal"
            } else {
                "Vulkan"
            },
            format!("{:?}", cpu_default()).to_lowercase()
        );
    }
    Ok(())
}
