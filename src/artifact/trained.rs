//! A trained model loaded from its artifact, with the tokenizers and config it was trained with.

use super::{load_weights, ArtifactDir};
use crate::config::ExperimentConfig;
use crate::data::Tokenizer;
use crate::kernels::LabBackend;
use anyhow::{bail, Result};
use burn::module::Module;

/// A trained model `M` in inference mode, with its tokenizers (none for an image model) and the
/// resolved config it was trained with.
pub struct Trained<M> {
    /// The model, weights loaded.
    pub model: M,
    /// Its tokenizers; present whenever the config's model reads text.
    pub tokenizers: Option<Tokenizers>,
    /// Its resolved config (vocabulary sizes filled in).
    pub config: ExperimentConfig,
}

impl<M> Trained<M> {
    /// Opens what `train` wrote in `artifact`: its config, its tokenizers (checked against the
    /// config) and the model `init` builds from the config, with the trained weights loaded.
    pub fn open<B: LabBackend>(
        artifact: &ArtifactDir,
        device: &B::Device,
        init: impl FnOnce(&ExperimentConfig) -> Result<M>,
    ) -> Result<Self>
    where
        M: Module<B>,
    {
        let weights = artifact.weights()?;
        let config = ExperimentConfig::load(&artifact.config())?;
        artifact.check_config_unchanged(false)?;
        let model = init(&config)?;
        let tokenizers = if config.model.reads_text() {
            Some(Tokenizers::open(artifact, &config)?)
        } else {
            None
        };
        let model = load_weights(model, &weights, device)?;
        Ok(Self {
            model,
            tokenizers,
            config,
        })
    }

    /// The tokenizers of a text model.
    ///
    /// # Panics
    /// For a model that reads no text (its artifact has no tokenizer).
    pub fn tokenizers(&self) -> &Tokenizers {
        self.tokenizers
            .as_ref()
            .expect("text models are opened with their tokenizers")
    }

    /// The tokenizer of a single-tokenizer text model (the target side of a translator).
    ///
    /// # Panics
    /// For a model that reads no text.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizers().target
    }
}

/// The tokenizers of a run: a language model has one (`source` and `target` are the same);
/// a translator has one per side, or one shared.
#[derive(Clone, Debug)]
pub struct Tokenizers {
    /// Tokenizes the translator's input.
    pub source: Tokenizer,
    /// Tokenizes the language model's text, or the translator's output.
    pub target: Tokenizer,
    /// Whether both sides use the same tokenizer.
    pub shared: bool,
}

impl Tokenizers {
    /// One tokenizer for everything.
    pub fn shared(tokenizer: Tokenizer) -> Self {
        Self {
            source: tokenizer.clone(),
            target: tokenizer,
            shared: true,
        }
    }

    /// Writes `tokenizer.json` (and `tokenizer-source.json` when the sides differ).
    pub fn save(&self, artifact: &ArtifactDir) -> Result<()> {
        self.target.save(&artifact.tokenizer())?;
        if !self.shared {
            self.source.save(&artifact.source_tokenizer())?;
        }
        Ok(())
    }

    /// Reads what [`Tokenizers::save`] wrote.
    pub fn load(artifact: &ArtifactDir) -> Result<Self> {
        let target = Tokenizer::load(&artifact.tokenizer())?;
        if artifact.source_tokenizer().exists() {
            let source = Tokenizer::load(&artifact.source_tokenizer())?;
            return Ok(Self {
                source,
                target,
                shared: false,
            });
        }
        Ok(Self::shared(target))
    }

    /// Reads the tokenizers of `artifact` and checks them against its config.
    pub fn open(artifact: &ArtifactDir, config: &ExperimentConfig) -> Result<Self> {
        let tokenizers = Self::load(artifact)?;
        tokenizers.check(config, artifact)?;
        Ok(tokenizers)
    }

    /// Checks the config's vocabulary sizes against the tokenizers'.
    pub fn check(&self, config: &ExperimentConfig, artifact: &ArtifactDir) -> Result<()> {
        let expected = (self.source.vocab_size(), self.target.vocab_size());
        if config.model.vocab_sizes() != expected {
            bail!(
                "{}: config.json has vocabulary sizes {:?} but the tokenizers have {:?}",
                artifact.root().display(),
                config.model.vocab_sizes(),
                expected
            );
        }
        Ok(())
    }
}
