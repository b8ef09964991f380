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
    /// NVIDIA GPU through CUDA (cargo feature `cuda`; needs the NVIDIA driver at run time).
    Cuda,
}

/// The CPU backend.
#[cfg(feature = "ndarray")]
pub type Cpu = burn::backend::NdArray<f32>;

/// burn's newer pure-Rust CPU backend.
#[cfg(feature = "flex")]
pub type Flex = burn::backend::Flex;

/// The GPU backend.
#[cfg(feature = "wgpu-backend")]
pub type Gpu = burn::backend::Wgpu<f32, i32>;

/// The CUDA backend.
#[cfg(feature = "cuda-backend")]
pub type CudaGpu = burn::backend::Cuda<f32, i32>;

/// The backend used when `--backend` is absent: wgpu when it is compiled in and a hardware GPU
/// is present; otherwise the fastest CPU backend compiled in (flex, then ndarray), which on a
/// CPU is several times faster than wgpu running through a software Vulkan driver (lavapipe).
pub fn default_backend() -> BackendKind {
    #[cfg(feature = "wgpu-backend")]
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
#[cfg(feature = "wgpu-backend")]
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

/// Keeps Mesa's Vulkan device-select layer from printing "error: XDG_RUNTIME_DIR is invalid or
/// not set in the environment." on a machine without a desktop session. The layer orders the
/// GPUs by the one the display uses, and to find it connects to a Wayland display as every
/// Vulkan instance starts. Without `XDG_RUNTIME_DIR` that connection fails loudly: one such line
/// per instance, on every command that looks for a GPU, before its own output. With no display
/// there is nothing to order by, and wgpu picks its adapter by type itself, so the layer is
/// switched off for this process (`NODEVICE_SELECT=1`, Mesa's own switch) unless the user set
/// that. Runs at start-up, before any thread.
pub fn quiet_headless_vulkan() {
    if cfg!(all(feature = "wgpu-backend", target_os = "linux"))
        && std::env::var_os("XDG_RUNTIME_DIR").is_none()
        && std::env::var_os("NODEVICE_SELECT").is_none()
    {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
}

/// Whether wgpu finds any adapter (a GPU, or a CPU driver such as lavapipe) to run on.
#[cfg(feature = "wgpu-backend")]
pub fn wgpu_adapter_present() -> bool {
    !wgpu_adapters().is_empty()
}

/// Whether wgpu sees a real (discrete, integrated or virtual) GPU, not just a CPU adapter.
#[cfg(feature = "wgpu-backend")]
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
        BackendKind::Wgpu => cfg!(feature = "wgpu-backend"),
        BackendKind::Cuda => cfg!(feature = "cuda-backend"),
    };
    if !compiled {
        bail!(
            "this binary was built without the {kind:?} backend; rebuild with --features {}",
            format!("{kind:?}").to_lowercase()
        );
    }
    #[cfg(feature = "wgpu-backend")]
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
    if kind == BackendKind::Cuda {
        cuda_driver::check()?;
    }
    Ok(())
}

/// Points cubecl's caches into the user's cache ([`crate::user_cache`]), unless a
/// `cubecl.toml` or a `CUBECL_*` variable already chose: the autotune choices under
/// `gpu-kernels/<device>/` (they depend on burn's kernels, pinned, and cubecl checks each
/// entry's checksum, so they outlive a rebuild), the compiled kernels under
/// `gpu-kernels/<device>/<binary>/` (a rebuild compiles other kernels under the same names;
/// compiled code is for one architecture). Says so on a binary's first GPU run. Left to itself
/// cubecl compiles every kernel again in every process and keeps its autotune choices in the
/// `target/` of whatever Cargo project the working directory lies in (else its own cache
/// directory). On CUDA that first run is long: on an H200 each kernel took 0.7–1.3 s through
/// NVRTC and the driver's PTX compiler, every new matmul shape autotunes ~10 candidates, and the
/// kernel check and a training run's first step each compiled hundreds (minutes).
#[cfg(feature = "cube-kernels")]
pub fn prepare_gpu(kind: BackendKind) {
    use cubecl::config::{cache::CacheConfig, CubeClRuntimeConfig, RuntimeConfig};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The device as a directory name: `NVIDIA_H200_CUDA_driver_13.0`.
        let device = describe_device(kind)
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '.' || c == '-'))
            .filter(|word| !word.is_empty())
            .collect::<Vec<_>>()
            .join("_");
        let device: String = device.chars().take(100).collect();
        let Some(tuned) =
            crate::user_cache::cache_dir().map(|dir| dir.join("gpu-kernels").join(device))
        else {
            return;
        };
        let compiled = tuned.join(crate::user_cache::binary_dir_name());
        let fresh = !compiled.exists();
        // cubecl fails hard on a cache it cannot write: where ours cannot be made, its own.
        if std::fs::create_dir_all(&compiled).is_err() {
            return;
        }
        let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
        let mut ours = false;
        if config.compilation.cache.is_none() {
            config.compilation.cache = Some(CacheConfig::File(compiled.clone()));
            ours = true;
        }
        if matches!(config.autotune.cache, CacheConfig::Target) {
            config.autotune.cache = CacheConfig::File(tuned.clone());
            ours = true;
        }
        {
            // Set only where nothing has read the configuration yet (it is read once).
            let mut state = CubeClRuntimeConfig::storage().lock();
            if state.is_some() {
                return;
            }
            *state = Some(std::sync::Arc::new(config));
        }
        if fresh && ours {
            eprintln!(
                "first {} run of this binary: its kernels are compiled (and on a new device \
                 autotuned; minutes on CUDA); later runs reuse them from {}",
                format!("{kind:?}").to_lowercase(),
                tuned.display()
            );
        }
    });
}

