//! Hugging Face GPT-2 checkpoints in and out.
//!
//! `import`: a directory holding `config.json`, `model.safetensors` and the tokenizer
//! (`tokenizer.json`, or `vocab.json` + `merges.txt`) becomes an ordinary language-model
//! artifact. GPT-2 is our pre-norm stack with learned positions, biases, GPT-2's tanh GELU, a
//! final LayerNorm (ε 1e-5) and the output projection tied to the token embedding. Its
//! `Conv1D` layers store their weight `[in, out]`, as burn's `Linear` does, so weights copy
//! as they are; the fused `c_attn` `[d, 3d]` splits into W^Q, W^K, W^V (columns `0..d`,
//! `d..2d`, `2d..3d`). `export` writes the reverse, which `transformers`'
//! `GPT2LMHeadModel.from_pretrained` reads.

use crate::artifact::{
    check_new_artifact_dir, write_new_artifact, write_new_dir, ArtifactDir, Tokenizers,
};
use crate::config::{ExperimentConfig, LmConfig, ModelConfig, TokenizerKind};
use crate::data::{BpeTokenizer, Tokenizer};
use crate::hf::{apply, read_config, snapshot, unfit, Tensors};
use crate::kernels::LabBackend;
use crate::models::LanguageModel;
use crate::nn::{Activation, Mixer, PositionKind, StackConfig};
use anyhow::{anyhow, bail, Context, Result};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn_store::ModuleSnapshot;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// The fields of a Hugging Face GPT-2 `config.json` that shape the model.
#[derive(Clone, Debug, Deserialize, Serialize)]
struct HfConfig {
    model_type: Option<String>,
    vocab_size: usize,
    n_positions: usize,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    #[serde(default)]
    n_inner: Option<usize>,
    #[serde(default = "gelu_new")]
    activation_function: String,
    #[serde(default = "layer_norm_epsilon")]
    layer_norm_epsilon: f64,
    #[serde(default = "crate::hf::yes")]
    tie_word_embeddings: bool,
    #[serde(default = "crate::hf::yes")]
    scale_attn_weights: bool,
    #[serde(default)]
    scale_attn_by_inverse_layer_idx: bool,
}

fn gelu_new() -> String {
    "gelu_new".into()
}
fn layer_norm_epsilon() -> f64 {
    1e-5
}

/// The language model a GPT-2 config describes, or what does not fit.
fn lm_config(hf: &HfConfig, path: &Path) -> Result<LmConfig> {
    let what = |field: &str, value: String, need: &str| unfit(path, "GPT-2", field, value, need);
    if hf.model_type.as_deref() != Some("gpt2") {
        return Err(what(
            "model_type",
            format!("{:?}", hf.model_type),
            "\"gpt2\"",
        ));
    }
    let activation = match hf.activation_function.as_str() {
        "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluTanh,
        "gelu" => Activation::Gelu,
        "relu" => Activation::Relu,
        other => {
            return Err(what(
                "activation_function",
                other.into(),
                "gelu_new, gelu or relu",
            ))
        }
    };
    if (hf.layer_norm_epsilon - 1e-5).abs() > 1e-12 {
        let eps = hf.layer_norm_epsilon.to_string();
        return Err(what("layer_norm_epsilon", eps, "1e-5 (burn's LayerNorm)"));
    }
    if !hf.tie_word_embeddings {
        return Err(what("tie_word_embeddings", "false".into(), "true"));
    }
    if !hf.scale_attn_weights || hf.scale_attn_by_inverse_layer_idx {
        return Err(what(
            "the attention scaling",
            "not 1/√d_head".into(),
            "1/√d_head",
        ));
    }
    if hf.n_head == 0 || !hf.n_embd.is_multiple_of(hf.n_head) {
        let heads = format!("{} heads of width {}", hf.n_head, hf.n_embd);
        return Err(what("n_head", heads, "a divisor of n_embd"));
    }
    let lm = LmConfig {
        vocab_size: hf.vocab_size,
        stack: StackConfig {
            d_model: hf.n_embd,
            n_heads: hf.n_head,
            d_ff: hf.n_inner.unwrap_or(4 * hf.n_embd),
            dropout: 0.0,
            activation,
            norm_first: true,
            bias: true,
            mixer: Mixer::Full,
            pruned_heads: BTreeMap::new(),
            norm_epsilon: crate::kernels::LAYER_NORM_EPSILON,
        },
        n_layers: hf.n_layer,
        context: hf.n_positions,
        position: PositionKind::Learned,
        tie_weights: true,
        init_from: None,
    };
    lm.validate()?;
    Ok(lm)
}

