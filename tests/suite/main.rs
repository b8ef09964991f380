//! The integration tests, linked into one binary (one link of burn instead of one per file).

mod attention;
mod bench;
mod bert;
mod bleu;
mod browser;
mod cache;
mod classifier;
mod cli;
mod cli_classify;
mod clip;
mod common;
mod config;
mod curves;
mod data;
#[cfg(feature = "flex")]
mod flex_backend;
mod generate;
mod gpt2;
#[cfg(all(feature = "wgpu-backend", feature = "flex"))]
mod gpu_kernels;
mod heads;
mod images;
mod inspect;
mod kernel_check;
#[cfg(feature = "flex")]
mod kernels;
mod layers;
mod lm;
mod mask;
mod mixer;
mod mlm;
mod newcomer;
mod old_artifacts;
mod parallel;
mod position;
mod real_data;
mod reliability;
mod seq2seq;
mod serve;
#[path = "../summary/skips.rs"]
mod skips;
mod tokenizer;
mod train;
mod vit;
#[cfg(feature = "wgpu-backend")]
mod wgpu_backend;
