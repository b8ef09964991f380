//! `bench train`: the training speed of an experiment of any kind on one backend — tokens,
//! target tokens, images or sentences per second over several runs (median, warm-up steps
//! excluded) and where a step's time goes (forward, backward, optimizer).
//!
//! The step is the one `train` runs (the model's loss, `backward`, AdamW with global-norm
//! clipping and decoupled decay) without the Learner around it; batches come from the real
//! training data through the training loader (same draw, same grouping by length) and are built
//! before timing starts, so data loading is not measured. The backend is
//! synchronised after each phase, so on an asynchronous backend (wgpu) each phase is timed whole.

pub mod generate;
pub mod kernels;
pub mod matmul;
pub mod mixers;
pub mod serve;

pub use crate::train::speed::{
    bench_training, draw_batches, median, padding_note, BenchPlan, BenchReport, RunTimes,
};
