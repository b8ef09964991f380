//! `serve`: trained models behind an HTTP API — OpenAI-compatible completions for language
//! models, with continuous batching of concurrent requests ([`engine`]), the other kinds' routes
//! ([`worker`], [`upload`]), the playground page at `/`, Prometheus metrics and a health check,
//! on axum and tokio.
//!
//! Every model is loaded once on its worker's thread; a language model also once on its
//! engine's thread, which decodes. The HTTP side checks each request
//! (unknown fields, characters outside the vocabulary, limits) and answers every bad one with
//! one JSON error, OpenAI's shape, without touching the others.

pub mod engine;
pub mod metrics;
mod openai;
pub mod text;
pub mod upload;
pub mod worker;

use crate::artifact::ArtifactDir;
use crate::config::LmConfig;
use crate::data::Tokenizer;
use crate::generate::check_prompt;
use crate::kernels::LabBackend;
use crate::kinds::load_as;
use crate::nn::PositionKind;
use anyhow::{bail, Context, Result};
use axum::extract::{FromRequest, MatchedPath, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use engine::{EngineConfig, EngineHandle};
use metrics::Metrics;
use serde::de::DeserializeOwned;
use serde_json::json;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;
use worker::WorkerHandle;

/// What `serve` is told.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The artifacts to serve; each model's id is its directory's name.
    pub artifacts: Vec<PathBuf>,
    /// Address to listen on.
    pub host: String,
    /// Port (0: any free one; the line printed at start says which).
    pub port: u16,
    /// A bearer token every request but `/health` and the playground page must carry.
    pub api_key: Option<String>,
    /// Requests decoded together on one model at most.
    pub max_batch: usize,
    /// Requests waiting per model at most; past it, 503 with `Retry-After`.
    pub queue: usize,
    /// `max_tokens` a request may ask for at most.
    pub max_tokens: usize,
    /// Largest request body, in bytes.
    pub max_body: usize,
    /// On Ctrl-C or SIGTERM, how long running generations may go on before they are cut.
    pub grace: Duration,
}

/// One model being served.
pub struct Served {
    /// Its id in the API.
    pub id: String,
    tokenizer: Arc<Tokenizer>,
    context: usize,
    position: PositionKind,
    engine: EngineHandle,
}

impl Served {
    /// `text`, cut to its last `context` tokens when longer.
    fn window(&self, text: String) -> Result<String, ApiError> {
        let ids = (self.tokenizer.encode(&text))
            .map_err(|e| ApiError::invalid("input", format!("{e:#}")))?;
        Ok(match ids.len().checked_sub(self.context) {
            Some(cut) if cut > 0 => self.tokenizer.decode(&ids[cut..]),
            _ => text,
        })
    }

    /// The prompt's text and token ids, or the error a client gets: text is encoded, ids are
    /// taken as they are (each below the vocabulary's size) and decoded for the text.
    fn prompt(&self, given: openai::Given) -> Result<(String, Vec<usize>), ApiError> {
        let (text, ids) = match given {
            openai::Given::Text(text) => {
                // An empty prompt starts a fresh passage, as `generate` does.
                let ids = (self.tokenizer)
                    .encode(if text.is_empty() { "\n" } else { &text })
                    .map_err(|e| ApiError::invalid("prompt", format!("{e:#}")))?;
                (text, ids)
            }
            openai::Given::Ids(ids) => {
                let vocab = self.tokenizer.vocab_size();
                if let Some(bad) = ids.iter().find(|&&id| id >= vocab) {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!(
                            "token id {bad} is not in the vocabulary (ids 0–{})",
                            vocab - 1
                        ),
                    ));
                }
                (self.tokenizer.decode(&ids), ids)
            }
        };
        check_prompt(ids.len(), self.context, self.position)
            .map_err(|e| ApiError::invalid("prompt", format!("{e:#}")))?;
        Ok((text, ids))
    }
}

/// The server's state.
pub struct App {
    /// The language models, with their engines.
    models: Vec<Served>,
    /// Every model (language models too), by id, with the worker that answers the routes
    /// for one request at a time (translate, classify, attention, embed).
    workers: Vec<(String, WorkerHandle)>,
    /// When the server started (seconds since the epoch).
    created: u64,
    metrics: Metrics,
    api_key: Option<String>,
    max_tokens: usize,
}

impl App {
    /// The language model `id`.
    fn model(&self, id: &str) -> Result<&Served, ApiError> {
        self.worker(id)?;
        self.models.iter().find(|m| m.id == id).ok_or_else(|| {
            ApiError::invalid(
                "model",
                format!("{id} is not a language model: completions need one"),
            )
        })
    }

