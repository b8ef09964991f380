//! `serve` through the binary, over HTTP on loopback: what a completion says is what
//! `generate` says for the same prompt, seed and settings, whether the request ran alone or
//! batched with others; streaming gives the same text; every bad request gets one JSON error
//! and the others go on; SIGTERM stops the server with status 0. The official `openai` Python
//! client is tested in `the_official_openai_client_talks_to_the_server`, the playground page in
//! a real headless Chromium in `the_playground_streams_shows_attention_aligns_and_classifies`.

use crate::common::{lm_artifact, BIN};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TEXT: &str = "to be, or not to be: that is the question. whether 'tis nobler in the mind";

/// A running `serve`, stopped when dropped.
pub struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(dir: &Path, extra: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .args([
                "--backend",
                "ndarray",
                "serve",
                "--artifact-dir",
                "lm",
                "--port",
                "0",
            ])
            .args(extra)
            .current_dir(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let address = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in the first line: {line:?}"));
        assert!(line.contains("this machine only"), "{line}");
        Self {
            child,
            url: format!("http://{address}"),
        }
    }

    fn post(&self, path: &str, body: &str) -> (u16, Value) {
        self.post_with(path, body, None)
    }

    fn post_with(&self, path: &str, body: &str, key: Option<&str>) -> (u16, Value) {
        let mut request = agent()
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        let mut response = request.send(body).unwrap();
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().unwrap();
        let value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{path} answered {status} with non-JSON ({e}): {text}"));
        (status, value)
    }

    fn get(&self, path: &str) -> (u16, String) {
        let mut response = agent().get(format!("{}{path}", self.url)).call().unwrap();
        let status = response.status().as_u16();
        (status, response.body_mut().read_to_string().unwrap())
    }

    /// Asserts that a completion request is refused with a 400 whose message holds `needle`.
    fn refuses(&self, request: Value, needle: &str) {
        let (status, answer) = self.post("/v1/completions", &request.to_string());
        assert_eq!(status, 400, "{answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{needle:?} not in {message:?}");
    }

    /// A completion's text (asserting a 200).
    fn complete(&self, request: Value) -> String {
        let (status, answer) = self.post("/v1/completions", &request.to_string());
        assert_eq!(status, 200, "{answer}");
        answer["choices"][0]["text"].as_str().unwrap().to_string()
    }

    /// A streamed completion's text (its first choice's), and how many events came.
    fn stream_text(&self, request: Value) -> (String, usize) {
        let (mut texts, events) = self.stream_texts(request);
        (texts.swap_remove(0), events)
    }

    /// Each choice's text of a streamed completion, its events' pieces joined by the choice's
    /// index, and how many events came (asserting that the last is `[DONE]`).
    fn stream_texts(&self, request: Value) -> (Vec<String>, usize) {
        let mut response = agent()
            .post(format!("{}/v1/completions", self.url))
            .header("content-type", "application/json")
            .send(request.to_string())
            .unwrap();
        let body = response.body_mut().read_to_string().unwrap();
        let events: Vec<&str> = body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert_eq!(events.last(), Some(&"[DONE]"), "{body}");
        let mut texts = Vec::new();
        for event in &events[..events.len() - 1] {
            let chunk: Value = serde_json::from_str(event).unwrap();
            for choice in chunk["choices"].as_array().unwrap() {
                let index = choice["index"].as_u64().unwrap() as usize;
                texts.resize(texts.len().max(index + 1), String::new());
                texts[index].push_str(choice["text"].as_str().unwrap());
            }
        }
        (texts, events.len())
    }

    /// A metric's value summed over its labels.
    fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

/// What `generate` prints after the prompt.
fn generated(dir: &Path, prompt: &str, tokens: usize, settings: &[&str]) -> String {
    let n = tokens.to_string();
    let mut args = vec![
        "generate",
        "--artifact-dir",
        "lm",
        "--prompt",
        prompt,
        "--max-new-tokens",
        &n,
    ];
    args.extend_from_slice(settings);
    let out = crate::common::run(dir, &args);
    assert!(out.status.success(), "{}", crate::common::stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    text.strip_prefix(prompt)
        .unwrap()
        .strip_suffix('\n')
        .unwrap()
        .to_string()
}

#[test]
fn completions_say_what_generate_says_alone_and_batched_and_streamed() {
    let dir = tempfile::tempdir().unwrap();
    lm_artifact(dir.path(), TEXT);
    // (prompt, seed): greedy, then sampled at temperature 1; 100 tokens pass the context (64)
    // of the learned positions, so the refill is compared too.
    let cases: Vec<(String, u64)> = (0..6)
        .map(|i| (TEXT[i * 3..i * 3 + 4 + i].to_string(), 7 + i as u64))
        .collect();
    let expected: Vec<(String, String)> = cases
        .iter()
        .map(|(prompt, seed)| {
            let seed = seed.to_string();
            (
                generated(dir.path(), prompt, 100, &["--greedy"]),
                generated(
                    dir.path(),
                    prompt,
                    100,
                    &["--temperature", "1", "--seed", &seed],
                ),
            )
        })
        .collect();
    let server = Server::start(dir.path(), &[]);
    let request = |prompt: &str, seed: u64, greedy: bool| {
        json!({"model": "lm", "prompt": prompt, "max_tokens": 100, "seed": seed,
               "temperature": if greedy { 0.0 } else { 1.0 }})
    };
    // Alone, one after the other.
    for ((prompt, seed), (greedy, sampled)) in cases.iter().zip(&expected) {
        assert_eq!(
            &server.complete(request(prompt, *seed, true)),
            greedy,
            "{prompt:?}"
        );
        assert_eq!(
            &server.complete(request(prompt, *seed, false)),
            sampled,
            "{prompt:?}"
        );
    }
    let steps_alone = server.metric("transformer_lab_decode_steps");
    let rows_alone = server.metric("transformer_lab_decode_rows");
    assert_eq!(
        steps_alone, rows_alone,
        "one request at a time decodes rows of one"
    );
    // All twelve at once: they share steps, and each says the same.
    std::thread::scope(|scope| {
        let server = &server;
        let handles: Vec<_> = cases
            .iter()
            .zip(&expected)
            .flat_map(|((prompt, seed), (greedy, sampled))| {
                [(true, greedy), (false, sampled)].map(|(is_greedy, want)| {
                    scope.spawn(move || {
                        let got = server.complete(request(prompt, *seed, is_greedy));
                        assert_eq!(&got, want, "{prompt:?} greedy={is_greedy} in a batch");
                    })
                })
            })
            .collect();
        for handle in handles {
            handle.join().unwrap();
        }
    });
    let steps = server.metric("transformer_lab_decode_steps") - steps_alone;
    let rows = server.metric("transformer_lab_decode_rows") - rows_alone;
    assert!(
        rows / steps > 2.0,
        "concurrent requests shared few steps: {rows} rows in {steps} steps"
    );
    // Streamed: the events' pieces make the same text, then [DONE].
    let (prompt, seed) = &cases[2];
    let (text, events) = server.stream_text(
        json!({"model": "lm", "prompt": prompt, "max_tokens": 100, "seed": seed,
            "temperature": 1.0, "stream": true}),
    );
    assert!(events > 50, "one event per token: {events} events");
    assert_eq!(text, expected[2].1);
    // Chat: the messages' contents, joined by newlines, are the prompt.
    let (status, answer) = server.post(
        "/v1/chat/completions",
        &json!({"model": "lm", "messages": [{"role": "user", "content": "to be"}],
                "max_tokens": 30, "temperature": 0})
        .to_string(),
    );
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["choices"][0]["message"]["content"].as_str().unwrap(),
        generated(dir.path(), "to be", 30, &["--greedy"])
    );
    // A stop string ends the text before it, with finish_reason "stop".
    let greedy = &expected[0].0;
    let stop: String = greedy.chars().skip(20).take(2).collect();
    let (status, answer) = server.post(
        "/v1/completions",
        &json!({"model": "lm", "prompt": cases[0].0, "max_tokens": 100, "temperature": 0,
                "stop": [stop]})
        .to_string(),
    );
    assert_eq!(status, 200, "{answer}");
    let cut = &greedy[..greedy.find(&stop).unwrap()];
    assert_eq!(answer["choices"][0]["text"], json!(cut));
    assert_eq!(answer["choices"][0]["finish_reason"], json!("stop"));
    assert_eq!(
        answer["usage"]["prompt_tokens"],
        json!(cases[0].0.chars().count())
    );
}

#[test]
fn a_linear_attention_model_decodes_one_request_at_a_time_and_says_what_generate_says() {
    use transformer_lab::config::{LmConfig, TokenizerKind};
    use transformer_lab::data::Tokenizer;
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = Tokenizer::fit(TokenizerKind::Char, std::iter::once(TEXT), 0).unwrap();
    crate::common::write_artifact_at(
        dir.path(),
        "lm",
        r#"{"name": "lm", "model": {"kind": "lm", "d_model": 32, "n_layers": 2, "n_heads": 4,
            "context": 64, "mixer": {"kind": "linear", "chunk": 16}},
            "data": {"dataset": "tinyshakespeare", "tokenizer": "char"}}"#,
        |c| {
            let model = c.model_as::<LmConfig>().unwrap().init(&Default::default());
            crate::common::explicit_weights(model, 11)
        },
        Some(tokenizer),
    );
    // 90 tokens pass the context of the learned positions: the refill is compared too.
    let cases = [("to be", 3u64), ("whether", 4), ("the q", 5)];
    let want: Vec<String> = (cases.iter())
        .map(|(prompt, seed)| {
            let seed = seed.to_string();
            let settings = ["--temperature", "1", "--seed", &seed];
            generated(dir.path(), prompt, 90, &settings)
        })
        .collect();
    let server = Server::start(dir.path(), &[]);
    std::thread::scope(|scope| {
        for ((prompt, seed), want) in cases.iter().zip(&want) {
            let server = &server;
            scope.spawn(move || {
                let got = server.complete(json!({"model": "lm", "prompt": prompt,
                    "max_tokens": 90, "seed": seed, "temperature": 1.0}));
                assert_eq!(&got, want, "{prompt:?}");
            });
        }
    });
    let (steps, rows) = (
        server.metric("transformer_lab_decode_steps"),
        server.metric("transformer_lab_decode_rows"),
    );
    assert!(steps >= 3.0 * 89.0, "{steps} steps");
    assert_eq!(steps, rows, "a linear-attention model decodes rows of one");
}

