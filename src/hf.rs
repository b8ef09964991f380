//! What the Hugging Face imports share: reading a checkpoint's `config.json` and
//! `model.safetensors`, taking its tensors one by one with their shapes checked, and putting
//! them into a model by our parameter names.

use anyhow::{anyhow, bail, Context, Result};
use burn::module::{Module, ParamId};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn_store::{ModuleSnapshot, ModuleStore, SafetensorsStore, TensorSnapshot};
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// `true`, the serde default of a config's flags that are on unless written.
pub(crate) fn yes() -> bool {
    true
}

/// The one error line for a `config.json` (at `path`) field that `model` here cannot take:
/// `PATH: FIELD is VALUE; transformer-lab's MODEL needs NEED`.
pub(crate) fn unfit(
    path: &Path,
    model: &str,
    field: &str,
    value: impl std::fmt::Display,
    need: &str,
) -> anyhow::Error {
    anyhow!(
        "{}: {field} is {value}; transformer-lab's {model} needs {need}",
        path.display()
    )
}

/// `dir/config.json` as `T`; `model` names the checkpoint in the errors ("GPT-2").
pub(crate) fn read_config<T: DeserializeOwned>(dir: &Path, model: &str) -> Result<(T, PathBuf)> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "cannot read {} (a {model} checkpoint has config.json)",
            path.display()
        )
    })?;
    let config = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a {model} config", path.display()))?;
    Ok((config, path))
}

/// A checkpoint's tensors as f32, by name, handed out once each.
pub(crate) struct Tensors {
    path: PathBuf,
    tensors: HashMap<String, TensorData>,
}

impl Tensors {
    /// `dir/model.safetensors`, the prefix `strip` (`"transformer."`, `"bert."`) dropped from
    /// the names that have it.
    pub fn read(dir: &Path, strip: &str) -> Result<Self> {
        let path = dir.join("model.safetensors");
        if !path.exists() {
            bail!("{} holds no model.safetensors", dir.display());
        }
        let mut store = SafetensorsStore::from_file(&path);
        let snapshots = store
            .get_all_snapshots()
            .map_err(|e| anyhow!("cannot read {}: {e}", path.display()))?;
        let mut tensors = HashMap::new();
        for (name, snapshot) in snapshots {
            let data = snapshot
                .to_data()
                .map_err(|e| anyhow!("cannot read {name} from {}: {e:?}", path.display()))?;
            let name = name.strip_prefix(strip).unwrap_or(name);
            tensors.insert(name.to_string(), data.convert::<f32>());
        }
        Ok(Self { path, tensors })
    }

    /// Whether the checkpoint has `name` (still).
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Takes `name`, which must have `shape` (the config's).
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<TensorData> {
        let data = self
            .tensors
            .remove(name)
            .ok_or_else(|| anyhow!("{} has no tensor {name}", self.path.display()))?;
        if data.shape.as_slice() != shape {
            bail!(
                "{}: {name} has shape {:?}, but config.json makes it {shape:?}",
                self.path.display(),
                data.shape.as_slice()
            );
        }
        Ok(data)
    }

    /// The first of `names` the checkpoint has (older files spell some names differently), taken.
    pub fn take_any(&mut self, names: &[String], shape: &[usize]) -> Result<TensorData> {
        let name = names
            .iter()
            .find(|n| self.has(n))
            .unwrap_or(&names[0])
            .clone();
        self.take(&name, shape)
    }

    /// Drops every tensor `ignore` accepts; then any left is one the model does not have.
    pub fn finish(mut self, model: &str, ignore: impl Fn(&str) -> bool) -> Result<()> {
        self.tensors.retain(|name, _| !ignore(name));
        let mut left: Vec<&String> = self.tensors.keys().collect();
        left.sort();
        match left.first() {
            Some(name) => bail!(
                "{} holds {name}, which {model} does not have",
                self.path.display()
            ),
            None => Ok(()),
        }
    }

    /// The file, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A tensor by our parameter path (`decoder.blocks.0.norm_self.gamma`).
pub(crate) fn snapshot(path: &str, data: TensorData) -> TensorSnapshot {
    let stack = path.split('.').map(String::from).collect();
    TensorSnapshot::from_data(data, stack, vec![], ParamId::new())
}

/// `data` `[a, b]` as `[b, a]`: PyTorch's `Linear` stores `[out, in]`, burn's `[in, out]`.
pub(crate) fn transposed<B: Backend>(data: TensorData, device: &B::Device) -> TensorData {
    Tensor::<B, 2>::from_data(data, device)
        .transpose()
        .into_data()
}

/// `model` with `snapshots` put in: every parameter covered but those under a path of `fresh`
/// (which keep their init), else one error naming `path`.
pub(crate) fn apply<B: Backend, M: Module<B>>(
    mut model: M,
    snapshots: Vec<TensorSnapshot>,
    path: &Path,
    fresh: &[&str],
) -> Result<M> {
    let result = model.apply(snapshots, None, None, false);
    let missing = result
        .missing
        .iter()
        .map(|(path, _)| path)
        .find(|path| !fresh.iter().any(|f| path.starts_with(f)));
    if !result.errors.is_empty() || missing.is_some() {
        bail!(
            "the weights of {} do not fit the model: {:?} {:?}",
            path.display(),
            result.errors.first(),
            missing
        );
    }
    Ok(model)
}
