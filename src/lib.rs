//! transformer-lab: build, train, inspect and sample transformer models on any burn backend.
//!
//! The one transformer implementation lives in [`nn`]; [`models`] wraps it into complete models
//! (embedding + stack + head); [`data`] turns real datasets into batches; [`train`] wires a model
//! into burn-train's `Learner`; [`artifact`] keeps a run on disk and loads it back as a
//! `Trained<M>`; [`kinds`] is the one place each model kind is described (how it trains,
//! evaluates and shows its attention) and [`config`] the one list of kinds. [`generate`] samples
//! from a trained language model and [`translate`] decodes a trained translator (greedy or beam
//! search), scored by [`bleu`]; [`classify`] runs the image and text classifiers, [`embed`]
//! reads contextual word vectors, [`inspect`] and [`explain`] show attention, [`curves`] and
//! [`plot`] draw result pictures; [`serve`] puts trained models behind an HTTP API.
//! ARCHITECTURE.md maps the layers.
//!
//! # Shapes
//!
//! Every `forward` documents its tensor shapes with this legend:
//!
//! | letter | meaning |
//! |---|---|
//! | `b` | batch size |
//! | `t` | target / query sequence length |
//! | `s` | source / key sequence length (`s = t` in self-attention) |
//! | `d` | model width, `d_model` |
//! | `h` | number of attention heads, `n_heads` |
//! | `k` | width of one head, `d_head = d_model / n_heads` |
//! | `v` | vocabulary size |
//! | `n` | tokens of an encoder input (patches + classification token, or a padded sentence) |
//! | `c`, `p` | image channels, patch side |
//!
//! Masks are boolean tensors in which **`true` means masked out** (the position may not be
//! attended to), the same polarity as burn's own attention.

pub mod app;
pub mod artifact;
pub mod backend;
pub mod bench;
pub mod bert;
pub mod bleu;
pub mod classify;
pub mod cli;
pub mod config;
pub mod curves;
pub mod data;
pub mod embed;
pub mod explain;
pub mod files;
pub mod generate;
pub mod gpt2;
pub mod hf;
pub mod inspect;
pub mod kernels;
pub mod kinds;
pub mod memory;
pub mod models;
pub mod nn;
pub mod plot;
pub mod serve;
pub mod stdio;
pub mod train;
pub mod translate;
pub mod user_cache;
