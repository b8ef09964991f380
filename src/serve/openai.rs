//! The OpenAI-compatible routes: `GET /v1/models`, `POST /v1/completions` and
//! `POST /v1/chat/completions`, streamed (server-sent events, one event per piece of text as
//! it is produced, then `data: [DONE]`) or not. The request and response fields are OpenAI's;
//! a field this server does not know is refused by name rather than ignored.

use super::engine::{Event as EngineEvent, Finish, Job, Scored, Submit};
use super::text::TextOut;
use super::{ApiError, ApiJson, App};
use crate::generate::{Penalties, Sampling};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

/// A prompt: one string, or a list holding one; or token ids, or a list holding one list.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One text.
    One(String),
    /// Several texts (this server takes one).
    Many(Vec<String>),
    /// One prompt's token ids, exactly as the model reads them.
    Ids(Vec<usize>),
    /// Several prompts' token ids (this server takes one).
    ManyIds(Vec<Vec<usize>>),
}

/// A prompt as given: text to encode, or token ids to take as they are.
pub enum Given {
    /// Text.
    Text(String),
    /// Token ids.
    Ids(Vec<usize>),
}

/// One or several stop strings.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One.
    One(String),
    /// Up to four.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with the token counts.
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling fields the two generation routes share.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    max_tokens: Option<usize>,
    /// OpenAI's newer name for `max_tokens` in chat.
    max_completion_tokens: Option<usize>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    /// vLLM's extension: only the `k` most likely tokens (`-1` or `0`: all).
    top_k: Option<i64>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    /// vLLM's extension, Hugging Face's `repetition_penalty`.
    repetition_penalty: Option<f32>,
    /// Token id (as a string) → bias added to its logit.
    logit_bias: Option<BTreeMap<String, f32>>,
    stop: Option<Stop>,
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    n: Option<usize>,
    /// Accepted and unused (OpenAI's end-user id).
    #[allow(dead_code)]
    user: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    model: String,
    prompt: Prompt,
    /// Put the prompt before the completion in the answer.
    #[serde(default)]
    echo: bool,
    /// Give each token's log-probability and this many most likely alternatives (0–5); with
    /// `echo`, the prompt's tokens too (how evaluation harnesses score a text).
    logprobs: Option<usize>,
    #[serde(flatten)]
    settings: Settings,
}

/// One message of a chat.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    role: String,
    content: String,
    #[allow(dead_code)]
    name: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    model: String,
    messages: Vec<Message>,
    #[serde(flatten)]
    settings: Settings,
}

/// `GET /v1/models`.
pub async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    let data: Vec<Value> = app
        .workers
        .iter()
        .map(|(id, worker)| {
            let mut model = json!({"id": id, "object": "model", "created": app.created,
                "owned_by": "transformer-lab", "kind": worker.kind});
            if let Some(lm) = app.models.iter().find(|m| m.id == *id) {
                model["context"] = json!(lm.context);
            }
            model
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// `POST /v1/completions`.
pub async fn completions(
    State(app): State<Arc<App>>,
    ApiJson(request): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let one = |count: usize| {
        ApiError::invalid(
            "prompt",
            format!("give one prompt per request (got {count})"),
        )
    };
    let prompt = match request.prompt {
        Prompt::One(text) => Given::Text(text),
        Prompt::Many(mut texts) if texts.len() == 1 => Given::Text(texts.remove(0)),
        Prompt::Many(texts) => return Err(one(texts.len())),
        Prompt::Ids(ids) => Given::Ids(ids),
        Prompt::ManyIds(mut lists) if lists.len() == 1 => Given::Ids(lists.remove(0)),
        Prompt::ManyIds(lists) => return Err(one(lists.len())),
    };
    if let Some(k) = request.logprobs {
        if k > MAX_LOGPROBS {
            return Err(ApiError::invalid(
                "logprobs",
                format!("logprobs is at most {MAX_LOGPROBS}, got {k}"),
            ));
        }
        if request.settings.stream {
            return Err(ApiError::invalid(
                "logprobs",
                "logprobs come with whole answers: ask without stream".into(),
            ));
        }
    }
    run(
        app,
        &request.model,
        prompt,
        request.settings,
        16,
        Route::Completion {
            echo: request.echo,
            logprobs: request.logprobs,
        },
    )
    .await
}

/// `POST /v1/chat/completions`. The models served are not trained on conversations: the
/// messages' contents, joined by newlines, are the prompt the model continues, and the
/// continuation is the assistant's message.
pub async fn chat(
    State(app): State<Arc<App>>,
    ApiJson(request): ApiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    if request.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "give at least one message".into(),
        ));
    }
    if let Some(m) = request.messages.iter().find(|m| {
        !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer"
        )
    }) {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "unknown role {:?} (system, developer, user or assistant)",
                m.role
            ),
        ));
    }
    let contents: Vec<&str> = request
        .messages
        .iter()
        .map(|m| m.content.as_str())
        .collect();
    let prompt = contents.join("\n");
    run(
        app,
        &request.model,
        Given::Text(prompt),
        request.settings,
        256,
        Route::Chat,
    )
    .await
}

