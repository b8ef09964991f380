//! Dataset declarations (`datasets/*.json`, compiled in) and the download-and-verify path.
//!
//! Data lives under a data directory: `--data-dir`, else `$TRANSFORMER_LAB_DATA`, else `./data`.
//! A declared file that is present is verified against its sha256; one that is absent is
//! downloaded from its URL into a temporary file, verified, and only then renamed into place.

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Environment variable naming the data directory.
pub const DATA_DIR_ENV: &str = "TRANSFORMER_LAB_DATA";

/// The declarations in `datasets/`, one JSON file each.
const DECLARATIONS: &[&str] = &[
    include_str!("../../datasets/tinyshakespeare.json"),
    include_str!("../../datasets/tatoeba-fra-eng.json"),
    include_str!("../../datasets/multi30k.json"),
    include_str!("../../datasets/mnist.json"),
    include_str!("../../datasets/fashion-mnist.json"),
    include_str!("../../datasets/sst2.json"),
    include_str!("../../datasets/uci-sentiment.json"),
];

/// A declared dataset: where its files come from and how to check them.
#[derive(Clone, Debug, Deserialize)]
pub struct DatasetSpec {
    /// Name used in experiment configs.
    pub name: String,
    /// One line on what it is.
    pub description: String,
    /// Licence and required credit.
    pub licence: String,
    /// File format.
    pub format: String,
    /// What the dataset is for.
    pub task: Task,
    /// Classification: the class names, by label index.
    #[serde(default)]
    pub classes: Vec<String>,
    /// Translation: the two language codes it pairs.
    #[serde(default)]
    pub languages: Vec<String>,
    /// The files, relative to the data directory.
    pub files: Vec<DataFile>,
}

/// What a dataset is for, as its declaration says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Task {
    /// Running text, for a language model.
    Text,
    /// Sentence pairs, for a translator.
    Translation,
    /// Labelled sentences, for a text classifier.
    SentenceClassification,
    /// Labelled images, for a vision model.
    Images,
}

impl Task {
    /// The task of `dataset`: its declaration's, or translation for the synthetic copy task;
    /// `None` for an unknown name.
    pub fn of(dataset: &str) -> Option<Self> {
        if dataset == super::translation::COPY_TASK {
            return Some(Task::Translation);
        }
        DatasetSpec::find(dataset).ok().map(|spec| spec.task)
    }
}

/// One file of a dataset.
#[derive(Clone, Debug, Deserialize)]
pub struct DataFile {
    /// Path under the data directory.
    pub path: String,
    /// Public URL it is downloaded from.
    pub url: String,
    /// Expected sha256, lowercase hex.
    pub sha256: String,
    /// Expected size in bytes.
    pub bytes: u64,
}

impl DatasetSpec {
    /// The declaration named `name`.
    pub fn find(name: &str) -> Result<Self> {
        let all = Self::all();
        all.iter().find(|s| s.name == name).cloned().ok_or_else(|| {
            let names: Vec<&str> = all.iter().map(|s| s.name.as_str()).collect();
            anyhow!(
                "unknown dataset {name:?}; declared datasets: {}",
                names.join(", ")
            )
        })
    }

    /// Every declaration.
    pub fn all() -> Vec<Self> {
        DECLARATIONS
            .iter()
            .map(|text| serde_json::from_str(text).expect("datasets/*.json are valid (tested)"))
            .collect()
    }

    /// Paths of every file under `data_dir`, downloading and verifying whatever is missing.
    pub fn ensure(&self, data_dir: &Path) -> Result<Vec<PathBuf>> {
        self.files
            .iter()
            .map(|file| file.ensure(data_dir))
            .collect()
    }
}

impl DataFile {
    /// The file's path under `data_dir`, verified; downloaded first when absent.
    pub fn ensure(&self, data_dir: &Path) -> Result<PathBuf> {
        let path = data_dir.join(&self.path);
        if path.exists() {
            verify_sha256(&path, &self.sha256)?;
            return Ok(path);
        }
        eprintln!("{} not found; downloading {}", path.display(), self.url);
        download_verified(&self.url, &self.sha256, &path).map_err(|err| {
            anyhow!(
                "{} is missing and could not be downloaded ({err:#}). Download {} to that path \
                 yourself, or point --data-dir (or ${DATA_DIR_ENV}) at a directory holding {}",
                path.display(),
                self.url,
                self.path
            )
        })?;
        Ok(path)
    }
}

/// The data directory: the flag, else `$TRANSFORMER_LAB_DATA`, else `./data`.
pub fn data_dir(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os(DATA_DIR_ENV).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("data"))
}

/// Lowercase hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Fails unless `path` hashes to `expected`.
pub fn verify_sha256(path: &Path, expected: &str) -> Result<()> {
    let actual = sha256_file(path)?;
    if actual != expected {
        bail!(
            "{} has sha256 {actual}, expected {expected}: the file is corrupt or a different \
             version; delete it to download it again",
            path.display()
        );
    }
    Ok(())
}

/// Downloads `url` to `dest`, verifying its sha256 before the file appears at `dest`.
///
/// The body goes to a temporary file beside `dest`; a failed or mismatching download leaves
/// nothing at `dest`.
pub fn download_verified(url: &str, sha256: &str, dest: &Path) -> Result<()> {
    let dir = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut response = ureq::get(url)
        .call()
        .with_context(|| format!("GET {url}"))?;
    let mut reader = response.body_mut().with_config().limit(4 << 30).reader();
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        let n = reader
            .read(&mut buf)
            .with_context(|| format!("reading {url}"))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        tmp.write_all(&buf[..n])?;
        total += n as u64;
    }
    let actual = hex(&hasher.finalize());
    if actual != sha256 {
        bail!("downloaded {total} bytes with sha256 {actual}, expected {sha256}");
    }
    tmp.as_file().sync_all()?;
    tmp.persist(dest)
        .with_context(|| format!("cannot move the download to {}", dest.display()))?;
    eprintln!(
        "downloaded {} ({total} bytes, sha256 verified)",
        dest.display()
    );
    Ok(())
}