    /// The worker of model `id` (any kind).
    fn worker(&self, id: &str) -> Result<&WorkerHandle, ApiError> {
        match self.workers.iter().find(|(known, _)| known == id) {
            Some((_, worker)) => Ok(worker),
            None => {
                let known: Vec<&str> = self.workers.iter().map(|(id, _)| id.as_str()).collect();
                Err(ApiError {
                    status: StatusCode::NOT_FOUND,
                    message: format!("no model {id:?} here; this server has {}", known.join(", ")),
                    kind: "invalid_request_error",
                    param: Some("model"),
                    code: Some("model_not_found"),
                    retry_after: None,
                })
            }
        }
    }
}

/// An error as OpenAI's API gives it: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
    retry_after: Option<u64>,
}

impl ApiError {
    fn invalid(param: &'static str, message: String) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message,
            kind: "invalid_request_error",
            param: Some(param),
            code: None,
            retry_after: None,
        }
    }

    /// An error with `status` (a rejection's).
    fn status(status: StatusCode, message: String) -> Self {
        Self {
            status,
            message,
            kind: "invalid_request_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    fn busy(model: &str) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!("{model} has as many requests waiting as it takes; try again shortly"),
            kind: "server_busy",
            param: None,
            code: Some("queue_full"),
            retry_after: Some(1),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code,
        }});
        let mut response = (self.status, Json(body)).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// A JSON body whose every rejection (malformed, wrong type, unknown field, too large) is an
/// [`ApiError`] with the rejection's status and message.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(value)) => Ok(Self(value)),
            Err(rejection) => Err(ApiError::status(rejection.status(), rejection.body_text())),
        }
    }
}

/// Seconds since the epoch.
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `GET /health`.
async fn health(State(app): State<Arc<App>>) -> Json<serde_json::Value> {
    let models: Vec<&str> = app.workers.iter().map(|(id, _)| id.as_str()).collect();
    Json(json!({"status": "ok", "models": models}))
}

/// `GET /`: the playground, one self-contained page (no network but this server).
async fn playground() -> axum::response::Html<&'static str> {
    axum::response::Html(include_str!("playground.html"))
}

/// `GET /metrics`.
async fn metrics(State(app): State<Arc<App>>) -> Response {
    for model in &app.models {
        let load =
            |n: &std::sync::atomic::AtomicUsize| n.load(std::sync::atomic::Ordering::SeqCst) as i64;
        app.metrics
            .waiting
            .with_label_values(&[&model.id])
            .set(load(&model.engine.waiting));
        app.metrics
            .running
            .with_label_values(&[&model.id])
            .set(load(&model.engine.running));
        app.metrics
            .steps
            .with_label_values(&[&model.id])
            .set(load(&model.engine.steps));
        app.metrics
            .rows
            .with_label_values(&[&model.id])
            .set(load(&model.engine.rows));
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
        .into_response()
}

/// Refuses requests without the bearer token (when one is set); `/health` and `/` are open.
async fn authorize(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // The health check and the playground page (which holds no data) are open.
        let open = ["/health", "/"].contains(&request.uri().path());
        if !open && given != Some(key.as_str()) {
            return ApiError {
                status: StatusCode::UNAUTHORIZED,
                message: "this server needs an API key: send `Authorization: Bearer KEY`".into(),
                kind: "invalid_request_error",
                param: None,
                code: Some("invalid_api_key"),
                retry_after: None,
            }
            .into_response();
        }
    }
    next.run(request).await
}

/// The most of a too-large body the server reads (and drops) before answering 413.
const DRAIN_LIMIT: u64 = 64 << 20;

/// A request whose declared body is over `max_body` bytes is answered 413 without reaching its
/// route. Its body is read and dropped first (up to [`DRAIN_LIMIT`] bytes, for at most 10 s): a
/// server that answers while the client is still sending closes the connection under it, and
/// the client sees a broken pipe instead of the answer. A body sent without a length still
/// meets the limit where its route reads it (`DefaultBodyLimit`).
async fn too_large(max_body: usize, request: Request, next: Next) -> Response {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let Some(length) = declared.filter(|&n| n > max_body as u64) else {
        return next.run(request).await;
    };
    if length <= DRAIN_LIMIT {
        let mut data = request.into_body().into_data_stream();
        let drain = async { while let Some(Ok(_)) = data.next().await {} };
        let _ = tokio::time::timeout(Duration::from_secs(10), drain).await;
    }
    ApiError::status(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!(
            "length limit exceeded: the body is {length} bytes, this server takes at most \
             {max_body} (--max-body)"
        ),
    )
    .into_response()
}

/// Counts each request by route and status, and times it to the start of its answer.
async fn record(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_string();
    let started = Instant::now();
    let response = next.run(request).await;
    app.metrics
        .requests
        .with_label_values(&[&route, response.status().as_str()])
        .inc();
    app.metrics
        .latency
        .with_label_values(&[&route])
        .observe(started.elapsed().as_secs_f64());
    response
}

