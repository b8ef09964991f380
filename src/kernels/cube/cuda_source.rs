//! The CUDA C++ of the attention kernels as the cuda runtime would compile it, made without a
//! GPU: each kernel's CubeCL definition is built through a wgpu client (which only supplies the
//! device's properties; lavapipe will do) and handed to cubecl's CUDA compiler.
//! `bench/gpu/registers.sh` compiles the result with NVIDIA's NVRTC and `ptxas` for a chosen
//! card, which says what no CPU test can: each kernel's registers, spills and shared memory.

use super::attention::*;
use cubecl::cuda::CudaCompiler;
use cubecl::ir::{ElemType, FloatKind, UIntKind};
use cubecl::prelude::*;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use cubecl::CubeTask;

/// `(name, CUDA C++ source)` of each attention kernel for `f32` heads `kd` wide, causal and
/// without padding (the language model's training step) with and without dropout, the
/// tile kernels at each split of a row among units; the name is the kernel's entry point
/// with what it was made for appended.
pub fn attention_sources(kd: usize) -> Result<Vec<(String, String)>, String> {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let tensor = || TensorCompilationArg { inplace: None };
    let layout = || LayoutCompilationArg {
        heads: (),
        out_batch: (),
        out_head: (),
        out_row: (),
        out_offset: (),
        out_offset_2: (),
        key_lo: (),
        key_hi: (),
        threshold: (),
        drop_scale: (),
    };
    let settings = |units| {
        KernelSettings::default()
            .cube_dim(CubeDim::new_1d(units))
            .address_type(AddressType::U32)
    };
    let f32_type: StorageType = ElemType::Float(FloatKind::F32).into();
    let (causal, has_pad) = (true, false);
    let mut sources = Vec::new();
    for dropout in [false, true] {
        let tag = if dropout { "_dropout" } else { "" };
        for split in [1, 2, 4, 8]
            .into_iter()
            .filter(|split| kd.is_multiple_of(*split))
        {
            let tag = format!("{tag}_split{split}");
            let units = TILE * split as u32;
            let kernel = attention_forward_kernel::AttentionForwardKernel::<WgpuRuntime>::new(
                settings(units),
                client.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                layout(),
                kd,
                causal,
                has_pad,
                dropout,
                split,
                f32_type,
            );
            sources.push(compile(kernel, &tag)?);
            let kernel = attention_backward_queries_kernel::AttentionBackwardQueriesKernel::<
                WgpuRuntime,
            >::new(
                settings(units),
                client.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                layout(),
                kd,
                causal,
                has_pad,
                dropout,
                split,
                f32_type,
            );
            sources.push(compile(kernel, &tag)?);
            let kernel =
                attention_backward_keys_kernel::AttentionBackwardKeysKernel::<WgpuRuntime>::new(
                    settings(units),
                    client.clone(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    layout(),
                    kd,
                    causal,
                    has_pad,
                    dropout,
                    split,
                    f32_type,
                );
            sources.push(compile(kernel, &tag)?);
        }
        if tiles_take(kd) {
            let kernel =
                attention_forward_tiles_kernel::AttentionForwardTilesKernel::<WgpuRuntime>::new(
                    settings(TILES_UNITS),
                    client.clone(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    layout(),
                    kd,
                    causal,
                    has_pad,
                    dropout,
                    f32_type,
                );
            sources.push(compile(kernel, tag)?);
            let kernel =
                attention_backward_queries_tiles_kernel::AttentionBackwardQueriesTilesKernel::<
                    WgpuRuntime,
                >::new(
                    settings(TILES_UNITS),
                    client.clone(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    layout(),
                    kd,
                    causal,
                    has_pad,
                    dropout,
                    f32_type,
                );
            sources.push(compile(kernel, tag)?);
            let kernel = attention_backward_keys_tiles_kernel::AttentionBackwardKeysTilesKernel::<
                WgpuRuntime,
            >::new(
                settings(TILES_UNITS),
                client.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                layout(),
                kd,
                causal,
                has_pad,
                dropout,
                f32_type,
            );
            sources.push(compile(kernel, tag)?);
        }
    }
    let kernel = attention_decode_kernel::AttentionDecodeKernel::<WgpuRuntime>::new(
        settings(DECODE_UNITS),
        client,
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        layout(),
        kd,
        false,
        f32_type,
    );
    sources.push(compile(kernel, "")?);
    Ok(sources)
}

/// `kernel` compiled to CUDA C++ as the cuda runtime compiles it (checked reads and writes,
/// 32-bit indices, fast math), named by its entry point and `tag`.
fn compile<K: CubeKernel>(kernel: K, tag: &str) -> Result<(String, String), String> {
    let mut options = <CudaCompiler as cubecl::Compiler>::CompilationOptions::default();
    options.supports_features.fast_math = true;
    let compiled = KernelTask::<CudaCompiler, K>::new(kernel)
        .compile(
            &mut Default::default(),
            &options,
            ExecutionMode::Checked,
            ElemType::UInt(UIntKind::U32).into(),
        )
        .map_err(|e| format!("{e:?}"))?;
    Ok((compiled.entrypoint_name + tag, compiled.source))
}
