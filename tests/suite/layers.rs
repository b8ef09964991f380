//! The layering of ARCHITECTURE.md holds: every `crate::` path in `src/` names a module of the
//! same layer or one below, so dependencies point one way.

use std::path::{Path, PathBuf};

/// Each top-level module's layer, lowest first (see ARCHITECTURE.md).
const LAYERS: &[(&str, usize)] = &[
    ("backend", 0),
    ("files", 0),
    ("memory", 0),
    ("stdio", 0),
    ("user_cache", 0),
    ("kernels", 1),
    ("hf", 1),
    ("bleu", 1),
    ("plot", 1),
    ("nn", 2),
    ("data", 3),
    ("models", 4),
    ("config", 5),
    ("artifact", 6),
    ("train", 7),
    ("generate", 8),
    ("gpt2", 8),
    ("bert", 8),
    ("translate", 8),
    ("classify", 8),
    ("embed", 8),
    ("inspect", 8),
    ("explain", 8),
    ("curves", 8),
    ("kinds", 9),
    ("bench", 10),
    ("serve", 10),
    ("cli", 11),
    ("app", 11),
];

fn layer(module: &str) -> usize {
    LAYERS
        .iter()
        .find(|(name, _)| *name == module)
        .unwrap_or_else(|| panic!("module {module} has no layer in tests/suite/layers.rs"))
        .1
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `(file, importing module, imported path)` of every `crate::` path in code (comments
/// removed); a `crate::{a, b::{c, d}}` group yields its top-level names.
fn imports() -> Vec<(String, String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut found = Vec::new();
    for file in files {
        let rel = file
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if rel == "lib.rs" || rel == "main.rs" {
            continue;
        }
        let module = rel.split(['/', '.']).next().unwrap().to_string();
        let text = std::fs::read_to_string(&file).unwrap();
        let code: String = text
            .lines()
            .map(|line| line.split("//").next().unwrap())
            .collect::<Vec<_>>()
            .join("\n");
        let mut rest = code.as_str();
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let (mut depth, mut name, mut names) = (0, String::new(), Vec::new());
                for c in group.chars() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => names.push(std::mem::take(&mut name)),
                        _ if depth == 0 => name.push(c),
                        _ => {}
                    }
                }
                names.push(name);
                for name in names {
                    let name = name.trim().trim_end_matches("::");
                    if !name.is_empty() {
                        found.push((rel.clone(), module.clone(), name.to_string()));
                    }
                }
            } else {
                let path: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                found.push((rel.clone(), module.clone(), path));
            }
        }
    }
    found
}

#[test]
fn no_module_imports_a_layer_above_its_own() {
    let mut upward = Vec::new();
    for (file, module, path) in imports() {
        let target = path.split("::").next().unwrap();
        if target.is_empty() || target == module {
            continue;
        }
        // The experiment config composes each layer's own section; `train/config.rs` imports
        // only layers below the config, so composing it closes no cycle.
        if module == "config" && path.starts_with("train::config") {
            continue;
        }
        if layer(target) > layer(&module) {
            upward.push(format!("{file}: {module} imports crate::{path}"));
        }
    }
    assert!(
        upward.is_empty(),
        "imports against the layering:\n{}",
        upward.join("\n")
    );
}

#[test]
fn the_train_config_leaf_imports_only_layers_below_the_config() {
    let leaf: Vec<_> = imports()
        .into_iter()
        .filter(|(file, _, _)| file == "train/config.rs")
        .collect();
    for (_, _, path) in &leaf {
        let target = path.split("::").next().unwrap();
        assert!(
            target != "train" && layer(target) < layer("config"),
            "train/config.rs imports crate::{path}, which the experiment config cannot compose"
        );
    }
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/train/config.rs"))
            .unwrap();
    assert!(!text.contains("super::"));
}

#[test]
fn every_test_lives_in_the_suite() {
    // Cargo.toml builds neither the library nor the binary in test mode (`test = false`,
    // `doctest = false`: a second compile of the crate, minutes on two cores), so a test or a
    // Rust example in a doc comment under src/ would never run. They belong in tests/suite.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut stray = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap().display().to_string();
        let mut in_fence = false;
        for (n, line) in std::fs::read_to_string(&file).unwrap().lines().enumerate() {
            let line = line.trim();
            let doc = line
                .strip_prefix("//!")
                .or_else(|| line.strip_prefix("///"))
                .map(str::trim);
            let runs = match doc.and_then(|d| d.strip_prefix("```")) {
                // An opening fence is Rust (a doctest) unless it names another language.
                Some(tag) if !in_fence => {
                    in_fence = true;
                    tag.is_empty() || tag.starts_with("rust") || tag.starts_with("no_run")
                }
                Some(_) => {
                    in_fence = false;
                    false
                }
                None => line.starts_with("#[test]") || line.starts_with("#[cfg(test)]"),
            };
            if runs {
                stray.push(format!("{rel}:{}: {line}", n + 1));
            }
        }
    }
    assert!(
        stray.is_empty(),
        "tests that would never run:\n{}",
        stray.join("\n")
    );
}