/// The devices `ids` of the backend whose default device is `default`, for data-parallel
/// training: CUDA device `i`; for wgpu the `i`-th adapter of the kind burn picks by default
/// (discrete, else integrated, virtual); on a CPU backend (and wgpu on a CPU adapter) every id
/// is `default`, the one CPU device, each peer a thread of its own (the path works and is
/// tested there, it is not faster). One error line for an id the machine does not have.
pub fn peer_devices<B: burn::tensor::backend::Backend>(
    default: &B::Device,
    ids: &[usize],
) -> Result<Vec<B::Device>> {
    use burn::tensor::backend::Device as _;
    use burn::tensor::backend::DeviceId;
    let name = std::any::type_name::<B::Device>();
    let first = default.to_id();
    let (type_id, available, what) = if name.contains("CudaDevice") {
        (first.type_id, cuda_driver::count()?, "CUDA devices")
    } else if name.contains("WgpuDevice") {
        wgpu_peer_kind()
    } else {
        (first.type_id, usize::MAX, "")
    };
    if available == usize::MAX {
        return Ok(vec![default.clone(); ids.len()]);
    }
    ids.iter()
        .map(|&id| {
            if id >= available {
                bail!(
                    "--devices: there is no device {id}: this machine has {available} {what} \
                     (numbered from 0)"
                );
            }
            Ok(B::Device::from_id(DeviceId::new(type_id, id as u16)))
        })
        .collect()
}

/// The wgpu device kind data-parallel peers use (burn's `DeviceId` type numbers: 0 discrete,
/// 1 integrated, 2 virtual, 3 the CPU adapter, which has no index), how many adapters of it
/// there are, and their name.
fn wgpu_peer_kind() -> (u16, usize, &'static str) {
    #[cfg(feature = "wgpu-backend")]
    {
        let adapters = wgpu_adapters();
        let of = |t: wgpu::DeviceType| {
            adapters
                .iter()
                .filter(|a| a.get_info().device_type == t)
                .count()
        };
        for (id, kind, what) in [
            (0, wgpu::DeviceType::DiscreteGpu, "discrete GPUs"),
            (1, wgpu::DeviceType::IntegratedGpu, "integrated GPUs"),
            (2, wgpu::DeviceType::VirtualGpu, "virtual GPUs"),
        ] {
            if of(kind) > 0 {
                return (id, of(kind), what);
            }
        }
    }
    (3, usize::MAX, "")
}

/// The device `kind` runs on, in words that change with the hardware and its driver: the
/// wgpu adapter burn picks (name, driver), the first CUDA device (name, driver version), or
/// the CPU.
pub fn describe_device(kind: BackendKind) -> String {
    match kind {
        BackendKind::Ndarray | BackendKind::Flex => format!(
            "cpu, {} threads",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        ),
        #[cfg(feature = "wgpu-backend")]
        BackendKind::Wgpu => {
            // burn's default device: the first discrete, then integrated, virtual, CPU adapter.
            let rank = |t: wgpu::DeviceType| match t {
                wgpu::DeviceType::DiscreteGpu => 0,
                wgpu::DeviceType::IntegratedGpu => 1,
                wgpu::DeviceType::VirtualGpu => 2,
                wgpu::DeviceType::Cpu => 3,
                wgpu::DeviceType::Other => 4,
            };
            let adapters = wgpu_adapters();
            match adapters
                .iter()
                .min_by_key(|a| rank(a.get_info().device_type))
            {
                Some(adapter) => {
                    let info = adapter.get_info();
                    format!(
                        "{} ({:?}, driver {} {})",
                        info.name, info.backend, info.driver, info.driver_info
                    )
                }
                None => "no adapter".into(),
            }
        }
        BackendKind::Cuda => cuda_driver::describe(),
        #[allow(unreachable_patterns)]
        _ => format!("{kind:?}"),
    }
}