/// A character language model with explicit (seeded, spread-out) weights written as the
/// artifact `lm` in a new folder; and `reference(text, log_softmax)`: the token ids of `text`
/// and the row after each position of the model's whole-sequence forward pass, computed here
/// in-process with burn's composed ops (logits, or their log-softmax).
fn explicit_lm() -> (
    tempfile::TempDir,
    transformer_lab::data::Tokenizer,
    Reference,
) {
    use burn::backend::NdArray;
    use burn::prelude::*;
    use transformer_lab::config::{LmConfig, TokenizerKind};
    use transformer_lab::data::Tokenizer;
    let dir = tempfile::tempdir().unwrap();
    let config = r#"{"name": "lm", "model": {"kind": "lm", "d_model": 32, "n_layers": 2,
        "n_heads": 4, "context": 64}, "data": {"dataset": "tinyshakespeare", "tokenizer": "char"}}"#;
    let build = |c: &transformer_lab::config::ExperimentConfig| {
        let model = c.model_as::<LmConfig>().unwrap();
        crate::common::explicit_weights(model.init::<NdArray<f32>>(&Default::default()), 5)
    };
    let tokenizer = Tokenizer::fit(TokenizerKind::Char, std::iter::once(TEXT), 0).unwrap();
    crate::common::write_artifact_at(dir.path(), "lm", config, build, Some(tokenizer.clone()));
    // The config as written: its vocabulary is the tokenizer's.
    let written = dir.path().join("lm/config.json");
    let model = build(&transformer_lab::config::ExperimentConfig::load(&written).unwrap());
    let encoder = tokenizer.clone();
    let reference = Box::new(move |text: &str, log_softmax: bool| {
        let ids = encoder.encode(text).unwrap();
        let input = Tensor::<NdArray<f32>, 2, Int>::from_data(
            TensorData::new(ids.iter().map(|&t| t as i64).collect(), [1, ids.len()]),
            &Default::default(),
        );
        let rows = transformer_lab::kernels::with_fused(false, || {
            let logits = model.forward(input).logits;
            match log_softmax {
                true => burn::tensor::activation::log_softmax(logits, 2),
                false => logits,
            }
        });
        let v = encoder.vocab_size();
        let values: Vec<f32> = rows.into_data().to_vec().unwrap();
        (ids, values.chunks(v).map(<[f32]>::to_vec).collect())
    });
    (dir, tokenizer, reference)
}

/// `reference(text, log_softmax)` of [`explicit_lm`].
type Reference = Box<dyn Fn(&str, bool) -> (Vec<usize>, Vec<Vec<f32>>)>;

/// Where `row` is largest (ties: the lower id), as greedy decoding picks.
fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best })
}

