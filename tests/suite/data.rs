//! Data: the char tokenizer round-trips, windows shift targets by one, declared datasets parse,
//! and the download path verifies what it fetches (served from 127.0.0.1).

use burn::data::dataset::Dataset;
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use transformer_lab::data::registry::{download_verified, verify_sha256};
use transformer_lab::data::{CharTokenizer, DatasetSpec, TokenWindows};

#[test]
fn char_tokenizer_round_trips_and_names_unknown_characters() {
    let tok = CharTokenizer::fit("hello world\n");
    assert_eq!(tok.vocab_size(), 9);
    let ids = tok.encode("low hold\n").unwrap();
    assert_eq!(tok.decode(&ids), "low hold\n");
    let err = tok.encode("hello, Zoë").unwrap_err().to_string();
    assert!(
        err.contains("','") && err.contains("'Z'") && err.contains("'ë'"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    tok.save(&path).unwrap();
    assert_eq!(CharTokenizer::load(&path).unwrap(), tok);
}

#[test]
fn windows_pair_each_token_with_the_next() {
    let tokens = Arc::new((0..10u32).collect::<Vec<_>>());
    let all = TokenWindows::new(tokens.clone(), 4);
    assert_eq!(all.len(), 6); // starts 0..=5
    assert_eq!(all.get(5).unwrap().window, vec![5, 6, 7, 8, 9]);
    assert!(all.get(6).is_none());
    let disjoint = TokenWindows::non_overlapping(tokens, 4);
    assert_eq!(disjoint.len(), 2); // starts 0 and 4; targets 1..=8
    assert_eq!(disjoint.get(1).unwrap().window, vec![4, 5, 6, 7, 8]);
}

#[test]
fn every_declared_dataset_parses_with_url_and_sha256() {
    let all = DatasetSpec::all();
    assert!(all.iter().any(|d| d.name == "tinyshakespeare"));
    for d in all {
        for f in &d.files {
            assert!(f.url.starts_with("https://"), "{}", f.url);
            assert_eq!(f.sha256.len(), 64);
        }
        assert!(!d.licence.is_empty() && !d.format.is_empty());
    }
    assert!(DatasetSpec::find("no-such-set").is_err());
}

/// Serves `body` once over HTTP on 127.0.0.1 and returns the URL.
fn serve_once(body: &'static [u8]) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        if let Ok((mut stream, _)) = listener.accept() {
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request);
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(body);
        }
    });
    format!("http://127.0.0.1:{port}/input.txt")
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn download_verifies_the_checksum_before_the_file_appears() {
    const BODY: &[u8] = b"First Citizen:\nBefore we proceed any further, hear me speak.\n";
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("tinyshakespeare/input.txt");
    download_verified(&serve_once(BODY), &sha256(BODY), &dest).unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), BODY);
    verify_sha256(&dest, &sha256(BODY)).unwrap();

    let bad = dir.path().join("other/input.txt");
    let err = download_verified(&serve_once(BODY), &sha256(b"something else"), &bad).unwrap_err();
    assert!(format!("{err:#}").contains("expected"), "{err:#}");
    assert!(
        !bad.exists(),
        "a mismatching download must not appear at its destination"
    );
    let leftovers = std::fs::read_dir(dir.path().join("other")).unwrap().count();
    assert_eq!(leftovers, 0, "no temporary file is left behind");
}

#[test]
fn a_corrupt_local_file_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tinyshakespeare/input.txt");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, "not shakespeare").unwrap();
    let spec = DatasetSpec::find("tinyshakespeare").unwrap();
    let err = spec.ensure(dir.path()).unwrap_err();
    assert!(format!("{err:#}").contains("sha256"), "{err:#}");
}

#[test]
fn an_unreachable_url_fails_cleanly_and_leaves_nothing() {
    // Port 9 on loopback: nothing listens there, so the connection is refused at once.
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("set/file.txt");
    let err = download_verified("http://127.0.0.1:9/file.txt", &sha256(b""), &dest).unwrap_err();
    assert!(format!("{err:#}").contains("127.0.0.1:9"), "{err:#}");
    assert!(!dest.exists());
}

#[test]
fn the_translation_split_never_puts_one_source_in_two_splits() {
    use transformer_lab::data::translation::split_by_source;
    use transformer_lab::data::Pair;
    // 200 sources, each with 1–3 translations.
    let pairs: Vec<Pair> = (0..200)
        .flat_map(|i| {
            (0..1 + i % 3).map(move |j| Pair {
                source: format!("sentence {i}"),
                target: format!("phrase {i} v{j}"),
            })
        })
        .collect();
    let corpus = split_by_source(pairs.clone(), 0.1, 0.1, 42);
    let sources = |ps: &[Pair]| -> std::collections::HashSet<String> {
        ps.iter().map(|p| p.source.clone()).collect()
    };
    let train = sources(&corpus.train);
    let valid = sources(&corpus.valid);
    let test: std::collections::HashSet<String> =
        corpus.test.iter().map(|t| t.source.clone()).collect();
    assert_eq!((valid.len(), test.len()), (20, 20));
    assert_eq!(train.len() + valid.len() + test.len(), 200);
    assert!(train.is_disjoint(&valid) && train.is_disjoint(&test) && valid.is_disjoint(&test));
    // Every pair lands somewhere, and test items keep all their references.
    let refs: usize = corpus.test.iter().map(|t| t.references.len()).sum();
    assert_eq!(corpus.train.len() + corpus.valid.len() + refs, pairs.len());
    // The split is a function of the seed.
    assert_eq!(
        split_by_source(pairs.clone(), 0.1, 0.1, 42).train,
        corpus.train
    );
    assert_ne!(split_by_source(pairs, 0.1, 0.1, 43).train, corpus.train);
}

#[test]
fn translation_datasets_are_declared_with_their_licences() {
    for name in ["tatoeba-fra-eng", "multi30k"] {
        let spec = DatasetSpec::find(name).unwrap();
        assert!(spec
            .files
            .iter()
            .all(|f| f.sha256.len() == 64 && f.url.starts_with("https://")));
        assert!(!spec.licence.is_empty());
    }
    assert!(DatasetSpec::find("tatoeba-fra-eng")
        .unwrap()
        .licence
        .contains("tatoeba.org"));
    assert!(DatasetSpec::find("multi30k")
        .unwrap()
        .licence
        .contains("non-commercial"));
}

#[cfg(unix)]
#[test]
fn atomic_writes_replace_the_whole_file_with_ordinary_permissions() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out/picture.png");
    transformer_lab::artifact::write_atomic(&path, b"first").unwrap();
    transformer_lab::artifact::write_atomic(&path, b"second").unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"second");
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(
        mode & 0o044,
        0o044,
        "others may read what the user asked to write: {mode:o}"
    );
    let leftovers = std::fs::read_dir(path.parent().unwrap()).unwrap().count();
    assert_eq!(leftovers, 1, "no temporary file is left behind");
}