/// The most alternatives `logprobs` may ask for (OpenAI's limit).
const MAX_LOGPROBS: usize = 5;

/// Which answer format.
enum Route {
    Completion { echo: bool, logprobs: Option<usize> },
    Chat,
}

impl Route {
    fn object(&self, stream: bool) -> &'static str {
        match (self, stream) {
            (Route::Completion { .. }, _) => "text_completion",
            (Route::Chat, false) => "chat.completion",
            (Route::Chat, true) => "chat.completion.chunk",
        }
    }

    /// One choice holding `text` (a whole answer, or one streamed piece).
    fn choice(
        &self,
        index: usize,
        text: &str,
        finish: Option<&str>,
        stream: bool,
        first: bool,
    ) -> Value {
        match self {
            Route::Completion { .. } => {
                json!({"index": index, "text": text, "logprobs": null, "finish_reason": finish})
            }
            Route::Chat if !stream => json!({
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish,
            }),
            Route::Chat => {
                let delta = match (first, finish) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, Some(_)) if text.is_empty() => json!({}),
                    _ => json!({"content": text}),
                };
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        }
    }
}

/// The most choices one request may ask for.
const MAX_CHOICES: usize = 16;

/// A checked generation request, ready for the engine.
struct Checked {
    prompt: Vec<usize>,
    /// Choices: choice `i` is drawn with `seed + i`.
    n: usize,
    max_tokens: usize,
    sampling: Sampling,
    seed: u64,
    stops: Vec<String>,
    stream: bool,
    usage_in_stream: bool,
}

fn check(
    app: &App,
    prompt: Vec<usize>,
    vocab: usize,
    settings: Settings,
    default_max: usize,
) -> Result<Checked, ApiError> {
    let n = settings.n.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(ApiError::invalid(
            "n",
            format!("n (choices per request) must be 1 to {MAX_CHOICES}, got {n}"),
        ));
    }
    let max_tokens = settings
        .max_tokens
        .or(settings.max_completion_tokens)
        .unwrap_or(default_max.min(app.max_tokens));
    if max_tokens > app.max_tokens {
        return Err(ApiError::invalid(
            "max_tokens",
            format!(
                "max_tokens is {max_tokens}; this server allows at most {}",
                app.max_tokens
            ),
        ));
    }
    let temperature = settings.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("temperature must be between 0 and 2, got {temperature}"),
        ));
    }
    let top_p = settings.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            "top_p",
            format!("top_p must be in (0, 1], got {top_p}"),
        ));
    }
    let top_k = match settings.top_k {
        None | Some(-1 | 0) => None,
        Some(k) if k > 0 => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("top_k must be at least 1 (or -1 for all), got {k}"),
            ))
        }
    };
    let penalties = penalties(&settings, vocab)?;
    let stops = match settings.stop {
        None => Vec::new(),
        Some(Stop::One(stop)) => vec![stop],
        Some(Stop::Many(stops)) if stops.len() <= 4 => stops,
        Some(Stop::Many(stops)) => {
            return Err(ApiError::invalid(
                "stop",
                format!("give at most 4 stop strings (got {})", stops.len()),
            ))
        }
    };
    Ok(Checked {
        prompt,
        n,
        max_tokens,
        sampling: Sampling {
            temperature,
            top_k,
            top_p: (top_p < 1.0).then_some(top_p),
            greedy: temperature == 0.0,
            penalties,
        },
        seed: settings.seed.unwrap_or_else(rand::random),
        stops,
        stream: settings.stream,
        usage_in_stream: settings.stream_options.unwrap_or_default().include_usage,
    })
}

