//! `bench serve`: a load generator for `serve`. It starts the server (this same program, as a
//! child process on a loopback port), then for each number of concurrent clients sends
//! streamed completions and measures what the clients see: requests and tokens per second,
//! the latency to the first token and between tokens (p50, p99) — once with the server
//! decoding one request at a time (`--max-batch 1`) and once batching them, so the table says
//! what continuous batching gives. Bounded in requests and in time.

use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What `bench serve` runs.
#[derive(Clone, Debug)]
pub struct LoadPlan {
    /// The language model to serve.
    pub artifact: PathBuf,
    /// Numbers of concurrent clients, one table row each (per server setting).
    pub clients: Vec<usize>,
    /// Requests per client.
    pub requests: usize,
    /// Tokens each request asks for.
    pub max_tokens: usize,
    /// The prompt.
    pub prompt: String,
    /// The batch the batching server takes (`serve --max-batch`).
    pub max_batch: usize,
    /// A row stops sending new requests after this long.
    pub limit: Duration,
    /// Options passed on to `serve` (the backend).
    pub server_args: Vec<String>,
}

/// One row of the table.
#[derive(Clone, Debug)]
pub struct LoadRow {
    /// `one at a time` or `batched`.
    pub server: String,
    /// Concurrent clients.
    pub clients: usize,
    /// Requests completed.
    pub requests: usize,
    /// Completed requests per second of the row's wall time.
    pub requests_per_s: f64,
    /// Tokens received per second of the row's wall time.
    pub tokens_per_s: f64,
    /// Latency to the first token, median and 99th percentile (ms).
    pub first_token_ms: (f64, f64),
    /// Time between two tokens of one request, median and 99th percentile (ms).
    pub per_token_ms: (f64, f64),
}

/// What one streamed request saw.
struct Seen {
    first: Duration,
    gaps: Vec<Duration>,
    tokens: usize,
}

