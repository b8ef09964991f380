//! Data-parallel training inside one process (`train --devices 0,1,…`): one peer per device,
//! each with a copy of the model, each step's batch split evenly across them.
//!
//! Peer 0 is the training thread and holds burn's `Learner` (the model, the optimizer, the
//! schedule, what checkpoints save); peers 1.. are threads of their own, each reading its share
//! of every batch from a loader of its own ([`EpochLoader::shard`]). A step: peer 0 hands every
//! other peer the current weights, each peer runs forward and backward on its share on its
//! device, the gradients of all parameters — flattened into one vector, in the order the model
//! visits its parameters — are averaged across the peers by burn-collective's all-reduce, and
//! peer 0's optimizer takes one step with that mean (burn's own multi-device strategy keeps its
//! optimizer on one device the same way). With equal shares, the mean of the peers' mean losses
//! is the mean loss over the whole batch, so the step is the one-device step up to the order of
//! floating-point sums (tested).
//!
//! [`EpochLoader::shard`]: super::loader::EpochLoader::shard

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorPrimitive};
use burn::train::TrainStep;
use burn_collective::{
    all_reduce, finish_collective, register, reset_collective, CollectiveConfig, PeerId,
    ReduceOperation,
};
use std::any::Any;
use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// One epoch of a peer's batches.
pub type ShardIter<O> = Box<dyn Iterator<Item = O>>;

/// A peer's batches of epoch `epoch` (1-based) after its first `skip`; called on the peer's
/// thread.
pub type ShardFn<O> = Arc<dyn Fn(usize, usize) -> ShardIter<O> + Send + Sync>;

/// The devices of a data-parallel run (peer 0's first) and the loaders of peers 1.. (peer 0
/// reads the loader burn's learner is given, itself the first share).
pub struct Peers<B: Backend, O> {
    /// One device per peer.
    pub devices: Vec<B::Device>,
    /// The batches of peers 1.., one function each.
    pub shards: Vec<ShardFn<O>>,
}

/// [`Peers`] without its types, as the training strategy carries it.
pub type AnyPeers = Arc<dyn Any + Send + Sync>;

/// What the training thread asks of the other peers.
enum Job<M> {
    /// Epoch `epoch` begins after `skip` batches.
    Epoch { epoch: usize, skip: usize },
    /// One step from these weights.
    Step(M),
}

/// The other peers of a run, as threads the training thread drives.
pub struct PeerThreads<M> {
    jobs: Vec<Sender<Job<M>>>,
    done: Receiver<(usize, Result<(), String>)>,
    threads: Vec<JoinHandle<()>>,
    /// Steps taken, their wall time on the training thread, and the part of it spent in the
    /// all-reduce (waiting for the other devices included).
    timing: Cell<(usize, Duration, Duration)>,
}