/// `logprobs` (with `echo`, how evaluation harnesses score a text) against the model's own
/// log-softmax, computed here in-process with burn's composed ops on the whole sequence.
#[test]
fn logprobs_are_the_model_s_log_softmax_for_the_prompt_and_every_generated_token() {
    let (dir, tokenizer, reference) = explicit_lm();
    // ln p(token i | tokens before it) for i ≥ 1, and each position's log-softmax row.
    let reference = |text: &str| reference(text, true);
    let top = |row: &[f32], k: usize| -> Vec<usize> {
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        order.truncate(k);
        order
    };
    let close = |got: &Value, want: f32, what: &str| {
        let got = got.as_f64().unwrap_or_else(|| panic!("{what}: {got}")) as f32;
        assert!((got - want).abs() < 1e-4, "{what}: {got} against {want}");
    };
    let server = Server::start(dir.path(), &[]);

    // Scoring a text: echo, no new token. The first token has no score.
    let prompt = "whether 'tis nobler";
    let (status, answer) = server.post(
        "/v1/completions",
        &json!({"model": "lm", "prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 3})
            .to_string(),
    );
    assert_eq!(status, 200, "{answer}");
    let scored = answer.clone();
    let (ids, rows) = reference(prompt);
    let lp = &answer["choices"][0]["logprobs"];
    assert_eq!(answer["choices"][0]["text"], prompt);
    let tokens: Vec<&str> = (lp["tokens"].as_array().unwrap().iter())
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.concat(), prompt);
    assert_eq!(lp["token_logprobs"][0], Value::Null);
    assert_eq!(lp["top_logprobs"][0], Value::Null);
    let offsets: Vec<u64> = (0..ids.len() as u64).collect();
    assert_eq!(lp["text_offset"], json!(offsets));
    for i in 1..ids.len() {
        let row = &rows[i - 1];
        close(&lp["token_logprobs"][i], row[ids[i]], &format!("token {i}"));
        let alternatives = lp["top_logprobs"][i].as_object().unwrap();
        assert_eq!(alternatives.len(), 3, "{alternatives:?}");
        for t in top(row, 3) {
            let piece = tokenizer.decode(&[t]);
            close(
                &alternatives[&piece],
                row[t],
                &format!("token {i}'s rival {piece:?}"),
            );
        }
    }

    // Generated tokens, decoded through the key–value cache, scored as the whole sequence's
    // forward pass scores them; greedy, so each is its position's most likely token.
    let (status, answer) = server.post(
        "/v1/completions",
        &json!({"model": "lm", "prompt": "to be", "max_tokens": 30, "temperature": 0,
            "logprobs": 1})
        .to_string(),
    );
    assert_eq!(status, 200, "{answer}");
    let text = answer["choices"][0]["text"].as_str().unwrap();
    let lp = &answer["choices"][0]["logprobs"];
    let (ids, rows) = reference(&format!("to be{text}"));
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 30);
    for j in 0..30 {
        let i = 5 + j; // the prompt is 5 tokens
        let row = &rows[i - 1];
        assert_eq!(top(row, 1), [ids[i]], "greedy token {j}");
        close(
            &lp["token_logprobs"][j],
            row[ids[i]],
            &format!("new token {j}"),
        );
        assert_eq!(lp["text_offset"][j], json!(i));
    }

    // A stop string: the tokens after the cut are left out.
    let (_, answer) = server.post(
        "/v1/completions",
        &json!({"model": "lm", "prompt": "to be", "max_tokens": 60, "seed": 3, "stop": "e",
            "logprobs": 0})
        .to_string(),
    );
    let text = answer["choices"][0]["text"].as_str().unwrap();
    let tokens: Vec<&str> = (answer["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap())
    .iter()
    .map(|t| t.as_str().unwrap())
    .collect();
    if answer["choices"][0]["finish_reason"] == "stop" {
        assert_eq!(tokens.concat(), text, "{answer}");
    }

    // The prompt as token ids (how harnesses send it, so that the ids scored are theirs): the
    // same answer as its text, scores included.
    let ids = tokenizer.encode(prompt).unwrap();
    for given in [json!(prompt), json!(ids), json!([ids])] {
        let (status, answer) = server.post(
            "/v1/completions",
            &json!({"model": "lm", "prompt": given, "max_tokens": 0, "echo": true,
                "logprobs": 3})
            .to_string(),
        );
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["choices"][0], scored["choices"][0], "{given}");
    }

    let vocab = tokenizer.vocab_size();
    for (body, needle) in [
        (
            json!({"model": "lm", "prompt": [0, vocab]}),
            "is not in the vocabulary",
        ),
        (
            json!({"model": "lm", "prompt": "to", "logprobs": 6}),
            "at most 5",
        ),
        (
            json!({"model": "lm", "prompt": "to", "logprobs": 1, "stream": true}),
            "without stream",
        ),
    ] {
        server.refuses(body, needle);
    }
}

/// `repetition_penalty`, `frequency_penalty`, `presence_penalty` and `logit_bias` on greedy
/// decoding through the key–value cache: each new token is the argmax of the whole
/// sequence's logits (computed here) after the formulas applied here to the tokens before it.
#[test]
fn penalties_and_logit_bias_act_on_every_step_as_their_formulas_say() {
    let (dir, tokenizer, reference) = explicit_lm();
    let server = Server::start(dir.path(), &[]);
    let prompt = "to be, or not";
    let plain = server
        .complete(json!({"model": "lm", "prompt": prompt, "max_tokens": 40, "temperature": 0}));
    let banned = tokenizer.encode(&plain[..1]).unwrap()[0];
    let (repetition, frequency, presence) = (3.0f32, 0.6f32, 0.5f32);
    let request = json!({"model": "lm", "prompt": prompt, "max_tokens": 40, "temperature": 0,
        "repetition_penalty": repetition, "frequency_penalty": frequency,
        "presence_penalty": presence, "logit_bias": {banned.to_string(): -100}, "top_k": -1});
    let text = server.complete(request.clone());
    assert_ne!(text, plain, "the penalties changed nothing");
    let (ids, rows) = reference(&format!("{prompt}{text}"), false);
    let start = tokenizer.encode(prompt).unwrap().len();
    assert_eq!(ids.len(), start + 40);
    for i in start..ids.len() {
        let mut row = rows[i - 1].clone();
        for (id, l) in row.iter_mut().enumerate() {
            if ids[..i].contains(&id) {
                *l = if *l > 0.0 {
                    *l / repetition
                } else {
                    *l * repetition
                };
            }
            let generated = ids[start..i].iter().filter(|&&x| x == id).count();
            if generated > 0 {
                *l -= generated as f32 * frequency + presence;
            }
            if id == banned {
                *l -= 100.0;
            }
        }
        assert_eq!(argmax(&row), ids[i], "token {}", i - start);
    }
    // Chat takes the same fields; streaming gives the same text.
    let (status, answer) = server.post(
        "/v1/chat/completions",
        &json!({"model": "lm", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 40, "temperature": 0, "repetition_penalty": repetition,
            "frequency_penalty": frequency, "presence_penalty": presence,
            "logit_bias": {banned.to_string(): -100}})
        .to_string(),
    );
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["choices"][0]["message"]["content"], text.as_str());
    let mut streamed = request;
    streamed["stream"] = json!(true);
    assert_eq!(server.stream_text(streamed).0, text);
    // `generate`'s flags are the same penalties (it has no logit bias).
    let unbiased = server.complete(json!({"model": "lm", "prompt": prompt, "max_tokens": 40,
        "temperature": 0, "repetition_penalty": repetition, "frequency_penalty": frequency,
        "presence_penalty": presence}));
    let flags = [repetition, frequency, presence].map(|x| x.to_string());
    let cli = generated(
        dir.path(),
        prompt,
        40,
        &[
            "--greedy",
            "--repetition-penalty",
            &flags[0],
            "--frequency-penalty",
            &flags[1],
            "--presence-penalty",
            &flags[2],
        ],
    );
    assert_eq!(cli, unbiased);
    assert_ne!(cli, plain);
    // A bias of +100 all but forces its token.
    let forced = server.complete(json!({"model": "lm", "prompt": prompt, "max_tokens": 10,
        "seed": 1, "logit_bias": {banned.to_string(): 100}}));
    assert_eq!(forced, plain[..1].repeat(10));

    let vocab = tokenizer.vocab_size();
    for (body, needle) in [
        (
            json!({"frequency_penalty": 2.5}),
            "frequency_penalty must be between -2 and 2",
        ),
        (
            json!({"presence_penalty": -3}),
            "presence_penalty must be between -2 and 2",
        ),
        (
            json!({"repetition_penalty": 0}),
            "repetition_penalty must be a finite number above 0",
        ),
        (
            json!({"logit_bias": {"x": 1}}),
            &format!("token ids below the vocabulary's size ({vocab}), got \"x\""),
        ),
        (
            json!({"logit_bias": {vocab.to_string(): 1}}),
            "below the vocabulary's size",
        ),
        (json!({"logit_bias": {"0": 101}}), "between -100 and 100"),
        (json!({"top_k": -2}), "top_k must be at least 1"),
    ] {
        let mut body = body;
        body["model"] = json!("lm");
        body["prompt"] = json!("to");
        server.refuses(body, needle);
    }
}

