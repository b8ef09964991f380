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
//! Several machines (`--nodes N --node-rank R --coordinator HOST:PORT`): one process per node,
//! each with its devices as above; burn-collective's level between nodes joins their
//! all-reduces (node 0 hosts its orchestrator at the coordinator's port; each node serves its
//! tensors on the next ports, `PORT + 1 + R`). Every node keeps the learner and takes the same
//! optimizer step from the same mean, so the weights stay equal everywhere without being sent.
//! Before the first step the nodes compare what they run (config and binary, devices, the step
//! they start after) and refuse to start otherwise, naming the node that differs; each step's
//! all-reduce also carries whether any node was asked to stop, so every node stops after the
//! same step; a node that leaves makes the others stop within [`LEAVE_TIMEOUT_ENV`] seconds.
//!
//! [`EpochLoader::shard`]: super::loader::EpochLoader::shard

use anyhow::{bail, Context, Result};
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
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Seconds a node waits for the coordinator and the other nodes to join (default 300).
pub const JOIN_TIMEOUT_ENV: &str = "TRANSFORMER_LAB_JOIN_TIMEOUT";

/// Seconds a step's all-reduce may wait for the other nodes before the run stops (default 600:
/// a step of the slowest node, a checkpoint or a validation in between included).
pub const LEAVE_TIMEOUT_ENV: &str = "TRANSFORMER_LAB_LEAVE_TIMEOUT";

fn seconds(env: &str, default: u64) -> Duration {
    Duration::from_secs_f64(
        std::env::var(env)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default as f64),
    )
}

/// The machines of a run: `count` nodes, this one `rank`, the coordinator at `host:port`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeGroup {
    /// Nodes taking part.
    pub count: usize,
    /// This node's number, 0-based; node 0 hosts the coordinator.
    pub rank: usize,
    /// The coordinator's host (node 0's address as the others reach it).
    pub host: String,
    /// The coordinator's port; node `r` serves its tensors on `port + 1 + r`.
    pub port: u16,
}

impl NodeGroup {
    /// `--nodes`, `--node-rank`, `--coordinator`: one error line for what does not fit.
    pub fn new(count: usize, rank: usize, coordinator: &str) -> Result<Self> {
        if count < 2 {
            bail!("--nodes must be at least 2 (a run on one machine needs none of these options)");
        }
        if rank >= count {
            bail!("--node-rank {rank} is not below --nodes {count} (nodes are numbered from 0)");
        }
        let (host, port) = coordinator
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.trim_matches(['[', ']']), p.parse::<u16>().ok()?)))
            .filter(|(h, _)| !h.is_empty())
            .with_context(|| {
                format!("--coordinator {coordinator:?} is not HOST:PORT (e.g. 10.0.0.1:29500)")
            })?;
        if port as usize + count >= u16::MAX as usize {
            bail!(
                "--coordinator port {port}: ports {port}..={} must exist",
                port as usize + count
            );
        }
        Ok(Self {
            count,
            rank,
            host: host.to_string(),
            port,
        })
    }

    /// The nodes other than this one, in words.
    pub fn others(&self) -> String {
        let others: Vec<String> = (0..self.count)
            .filter(|&r| r != self.rank)
            .map(|r| r.to_string())
            .collect();
        match others.as_slice() {
            [one] => format!("node {one}"),
            many => format!("one of nodes {}", many.join(", ")),
        }
    }

    /// This node's address as the others reach it: the local address of the route to the
    /// coordinator.
    fn own_host(&self) -> String {
        std::net::UdpSocket::bind(("0.0.0.0", 0))
            .and_then(|socket| {
                socket.connect((self.host.as_str(), self.port))?;
                socket.local_addr()
            })
            .map_or_else(|_| "127.0.0.1".to_string(), |a| a.ip().to_string())
    }

    fn collective(&self, devices: usize) -> Result<CollectiveConfig> {
        let address = |host: &str, port: u16| {
            let host = if host.contains(':') {
                format!("[{host}]")
            } else {
                host.to_string()
            };
            format!("ws://{host}:{port}")
                .parse::<burn_communication::Address>()
                .map_err(|_| anyhow::anyhow!("{host}:{port} is not an address"))
        };
        let data_port = self.port + 1 + self.rank as u16;
        Ok(CollectiveConfig::default()
            .with_num_devices(devices)
            .with_num_nodes(self.count as u32)
            .with_global_address(address(&self.host, self.port)?)
            .with_node_address(address(&self.own_host(), data_port)?)
            .with_data_service_port(data_port))
    }

    /// Node 0: the coordinator (burn-collective's orchestrator) on its port, for the life of
    /// the process.
    fn host_coordinator(&self) -> Result<()> {
        // Its server logs a failure to listen and ends; asked first, that is one line here.
        std::net::TcpListener::bind(("0.0.0.0", self.port))
            .with_context(|| format!("the coordinator cannot listen on port {}", self.port))?;
        let port = self.port;
        std::thread::Builder::new()
            .name("coordinator".into())
            .spawn(move || {
                if let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    runtime.block_on(burn_collective::start_global_orchestrator_until(
                        port,
                        std::future::pending(),
                    ));
                }
            })
            .context("cannot start the coordinator's thread")?;
        Ok(())
    }
}

