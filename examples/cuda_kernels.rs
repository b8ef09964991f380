//! Writes the CUDA C++ of the attention kernels, as the cuda runtime would compile it, into a
//! folder, one `NAME.cu` a kernel: `bench/gpu/registers.sh` runs it and reads their registers
//! and spills from NVIDIA's compiler. Needs a wgpu adapter (lavapipe will do), not a GPU.
//!
//!   cargo run --features wgpu,cuda --example cuda_kernels -- DIR [HEAD_DIM]

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (Some(dir), head_dim) = (args.next(), args.next()) else {
        eprintln!("error: usage: cuda_kernels DIR [HEAD_DIM]");
        return ExitCode::FAILURE;
    };
    let head_dim = match head_dim.as_deref().map_or(Ok(64), str::parse::<usize>) {
        Ok(width) if width > 0 => width,
        _ => {
            eprintln!("error: HEAD_DIM must be a positive whole number");
            return ExitCode::FAILURE;
        }
    };
    let written = transformer_lab::kernels::cube::cuda_source::attention_sources(head_dim)
        .and_then(|sources| {
            std::fs::create_dir_all(&dir).map_err(|e| format!("{dir}: {e}"))?;
            for (name, source) in &sources {
                let path = format!("{dir}/{name}.cu");
                std::fs::write(&path, source).map_err(|e| format!("{path}: {e}"))?;
            }
            Ok(sources.len())
        });
    match written {
        Ok(count) => {
            println!("{count} kernels written to {dir}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
