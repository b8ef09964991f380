//! transformer-lab: parse, pick the backend, dispatch.

use clap::Parser;
use std::process::ExitCode;
use transformer_lab::app::run;
use transformer_lab::cli::Cli;
use transformer_lab::memory::CountingAlloc;

/// Counts heap bytes so `bench mixers` can report peak memory (forwards to the system
/// allocator).
#[global_allocator]
static ALLOCATOR: CountingAlloc = CountingAlloc;

fn main() -> ExitCode {
    // Before any thread starts: it sets an environment variable.
    transformer_lab::backend::quiet_headless_vulkan();
    // clap prints --help and usage errors itself (ignoring a closed pipe) and exits.
    let cli = Cli::parse();
    transformer_lab::memory::keep_freed_memory();
    // Commands run on a thread of rayon's pool (`kernels::cpu::in_pool`): give its threads
    // the stack a main thread has (8 MiB; spawned threads get 2 MiB).
    let _ = rayon::ThreadPoolBuilder::new()
        .stack_size(8 << 20)
        .build_global();
    // A closed stdout or stderr (`train | head -1`) must not stop the work: see `stdio`.
    let stdio = transformer_lab::stdio::guard();
    let code = match run(cli.compute, cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => match err.downcast_ref::<transformer_lab::train::stop::Stopped>() {
            Some(stopped) => {
                eprintln!("{stopped}");
                ExitCode::from(transformer_lab::train::stop::STOPPED_STATUS)
            }
            None => {
                eprintln!("error: {err:#}");
                ExitCode::FAILURE
            }
        },
    };
    drop(stdio);
    code
}
