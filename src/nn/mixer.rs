//! The token mixer: how a block lets positions exchange information. One config switch,
//! `"mixer": {"kind": …}`, chooses it for every self-attention layer of a model.
//!
//! | kind | computes | cost in `t` | serves |
//! |---|---|---|---|
//! | `full` | softmax attention over every visible key | `O(t²)` | all |
//! | `local` | softmax attention over a sliding window of `window` keys | `O(t·w)` | all |
//! | `strided` | softmax attention, own block of `stride` + one summary key per block | `O(t·l + t²/l)` | all |
//! | `linear` | kernelized attention `φ(Q)(φ(K)ᵀV)`, φ = elu + 1 | `O(t)` | all |
//! | `hyena` | implicit long convolutions and gating, no attention | `O(t log t)` | causal only |
//!
//! Cross-attention (a translator's decoder reading the encoder) stays full softmax attention
//! whatever the mixer: queries and keys there are different sequences, which the sparse patterns
//! (defined on positions of one sequence) and Hyena (a convolution along one sequence) do not
//! describe.

use super::hyena::HyenaConfig;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Which token mixer the self-attention sublayers use; see the module docs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Mixer {
    /// Softmax attention over every visible key ("Attention Is All You Need").
    #[default]
    Full,
    /// Sliding-window attention: the `window` most recent keys (causal) or keys within
    /// `window − 1` positions either side (not causal).
    Local {
        /// Keys each query sees on one side, itself included.
        window: usize,
    },
    /// The fixed block-sparse pattern of Child et al. (2019): each query sees its own block of
    /// `stride` positions and the last position of every other (causal: earlier) block.
    Strided {
        /// Block length `l`; √t balances the two parts.
        stride: usize,
    },
    /// Kernelized linear attention (Katharopoulos et al. 2020).
    Linear {
        /// Causal form: positions per chunk of the chunked prefix sums.
        #[serde(default = "default_chunk")]
        chunk: usize,
    },
    /// The Hyena operator (Poli et al. 2023).
    Hyena(HyenaConfig),
}

fn default_chunk() -> usize {
    64
}

impl Mixer {
    /// The name written in configs: `full`, `local`, `strided`, `linear` or `hyena`.
    pub fn name(&self) -> &'static str {
        match self {
            Mixer::Full => "full",
            Mixer::Local { .. } => "local",
            Mixer::Strided { .. } => "strided",
            Mixer::Linear { .. } => "linear",
            Mixer::Hyena(_) => "hyena",
        }
    }

    /// Whether the mixer is an attention (has weights over keys to show); Hyena is not.
    pub fn is_attention(&self) -> bool {
        !matches!(self, Mixer::Hyena(_))
    }

    /// Checks the mixer's settings and that it can serve `model`, whose self-attention is
    /// causal or not.
    pub fn validate(&self, model: &str, causal: bool) -> Result<()> {
        match self {
            Mixer::Full => {}
            Mixer::Local { window } if *window == 0 => {
                bail!("model: mixer local needs a window of at least 1")
            }
            Mixer::Strided { stride } if *stride == 0 => {
                bail!("model: mixer strided needs a stride of at least 1")
            }
            Mixer::Linear { chunk } if *chunk == 0 => {
                bail!("model: mixer linear needs a chunk of at least 1")
            }
            Mixer::Hyena(hyena) => {
                if !causal {
                    bail!(
                        "model: mixer hyena is causal (a long convolution over the past) and \
                         cannot serve the bidirectional self-attention of a {model}; use full, \
                         local, strided or linear"
                    );
                }
                if hyena.order == 0 || hyena.filter_width == 0 || hyena.short_kernel == 0 {
                    bail!("model: mixer hyena needs order, filter_width and short_kernel >= 1");
                }
            }
            Mixer::Local { .. } | Mixer::Strided { .. } | Mixer::Linear { .. } => {}
        }
        Ok(())
    }
}
