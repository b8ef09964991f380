//! Continuous batching: one thread owns a language model and decodes every request it is
//! given in one batch. A request joins the running batch at the next step (its prompt
//! prefilled alone, then its key–value columns joined: [`RowsCache::join`]) and leaves it as
//! soon as it is done, is cancelled, or its client has gone; the others never wait for it.
//!
//! Each request samples from its own seeded generator, so its text does not depend on which
//! other requests share its steps: each row's logits are those of decoding it alone (tested
//! in `nn`), and the same request with the same seed gives the same text, batched or not.

use crate::generate::{generate, ids, Decoding, Sampler, Sampling};
use crate::kernels::LabBackend;
use crate::models::LanguageModel;
use crate::nn::{KvCache, RowsCache};
use burn::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// One generation request, as the engine runs it.
pub struct Job {
    /// The prompt's token ids (non-empty).
    pub prompt: Vec<usize>,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// Seed of this request's own generator.
    pub seed: u64,
    /// Score each generated token ([`Scored`]) with this many most likely alternatives.
    pub logprobs: Option<usize>,
    /// Also score the prompt's tokens ([`Event::Prompt`]): it must fit the model's context.
    pub score_prompt: bool,
    /// Where its tokens go; a closed receiver (the client left, or a stop string was met)
    /// takes the request out of the batch at the next step.
    pub events: UnboundedSender<Event>,
}

/// What the engine tells a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The scores of the prompt's tokens after the first (asked with [`Job::score_prompt`]),
    /// before any token.
    Prompt(Vec<Scored>),
    /// The next token, scored where [`Job::logprobs`] asks.
    Token(usize, Option<Scored>),
    /// No more tokens, and why.
    Done(Finish),
}

/// A token's log-probability under the model, and the most likely tokens at its position
/// with theirs, most likely first: the model's own distribution, `log softmax(logits)`,
/// before temperature and top-p reshape it for sampling.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    /// ln p(token).
    pub logprob: f32,
    /// `(token, ln p)` of the `k` most likely tokens (ties: the lower id first).
    pub top: Vec<(usize, f32)>,
}

impl Scored {
    /// `token`'s score in `logits` (one position's, `[v]`) with its `k` most likely rivals.
    pub fn of(logits: &[f32], token: usize, k: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
        let log_z = f64::from(max) + sum.ln();
        let logprob = |t: usize| (f64::from(logits[t]) - log_z) as f32;
        let k = k.min(logits.len());
        let mut top = Vec::new();
        if k > 0 {
            let by = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.select_nth_unstable_by(k - 1, by);
            order.truncate(k);
            order.sort_by(by);
            top = order.into_iter().map(|t| (t, logprob(t))).collect();
        }
        Self {
            logprob: logprob(token),
            top,
        }
    }
}

/// The scores of `tokens[1..]` given the tokens before each (`tokens` fit the context): one
/// forward pass over the whole window.
fn score_window<B: LabBackend>(
    model: &LanguageModel<B>,
    tokens: &[usize],
    k: usize,
    device: &B::Device,
) -> Vec<Scored> {
    let n = tokens.len();
    if n < 2 {
        return Vec::new();
    }
    let input = ids::<B>(&[tokens[..n - 1].to_vec()], 0..n - 1, device);
    let logits: Vec<f32> = model
        .forward(input)
        .logits
        .into_data()
        .convert::<f32>()
        .to_vec()
        .expect("f32 logits");
    let v = model.vocab_size();
    logits
        .chunks(v)
        .zip(&tokens[1..])
        .map(|(row, &token)| Scored::of(row, token, k))
        .collect()
}

/// Why a request's generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// It produced `max_tokens` tokens.
    Length,
    /// The server shut down before it was done.
    Cancelled,
}

/// How the engine runs.
#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// Requests decoded together at most; more wait in the queue.
    pub max_batch: usize,
    /// Requests waiting at most; past it new ones are refused ([`Submit::Full`]).
    pub queue: usize,
}