/// The request's penalties and biases, checked against OpenAI's ranges (and vLLM's for
/// `repetition_penalty`) and the vocabulary.
fn penalties(settings: &Settings, vocab: usize) -> Result<Penalties, ApiError> {
    let mut penalties = Penalties {
        repetition: settings.repetition_penalty.unwrap_or(1.0),
        frequency: settings.frequency_penalty.unwrap_or(0.0),
        presence: settings.presence_penalty.unwrap_or(0.0),
        bias: Vec::new(),
    };
    if let Some((name, range, value)) = penalties.out_of_range() {
        let param = match name {
            "repetition" => "repetition_penalty",
            "frequency" => "frequency_penalty",
            _ => "presence_penalty",
        };
        let message = format!("{param} must be {range}, got {value}");
        return Err(ApiError::invalid(param, message));
    }
    for (token, &bias) in settings.logit_bias.iter().flatten() {
        let id = match token.parse::<usize>() {
            Ok(id) if id < vocab => id,
            _ => {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!(
                        "logit_bias keys are token ids below the vocabulary's size ({vocab}), \
                         got {token:?}"
                    ),
                ))
            }
        };
        if !(-100.0..=100.0).contains(&bias) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("a logit bias must be between -100 and 100, got {bias} for {token}"),
            ));
        }
        penalties.bias.push((id, bias));
    }
    Ok(penalties)
}