/// The GPT-2 config of a language model, or one line saying what GPT-2 cannot express.
fn hf_config(lm: &LmConfig) -> Result<HfConfig> {
    let stack = &lm.stack;
    let no = |what: &str| bail!("GPT-2 cannot express this model: {what}");
    if lm.position != PositionKind::Learned {
        return no("its positions are not learned");
    }
    if !stack.norm_first {
        return no("it is post-norm (GPT-2 is pre-norm)");
    }
    if !stack.bias {
        return no("its layers have no biases (GPT-2's have)");
    }
    if !lm.tie_weights {
        return no("its output projection is not tied to the token embedding");
    }
    if stack.mixer != Mixer::Full {
        return no(&format!(
            "its token mixer is {} (GPT-2's is full attention)",
            stack.mixer.name()
        ));
    }
    if !stack.pruned_heads.is_empty() {
        return no("it is pruned (its layers have different numbers of heads)");
    }
    if stack.norm_epsilon != crate::kernels::LAYER_NORM_EPSILON {
        return no(&format!(
            "its LayerNorms' epsilon is {} (GPT-2's is 1e-5)",
            stack.norm_epsilon
        ));
    }
    let activation_function = match stack.activation {
        Activation::GeluTanh => "gelu_new",
        Activation::Gelu => "gelu",
        Activation::Relu => "relu",
    };
    Ok(HfConfig {
        model_type: Some("gpt2".into()),
        vocab_size: lm.vocab_size,
        n_positions: lm.context,
        n_embd: stack.d_model,
        n_layer: lm.n_layers,
        n_head: stack.n_heads,
        n_inner: Some(stack.d_ff()),
        activation_function: activation_function.into(),
        layer_norm_epsilon: 1e-5,
        tie_word_embeddings: true,
        scale_attn_weights: true,
        scale_attn_by_inverse_layer_idx: false,
    })
}

/// `(GPT-2 name, our name)` of every parameter stored as it is (c_attn is split apart).
fn same_tensors(n_layers: usize) -> Vec<(String, String)> {
    let mut pairs = vec![
        ("wte.weight".into(), "token_embedding.weight".into()),
        ("wpe.weight".into(), "position.Learned.weight".into()),
        ("ln_f.weight".into(), "decoder.final_norm.gamma".into()),
        ("ln_f.bias".into(), "decoder.final_norm.beta".into()),
    ];
    for i in 0..n_layers {
        let (h, ours) = (format!("h.{i}."), format!("decoder.blocks.{i}."));
        for (theirs, mine) in [
            ("ln_1.weight", "norm_self.gamma"),
            ("ln_1.bias", "norm_self.beta"),
            ("attn.c_proj.weight", "self_attention.output.weight"),
            ("attn.c_proj.bias", "self_attention.output.bias"),
            ("ln_2.weight", "norm_ff.gamma"),
            ("ln_2.bias", "norm_ff.beta"),
            ("mlp.c_fc.weight", "feedforward.linear_inner.weight"),
            ("mlp.c_fc.bias", "feedforward.linear_inner.bias"),
            ("mlp.c_proj.weight", "feedforward.linear_outer.weight"),
            ("mlp.c_proj.bias", "feedforward.linear_outer.bias"),
        ] {
            pairs.push((format!("{h}{theirs}"), format!("{ours}{mine}")));
        }
    }
    pairs
}