/// One epoch of a peer's batches.
pub type ShardIter<O> = Box<dyn Iterator<Item = O>>;

/// A peer's batches of epoch `epoch` (1-based) after its first `skip`; called on the peer's
/// thread.
pub type ShardFn<O> = Arc<dyn Fn(usize, usize) -> ShardIter<O> + Send + Sync>;

/// The devices of a data-parallel run (peer 0's first) and the loaders of peers 1.. (peer 0
/// reads the loader burn's learner is given, itself the first share).
pub struct Peers<B: Backend, O> {
    /// One device per peer of this node.
    pub devices: Vec<B::Device>,
    /// The batches of peers 1.., one function each.
    pub shards: Vec<ShardFn<O>>,
    /// The machines, when the run spans several.
    pub group: Option<NodeGroup>,
    /// What every node must run alike: a hash of the resolved config and the binary.
    pub identity: u64,
}

impl<B: Backend, O> Peers<B, O> {
    /// The first peer of this node in the whole run's numbering.
    fn first(&self) -> usize {
        peer_numbers(self.group.as_ref(), self.devices.len()).0
    }
}

/// With `local` devices on each node: the number of this node's first peer in the whole run,
/// and how many peers the run has.
pub fn peer_numbers(group: Option<&NodeGroup>, local: usize) -> (usize, usize) {
    match group {
        Some(group) => (group.rank * local, group.count * local),
        None => (0, local),
    }
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
    /// Across nodes: ends the process when a step's all-reduce waits too long.
    watchdog: Option<Watchdog>,
    /// This node's first peer in the run's numbering (the training thread's).
    first: usize,
}