/// `n` choices: choice `i` is the same request's text with seed `seed + i`, whole or
/// streamed, chat too; usage counts every choice's tokens; with `echo` and `logprobs` each
/// choice scores the prompt alike.
#[test]
fn several_choices_are_the_request_with_the_seeds_after_its_own() {
    let dir = tempfile::tempdir().unwrap();
    lm_artifact(dir.path(), TEXT);
    let server = Server::start(dir.path(), &[]);
    let request = |n: usize, seed: u64| {
        json!({"model": "lm", "prompt": "to be", "max_tokens": 30, "temperature": 1.0,
            "seed": seed, "n": n})
    };
    let alone: Vec<String> = (0..4)
        .map(|i| server.complete(request(1, 20 + i)))
        .collect();
    let distinct: std::collections::HashSet<&String> = alone.iter().collect();
    assert!(distinct.len() > 1, "four seeds gave one text: {alone:?}");
    let (status, answer) = server.post("/v1/completions", &request(4, 20).to_string());
    assert_eq!(status, 200, "{answer}");
    let choices = answer["choices"].as_array().unwrap();
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], json!(i));
        assert_eq!(choice["text"], alone[i].as_str(), "choice {i}");
    }
    assert_eq!(choices.len(), 4);
    assert_eq!(answer["usage"]["prompt_tokens"], 5);
    assert_eq!(answer["usage"]["completion_tokens"], 4 * 30);
    // Streamed: the pieces, sorted by their choice's index, make the same texts; the usage
    // chunk counts them all.
    let mut streamed = request(4, 20);
    streamed["stream"] = json!(true);
    assert_eq!(server.stream_texts(streamed).0, alone);
    // Chat.
    let (status, chat) = server.post(
        "/v1/chat/completions",
        &json!({"model": "lm", "messages": [{"role": "user", "content": "to be"}],
            "max_tokens": 30, "temperature": 1.0, "seed": 20, "n": 2})
        .to_string(),
    );
    assert_eq!(status, 200, "{chat}");
    for i in 0..2 {
        assert_eq!(chat["choices"][i]["index"], json!(i));
        assert_eq!(chat["choices"][i]["message"]["content"], alone[i].as_str());
    }
    // Scores: every choice carries the prompt's, as one choice alone does.
    let scoring = |n: usize| {
        let (status, answer) = server.post(
            "/v1/completions",
            &json!({"model": "lm", "prompt": "to be", "max_tokens": 5, "seed": 20, "n": n,
                "echo": true, "logprobs": 2})
            .to_string(),
        );
        assert_eq!(status, 200, "{answer}");
        answer["choices"].as_array().unwrap().clone()
    };
    let one = scoring(1);
    let three = scoring(3);
    assert_eq!(three[0], one[0]);
    for choice in &three[1..] {
        for field in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let prompt = |c: &Value| c["logprobs"][field].as_array().unwrap()[..5].to_vec();
            assert_eq!(prompt(choice), prompt(&one[0]), "{field}");
        }
    }
}