/// Unknown routes: a JSON 404.
async fn not_found(request: Request) -> ApiError {
    ApiError::status(
        StatusCode::NOT_FOUND,
        format!("no route {} {}", request.method(), request.uri().path()),
    )
}

/// The routes.
fn router(app: Arc<App>, max_body: usize) -> Router {
    Router::new()
        .route("/", get(playground))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(openai::models))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/translate", post(worker::translate))
        .route("/v1/classify", post(worker::classify))
        .route("/v1/attention", post(worker::attention))
        .route("/v1/embed", post(worker::embed))
        .route("/v1/predict", post(upload::predict))
        .route("/v1/zero-shot", post(upload::zero_shot))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn(move |request, next| {
            too_large(max_body, request, next)
        }))
        .route_layer(axum::middleware::from_fn_with_state(app.clone(), record))
        .layer(axum::middleware::from_fn_with_state(app.clone(), authorize))
        .with_state(app)
}

/// Loads every artifact, starts an engine for each, and serves until Ctrl-C or SIGTERM.
pub fn serve<B: LabBackend>(options: ServeOptions, device: B::Device) -> Result<()> {
    if options.max_batch == 0 || options.queue == 0 {
        bail!("--max-batch and --queue must be at least 1");
    }
    let config = EngineConfig {
        max_batch: options.max_batch,
        queue: options.queue,
    };
    let mut models: Vec<Served> = Vec::new();
    let mut workers: Vec<(String, WorkerHandle)> = Vec::new();
    for dir in &options.artifacts {
        let id = dir
            .canonicalize()
            .unwrap_or_else(|_| dir.clone())
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .with_context(|| format!("{} names no directory", dir.display()))?;
        if workers.iter().any(|(known, _)| *known == id) {
            bail!("two artifacts are named {id}: the API names a model by its directory's name");
        }
        let artifact = ArtifactDir::new(dir);
        let worker = worker::start::<B>(&id, artifact.clone(), options.queue, device.clone())?;
        let kind = worker.kind;
        workers.push((id.clone(), worker));
        if kind != <LmConfig as crate::config::ModelSection>::KIND {
            continue;
        }
        let (engine, (tokenizer, context, position)) = engine::start::<B, _>(
            id.clone(),
            config,
            options.grace,
            device.clone(),
            move |device| {
                let trained = load_as::<LmConfig, B>(&artifact, device)?;
                let lm = trained.config.model_as::<LmConfig>()?;
                let facts = (trained.tokenizer().clone(), lm.context, lm.position);
                Ok((trained.model, facts))
            },
        )?;
        models.push(Served {
            id,
            tokenizer: Arc::new(tokenizer),
            context,
            position,
            engine,
        });
    }
    let engines: Vec<EngineHandle> = models.iter().map(|m| m.engine.clone()).collect();
    let ids: Vec<String> = workers.iter().map(|(id, _)| id.clone()).collect();
    let app = Arc::new(App {
        models,
        workers,
        created: now(),
        metrics: Metrics::new(),
        api_key: options.api_key.clone(),
        max_tokens: options.max_tokens,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let address = format!("{}:{}", options.host, options.port);
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .with_context(|| format!("cannot listen on {address}"))?;
        let bound: SocketAddr = listener.local_addr()?;
        let exposure = if bound.ip().is_loopback() {
            "this machine only; --host 0.0.0.0 to accept other machines"
        } else {
            "reachable from other machines"
        };
        let key = if options.api_key.is_some() {
            "an API key is required"
        } else {
            "no API key (--api-key or TRANSFORMER_LAB_API_KEY to require one)"
        };
        println!(
            "serving {} on http://{bound} ({exposure}; {key})",
            ids.join(", ")
        );
        let grace = options.grace;
        let stopping = Arc::new(tokio::sync::Notify::new());
        let told = stopping.clone();
        let server = axum::serve(listener, router(app, options.max_body)).with_graceful_shutdown(
            async move {
                shutdown_signal().await;
                eprintln!(
                    "stopping: no new requests; running ones get {:.0} s to finish",
                    grace.as_secs_f64()
                );
                for engine in &engines {
                    engine.stop();
                }
                told.notify_one();
            },
        );
        // A client that never reads its stream must not hold the process: past the grace
        // (and a little for the last events to go out), connections are cut.
        tokio::select! {
            done = server => done.context("the server failed"),
            _ = async {
                stopping.notified().await;
                tokio::time::sleep(grace + Duration::from_secs(2)).await;
            } => {
                eprintln!("cut the connections still open after the grace");
                Ok(())
            }
        }
    })?;
    runtime.shutdown_timeout(Duration::from_secs(1));
    println!("stopped");
    Ok(())
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("a SIGTERM handler");
        tokio::select! {
            _ = interrupt => {},
            _ = terminate.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}
