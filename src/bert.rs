//! Hugging Face BERT checkpoints in.
//!
//! `import`: a directory holding `config.json`, `model.safetensors` (a `BertForMaskedLM`, or a
//! bare `BertModel`) and BERT's WordPiece `tokenizer.json` becomes an ordinary masked-language-
//! model artifact (`"kind": "mlm"`), which `fill-mask`, `embed`, `attention`, `eval` and a
//! classifier's `init_from` read.
//!
//! BERT is our encoder stack post-norm (`LN(x + f(x))`), with biases, exact GELU and LayerNorm
//! ε 1e-12, under a LayerNorm over the embeddings' sum; its masked-LM head is ours (transform,
//! GELU, LayerNorm, the token embedding tied, a bias of its own). PyTorch's `Linear` stores
//! `[out, in]` and burn's `[in, out]`, so every projection is transposed. BERT's token-type
//! embedding adds row 0 (segment A) to every position of a one-text input: it is folded into
//! the position table, exact for the single texts every command here reads (segment B, for
//! sentence pairs, is dropped). The pooler (`BertModel`'s dense + tanh over `[CLS]`) is dropped:
//! a classifier's head reads `[CLS]` itself.

use crate::artifact::{check_new_artifact_dir, write_new_artifact, ArtifactDir, Tokenizers};
use crate::config::{ExperimentConfig, MlmConfig, ModelConfig, TokenizerKind};
use crate::data::{BpeTokenizer, Tokenizer};
use crate::hf::{apply, read_config, snapshot, transposed, unfit, Tensors};
use crate::kernels::LabBackend;
use crate::models::MaskedLm;
use crate::nn::{Activation, Mixer, PositionKind, StackConfig};
use anyhow::{bail, Context, Result};
use burn::prelude::*;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

/// The fields of a Hugging Face BERT `config.json` that shape the model.
#[derive(Clone, Debug, Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    intermediate_size: usize,
    #[serde(default = "gelu")]
    hidden_act: String,
    #[serde(default = "dropout")]
    hidden_dropout_prob: f64,
    max_position_embeddings: usize,
    #[serde(default = "two")]
    type_vocab_size: usize,
    #[serde(default = "layer_norm_eps")]
    layer_norm_eps: f64,
    #[serde(default = "absolute")]
    position_embedding_type: String,
    #[serde(default)]
    is_decoder: bool,
    #[serde(default = "crate::hf::yes")]
    tie_word_embeddings: bool,
}

fn gelu() -> String {
    "gelu".into()
}
fn dropout() -> f64 {
    0.1
}
fn two() -> usize {
    2
}
fn layer_norm_eps() -> f64 {
    1e-12
}
fn absolute() -> String {
    "absolute".into()
}

/// The masked language model a BERT config describes, or what does not fit.
fn mlm_config(hf: &HfConfig, path: &Path) -> Result<MlmConfig> {
    let what = |field: &str, value: String, need: &str| unfit(path, "BERT", field, value, need);
    if hf.model_type.as_deref() != Some("bert") {
        let found = format!("{:?}", hf.model_type);
        return Err(what("model_type", found, "\"bert\""));
    }
    let activation = match hf.hidden_act.as_str() {
        "gelu" => Activation::Gelu,
        "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluTanh,
        "relu" => Activation::Relu,
        other => return Err(what("hidden_act", other.into(), "gelu, gelu_new or relu")),
    };
    if hf.position_embedding_type != "absolute" {
        let found = hf.position_embedding_type.clone();
        return Err(what("position_embedding_type", found, "absolute"));
    }
    if hf.is_decoder {
        return Err(what("is_decoder", "true".into(), "an encoder"));
    }
    if !hf.tie_word_embeddings {
        let found = "false".into();
        return Err(what(
            "tie_word_embeddings",
            found,
            "true (the head reads the embedding)",
        ));
    }
    if hf.type_vocab_size == 0 {
        return Err(what("type_vocab_size", "0".into(), "at least 1"));
    }
    let (d, h) = (hf.hidden_size, hf.num_attention_heads);
    if h == 0 || !d.is_multiple_of(h) {
        return Err(what(
            "num_attention_heads",
            h.to_string(),
            "a divisor of hidden_size",
        ));
    }
    let mlm = MlmConfig {
        vocab_size: hf.vocab_size,
        stack: StackConfig {
            d_model: d,
            n_heads: h,
            d_ff: hf.intermediate_size,
            dropout: hf.hidden_dropout_prob,
            activation,
            norm_first: false,
            bias: true,
            mixer: Mixer::Full,
            pruned_heads: BTreeMap::new(),
            norm_epsilon: hf.layer_norm_eps,
        },
        n_layers: hf.num_hidden_layers,
        max_len: hf.max_position_embeddings,
        position: PositionKind::Learned,
        mask_fraction: 0.15,
        embedding_norm: true,
    };
    mlm.validate()?;
    Ok(mlm)
}