/// Queues the request on its model's engine and answers, streamed or whole.
async fn run(
    app: Arc<App>,
    model_id: &str,
    prompt: Given,
    settings: Settings,
    default_max: usize,
    route: Route,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let model = app.model(model_id)?;
    let (prompt, ids) = model.prompt(prompt)?;
    let checked = check(
        &app,
        ids,
        model.tokenizer.vocab_size(),
        settings,
        default_max,
    )?;
    let prompt_tokens = checked.prompt.len();
    let (logprobs, score_prompt) = match &route {
        Route::Completion { echo, logprobs } => (*logprobs, logprobs.is_some() && *echo),
        Route::Chat => (None, false),
    };
    if score_prompt && prompt_tokens > model.context {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "echo with logprobs scores the prompt in one window of the model's context ({} \
                 tokens); the prompt has {prompt_tokens}",
                model.context
            ),
        ));
    }
    let scored_prompt = score_prompt.then(|| checked.prompt.clone());
    // One job a choice, choice i drawn with seed + i; the first scores the prompt for all.
    // Should the queue fill before the last, the readers made so far are dropped, which
    // closes their channels: the engine skips those jobs.
    let mut readers = Vec::with_capacity(checked.n);
    for i in 0..checked.n {
        let (events, tokens) = mpsc::unbounded_channel();
        let job = Job {
            prompt: checked.prompt.clone(),
            max_tokens: checked.max_tokens,
            sampling: checked.sampling.clone(),
            seed: checked.seed.wrapping_add(i as u64),
            logprobs,
            score_prompt: score_prompt && i == 0,
            events,
        };
        if let Submit::Full = model.engine.submit(job) {
            return Err(ApiError::busy(&model.id));
        }
        readers.push(Reader {
            out: TextOut::new(model.tokenizer.clone(), checked.stops.clone()),
            model: model.id.clone(),
            app: app.clone(),
            tokens,
            arrived,
            last: arrived,
            done: false,
            prompt_scores: Vec::new(),
            scored: Vec::new(),
        });
    }
    app.metrics
        .prompt_tokens
        .with_label_values(&[&model.id])
        .inc_by(prompt_tokens as u64);
    let head = json!({
        "id": format!("cmpl-{:016x}", rand::random::<u64>()),
        "object": route.object(checked.stream),
        "created": super::now(),
        "model": model.id,
    });
    let usage = move |completion: usize| json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion});
    let echo = match &route {
        Route::Completion { echo: true, .. } => Some(prompt.clone()),
        _ => None,
    };
    if !checked.stream {
        // Every choice read at once, so that a stop string ends its row at once; should the
        // client leave, dropping the set aborts the readers, which closes their channels.
        let mut reading = tokio::task::JoinSet::new();
        for (index, mut reader) in readers.into_iter().enumerate() {
            reading.spawn(async move {
                let (mut text, mut finish) = (String::new(), "cancelled");
                while let Some(piece) = reader.next().await {
                    text.push_str(&piece.text);
                    if let Some(reason) = piece.finish {
                        finish = reason;
                    }
                }
                (index, text, finish, reader)
            });
        }
        let mut read = Vec::with_capacity(checked.n);
        while let Some(done) = reading.join_next().await {
            read.push(done.map_err(|e| {
                let message = format!("a choice's reader failed: {e}");
                ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, message)
            })?);
        }
        read.sort_by_key(|r| r.0);
        // The first choice's job scored the prompt for every choice.
        let prompt_scores = std::mem::take(&mut read[0].3.prompt_scores);
        let prompt_scored = scored_prompt.as_deref().map(|p| (p, &prompt_scores[..]));
        let (mut choices, mut completion_tokens) = (Vec::new(), 0);
        for (index, text, finish, reader) in read {
            completion_tokens += reader.out.tokens();
            let whole = format!("{}{text}", echo.as_deref().unwrap_or_default());
            let mut choice = route.choice(index, &whole, Some(finish), false, true);
            if logprobs.is_some() {
                choice["logprobs"] = reader.logprobs(
                    prompt_scored,
                    prompt.chars().count(),
                    (finish == "stop").then_some(text.chars().count()),
                );
            }
            choices.push(choice);
        }
        let mut answer = head;
        answer["choices"] = json!(choices);
        answer["usage"] = usage(completion_tokens);
        return Ok(Json(answer).into_response());
    }
    // Streamed: a small bounded channel to the connection, so a client that does not read
    // holds a few events here (and at most max_tokens tokens in the engine's channel); one
    // that leaves closes it, which ends the tasks and takes the requests out of the batch.
    // Each choice's pieces go out as they come, marked with its index.
    let (sender, events) = mpsc::channel::<Event>(16);
    let usage_in_stream = checked.usage_in_stream;
    let route = Arc::new(route);
    let tasks: Vec<_> = (readers.into_iter().enumerate())
        .map(|(index, mut reader)| {
            let (sender, head, route, echo) =
                (sender.clone(), head.clone(), route.clone(), echo.clone());
            tokio::spawn(async move {
                let chunk = |text: &str, finish: Option<&str>, first: bool| {
                    let mut chunk = head.clone();
                    chunk["choices"] = json!([route.choice(index, text, finish, true, first)]);
                    Event::default().data(chunk.to_string())
                };
                let mut first = true;
                if let Some(prompt) = echo {
                    if sender.send(chunk(&prompt, None, true)).await.is_err() {
                        return None;
                    }
                    first = false;
                }
                while let Some(piece) = reader.next().await {
                    if sender
                        .send(chunk(&piece.text, piece.finish, first))
                        .await
                        .is_err()
                    {
                        return None;
                    }
                    first = false;
                }
                Some(reader.out.tokens())
            })
        })
        .collect();
    tokio::spawn(async move {
        let mut completion_tokens = 0;
        for task in tasks {
            match task.await {
                Ok(Some(tokens)) => completion_tokens += tokens,
                _ => return, // the client has gone
            }
        }
        if usage_in_stream {
            let mut last = head.clone();
            last["choices"] = json!([]);
            last["usage"] = usage(completion_tokens);
            if sender
                .send(Event::default().data(last.to_string()))
                .await
                .is_err()
            {
                return;
            }
        }
        let _ = sender.send(Event::default().data("[DONE]")).await;
    });
    let stream = ReceiverStream::new(events).map(Ok::<Event, Infallible>);
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// A piece of the answer: text, and with the last one why it ended.
struct Piece {
    text: String,
    finish: Option<&'static str>,
}

