//! What `/metrics` reports, in the Prometheus text format: requests by route and status,
//! tokens in and out, latencies (whole request, first token, each later token), and per model
//! the requests waiting and running.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// The server's metrics, registered in their own registry.
pub struct Metrics {
    registry: Registry,
    /// Requests answered, by route and HTTP status.
    pub requests: IntCounterVec,
    /// Prompt tokens read, by model.
    pub prompt_tokens: IntCounterVec,
    /// Tokens generated, by model.
    pub completion_tokens: IntCounterVec,
    /// Seconds from a request's arrival to its answer's end, by route.
    pub latency: HistogramVec,
    /// Seconds from a generation request's arrival to its first token, by model.
    pub first_token: HistogramVec,
    /// Seconds between two tokens of one generation, by model.
    pub per_token: HistogramVec,
    /// Requests queued for a model's engine and not yet in its batch.
    pub waiting: IntGaugeVec,
    /// Requests in a model's running batch.
    pub running: IntGaugeVec,
    /// Batched decoding steps run, by model.
    pub steps: IntGaugeVec,
    /// Rows those steps decoded (steps × their batch), by model.
    pub rows: IntGaugeVec,
}

impl Metrics {
    /// Empty counters and histograms.
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGaugeVec::new(Opts::new(name, help), &["model"]).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let histogram = |name: &str, help: &str, label: &str, buckets: Vec<f64>| {
            let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), &[label])
                .expect("valid metric");
            registry
                .register(Box::new(h.clone()))
                .expect("unique metric");
            h
        };
        let seconds = prometheus::exponential_buckets(0.0005, 2.0, 18).expect("buckets");
        Self {
            requests: counter(
                "transformer_lab_requests_total",
                "Requests answered, by route and HTTP status.",
                &["route", "status"],
            ),
            prompt_tokens: counter(
                "transformer_lab_prompt_tokens_total",
                "Prompt tokens read.",
                &["model"],
            ),
            completion_tokens: counter(
                "transformer_lab_completion_tokens_total",
                "Tokens generated.",
                &["model"],
            ),
            latency: histogram(
                "transformer_lab_request_seconds",
                "Seconds from a request's arrival to the end of its answer.",
                "route",
                seconds.clone(),
            ),
            first_token: histogram(
                "transformer_lab_first_token_seconds",
                "Seconds from a generation request's arrival to its first token.",
                "model",
                seconds.clone(),
            ),
            per_token: histogram(
                "transformer_lab_token_seconds",
                "Seconds between two tokens of one generation.",
                "model",
                seconds,
            ),
            waiting: gauge(
                "transformer_lab_queue_length",
                "Requests queued for a model and not yet in its batch.",
            ),
            running: gauge(
                "transformer_lab_batch_size",
                "Requests in a model's running batch.",
            ),
            steps: gauge(
                "transformer_lab_decode_steps",
                "Batched decoding steps run (a counter, read from the engine).",
            ),
            rows: gauge(
                "transformer_lab_decode_rows",
                "Rows those steps decoded; rows / steps is the mean batch.",
            ),
            registry,
        }
    }

    /// The text `/metrics` serves.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("metrics encode as text");
        String::from_utf8(out).expect("metrics are UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