impl<M: Send + 'static> PeerThreads<M> {
    /// Starts peers 1.. of `peers`, registers the training thread as this node's first peer
    /// and, across nodes, checks that every node runs alike; with the step the run starts
    /// after: `start` (the newest checkpoint this node has), or across nodes the lowest of
    /// theirs.
    pub fn start<B>(peers: &Peers<B, M::Input>, start: usize) -> Result<(Self, usize), String>
    where
        B: AutodiffBackend,
        M: TrainStep + AutodiffModule<B>,
    {
        Self::start_group(peers, start).map_err(|err| format!("{err:#}"))
    }

    fn start_group<B>(peers: &Peers<B, M::Input>, start: usize) -> Result<(Self, usize)>
    where
        B: AutodiffBackend,
        M: TrainStep + AutodiffModule<B>,
    {
        let count = peers.devices.len();
        let first = peers.first();
        let config = match &peers.group {
            Some(group) => {
                quiet_collective_panics();
                if group.rank == 0 {
                    group.host_coordinator()?;
                }
                group.collective(count)?
            }
            None => CollectiveConfig::default().with_num_devices(count),
        };
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
            let nodes = peers.group.as_ref().map(|g| g.count);
            let thread = std::thread::Builder::new()
                .name(format!("peer-{peer}"))
                .spawn(move || {
                    serve::<B, M>(
                        peer,
                        first + peer,
                        nodes,
                        device,
                        shard,
                        config,
                        receive,
                        report,
                    )
                })
                .with_context(|| format!("cannot start the thread of device {peer}"))?;
            jobs.push(send);
            threads.push(thread);
        }
        let threads = Self {
            jobs,
            done,
            threads,
            timing: Cell::default(),
            watchdog: peers.group.clone().map(Watchdog::start),
            first,
        };
        let device = peers.devices[0].clone();
        let id = PeerId(first as u32);
        let Some(group) = &peers.group else {
            register::<B::InnerBackend>(id, device, config)
                .map_err(|err| anyhow::anyhow!("burn-collective refused device 0: {err:?}"))?;
            return Ok((threads, start));
        };
        let join = seconds(JOIN_TIMEOUT_ENV, 300);
        within(join, move || {
            register::<B::InnerBackend>(id, device, config)
        })
        .map_err(|_| {
            anyhow::anyhow!(
                "node {}: the coordinator at {}:{} did not answer, or not all {} nodes joined, \
                     within {:.0} s: start every node with the same --nodes and --coordinator \
                     (node 0 hosts it)",
                group.rank,
                group.host,
                group.port,
                group.count,
                join.as_secs_f64()
            )
        })?
        .map_err(|err| anyhow::anyhow!("burn-collective refused node {}: {err:?}", group.rank))?;
        let row = Row::new(peers.identity, start, count);
        let nodes = group.count;
        let rank = group.rank;
        let rows =
            within(join, move || agree::<B>(first, nodes, Some((rank, row)))).map_err(|_| {
                anyhow::anyhow!("the nodes did not compare their runs within {join:?}")
            })??;
        Row::check(&rows, group)?;
        let start = rows.iter().map(Row::start).min().unwrap_or(start);
        Ok((threads, start))
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

    /// Counts a batch (a step, or one of a step's accumulated batches) of `step` wall time,
    /// `reduce` of it in the all-reduce.
    pub fn timed(&self, step: Duration, reduce: Duration) {
        let (steps, total, reduced) = self.timing.get();
        self.timing.set((steps + 1, total + step, reduced + reduce));
    }

    /// Marks the start (`Some(step)`) and end (`None`) of a step's all-reduce, for the
    /// watchdog of a run across nodes.
    pub fn reducing(&self, step: Option<usize>) {
        if let Some(watchdog) = &self.watchdog {
            *watchdog.since.lock().unwrap_or_else(|e| e.into_inner()) =
                step.map(|s| (s, Instant::now()));
        }
    }

    /// The machines of the run, if several.
    pub fn group(&self) -> Option<&NodeGroup> {
        self.watchdog.as_ref().map(|w| &w.group)
    }

    /// This node's first peer in the run's numbering.
    pub fn first(&self) -> usize {
        self.first
    }

    /// Ends the peers' threads and unregisters the training thread; says what the all-reduce
    /// cost.
    pub fn stop<B: AutodiffBackend>(self) {
        let (steps, total, reduced) = self.timing.get();
        if steps > 0 {
            println!(
                "data-parallel on {}{}: {:.1} ms a batch, of which {:.1} ms ({:.0}%) in \
                 the gradients' all-reduce (waiting for the slowest device included)",
                crate::stdio::count(self.jobs.len() + 1, "device"),
                self.group()
                    .map(|g| format!(" × {} nodes", g.count))
                    .unwrap_or_default(),
                total.as_secs_f64() * 1e3 / steps as f64,
                reduced.as_secs_f64() * 1e3 / steps as f64,
                100.0 * reduced.as_secs_f64() / total.as_secs_f64().max(1e-9),
            );
        }
        let first = self.first;
        drop(self.jobs);
        for thread in self.threads {
            let _ = thread.join();
        }
        if let Some(watchdog) = &self.watchdog {
            watchdog
                .finished
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        // Across nodes this tells the coordinator, which may be gone with its node.
        let _ = within(Duration::from_secs(10), move || {
            finish_collective::<B::InnerBackend>(PeerId(first as u32))
        });
    }
}