/// Turns the engine's tokens for one request into pieces of text, and records the latencies.
struct Reader {
    out: TextOut,
    model: String,
    app: Arc<App>,
    tokens: mpsc::UnboundedReceiver<EngineEvent>,
    arrived: Instant,
    last: Instant,
    done: bool,
    /// The prompt's scores, where its job was asked for them (the first choice's).
    prompt_scores: Vec<Scored>,
    /// The generated tokens with their scores, where asked.
    scored: Vec<(usize, Scored)>,
}

impl Reader {
    /// The next non-empty piece, or the last one; `None` after the last.
    async fn next(&mut self) -> Option<Piece> {
        if self.done {
            return None;
        }
        let metrics = &self.app.metrics;
        loop {
            let finish = match self.tokens.recv().await {
                Some(EngineEvent::Prompt(scores)) => {
                    self.prompt_scores = scores;
                    continue;
                }
                Some(EngineEvent::Token(token, scored)) => {
                    if let Some(scored) = scored {
                        self.scored.push((token, scored));
                    }
                    let now = Instant::now();
                    let (histogram, since) = if self.out.tokens() == 0 {
                        (&metrics.first_token, self.arrived)
                    } else {
                        (&metrics.per_token, self.last)
                    };
                    histogram
                        .with_label_values(&[&self.model])
                        .observe((now - since).as_secs_f64());
                    self.last = now;
                    metrics
                        .completion_tokens
                        .with_label_values(&[&self.model])
                        .inc();
                    let text = self.out.push(token);
                    if self.out.stopped {
                        // Closing the channel takes the request out of the batch.
                        self.tokens.close();
                        self.done = true;
                        return Some(Piece {
                            text,
                            finish: Some("stop"),
                        });
                    }
                    if text.is_empty() {
                        continue;
                    }
                    return Some(Piece { text, finish: None });
                }
                Some(EngineEvent::Done(Finish::Length)) => "length",
                Some(EngineEvent::Done(Finish::Cancelled)) | None => "cancelled",
            };
            self.done = true;
            return Some(Piece {
                text: self.out.finish(),
                finish: Some(finish),
            });
        }
    }

    /// The answer's `logprobs` (OpenAI's completions form): each token's text, log-probability
    /// and most likely alternatives, and where its text begins — the prompt's tokens first when
    /// `prompt` is given with the scores of its tokens after the first (which has none: nothing
    /// precedes it); otherwise the offsets begin after the prompt's `prompt_chars` characters.
    /// A stop string cut the text at `stopped_at` characters of the completion: the tokens
    /// after the cut are left out.
    fn logprobs(
        &self,
        prompt: Option<(&[usize], &[Scored])>,
        prompt_chars: usize,
        stopped_at: Option<usize>,
    ) -> Value {
        let tokenizer = self.out.tokenizer();
        let top = |scored: &Scored| {
            let mut map = serde_json::Map::new();
            for &(token, logprob) in &scored.top {
                map.entry(tokenizer.decode(&[token]))
                    .or_insert(json!(logprob));
            }
            Value::Object(map)
        };
        let (mut tokens, mut logprobs, mut tops, mut offsets) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // One token's entries, at character `at`; returns the length of its text.
        let mut push = |token: usize, scored: Option<&Scored>, at: usize| {
            let text = tokenizer.decode(&[token]);
            let length = text.chars().count();
            offsets.push(at);
            tokens.push(text);
            logprobs.push(scored.map_or(Value::Null, |s| json!(s.logprob)));
            tops.push(scored.map_or(Value::Null, top));
            length
        };
        let mut at = 0;
        match prompt {
            Some((prompt, scores)) => {
                for (i, &token) in prompt.iter().enumerate() {
                    let scored = i.checked_sub(1).and_then(|i| scores.get(i));
                    at += push(token, scored, at);
                }
            }
            None => at = prompt_chars,
        }
        let start = at;
        for (token, scored) in &self.scored {
            if stopped_at.is_some_and(|end| at - start >= end) {
                break;
            }
            at += push(*token, Some(scored), at);
        }
        json!({"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": offsets})
    }
}