#[test]
fn every_bad_request_gets_one_json_error_and_the_others_go_on() {
    let dir = tempfile::tempdir().unwrap();
    lm_artifact(dir.path(), TEXT);
    let server = Server::start(dir.path(), &["--max-tokens", "500", "--max-body", "100000"]);
    let error = |path: &str, body: &str| {
        let (status, answer) = server.post(path, body);
        let message = answer["error"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("no error message: {answer}"))
            .to_string();
        (status, message)
    };
    let cases: Vec<(&str, String, u16, &str)> = vec![
        (
            "malformed JSON",
            r#"{"model": "lm", "prompt": "to"#.into(),
            400,
            "EOF",
        ),
        (
            "unknown field",
            json!({"model": "lm", "prompt": "to", "best_of": 3}).to_string(),
            422,
            "unknown field `best_of`",
        ),
        (
            "wrong type",
            json!({"model": "lm", "prompt": "to", "max_tokens": "ten"}).to_string(),
            422,
            "expected usize",
        ),
        (
            "outside the vocabulary",
            json!({"model": "lm", "prompt": "to ZZ€"}).to_string(),
            400,
            "outside the model's vocabulary: 'Z', '€'",
        ),
        (
            "past the cap",
            json!({"model": "lm", "prompt": "to", "max_tokens": 501}).to_string(),
            400,
            "at most 500",
        ),
        (
            "prompt past the context",
            json!({"model": "lm", "prompt": "to ".repeat(30)}).to_string(),
            400,
            "context is 64",
        ),
        (
            "unknown model",
            json!({"model": "gpt-4", "prompt": "to"}).to_string(),
            404,
            "no model \"gpt-4\"",
        ),
        (
            "temperature",
            json!({"model": "lm", "prompt": "to", "temperature": -1}).to_string(),
            400,
            "temperature",
        ),
        (
            "too many choices",
            json!({"model": "lm", "prompt": "to", "n": 17}).to_string(),
            400,
            "must be 1 to 16",
        ),
        (
            "no choice",
            json!({"model": "lm", "prompt": "to", "n": 0}).to_string(),
            400,
            "must be 1 to 16",
        ),
        (
            "a body too large",
            format!(r#"{{"model": "lm", "prompt": "{}"}}"#, "t".repeat(200_000)),
            413,
            "length limit",
        ),
    ];
    for (what, body, want, needle) in cases {
        let (status, message) = error("/v1/completions", &body);
        assert_eq!(status, want, "{what}: {message}");
        assert!(
            message.contains(needle),
            "{what}: {needle:?} not in {message:?}"
        );
    }
    let (status, message) = error(
        "/v1/chat/completions",
        &json!({"model": "lm", "messages": [{"role": "robot", "content": "to"}]}).to_string(),
    );
    assert_eq!(
        (status, message.contains("unknown role")),
        (400, true),
        "{message}"
    );
    let (status, _) = server.get("/v1/nothing");
    assert_eq!(status, 404);
    // A client that leaves mid-stream, and one that never reads its stream: neither stops
    // the others, and the one that left is taken out of the batch.
    let stream = |tokens: usize| {
        let mut socket =
            std::net::TcpStream::connect(server.url.trim_start_matches("http://")).unwrap();
        let body = json!({"model": "lm", "prompt": "to", "max_tokens": tokens, "stream": true})
            .to_string();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        std::io::Write::write_all(&mut socket, head.as_bytes()).unwrap();
        socket
    };
    let silent = stream(500); // never read
    let mut leaving = stream(500);
    let mut first = [0u8; 64];
    leaving.read_exact(&mut first).unwrap();
    drop(leaving);
    let before = server.metric("transformer_lab_completion_tokens_total");
    let text =
        server.complete(json!({"model": "lm", "prompt": "to", "max_tokens": 50, "temperature": 0}));
    assert_eq!(text.chars().count(), 50);
    std::thread::sleep(Duration::from_millis(500));
    let (status, _) = server.get("/health");
    assert_eq!(status, 200);
    // The silent stream generates at most its 500 tokens; the one that left stopped early.
    let made = server.metric("transformer_lab_completion_tokens_total");
    assert!(made < 500.0 + 500.0 + 50.0, "{before} then {made} tokens");
    drop(silent);
    let (_, metrics) = server.get("/metrics");
    assert!(
        metrics
            .contains("transformer_lab_requests_total{route=\"/v1/completions\",status=\"400\"} 7"),
        "{metrics}"
    );
}

#[test]
fn a_full_queue_answers_503_with_retry_after_and_a_key_is_required_when_set() {
    let dir = tempfile::tempdir().unwrap();
    lm_artifact(dir.path(), TEXT);
    let server = Server::start(
        dir.path(),
        &["--max-batch", "1", "--queue", "1", "--api-key", "sesame"],
    );
    let body = json!({"model": "lm", "prompt": "to", "max_tokens": 300}).to_string();
    let (status, answer) = server.post("/v1/completions", &body);
    assert_eq!(status, 401, "{answer}");
    assert_eq!(answer["error"]["code"], json!("invalid_api_key"));
    let (status, _) = server.get("/health");
    assert_eq!(status, 200, "health needs no key");
    let statuses: Vec<(u16, Option<String>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..6)
            .map(|_| {
                scope.spawn(|| {
                    let mut response = agent()
                        .post(format!("{}/v1/completions", server.url))
                        .header("content-type", "application/json")
                        .header("authorization", "Bearer sesame")
                        .send(&body)
                        .unwrap();
                    let retry = response
                        .headers()
                        .get("retry-after")
                        .map(|v| v.to_str().unwrap().to_string());
                    let _ = response.body_mut().read_to_string();
                    (response.status().as_u16(), retry)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(statuses.iter().any(|(s, _)| *s == 200), "{statuses:?}");
    let busy: Vec<_> = statuses.iter().filter(|(s, _)| *s == 503).collect();
    assert!(!busy.is_empty(), "{statuses:?}");
    assert!(
        busy.iter().all(|(_, retry)| retry.as_deref() == Some("1")),
        "{statuses:?}"
    );
    assert!(
        statuses.iter().all(|(s, _)| *s == 200 || *s == 503),
        "{statuses:?}"
    );
    let (status, _) = server.post_with("/v1/completions", &body, Some("sesame"));
    assert_eq!(
        status, 200,
        "once the queue drains, requests are taken again"
    );
}

#[test]
fn sigterm_stops_the_server_cleanly_within_its_grace() {
    let dir = tempfile::tempdir().unwrap();
    lm_artifact(dir.path(), TEXT);
    let mut server = Server::start(dir.path(), &["--grace", "1", "--max-tokens", "1000000"]);
    // A long generation in flight when the signal comes.
    let url = server.url.clone();
    let flight = std::thread::spawn(move || {
        let mut response = agent()
            .post(format!("{url}/v1/completions"))
            .header("content-type", "application/json")
            .send(
                json!({"model": "lm", "prompt": "to", "max_tokens": 1000000, "stream": true})
                    .to_string(),
            )
            .unwrap();
        response.body_mut().read_to_string().unwrap_or_default()
    });
    std::thread::sleep(Duration::from_millis(800));
    let sent = Instant::now();
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(15),
            "still running 15 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    let mut stderr = String::new();
    server
        .child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(stderr.contains("stopping: no new requests"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let body = flight.join().unwrap();
    assert!(
        body.contains("\"finish_reason\":\"cancelled\""),
        "the generation in flight is cut with a reason: {}",
        &body[body.len().saturating_sub(400)..]
    );
}

#[test]
fn the_official_openai_client_talks_to_the_server() {
    let python = std::env::var("TRANSFORMER_LAB_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_client = Command::new(&python)
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_client {
        assert!(
            std::env::var_os("CI_EXPECT_OPENAI").is_none(),
            "CI_EXPECT_OPENAI is set but {python} cannot import openai"
        );
        crate::common::skip("no openai client: pip install openai, or set TRANSFORMER_LAB_PYTHON");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    lm_artifact(dir.path(), TEXT);
    let greedy = generated(dir.path(), "to be", 40, &["--greedy"]);
    let server = Server::start(dir.path(), &["--api-key", "sesame"]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve/openai_client.py");
    let out = Command::new(&python)
        .arg(script)
        .args([format!("{}/v1", server.url), greedy])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("all checks passed"), "{said}");
}

#[test]
fn translators_classifiers_and_every_kind_s_attention_answer_as_their_commands_do() {
    use crate::common::{classifier_artifact, translator_artifact};
    let dir = tempfile::tempdir().unwrap();
    lm_artifact(dir.path(), TEXT);
    translator_artifact(dir.path());
    std::fs::create_dir(dir.path().join("c")).unwrap();
    classifier_artifact(&dir.path().join("c"));
    let server = Server::start(
        dir.path(),
        &["--artifact-dir", "s2s", "--artifact-dir", "c/art"],
    );
    let (_, models) = server.get("/v1/models");
    let models: Value = serde_json::from_str(&models).unwrap();
    let kinds: Vec<(&str, &str)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["kind"].as_str().unwrap()))
        .collect();
    assert_eq!(
        kinds,
        [("lm", "lm"), ("s2s", "seq2seq"), ("art", "classifier")]
    );
    let cli = |args: &[&str]| {
        let out = crate::common::run(dir.path(), args);
        assert!(out.status.success(), "{}", crate::common::stderr(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    // Translate: the `translate` command's lines, greedy and beam 3.
    let texts = ["the cat sat", "a dog on the mat"];
    for beam in [1, 3] {
        let (status, answer) = server.post(
            "/v1/translate",
            &json!({"model": "s2s", "texts": texts, "beam": beam}).to_string(),
        );
        assert_eq!(status, 200, "{answer}");
        let b = beam.to_string();
        let printed = cli(&[
            "translate",
            "--artifact-dir",
            "s2s",
            "--beam",
            &b,
            texts[0],
            texts[1],
        ]);
        // The command prints one translation a line; an untrained model's byte-level output
        // may itself hold '\n' or '\r', so the server's translations are compared as printed
        // rather than the printout split into lines.
        let translations: Vec<&str> = (answer["translations"].as_array().unwrap().iter())
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(translations.len(), 2, "{answer}");
        assert_eq!(
            format!("{}\n", translations.join("\n")),
            printed,
            "beam {beam}"
        );
    }
    // Classify: the `classify` command's label and probability.
    let texts = ["a good movie", "money at the bank"];
    let (status, answer) = server.post(
        "/v1/classify",
        &json!({"model": "art", "texts": texts}).to_string(),
    );
    assert_eq!(status, 200, "{answer}");
    let lines = cli(&["classify", "--artifact-dir", "c/art", texts[0], texts[1]]);
    for (line, result) in lines.lines().zip(answer["results"].as_array().unwrap()) {
        let mut fields = line.split('\t');
        let (label, p) = (fields.next().unwrap(), fields.next().unwrap());
        assert_eq!(result["label"], json!(label), "{line}");
        let got = result["probabilities"][label].as_f64().unwrap();
        assert_eq!(format!("{got:.3}"), p, "{line}");
        let total: f64 = result["probabilities"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .sum();
        assert!((total - 1.0).abs() < 1e-5, "{result}");
    }
    // Attention, of each kind: what `attention --json` writes.
    for (model, dir_name, input) in [
        ("lm", "lm", "to be or"),
        ("s2s", "s2s", "the cat"),
        ("art", "c/art", "a bad movie"),
    ] {
        let (status, answer) = server.post(
            "/v1/attention",
            &json!({"model": model, "input": input}).to_string(),
        );
        assert_eq!(status, 200, "{model}: {answer}");
        let file = dir.path().join(format!("{model}.json"));
        let path = file.to_str().unwrap();
        cli(&[
            "attention",
            "--artifact-dir",
            dir_name,
            input,
            "--json",
            path,
        ]);
        let want: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert!(
            answer == want,
            "{model}: the maps served differ from attention --json's"
        );
    }
    // Embed: a word's vector, as wide as the model.
    let (status, answer) = server.post(
        "/v1/embed",
        &json!({"model": "art", "sentence": "money at the bank", "word": "bank"}).to_string(),
    );
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["contextual"].as_array().unwrap().len(), 16);
    // Each route refuses the kinds it is not for, and words that are not there.
    for (path, body, needle) in [
        (
            "/v1/completions",
            json!({"model": "art", "prompt": "a"}),
            "not a language model",
        ),
        (
            "/v1/translate",
            json!({"model": "art", "texts": ["a"]}),
            "not for a classifier",
        ),
        (
            "/v1/classify",
            json!({"model": "lm", "texts": ["to"]}),
            "not for a lm",
        ),
        (
            "/v1/embed",
            json!({"model": "art", "sentence": "a good movie", "word": "bank"}),
            "not in the sentence",
        ),
        (
            "/v1/translate",
            json!({"model": "s2s", "texts": []}),
            "1 to 256",
        ),
    ] {
        let (status, answer) = server.post(path, &body.to_string());
        assert_eq!(status, 400, "{path}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(needle),
            "{path}: {needle:?} not in {message:?}"
        );
    }
}

/// A multipart/form-data body of text `fields` and `(field, file name, bytes)` files, with its
/// content type — what `curl -F` sends.
fn form(fields: &[(&str, &str)], files: &[(&str, &str, Vec<u8>)]) -> (String, Vec<u8>) {
    let boundary = "----transformer-lab-test-7d1e";
    let mut body = Vec::new();
    for (name, value) in fields {
        body.extend(
            format!(
            "--{boundary}\r\ncontent-disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
        )
            .bytes(),
        );
    }
    for (name, file, bytes) in files {
        body.extend(format!(
            "--{boundary}\r\ncontent-disposition: form-data; name=\"{name}\"; filename=\"{file}\"\r\ncontent-type: image/png\r\n\r\n"
        ).bytes());
        body.extend(bytes);
        body.extend(b"\r\n");
    }
    body.extend(format!("--{boundary}--\r\n").bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// The files `names` in `dir`, as `image` fields of a form.
fn image_files(dir: &Path, names: &[&'static str]) -> Vec<(&'static str, &'static str, Vec<u8>)> {
    (names.iter())
        .map(|&name| ("image", name, std::fs::read(dir.join(name)).unwrap()))
        .collect()
}

impl Server {
    fn upload(
        &self,
        path: &str,
        fields: &[(&str, &str)],
        files: &[(&str, &str, Vec<u8>)],
    ) -> (u16, Value) {
        let (content_type, body) = form(fields, files);
        let mut response = agent()
            .post(format!("{}{path}", self.url))
            .header("content-type", content_type)
            .send(&body[..])
            .unwrap();
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().unwrap();
        let value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{path} answered {status} with non-JSON ({e}): {text}"));
        (status, value)
    }
}

#[test]
fn uploaded_images_get_what_predict_zero_shot_and_attention_print_and_no_path_is_read() {
    use crate::common::{clip_artifact, stroke_png, vit_artifact_seeded};
    let dir = tempfile::tempdir().unwrap();
    lm_artifact(dir.path(), TEXT);
    std::fs::create_dir(dir.path().join("v")).unwrap();
    vit_artifact_seeded(&dir.path().join("v"), Some(5));
    clip_artifact(dir.path());
    stroke_png(&dir.path().join("digit.png"), 28, false);
    stroke_png(&dir.path().join("paper.png"), 40, true);
    stroke_png(&dir.path().join("bar.png"), 8, false);
    let files = |names: &[&'static str]| image_files(dir.path(), names);
    let server = Server::start(
        dir.path(),
        &["--artifact-dir", "v/art", "--artifact-dir", "clip"],
    );
    let cli = |args: &[&str]| {
        let out = crate::common::run(dir.path(), args);
        assert!(out.status.success(), "{}", crate::common::stderr(&out));
        String::from_utf8(out.stdout).unwrap()
    };

    // predict: every class's probability; the command's ten lines, to its one decimal.
    let (status, answer) = server.upload(
        "/v1/predict",
        &[("model", "art")],
        &files(&["digit.png", "paper.png"]),
    );
    assert_eq!(status, 200, "{answer}");
    let printed = cli(&[
        "predict",
        "--artifact-dir",
        "v/art",
        "--top",
        "10",
        "digit.png",
        "paper.png",
    ]);
    let results = answer["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    let mut spread = 0.0f64;
    for (line, result) in printed.lines().zip(results) {
        let (image, ranked) = line.split_once(": ").unwrap();
        assert_eq!(result["image"], json!(image), "{line}");
        assert_eq!(
            result["inverted"],
            json!(line.contains("inverted")),
            "{line}"
        );
        let ranked = ranked.split(" (inverted").next().unwrap();
        for (i, shown) in ranked.split(", ").enumerate() {
            let (class, percent) = shown.rsplit_once(' ').unwrap();
            let p = result["probabilities"][class].as_f64().unwrap();
            assert_eq!(format!("{:.1}%", 100.0 * p), percent, "{line}");
            if i == 0 {
                assert_eq!(result["label"], json!(class), "{line}");
            }
            spread = spread.max((p - 0.1).abs());
        }
    }
    assert!(spread > 0.01, "the classes are told apart: {printed}");

    // zero-shot: each label's probability, as the command prints them.
    let labels = "a bar at the top,a dot in the middle,a bar on the left";
    let (status, answer) = server.upload(
        "/v1/zero-shot",
        &[("model", "clip"), ("labels", labels)],
        &files(&["bar.png"]),
    );
    assert_eq!(status, 200, "{answer}");
    let printed = cli(&[
        "zero-shot",
        "--artifact-dir",
        "clip",
        "--labels",
        labels,
        "bar.png",
    ]);
    let result = &answer["results"][0];
    let mut shown = 0;
    for line in printed.lines().skip(1) {
        let (label, percent) = line.trim().rsplit_once("  ").unwrap();
        let p = result["probabilities"][label.trim()].as_f64().unwrap();
        assert_eq!(format!("{:.1}%", 100.0 * p), percent.trim(), "{line}");
        shown += 1;
    }
    assert_eq!(shown, 3, "{printed}");

    // attention of an uploaded image (ViT, clip's image encoder) and of a caption: the JSON
    // `attention --json` writes.
    let json_of = |artifact: &str, input: &str| -> Value {
        let path = dir.path().join("maps.json");
        cli(&[
            "attention",
            "--artifact-dir",
            artifact,
            input,
            "--json",
            path.to_str().unwrap(),
        ]);
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    };
    for (model, artifact, image) in [("art", "v/art", "digit.png"), ("clip", "clip", "bar.png")] {
        let (status, answer) =
            server.upload("/v1/attention", &[("model", model)], &files(&[image]));
        assert_eq!(status, 200, "{model}: {answer}");
        assert!(
            answer == json_of(artifact, image),
            "{model}: the maps differ from the command's"
        );
    }
    let caption = "a bar at the top";
    let (status, answer) = server.post(
        "/v1/attention",
        &json!({"model": "clip", "input": caption}).to_string(),
    );
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer == json_of("clip", caption),
        "the caption's maps differ"
    );

    // A text naming a file on the server is never read as that file: for clip it is a
    // caption, for a ViT (which reads nothing else) an error.
    let on_server = dir.path().join("bar.png");
    let (status, answer) = server.post(
        "/v1/attention",
        &json!({"model": "clip", "input": on_server.to_str().unwrap()}).to_string(),
    );
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["groups"][0]["name"],
        json!("text"),
        "read as a caption"
    );
    assert!(answer.get("image").is_none());

    // Bad uploads: one JSON error each.
    std::fs::write(dir.path().join("notes.png"), "not an image").unwrap();
    type Case<'a> = (
        &'a str,
        Vec<(&'a str, &'a str)>,
        Vec<&'static str>,
        u16,
        &'a str,
    );
    let cases: Vec<Case> = vec![
        ("/v1/attention", vec![], vec![], 400, ""),
        (
            "/v1/predict",
            vec![("model", "art")],
            vec![],
            400,
            "give 1 to 64 files as `image`",
        ),
        (
            "/v1/predict",
            vec![("model", "art")],
            vec!["notes.png"],
            400,
            "notes.png is not a readable PNG or JPEG",
        ),
        (
            "/v1/predict",
            vec![("model", "art"), ("top", "3")],
            vec!["digit.png"],
            422,
            "unknown field `top`",
        ),
        (
            "/v1/predict",
            vec![("model", "lm")],
            vec!["digit.png"],
            400,
            "predict is not for a lm",
        ),
        (
            "/v1/predict",
            vec![],
            vec!["digit.png"],
            400,
            "the form has no `model`",
        ),
        (
            "/v1/zero-shot",
            vec![("model", "clip"), ("labels", "a bar,")],
            vec!["bar.png"],
            400,
            "none empty",
        ),
        (
            "/v1/zero-shot",
            vec![("model", "art"), ("labels", "a,b")],
            vec!["bar.png"],
            400,
            "zero-shot is not for a vit",
        ),
        (
            "/v1/attention",
            vec![("model", "lm")],
            vec!["bar.png"],
            400,
            "reads text, not images",
        ),
    ];
    for (path, fields, names, want, needle) in cases {
        let (status, answer) = if names.is_empty() && fields.is_empty() {
            // The ViT given a text: it reads only images.
            server.post(
                path,
                &json!({"model": "art", "input": on_server.to_str().unwrap()}).to_string(),
            )
        } else {
            server.upload(path, &fields, &files(&names))
        };
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(status, want, "{path} {fields:?}: {answer}");
        let needle = if needle.is_empty() {
            "attention is over an image"
        } else {
            needle
        };
        assert!(
            message.contains(needle),
            "{path}: {needle:?} not in {message:?}"
        );
    }
}

#[test]
fn the_playground_streams_shows_attention_aligns_and_classifies_in_a_real_browser() {
    use crate::browser::{have_browser, Browser};
    use crate::common::{classifier_artifact, translator_artifact};
    if !have_browser() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    lm_artifact(dir.path(), TEXT);
    translator_artifact(dir.path());
    std::fs::create_dir(dir.path().join("c")).unwrap();
    classifier_artifact(&dir.path().join("c"));
    std::fs::create_dir(dir.path().join("v")).unwrap();
    crate::common::vit_artifact_seeded(&dir.path().join("v"), Some(5));
    std::fs::rename(dir.path().join("v/art"), dir.path().join("v/digits")).unwrap();
    crate::common::stroke_png(&dir.path().join("digit.png"), 28, false);
    let server = Server::start(
        dir.path(),
        &[
            "--artifact-dir",
            "s2s",
            "--artifact-dir",
            "c/art",
            "--artifact-dir",
            "v/digits",
        ],
    );
    let browser = Browser::start(&dir.path().join("profile"));
    browser.post("/url", json!({"url": format!("{}/", server.url)}));
    browser.wait_for(
        "return Array.from(document.querySelectorAll('#model option')).map(o => o.value);",
        json!(["lm", "s2s", "art", "digits"]),
    );
    let errors = browser.errors();
    assert!(errors.is_empty(), "console errors on load: {errors:?}");

    // A language model: type a prompt, generate greedily, the tokens stream into the page —
    // what `generate` writes.
    let prompt = "to be";
    browser.type_into("#prompt", prompt);
    browser.script(
        "document.getElementById('temperature').value = '0'; \
         document.getElementById('max-tokens').value = '30';",
    );
    browser.click("#generate");
    browser.wait_for(
        "return document.getElementById('output').dataset.done === 'true';",
        json!(true),
    );
    let pieces: Vec<String> = serde_json::from_value(browser.script(
        "return Array.from(document.querySelectorAll('#output .token')).map(t => t.textContent);",
    ))
    .unwrap();
    assert_eq!(pieces.len(), 30, "one token per event: {pieces:?}");
    let want = generated(dir.path(), prompt, 30, &["--temperature", "0"]);
    assert_eq!(pieces.concat(), want, "the page shows what generate writes");

    // Click the sixth token: every layer's and head's strip is drawn, and the context is
    // coloured by the weights its step's query gave — the last row of the attention maps of
    // the text before it.
    browser.click("#output .token[data-step='5']");
    browser.wait_for(
        "return document.querySelectorAll('#heads-grid .strip canvas').length;",
        json!(2 * 4),
    );
    let context = format!("{prompt}{}", pieces[..5].concat());
    let (status, maps) = server.post(
        "/v1/attention",
        &json!({"model": "lm", "input": context, "window": true}).to_string(),
    );
    assert_eq!(status, 200, "{maps}");
    let weights = &maps["groups"][0]["weights"];
    let row = |layer: usize, head: usize| -> Vec<f64> {
        let rows = weights[layer][head].as_array().unwrap();
        serde_json::from_value(rows[rows.len() - 1].clone()).unwrap()
    };
    const SHOWN: &str = "return Array.from(document.querySelectorAll('#context-view .key')).map(k => Number(k.dataset.weight));";
    let close = |shown: Value, want: &[f64]| {
        let shown: Vec<f64> = serde_json::from_value(shown).unwrap();
        assert_eq!(shown.len(), context.chars().count());
        let worst = (shown.iter().zip(want))
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(worst < 1e-6, "shown {shown:?}, want {want:?}");
    };
    close(browser.script(SHOWN), &row(0, 0));
    // Each cell of a strip is drawn in the colour of its weight over the strip's peak (red
    // channel 247 - 239 · w / peak).
    let reds: Vec<f64> = serde_json::from_value(browser.script(
        "const c = document.querySelector(\".strip[data-layer='1'][data-head='2'] canvas\"); \
         const d = c.getContext('2d').getImageData(0, 7, c.width, 1).data; \
         const n = document.querySelectorAll('#context-view .key').length, cell = c.width / n; \
         return Array.from({length: n}, (_, k) => d[4 * (k * cell)]);",
    ))
    .unwrap();
    let strip = row(1, 2);
    let peak = strip.iter().copied().fold(0.0, f64::max);
    assert_eq!(reds.len(), strip.len());
    for (k, (red, w)) in reds.iter().zip(&strip).enumerate() {
        let want = (247.0 - 239.0 * w / peak).round();
        assert!((red - want).abs() <= 1.0, "key {k}: red {red}, want {want}");
    }
    browser.click(".strip[data-layer='1'][data-head='2']");
    close(browser.script(SHOWN), &row(1, 2));

    // A translator: its translation, and the cross-attention drawn target × source.
    browser.click("#model option[value='s2s']");
    browser.type_into("#source", "the cat sat");
    browser.click("#beam option:first-child");
    browser.click("#translate");
    browser.wait_for(
        "return document.getElementById('alignment').dataset.rows !== undefined;",
        json!(true),
    );
    let shown = browser.script("return document.getElementById('translation').textContent;");
    let out = crate::common::run(
        dir.path(),
        &[
            "translate",
            "--artifact-dir",
            "s2s",
            "--beam",
            "1",
            "the cat sat",
        ],
    );
    let translation = String::from_utf8(out.stdout).unwrap();
    assert_eq!(shown, json!(translation.trim_end_matches('\n')));
    // The maps of the translation shown, as the page asks for them: its text read back into
    // tokens, which can be fewer than the tokens decoded (an untrained model's output, cut at
    // max_len, need not be how the tokenizer splits the same text).
    let (_, maps) = server.post(
        "/v1/attention",
        &json!({"model": "s2s", "input": "the cat sat", "target": shown}).to_string(),
    );
    let cross = (maps["groups"].as_array().unwrap().iter())
        .find(|g| g["name"] == "cross")
        .unwrap();
    let drawn = browser.script(
        "const c = document.getElementById('alignment'); return [Number(c.dataset.rows), Number(c.dataset.cols)];",
    );
    let want = json!([
        cross["queries"].as_array().unwrap().len(),
        cross["keys"].as_array().unwrap().len()
    ]);
    assert_eq!(
        drawn, want,
        "one row per written token, one column per source token"
    );

    // A classifier: the probabilities follow the typing.
    browser.click("#model option[value='art']");
    let text = "a good movie";
    browser.type_into("#text", text);
    browser.wait_for(
        "return document.getElementById('probabilities').dataset.text;",
        json!(text),
    );
    let bars = browser.script(PROBABILITIES);
    let (_, answer) = server.post(
        "/v1/classify",
        &json!({"model": "art", "texts": [text]}).to_string(),
    );
    same_probabilities(&bars, &answer["results"][0]["probabilities"]);

    // A ViT: an image chosen from this computer, its class probabilities.
    browser.click("#model option[value='digits']");
    let image = dir.path().join("digit.png");
    browser.type_into("#image", image.to_str().unwrap());
    browser.click("#predict");
    browser.wait_for(
        "return document.querySelectorAll('#image-probabilities .bar').length;",
        json!(10),
    );
    let bars = browser.script(&PROBABILITIES.replace("#probabilities", "#image-probabilities"));
    let (_, answer) = server.upload(
        "/v1/predict",
        &[("model", "digits")],
        &image_files(dir.path(), &["digit.png"]),
    );
    same_probabilities(&bars, &answer["results"][0]["probabilities"]);

    let errors = browser.errors();
    assert!(errors.is_empty(), "console errors: {errors:?}");
}

const PROBABILITIES: &str = "return Object.fromEntries(Array.from(document.querySelectorAll('#probabilities .bar')).map(b => [b.dataset.name, Number(b.dataset.p)]));";

/// The bars a page shows are the probabilities the server gives.
fn same_probabilities(bars: &Value, want: &Value) {
    let (bars, want) = (bars.as_object().unwrap(), want.as_object().unwrap());
    assert_eq!(bars.len(), want.len(), "{bars:?}");
    for (class, p) in want {
        let shown = bars[class].as_f64().unwrap();
        let p = p.as_f64().unwrap();
        assert!((shown - p).abs() < 1e-6, "{class}: {shown} vs {p}");
    }
}

#[test]
fn bench_serve_loads_the_server_and_counts_what_it_sent() {
    let dir = tempfile::tempdir().unwrap();
    lm_artifact(dir.path(), TEXT);
    let out = crate::common::run(
        dir.path(),
        &[
            "bench",
            "serve",
            "--artifact-dir",
            "lm",
            "--clients",
            "1,3",
            "--requests",
            "2",
            "--max-tokens",
            "8",
            "--prompt",
            "to",
            "--backend",
            "ndarray",
            "--csv",
            "load.csv",
        ],
    );
    assert!(out.status.success(), "{}", crate::common::stderr(&out));
    let csv = std::fs::read_to_string(dir.path().join("load.csv")).unwrap();
    let rows: Vec<Vec<&str>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    let counted: Vec<(&str, &str, &str)> = rows.iter().map(|r| (r[0], r[1], r[2])).collect();
    assert_eq!(
        counted,
        [
            ("one at a time", "1", "2"),
            ("one at a time", "3", "6"),
            ("batched", "1", "2"),
            ("batched", "3", "6"),
        ]
    );
    for row in &rows {
        // tokens/s over requests/s is the tokens per request: 8.
        let (requests, tokens): (f64, f64) = (row[3].parse().unwrap(), row[4].parse().unwrap());
        assert!((tokens / requests - 8.0).abs() < 0.1, "{row:?}");
    }
    let said = String::from_utf8(out.stdout).unwrap();
    assert!(said.contains("batching at 3 clients:"), "{said}");
    let bad = crate::common::run(
        dir.path(),
        &["bench", "serve", "--artifact-dir", "lm", "--clients", "0"],
    );
    crate::common::assert_clean_error(&bad, "at least 1");
}
