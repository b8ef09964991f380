//! Tokenizers: BPE round-trips any text, keeps its special tokens at fixed ids, and survives
//! save → load, as does the char tokenizer.

use transformer_lab::config::TokenizerKind;
use transformer_lab::data::{Special, Tokenizer};

const TRAINING: &[&str] = &[
    "The cat sat on the mat.",
    "Le chat est assis sur le tapis.",
    "The dog sat on the log, and the cat sat on the dog.",
    "Où est le chat ? Il est là-bas, près de l'arbre.",
];

fn bpe() -> Tokenizer {
    let texts = TRAINING.iter().cycle().take(40);
    Tokenizer::fit(TokenizerKind::Bpe, texts, 320).unwrap()
}

#[test]
fn bpe_round_trips_text_even_with_characters_never_seen() {
    let tokenizer = bpe();
    for text in [
        "The cat sat on the mat.",
        "  leading and trailing spaces  ",
        "naïve café — 日本語 🙂 \t tab",
        "",
    ] {
        let ids = tokenizer.encode(text).unwrap();
        assert_eq!(tokenizer.decode(&ids), text, "{ids:?}");
        assert!(ids.iter().all(|&id| id < tokenizer.vocab_size()));
        assert!(
            !ids.contains(&Special::Unk.id()),
            "byte-level BPE needs no <unk>"
        );
    }
}

#[test]
fn bpe_learns_merges_and_keeps_specials_at_fixed_ids() {
    let tokenizer = bpe();
    // Merges: a frequent word is fewer tokens than its bytes.
    assert!(tokenizer.encode(" the cat").unwrap().len() < " the cat".len());
    for special in Special::ALL {
        assert_eq!(tokenizer.special(special), Some(special.id()));
    }
    // Special ids decode to nothing.
    let mut ids = vec![Special::Bos.id()];
    ids.extend(tokenizer.encode("sat").unwrap());
    ids.push(Special::Eos.id());
    assert_eq!(tokenizer.decode(&ids), "sat");
}

#[test]
fn both_kinds_survive_save_and_load() {
    let dir = tempfile::tempdir().unwrap();
    let char_tokenizer = Tokenizer::fit(TokenizerKind::Char, TRAINING.iter(), 0).unwrap();
    for tokenizer in [bpe(), char_tokenizer] {
        let path = dir.path().join("tokenizer.json");
        tokenizer.save(&path).unwrap();
        let loaded = Tokenizer::load(&path).unwrap();
        assert_eq!(loaded.kind(), tokenizer.kind());
        assert_eq!(loaded.vocab_size(), tokenizer.vocab_size());
        let text = "The cat sat on the log.";
        assert_eq!(
            loaded.encode(text).unwrap(),
            tokenizer.encode(text).unwrap()
        );
    }
    std::fs::write(dir.path().join("bad.json"), "{\"model\": 1}").unwrap();
    let err = Tokenizer::load(&dir.path().join("bad.json")).unwrap_err();
    assert!(
        format!("{err:#}").contains("malformed tokenizer"),
        "{err:#}"
    );
}