/// burn-collective's tasks panic where a node goes away mid-transfer (tokio catches it and the
/// all-reduce returns an error, which the run reports in one line): their panic messages are
/// not printed. Every other panic still is.
/// Installed on top of the hook in place (burn-train's learner installs its own when it starts:
/// this is called again after it).
pub fn quiet_collective_panics() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let file = info.location().map_or("", |l| l.file());
        if !(file.contains("burn-collective") || file.contains("burn-communication")) {
            previous(info);
        }
    }));
}

/// Runs `work` on a thread of its own; its result, or `Err` after `limit`.
fn within<T: Send + 'static>(
    limit: Duration,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ()> {
    let (send, receive) = channel();
    std::thread::spawn(move || {
        let _ = send.send(work());
    });
    receive.recv_timeout(limit).map_err(|_| ())
}

/// What one node tells the others before the first step (small integers, exact in f32).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Row([f32; 7]);

impl Row {
    fn new(identity: u64, start: usize, devices: usize) -> Self {
        let part = |i: u32| ((identity >> (16 * i)) & 0xffff) as f32;
        Self([
            part(0),
            part(1),
            part(2),
            part(3),
            (start >> 16) as f32,
            (start & 0xffff) as f32,
            devices as f32,
        ])
    }

    fn start(&self) -> usize {
        ((self.0[4] as usize) << 16) | self.0[5] as usize
    }

    /// Fails with one line naming the first node that differs from node 0.
    fn check(rows: &[Row], group: &NodeGroup) -> Result<()> {
        let zero = rows[0];
        for (rank, row) in rows.iter().enumerate().skip(1) {
            if row.0[..4] != zero.0[..4] {
                bail!(
                    "node {rank} runs another experiment or another binary than node 0 (this is \
                     node {}): start every node with the same config and the same build",
                    group.rank
                );
            }
            if row.0[6] != zero.0[6] {
                bail!(
                    "node {rank} trains on {} devices, node 0 on {}: every node needs the same \
                     number (--devices)",
                    row.0[6],
                    zero.0[6]
                );
            }
        }
        Ok(())
    }
}

/// Every node's [`Row`], by one all-reduce (a sum of rows each peer fills only its node's of;
/// only a node's first peer has one).
fn agree<B: AutodiffBackend>(
    peer: usize,
    nodes: usize,
    row: Option<(usize, Row)>,
) -> Result<Vec<Row>> {
    let width = 7;
    let mut values = vec![0f32; nodes * width];
    if let Some((node, row)) = row {
        values[node * width..(node + 1) * width].copy_from_slice(&row.0);
    }
    let device = Default::default();
    let tensor = Tensor::<B::InnerBackend, 1>::from_floats(values.as_slice(), &device);
    let sum = all_reduce::<B::InnerBackend>(
        PeerId(peer as u32),
        tensor.into_primitive().tensor(),
        ReduceOperation::Sum,
    )
    .map_err(|err| anyhow::anyhow!("the nodes could not compare their runs: {err:?}"))?;
    let sum: Vec<f32> = Tensor::<B::InnerBackend, 1>::from_primitive(TensorPrimitive::Float(sum))
        .into_data()
        .to_vec()
        .map_err(|err| anyhow::anyhow!("{err:?}"))?;
    Ok(sum
        .chunks(width)
        .map(|c| Row(c.try_into().unwrap_or([0.0; 7])))
        .collect())
}