/// A `serve` child process, killed when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(plan: &LoadPlan, max_batch: usize) -> Result<Self> {
        let exe = std::env::current_exe().context("cannot find this program to start serve")?;
        let queue = (plan.clients.iter().max().copied().unwrap_or(1) * 2).to_string();
        let mut child = Command::new(exe)
            .args(&plan.server_args)
            .arg("serve")
            .arg("--artifact-dir")
            .arg(&plan.artifact)
            .args(["--port", "0", "--max-batch", &max_batch.to_string()])
            .args(["--queue", &queue])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot start serve")?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped stdout")).read_line(&mut line)?;
        let Some(address) = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
        else {
            let _ = child.kill();
            bail!("serve did not start (it printed {line:?})");
        };
        Ok(Self {
            url: format!("http://{address}"),
            child,
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends one streamed completion and times its events.
fn request(
    agent: &ureq::Agent,
    url: &str,
    model: &str,
    plan: &LoadPlan,
    seed: usize,
) -> Result<Seen> {
    let body = serde_json::json!({
        "model": model, "prompt": plan.prompt, "max_tokens": plan.max_tokens,
        "temperature": 0.8, "seed": seed, "stream": true,
    });
    let sent = Instant::now();
    let response = agent
        .post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .send(body.to_string())
        .context("the request failed")?;
    if response.status() != 200 {
        bail!("the server answered {}", response.status());
    }
    let reader = BufReader::new(response.into_body().into_reader());
    let (mut first, mut last, mut gaps, mut tokens) = (None, sent, Vec::new(), 0);
    for line in reader.lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let now = Instant::now();
        let chunk: serde_json::Value = serde_json::from_str(data)?;
        if chunk["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
        {
            tokens += 1;
            match first {
                None => first = Some(now - sent),
                Some(_) => gaps.push(now - last),
            }
            last = now;
        }
    }
    Ok(Seen {
        first: first.context("the stream had no tokens")?,
        gaps,
        tokens,
    })
}

/// The `q`-quantile (0..=1) of `values` in milliseconds (nearest rank).
fn quantile_ms(values: &mut [Duration], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort();
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1].as_secs_f64() * 1e3
}

/// Runs the plan: every client count against a server that decodes one request at a time,
/// then against one that batches. `progress` hears of each row as it ends.
pub fn run_load(plan: &LoadPlan, mut progress: impl FnMut(&LoadRow)) -> Result<Vec<LoadRow>> {
    if plan.clients.contains(&0) || plan.requests == 0 || plan.max_tokens == 0 {
        bail!("--clients, --requests and --max-tokens must be at least 1");
    }
    let model = plan
        .artifact
        .canonicalize()
        .with_context(|| format!("no artifact at {}", plan.artifact.display()))?
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .context("the artifact dir has no name")?;
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(plan.limit + Duration::from_secs(60)))
        .build()
        .into();
    let mut rows = Vec::new();
    for (server_name, max_batch) in [("one at a time", 1), ("batched", plan.max_batch)] {
        let server = Server::start(plan, max_batch)?;
        // Warm up (the first request pays for lazily built kernels).
        request(&agent, &server.url, &model, plan, 0)?;
        for &clients in &plan.clients {
            let started = Instant::now();
            let seen: Vec<Seen> = std::thread::scope(|scope| {
                let handles: Vec<_> = (0..clients)
                    .map(|c| {
                        let (agent, url, model) = (&agent, &server.url, &model);
                        scope.spawn(move || {
                            let mut seen = Vec::new();
                            for r in 0..plan.requests {
                                if started.elapsed() > plan.limit {
                                    break;
                                }
                                seen.push(request(agent, url, model, plan, c * plan.requests + r));
                            }
                            seen
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|h| h.join().expect("a client thread panicked"))
                    .collect::<Result<Vec<Seen>>>()
            })?;
            let wall = started.elapsed().as_secs_f64();
            let tokens: usize = seen.iter().map(|s| s.tokens).sum();
            let mut firsts: Vec<Duration> = seen.iter().map(|s| s.first).collect();
            let mut gaps: Vec<Duration> = seen.iter().flat_map(|s| s.gaps.clone()).collect();
            let row = LoadRow {
                server: server_name.to_string(),
                clients,
                requests: seen.len(),
                requests_per_s: seen.len() as f64 / wall,
                tokens_per_s: tokens as f64 / wall,
                first_token_ms: (
                    quantile_ms(&mut firsts, 0.5),
                    quantile_ms(&mut firsts, 0.99),
                ),
                per_token_ms: (quantile_ms(&mut gaps, 0.5), quantile_ms(&mut gaps, 0.99)),
            };
            progress(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// The table's header, for [`row_line`].
pub const TABLE_HEAD: &str = "| server | clients | requests | requests/s | tokens/s | first token p50 / p99 (ms) | per token p50 / p99 (ms) |\n|---|---|---|---|---|---|---|";

/// One row as a Markdown table line.
pub fn row_line(row: &LoadRow) -> String {
    format!(
        "| {} | {} | {} | {:.2} | {:.0} | {:.1} / {:.1} | {:.2} / {:.2} |",
        row.server,
        row.clients,
        row.requests,
        row.requests_per_s,
        row.tokens_per_s,
        row.first_token_ms.0,
        row.first_token_ms.1,
        row.per_token_ms.0,
        row.per_token_ms.1
    )
}

/// Batched tokens/s over one-at-a-time tokens/s, per client count.
pub fn gains(rows: &[LoadRow]) -> Vec<(usize, f64)> {
    let alone = |c: usize| {
        rows.iter()
            .find(|r| r.server == "one at a time" && r.clients == c)
    };
    rows.iter()
        .filter(|r| r.server == "batched")
        .filter_map(|r| Some((r.clients, r.tokens_per_s / alone(r.clients)?.tokens_per_s)))
        .collect()
}