/// The engine as the HTTP handlers see it: a bounded queue into its thread and its counters.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: SyncSender<Job>,
    /// Requests submitted and not yet taken into the batch.
    pub waiting: Arc<AtomicUsize>,
    /// Requests in the running batch.
    pub running: Arc<AtomicUsize>,
    /// Decoding steps run, and the rows they decoded: their ratio is the mean batch.
    pub steps: Arc<AtomicUsize>,
    /// See [`Self::steps`].
    pub rows: Arc<AtomicUsize>,
    stopping: Arc<AtomicBool>,
}

/// What became of a submitted request.
pub enum Submit {
    /// Queued: its events follow.
    Queued,
    /// The queue is full (or the engine is shutting down): try again later.
    Full,
}

impl EngineHandle {
    /// Queues `job` unless the queue is full or the engine is stopping.
    pub fn submit(&self, job: Job) -> Submit {
        if self.stopping.load(Ordering::SeqCst) {
            return Submit::Full;
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        match self.jobs.try_send(job) {
            Ok(()) => Submit::Queued,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                Submit::Full
            }
        }
    }

    /// Stops taking requests: those running finish, within `grace`; the rest are cancelled.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }
}

/// Starts the engine's thread on `model` (built there by `load`, which runs on that thread:
/// burn's tensors stay on the thread that made them). Returns once the model is loaded.
pub fn start<B: LabBackend, T: Send + 'static>(
    name: String,
    config: EngineConfig,
    grace: Duration,
    device: B::Device,
    load: impl FnOnce(&B::Device) -> anyhow::Result<(LanguageModel<B>, T)> + Send + 'static,
) -> anyhow::Result<(EngineHandle, T)> {
    let (jobs, queue) = std::sync::mpsc::sync_channel::<Job>(config.queue.max(1));
    let handle = EngineHandle {
        jobs,
        waiting: Arc::new(AtomicUsize::new(0)),
        running: Arc::new(AtomicUsize::new(0)),
        steps: Arc::new(AtomicUsize::new(0)),
        rows: Arc::new(AtomicUsize::new(0)),
        stopping: Arc::new(AtomicBool::new(false)),
    };
    let (ready, loaded) = std::sync::mpsc::channel();
    let counters = handle.clone();
    std::thread::Builder::new()
        .name(format!("engine {name}"))
        .spawn(move || {
            let model = match load(&device) {
                Ok((model, extra)) => {
                    let _ = ready.send(Ok(extra));
                    model
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            crate::nn::without_weights(|| {
                Engine {
                    model: &model,
                    device,
                    config,
                    grace,
                    counters,
                }
                .run(queue)
            });
        })?;
    let extra = loaded
        .recv()
        .map_err(|_| anyhow::anyhow!("the engine of {name} stopped while loading"))??;
    Ok((handle, extra))
}

/// A request in the running batch.
struct Row {
    job: Job,
    /// Every token so far, prompt included; the last is not yet in the cache.
    tokens: Vec<usize>,
    produced: usize,
    sampler: Sampler,
}

impl Row {
    /// Draws the next token from `logits`, tells the client, and says whether the row goes on.
    fn take(&mut self, logits: &[f32]) -> bool {
        let token = self.sampler.next(logits);
        self.tokens.push(token);
        self.produced += 1;
        let scored = self.job.logprobs.map(|k| Scored::of(logits, token, k));
        if self.job.events.send(Event::Token(token, scored)).is_err() {
            return false; // the client has gone
        }
        if self.produced >= self.job.max_tokens {
            let _ = self.job.events.send(Event::Done(Finish::Length));
            return false;
        }
        true
    }

    /// Whether the client still listens.
    fn wanted(&self) -> bool {
        !self.job.events.is_closed()
    }
}

struct Engine<'a, B: LabBackend> {
    model: &'a LanguageModel<B>,
    device: B::Device,
    config: EngineConfig,
    grace: Duration,
    counters: EngineHandle,
}

impl<B: LabBackend> Engine<'_, B> {
    /// Runs until the queue closes, or until stopped and its batch is done (or the grace has
    /// passed).
    fn run(self, queue: Receiver<Job>) {
        let batched = self.model.caches() && self.model.batches();
        let max_batch = if batched {
            self.config.max_batch.max(1)
        } else {
            1
        };
        let mut rows: Vec<Row> = Vec::new();
        let mut cache = self.model.new_rows_cache();
        let mut stopped_at: Option<Instant> = None;
        loop {
            let stopping = self.counters.stopping.load(Ordering::SeqCst);
            if stopping {
                // Cancel what waits; let the batch finish within the grace.
                while let Ok(job) = queue.try_recv() {
                    self.counters.waiting.fetch_sub(1, Ordering::SeqCst);
                    let _ = job.events.send(Event::Done(Finish::Cancelled));
                }
                let since = *stopped_at.get_or_insert_with(Instant::now);
                if rows.is_empty() {
                    return;
                }
                if since.elapsed() >= self.grace {
                    for row in rows.drain(..) {
                        let _ = row.job.events.send(Event::Done(Finish::Cancelled));
                    }
                    self.counters.running.store(0, Ordering::SeqCst);
                    return;
                }
            }
            // Take in new requests: block only when there is nothing to decode.
            while !stopping && rows.len() < max_batch {
                let job = if rows.is_empty() {
                    match queue.recv_timeout(Duration::from_millis(100)) {
                        Ok(job) => job,
                        Err(RecvTimeoutError::Timeout) => break,
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                } else {
                    match queue.try_recv() {
                        Ok(job) => job,
                        Err(_) => break,
                    }
                };
                self.counters.waiting.fetch_sub(1, Ordering::SeqCst);
                if job.events.is_closed() {
                    continue;
                }
                if job.score_prompt {
                    let k = job.logprobs.unwrap_or(0);
                    let scores = score_window(self.model, &job.prompt, k, &self.device);
                    let _ = job.events.send(Event::Prompt(scores));
                }
                if job.max_tokens == 0 {
                    let _ = job.events.send(Event::Done(Finish::Length));
                    continue;
                }
                if !batched {
                    self.alone(job);
                    continue;
                }
                let mut row = Row {
                    tokens: job.prompt.clone(),
                    sampler: Sampler::new(job.sampling.clone(), job.seed, &job.prompt),
                    produced: 0,
                    job,
                };
                let logits = self.prefill(&row.tokens, &mut cache);
                if row.take(&logits) {
                    rows.push(row);
                } else {
                    // Done at its first token: its columns leave with it.
                    let keep: Vec<usize> = (0..rows.len()).collect();
                    cache.keep(&keep, &self.device);
                }
            }
            self.counters.running.store(rows.len(), Ordering::SeqCst);
            if rows.is_empty() {
                continue;
            }
            self.refill_full(&rows, &mut cache);
            // One step of the whole batch: every row's newest token in, its next one out.
            let ids: Vec<i64> = rows
                .iter()
                .map(|r| *r.tokens.last().unwrap() as i64)
                .collect();
            let tokens =
                Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [rows.len()]), &self.device);
            let logits = self.model.forward_rows(tokens, &mut cache);
            self.counters.steps.fetch_add(1, Ordering::SeqCst);
            self.counters.rows.fetch_add(rows.len(), Ordering::SeqCst);
            let logits: Vec<f32> = logits
                .into_data()
                .convert::<f32>()
                .to_vec()
                .expect("f32 logits");
            let vocab = self.model.vocab_size();
            let mut keep = Vec::with_capacity(rows.len());
            for (r, row) in rows.iter_mut().enumerate() {
                if row.wanted() && row.take(&logits[r * vocab..(r + 1) * vocab]) {
                    keep.push(r);
                }
            }
            if keep.len() < rows.len() {
                let mut index = 0;
                rows.retain(|_| {
                    index += 1;
                    keep.contains(&(index - 1))
                });
                cache.keep(&keep, &self.device);
            }
            self.counters.running.store(rows.len(), Ordering::SeqCst);
        }
    }

    /// Prefills `tokens` alone (its last `context` tokens, as the single-sequence decoder),
    /// joins the batch as its last row, and returns the logits of the token after them.
    fn prefill(&self, tokens: &[usize], cache: &mut RowsCache<B>) -> Vec<f32> {
        let start = tokens.len().saturating_sub(self.model.context());
        let n = tokens.len() - start;
        self.join_alone(&tokens[start..], cache)
            .slice([0..1, n - 1..n])
            .reshape([self.model.vocab_size()])
            .into_data()
            .convert::<f32>()
            .to_vec()
            .expect("f32 logits")
    }

    /// Decodes `window` (non-empty) alone from an empty cache, joins the batch with it as the
    /// last row, and returns the logits of its positions, `[1, n, v]`.
    fn join_alone(&self, window: &[usize], cache: &mut RowsCache<B>) -> Tensor<B, 3> {
        let mut single: KvCache<B> = self.model.new_cache();
        let input = ids::<B>(&[window.to_vec()], 0..window.len(), &self.device);
        let logits = self.model.forward_cached(input, &mut single);
        cache.join(&single);
        logits
    }

    /// With absolute positions (learned, sinusoidal) a row whose next token would pass the
    /// context starts again from its last context/2 tokens, as [`Decoding::Cached`] does.
    fn refill_full(&self, rows: &[Row], cache: &mut RowsCache<B>) {
        if self.model.any_length() {
            return; // relative positions: the cache rolls
        }
        let context = self.model.context();
        let full: Vec<usize> = (0..rows.len())
            .filter(|&r| cache.rows.next[r] >= context)
            .collect();
        if full.is_empty() {
            return;
        }
        let keep: Vec<usize> = (0..rows.len()).filter(|r| !full.contains(r)).collect();
        let mut order = keep.clone();
        cache.keep(&keep, &self.device);
        for &r in &full {
            // The cache holds every token but the newest; refill with the context/2 − 1 before
            // it, so that the newest goes in at position context/2 − 1.
            let tokens = &rows[r].tokens;
            let keep = (context / 2).max(2) - 1;
            let before = &tokens[..tokens.len() - 1];
            let window = &before[before.len() - keep.min(before.len())..];
            self.join_alone(window, cache);
            order.push(r);
        }
        // The batch's rows are now `order`; put them back in the order of `rows`.
        let mut back = vec![0; order.len()];
        for (at, &r) in order.iter().enumerate() {
            back[r] = at;
        }
        cache.keep(&back, &self.device);
    }

    /// A request on a model that cannot share its steps (linear attention's running sums,
    /// Hyena): decoded alone, start to end, with the single-sequence decoder.
    fn alone(&self, job: Job) {
        self.counters.running.store(1, Ordering::SeqCst);
        let stopping = &self.counters.stopping;
        let decoded = generate(
            self.model,
            &job.prompt,
            job.max_tokens,
            &job.sampling,
            job.seed,
            Decoding::Cached,
            &self.device,
            |token, logits| {
                if stopping.load(Ordering::SeqCst) {
                    anyhow::bail!("stopping");
                }
                self.counters.steps.fetch_add(1, Ordering::SeqCst);
                self.counters.rows.fetch_add(1, Ordering::SeqCst);
                let scored = job.logprobs.map(|k| Scored::of(logits, token, k));
                job.events
                    .send(Event::Token(token, scored))
                    .map_err(|_| anyhow::anyhow!("the client has gone"))
            },
        );
        match decoded {
            Ok(_) => {
                let _ = job.events.send(Event::Done(Finish::Length));
            }
            Err(_) if stopping.load(Ordering::SeqCst) => {
                let _ = job.events.send(Event::Done(Finish::Cancelled));
            }
            Err(_) => {} // the client has gone
        }
        self.counters.running.store(0, Ordering::SeqCst);
    }
}