/// `(BERT name, our name)` of a LayerNorm's two parameters; older checkpoints call them
/// `gamma` and `beta`.
fn norm(theirs: &str, ours: &str) -> [([String; 2], String); 2] {
    [
        (
            [format!("{theirs}.weight"), format!("{theirs}.gamma")],
            format!("{ours}.gamma"),
        ),
        (
            [format!("{theirs}.bias"), format!("{theirs}.beta")],
            format!("{ours}.beta"),
        ),
    ]
}

/// `(BERT layer, our layer)` of every projection of block `i`: transposed weights, biases as
/// they are.
fn projections(i: usize) -> Vec<(String, String)> {
    let (theirs, ours) = (
        format!("encoder.layer.{i}."),
        format!("encoder.blocks.{i}."),
    );
    [
        ("attention.self.query", "self_attention.query"),
        ("attention.self.key", "self_attention.key"),
        ("attention.self.value", "self_attention.value"),
        ("attention.output.dense", "self_attention.output"),
        ("intermediate.dense", "feedforward.linear_inner"),
        ("output.dense", "feedforward.linear_outer"),
    ]
    .into_iter()
    .map(|(t, o)| (format!("{theirs}{t}"), format!("{ours}{o}")))
    .collect()
}

/// Reads the Hugging Face BERT checkpoint in `dir` and writes it to `out` as a masked language
/// model artifact (`out` must be new or empty). Says what it dropped or could not find.
pub fn import<B: LabBackend>(dir: &Path, out: &Path, device: &B::Device) -> Result<ArtifactDir> {
    check_new_artifact_dir(out)?;
    let (hf, config_path): (HfConfig, _) = read_config(dir, "BERT")?;
    let mlm = mlm_config(&hf, &config_path)?;
    let tokenizer = read_tokenizer(dir)?;
    if tokenizer.vocab_size() != hf.vocab_size {
        bail!(
            "{}'s tokenizer has {} tokens but config.json says vocab_size {}",
            dir.display(),
            tokenizer.vocab_size(),
            hf.vocab_size
        );
    }
    let mut tensors = Tensors::read(dir, "bert.")?;
    let (d, f, v, p) = (
        hf.hidden_size,
        hf.intermediate_size,
        hf.vocab_size,
        hf.max_position_embeddings,
    );
    let mut snapshots = Vec::new();
    let table = tensors.take("embeddings.word_embeddings.weight", &[v, d])?;
    snapshots.push(snapshot("token_embedding.weight", table));
    // Segment A's embedding is added at every position of a one-text input: fold it in.
    let positions = tensors.take("embeddings.position_embeddings.weight", &[p, d])?;
    let types = tensors.take(
        "embeddings.token_type_embeddings.weight",
        &[hf.type_vocab_size, d],
    )?;
    let segment_a = Tensor::<B, 2>::from_data(types, device).narrow(0, 0, 1);
    let positions = Tensor::<B, 2>::from_data(positions, device) + segment_a;
    snapshots.push(snapshot("position.Learned.weight", positions.into_data()));

    let mut norms = norm("embeddings.LayerNorm", "embedding_norm").to_vec();
    for i in 0..hf.num_hidden_layers {
        let (theirs, ours) = (
            format!("encoder.layer.{i}."),
            format!("encoder.blocks.{i}."),
        );
        norms.extend(norm(
            &format!("{theirs}attention.output.LayerNorm"),
            &format!("{ours}norm_self"),
        ));
        norms.extend(norm(
            &format!("{theirs}output.LayerNorm"),
            &format!("{ours}norm_ff"),
        ));
        for (theirs, ours) in projections(i) {
            let (n_in, n_out) = match ours.rsplit('.').next() {
                Some("linear_inner") => (d, f),
                Some("linear_outer") => (f, d),
                _ => (d, d),
            };
            let weight = tensors.take(&format!("{theirs}.weight"), &[n_out, n_in])?;
            let bias = tensors.take(&format!("{theirs}.bias"), &[n_out])?;
            snapshots.push(snapshot(
                &format!("{ours}.weight"),
                transposed::<B>(weight, device),
            ));
            snapshots.push(snapshot(&format!("{ours}.bias"), bias));
        }
    }

    // The masked-LM head, when the checkpoint has one (a bare BertModel has not).
    let head = tensors.has("cls.predictions.bias");
    if head {
        norms.extend(norm(
            "cls.predictions.transform.LayerNorm",
            "transform_norm",
        ));
        let weight = tensors.take("cls.predictions.transform.dense.weight", &[d, d])?;
        let bias = tensors.take("cls.predictions.transform.dense.bias", &[d])?;
        snapshots.push(snapshot(
            "transform.weight",
            transposed::<B>(weight, device),
        ));
        snapshots.push(snapshot("transform.bias", bias));
        let output_bias = tensors.take("cls.predictions.bias", &[v])?;
        snapshots.push(snapshot("output_bias", output_bias));
    }
    for (theirs, ours) in norms {
        snapshots.push(snapshot(&ours, tensors.take_any(&theirs, &[d])?));
    }
    let weights = tensors.path().to_path_buf();
    // Left: the tied decoder (and its copy of the bias), the pooler, the next-sentence head
    // (BertForPreTraining's, in the Hub's bert-base-uncased), buffers.
    let pooler = tensors.has("pooler.dense.weight");
    tensors.finish("BERT's masked language model", |name| {
        name.starts_with("cls.predictions.decoder.")
            || name.starts_with("cls.seq_relationship.")
            || name.starts_with("pooler.")
            || name == "embeddings.position_ids"
            || name == "embeddings.token_type_ids"
    })?;
    // Without a head, the head keeps its fresh init.
    let fresh: &[&str] = if head {
        &[]
    } else {
        &["transform.", "transform_norm.", "output_bias"]
    };
    let model: MaskedLm<B> = apply(mlm.init(device), snapshots, &weights, fresh)?;

    let mut config = ExperimentConfig::parse(crate::config::DEFAULT_EXPERIMENT)?;
    config.name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "bert".into());
    config.data.dataset = "multi30k+tatoeba-fra-eng+sst2+uci-sentiment".into();
    config.data.tokenizer = TokenizerKind::Bert;
    config.data.max_tokens = config.data.max_tokens.clamp(3, mlm.max_len);
    config.model = ModelConfig::Mlm(mlm);
    config.validate()?;
    let artifact = write_new_artifact(out, &config, Some(&Tokenizers::shared(tokenizer)), model)?;
    if !head {
        println!(
            "{} has no masked-LM head (a BertModel): its encoder is imported for embed, \
             attention and init_from; fill-mask needs a BertForMaskedLM",
            weights.display()
        );
    }
    if pooler {
        println!("the pooler is left out: a classifier's head reads [CLS] itself");
    }
    if hf.type_vocab_size > 1 {
        println!(
            "token type 0 (segment A) is folded into the positions; the other {} type(s), for \
             sentence pairs, are left out",
            hf.type_vocab_size - 1
        );
    }
    Ok(artifact)
}

/// BERT's `tokenizer.json` beside the checkpoint.
fn read_tokenizer(dir: &Path) -> Result<Tokenizer> {
    let json = dir.join("tokenizer.json");
    if !json.exists() {
        bail!(
            "{} holds no tokenizer.json: save BERT's with transformers' \
             AutoTokenizer.from_pretrained(...).save_pretrained(DIR)",
            dir.display()
        );
    }
    let text = std::fs::read_to_string(&json)
        .with_context(|| format!("cannot read {}", json.display()))?;
    Ok(Tokenizer::Bpe(Box::new(BpeTokenizer::bert_from_json(
        &text, &json,
    )?)))
}