/// W^Q, W^K, W^V: the three parts of GPT-2's fused `c_attn`, in order.
const QKV: [&str; 3] = ["query", "key", "value"];

/// The tokenizer beside a checkpoint: `tokenizer.json`, else `vocab.json` + `merges.txt`.
fn read_tokenizer(dir: &Path) -> Result<Tokenizer> {
    let json = dir.join("tokenizer.json");
    if json.exists() {
        let text = std::fs::read_to_string(&json)
            .with_context(|| format!("cannot read {}", json.display()))?;
        return Ok(Tokenizer::Bpe(Box::new(BpeTokenizer::gpt2_from_json(
            &text, &json,
        )?)));
    }
    let (vocab, merges) = (dir.join("vocab.json"), dir.join("merges.txt"));
    if !vocab.exists() || !merges.exists() {
        bail!(
            "{} holds no tokenizer: GPT-2's is tokenizer.json, or vocab.json and merges.txt",
            dir.display()
        );
    }
    Ok(Tokenizer::Bpe(Box::new(BpeTokenizer::gpt2_from_files(
        &vocab, &merges,
    )?)))
}

/// Reads the Hugging Face GPT-2 checkpoint in `dir` and writes it to `out` as an artifact
/// every command loads (`out` must be new or empty).
pub fn import<B: LabBackend>(dir: &Path, out: &Path, device: &B::Device) -> Result<ArtifactDir> {
    check_new_artifact_dir(out)?;
    let (hf, config_path): (HfConfig, _) = read_config(dir, "GPT-2")?;
    let lm = lm_config(&hf, &config_path)?;
    let tokenizer = read_tokenizer(dir)?;
    if tokenizer.vocab_size() != hf.vocab_size {
        bail!(
            "{}'s tokenizer has {} tokens but config.json says vocab_size {}",
            dir.display(),
            tokenizer.vocab_size(),
            hf.vocab_size
        );
    }
    let mut tensors = Tensors::read(dir, "transformer.")?;
    let (d, f, v) = (hf.n_embd, lm.stack.d_ff(), hf.vocab_size);
    let shape_of = |ours: &str| -> Vec<usize> {
        match ours.rsplit_once('.').map(|(_, last)| last) {
            _ if ours == "token_embedding.weight" => vec![v, d],
            _ if ours == "position.Learned.weight" => vec![hf.n_positions, d],
            _ if ours.ends_with("linear_inner.weight") => vec![d, f],
            _ if ours.ends_with("linear_inner.bias") => vec![f],
            _ if ours.ends_with("linear_outer.weight") => vec![f, d],
            _ if ours.ends_with("output.weight") => vec![d, d],
            _ => vec![d],
        }
    };
    let mut snapshots = Vec::new();
    for (theirs, ours) in same_tensors(hf.n_layer) {
        snapshots.push(snapshot(&ours, tensors.take(&theirs, &shape_of(&ours))?));
    }
    for i in 0..hf.n_layer {
        let weight = tensors.take(&format!("h.{i}.attn.c_attn.weight"), &[d, 3 * d])?;
        let bias = tensors.take(&format!("h.{i}.attn.c_attn.bias"), &[3 * d])?;
        let weight = Tensor::<B, 2>::from_data(weight, device);
        let bias = Tensor::<B, 1>::from_data(bias, device);
        for (part, name) in QKV.iter().enumerate() {
            let path = format!("decoder.blocks.{i}.self_attention.{name}");
            let w = weight.clone().narrow(1, part * d, d).into_data();
            let b = bias.clone().narrow(0, part * d, d).into_data();
            snapshots.push(snapshot(&format!("{path}.weight"), w));
            snapshots.push(snapshot(&format!("{path}.bias"), b));
        }
    }
    let weights = tensors.path().to_path_buf();
    // Left: the tied head and the causal-mask buffers older checkpoints carry.
    tensors.finish("GPT-2", |name| {
        name == "lm_head.weight"
            || name.ends_with("attn.bias")
            || name.ends_with("attn.masked_bias")
    })?;
    let model: LanguageModel<B> = apply(lm.init(device), snapshots, &weights, &[])?;
    let mut config = ExperimentConfig::parse(crate::config::DEFAULT_EXPERIMENT)?;
    config.name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "gpt2".into());
    config.model = ModelConfig::Lm(lm);
    config.data.tokenizer = TokenizerKind::Gpt2;
    config.validate()?;
    write_new_artifact(out, &config, Some(&Tokenizers::shared(tokenizer)), model)
}