/// Ends the process when a step's all-reduce across nodes waits longer than
/// [`LEAVE_TIMEOUT_ENV`]: a node that left (killed, its machine gone) leaves the others
/// waiting in burn-collective, which cannot be interrupted.
struct Watchdog {
    group: NodeGroup,
    since: Arc<Mutex<Option<(usize, Instant)>>>,
    finished: Arc<std::sync::atomic::AtomicBool>,
}

impl Watchdog {
    fn start(group: NodeGroup) -> Self {
        let since: Arc<Mutex<Option<(usize, Instant)>>> = Arc::default();
        let finished: Arc<std::sync::atomic::AtomicBool> = Arc::default();
        let limit = seconds(LEAVE_TIMEOUT_ENV, 600);
        let (watched, done, who) = (since.clone(), finished.clone(), group.clone());
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(100));
            if done.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            let stuck = *watched.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((step, began)) = stuck.filter(|(_, t)| t.elapsed() > limit) {
                let _ = began;
                eprintln!(
                    "error: node {}: {} did not join the all-reduce of step {step} within {:.0} \
                     s (stopped, killed or unreachable); training stopped: start every node \
                     again with --resume",
                    who.rank,
                    who.others(),
                    limit.as_secs_f64()
                );
                crate::stdio::exit(1);
            }
        });
        Self {
            group,
            since,
            finished,
        }
    }
}

/// Peer `peer`'s thread: registers with burn-collective, then serves the training thread's
/// jobs until it hangs up.
#[allow(clippy::too_many_arguments)]
fn serve<B, M>(
    peer: usize,
    global: usize,
    nodes: Option<usize>,
    device: B::Device,
    shard: ShardFn<M::Input>,
    config: CollectiveConfig,
    jobs: Receiver<Job<M>>,
    report: Sender<(usize, Result<(), String>)>,
) where
    B: AutodiffBackend,
    M: TrainStep + AutodiffModule<B>,
{
    let id = PeerId(global as u32);
    if let Err(err) = register::<B::InnerBackend>(id, device.clone(), config) {
        let _ = report.send((peer, Err(format!("burn-collective refused it: {err:?}"))));
        return;
    }
    // Across nodes, the comparison of the nodes' runs: every peer takes part.
    if let Some(nodes) = nodes {
        if let Err(err) = agree::<B>(global, nodes, None) {
            let _ = report.send((peer, Err(format!("{err:#}"))));
            return;
        }
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
                    mean_across_peers::<B, M>(global, &model, output.grads, [0.0; 2]).map(|_| ())
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
    let _ = within(Duration::from_secs(10), move || {
        finish_collective::<B::InnerBackend>(id)
    });
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
/// peer, whatever the parameters' ids — with `flags` appended: their mean comes back too (a
/// flag one peer raises is above 0 on every peer).
pub fn mean_across_peers<B, M>(
    peer: usize,
    model: &M,
    grads: GradientsParams,
    flags: [f32; 2],
) -> Result<(GradientsParams, [f32; 2]), String>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let mut gather = Gather::<B> {
        grads,
        flat: Vec::new(),
    };
    model.visit(&mut gather);
    let Gather { grads, mut flat } = gather;
    let device = model
        .devices()
        .into_iter()
        .next()
        .ok_or("the model has no parameters")?;
    flat.push(Tensor::from_floats(flags, &device));
    let flat = Tensor::cat(flat, 0).into_primitive().tensor();
    let mean = all_reduce::<B::InnerBackend>(PeerId(peer as u32), flat, ReduceOperation::Mean)
        .map_err(|err| format!("the all-reduce of the gradients failed: {err:?}"))?;
    let mean: Tensor<B::InnerBackend, 1> = Tensor::from_primitive(TensorPrimitive::Float(mean));
    let len = mean.dims()[0];
    let raised: Vec<f32> = mean
        .clone()
        .slice(len - 2..len)
        .into_data()
        .to_vec()
        .map_err(|err| format!("{err:?}"))?;
    let mut scatter = Scatter::<B> { grads, mean, at: 0 };
    model.visit(&mut scatter);
    Ok((scatter.grads, [raised[0], raised[1]]))
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