/// Whether the NVIDIA driver can be used, asked of the driver library itself before burn loads
/// it (burn's CUDA runtime panics where it cannot).
mod cuda_driver {
    use anyhow::{bail, Result};

    /// Fails with one line where no CUDA driver or no CUDA device is found.
    pub fn check() -> Result<()> {
        count().map(|_| ())
    }

    /// How many CUDA devices the driver sees; fails with one line where there is no driver or
    /// no device.
    #[cfg(unix)]
    pub fn count() -> Result<usize> {
        use std::ffi::{c_char, c_int, c_uint, CStr};
        const NAMES: [&CStr; 2] = [c"libcuda.so.1", c"libcuda.so"];
        // SAFETY: dlopen/dlsym with valid C strings; the symbols are called with the
        // signatures the CUDA driver API documents (CUresult cuInit(unsigned int),
        // CUresult cuDeviceGetCount(int*)); the library is never unloaded.
        unsafe {
            let Some(library) = NAMES
                .iter()
                .map(|name| libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL))
                .find(|handle| !handle.is_null())
            else {
                bail!(
                    "--backend cuda: no CUDA driver found (libcuda.so could not be loaded); \
                     install the NVIDIA driver, or use --backend wgpu or a CPU backend"
                );
            };
            let symbol = |name: &CStr| libc::dlsym(library, name.as_ptr() as *const c_char);
            let (init, count) = (symbol(c"cuInit"), symbol(c"cuDeviceGetCount"));
            if init.is_null() || count.is_null() {
                bail!("--backend cuda: the CUDA driver library lacks cuInit/cuDeviceGetCount");
            }
            let init: extern "C" fn(c_uint) -> c_int = std::mem::transmute(init);
            let count: extern "C" fn(*mut c_int) -> c_int = std::mem::transmute(count);
            let status = init(0);
            let mut devices: c_int = 0;
            if status != 0 || count(&mut devices) != 0 || devices == 0 {
                bail!(
                    "--backend cuda: the CUDA driver finds no usable GPU (cuInit returned \
                     {status}, {devices} devices); use --backend wgpu or a CPU backend"
                );
            }
            Ok(devices as usize)
        }
    }

    /// Elsewhere burn's own loader reports a missing driver; the count is not asked.
    #[cfg(not(unix))]
    pub fn count() -> Result<usize> {
        Ok(usize::MAX)
    }

    /// The first CUDA device's name and the driver's version (`cuda` where the driver cannot
    /// be asked).
    #[cfg(unix)]
    pub fn describe() -> String {
        use std::ffi::{c_char, c_int, CStr};
        // SAFETY: as in `check` (which the caller ran first); cuDeviceGetName(char*, int,
        // CUdevice) writes a NUL-terminated name into the buffer of the given length, and
        // cuDriverGetVersion(int*) one integer.
        unsafe {
            let library = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW);
            if library.is_null() {
                return "cuda".into();
            }
            let symbol = |name: &CStr| libc::dlsym(library, name.as_ptr() as *const c_char);
            let (name, version) = (symbol(c"cuDeviceGetName"), symbol(c"cuDriverGetVersion"));
            if name.is_null() || version.is_null() {
                return "cuda".into();
            }
            let name: extern "C" fn(*mut c_char, c_int, c_int) -> c_int = std::mem::transmute(name);
            let version: extern "C" fn(*mut c_int) -> c_int = std::mem::transmute(version);
            let mut buffer = [0 as c_char; 256];
            let mut driver: c_int = 0;
            if name(buffer.as_mut_ptr(), 256, 0) != 0 || version(&mut driver) != 0 {
                return "cuda".into();
            }
            let device = CStr::from_ptr(buffer.as_ptr()).to_string_lossy();
            format!(
                "{device} (CUDA driver {}.{})",
                driver / 1000,
                driver % 1000 / 10
            )
        }
    }

    /// Elsewhere: the backend's name only.
    #[cfg(not(unix))]
    pub fn describe() -> String {
        "cuda".into()
    }
}