/// Writes `model` (with `config` and `tokenizer`) to `to` as a Hugging Face GPT-2 checkpoint:
/// `config.json`, `model.safetensors` (f32, GPT-2's names, `c_attn` fused) and
/// `tokenizer.json`.
pub fn export<B: LabBackend>(
    model: &LanguageModel<B>,
    config: &ExperimentConfig,
    tokenizer: &Tokenizer,
    to: &Path,
) -> Result<()> {
    let lm = config.model_as::<LmConfig>()?;
    let hf = hf_config(lm)?;
    if !matches!(tokenizer, Tokenizer::Bpe(_)) {
        bail!(
            "GPT-2 reads byte-level BPE; this model's tokenizer is {:?}",
            tokenizer.kind()
        );
    }
    check_new_artifact_dir(to)?;
    let ours: HashMap<String, TensorData> = model
        .collect(None, None, false)
        .into_iter()
        .map(|s| {
            let data = s
                .to_data()
                .map_err(|e| anyhow!("cannot read {}: {e:?}", s.full_path()))?;
            Ok((s.full_path(), data.convert::<f32>()))
        })
        .collect::<Result<_>>()?;
    let get = |name: &str| {
        ours.get(name)
            .cloned()
            .ok_or_else(|| anyhow!("the model has no {name}"))
    };
    let mut tensors: Vec<(String, TensorData)> = Vec::new();
    for (theirs, mine) in same_tensors(lm.n_layers) {
        tensors.push((theirs, get(&mine)?));
    }
    let device = Default::default();
    for i in 0..lm.n_layers {
        let part = |name: &str, kind: &str| {
            get(&format!("decoder.blocks.{i}.self_attention.{name}.{kind}"))
        };
        let weights = QKV
            .iter()
            .map(|n| Ok(Tensor::<B, 2>::from_data(part(n, "weight")?, &device)))
            .collect::<Result<Vec<_>>>()?;
        let biases = QKV
            .iter()
            .map(|n| Ok(Tensor::<B, 1>::from_data(part(n, "bias")?, &device)))
            .collect::<Result<Vec<_>>>()?;
        tensors.push((
            format!("h.{i}.attn.c_attn.weight"),
            Tensor::cat(weights, 1).into_data(),
        ));
        tensors.push((
            format!("h.{i}.attn.c_attn.bias"),
            Tensor::cat(biases, 0).into_data(),
        ));
    }
    let views = tensors
        .iter()
        .map(|(name, data)| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                data.shape.to_vec(),
                data.as_bytes(),
            )
            .map_err(|e| anyhow!("cannot write {name}: {e}"))?;
            Ok((name.clone(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|e| anyhow!("cannot serialise the weights: {e}"))?;

    let mut hf_json = serde_json::to_value(&hf)?;
    hf_json["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    let eos = match tokenizer {
        Tokenizer::Bpe(t) if t.is_gpt2() => t.id_of(crate::data::END_OF_TEXT),
        _ => None,
    };
    if let Some(eos) = eos {
        hf_json["bos_token_id"] = eos.into();
        hf_json["eos_token_id"] = eos.into();
    }
    let config_json = serde_json::to_string_pretty(&hf_json)?;
    write_new_dir(to, |staged| {
        crate::files::write_atomic(&staged.join("config.json"), config_json.as_bytes())?;
        crate::files::write_atomic(&staged.join("model.safetensors"), &bytes)?;
        tokenizer.save(&staged.join("tokenizer.json"))
    })
}