impl<M: Send + 'static> PeerThreads<M> {
    /// Starts peers 1.. of `peers` and registers the training thread as peer 0.
    pub fn start<B>(peers: &Peers<B, M::Input>) -> Result<Self, String>
    where
        B: AutodiffBackend,
        M: TrainStep + AutodiffModule<B>,
    {
        let count = peers.devices.len();
        let config = CollectiveConfig::default().with_num_devices(count);
        let (report, done) = channel();
        let mut jobs = Vec::new();
        let mut threads = Vec::new();
        for (peer, shard) in (1..count).zip(&peers.shards) {
            let (send, receive) = channel();
            let (device, shard, report, config) = (
                peers.devices[peer].clone(),
                shard.clone(),
                report.clone(),
                config.clone(),
            );
            let thread = std::thread::Builder::new()
                .name(format!("peer-{peer}"))
                .spawn(move || serve::<B, M>(peer, device, shard, config, receive, report))
                .map_err(|err| format!("cannot start the thread of device {peer}: {err}"))?;
            jobs.push(send);
            threads.push(thread);
        }
        register::<B::InnerBackend>(PeerId(0), peers.devices[0].clone(), config)
            .map_err(|err| format!("burn-collective refused peer 0: {err:?}"))?;
        Ok(Self {
            jobs,
            done,
            threads,
            timing: Cell::default(),
        })
    }

    /// Tells the other peers that epoch `epoch` begins after `skip` batches.
    pub fn begin_epoch(&self, epoch: usize, skip: usize) {
        for jobs in &self.jobs {
            let _ = jobs.send(Job::Epoch { epoch, skip });
        }
    }

    /// Starts the other peers' shares of a step from `weights`.
    pub fn step(&self, weights: &M)
    where
        M: Clone,
    {
        for jobs in &self.jobs {
            let _ = jobs.send(Job::Step(weights.clone()));
        }
    }

    /// Waits for the other peers' shares of the step: the first failure, naming the device.
    pub fn finish_step(&self) -> Result<(), String> {
        let mut failure = None;
        for _ in 0..self.jobs.len() {
            match self.done.recv() {
                Ok((_, Ok(()))) => {}
                Ok((peer, Err(err))) => {
                    failure.get_or_insert(format!("device {peer}: {err}"));
                }
                Err(_) => {
                    failure.get_or_insert("a peer thread ended".to_string());
                }
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Counts a step of `step` wall time, `reduce` of it in the all-reduce.
    pub fn timed(&self, step: Duration, reduce: Duration) {
        let (steps, total, reduced) = self.timing.get();
        self.timing.set((steps + 1, total + step, reduced + reduce));
    }

    /// Ends the peers' threads and unregisters the training thread; says what the all-reduce
    /// cost.
    pub fn stop<B: AutodiffBackend>(self) {
        let (steps, total, reduced) = self.timing.get();
        if steps > 0 {
            println!(
                "data-parallel on {} devices: {:.1} ms a step, of which {:.1} ms ({:.0}%) in the \
                 gradients' all-reduce (waiting for the slowest device included)",
                self.jobs.len() + 1,
                total.as_secs_f64() * 1e3 / steps as f64,
                reduced.as_secs_f64() * 1e3 / steps as f64,
                100.0 * reduced.as_secs_f64() / total.as_secs_f64().max(1e-9),
            );
        }
        drop(self.jobs);
        for thread in self.threads {
            let _ = thread.join();
        }
        let _ = finish_collective::<B::InnerBackend>(PeerId(0));
    }
}

/// Peer `peer`'s thread: registers with burn-collective, then serves the training thread's
/// jobs until it hangs up.
fn serve<B, M>(
    peer: usize,
    device: B::Device,
    shard: ShardFn<M::Input>,
    config: CollectiveConfig,
    jobs: Receiver<Job<M>>,
    report: Sender<(usize, Result<(), String>)>,
) where
    B: AutodiffBackend,
    M: TrainStep + AutodiffModule<B>,
{
    let id = PeerId(peer as u32);
    if let Err(err) = register::<B::InnerBackend>(id, device.clone(), config) {
        let _ = report.send((peer, Err(format!("burn-collective refused it: {err:?}"))));
        return;
    }
    let mut batches: Option<ShardIter<M::Input>> = None;
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Epoch { epoch, skip } => batches = Some(shard(epoch, skip)),
            Job::Step(weights) => {
                let step = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    let item = batches
                        .as_mut()
                        .and_then(Iterator::next)
                        .ok_or("its loader has no batch left for this step")?;
                    let model = weights.fork(&device);
                    let output = model.step(item);
                    mean_across_peers::<B, M>(peer, &model, output.grads).map(|_| ())
                }))
                .unwrap_or_else(|panic| Err(panic_message(&panic)));
                if step.is_err() {
                    // Releases the peers waiting in the all-reduce this one never joined.
                    reset_collective::<B::InnerBackend>();
                }
                let _ = report.send((peer, step));
            }
        }
    }
    let _ = finish_collective::<B::InnerBackend>(id);
}

fn panic_message(panic: &Box<dyn Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "it panicked".to_string())
}

/// The mean of every peer's `grads` (those of `model`'s parameters), through one all-reduce of
/// them all flattened in the order `model` visits its parameters — the same order on every
/// peer, whatever the parameters' ids.
pub fn mean_across_peers<B, M>(
    peer: usize,
    model: &M,
    grads: GradientsParams,
) -> Result<GradientsParams, String>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let mut gather = Gather::<B> {
        grads,
        flat: Vec::new(),
    };
    model.visit(&mut gather);
    let Gather { grads, flat } = gather;
    if flat.is_empty() {
        return Ok(grads);
    }
    let flat = Tensor::cat(flat, 0).into_primitive().tensor();
    let mean = all_reduce::<B::InnerBackend>(PeerId(peer as u32), flat, ReduceOperation::Mean)
        .map_err(|err| format!("the all-reduce of the gradients failed: {err:?}"))?;
    let mut scatter = Scatter::<B> {
        grads,
        mean: Tensor::from_primitive(TensorPrimitive::Float(mean)),
        at: 0,
    };
    model.visit(&mut scatter);
    Ok(scatter.grads)
}

/// Takes each parameter's gradient out of `grads`, flattened.
struct Gather<B: AutodiffBackend> {
    grads: GradientsParams,
    flat: Vec<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let len = grad.shape().num_elements();
            // Put back as a placeholder: `Scatter` finds the parameters that had one.
            self.flat.push(grad.clone().reshape([len]));
            self.grads.register(param.id, grad);
        }
    }
}

/// Puts the mean back, parameter by parameter, where `Gather` found a gradient.
struct Scatter<B: AutodiffBackend> {
    grads: GradientsParams,
    mean: Tensor<B::InnerBackend, 1>,
    at: usize,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scatter<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let dims = grad.dims();
            let len = grad.shape().num_elements();
            let part = self.mean.clone().slice(self.at..self.at + len);
            self.at += len;
            self.grads.register(param.id, part.reshape(dims));
        }
    }
}
