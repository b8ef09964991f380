//! Deterministic data loading for training: every epoch's batches — which items, in which
//! order, and each batch's augmentation and dropout masks — are a pure function of
//! `(seed, epoch, batch)`, whatever the number of worker threads. A run resumed after batch `j`
//! of epoch `k` therefore sees exactly the batches the uninterrupted run saw from there on: the
//! loader skips the first `j` (see [`EpochLoader::skipping`]) without reading their items.
//!
//! burn's own loaders cannot promise this: with replacement sampling the items come from one
//! random stream shared by all epochs (a resumed run had to reseed it), and with several workers
//! batches arrive in whichever order the threads finish them.

use crate::artifact::CheckpointWatch;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::Dataset;
use burn::tensor::backend::Backend;
use burn::tensor::Device;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

/// Makes one batch from its items; the `u64` seeds whatever randomness the batch has (image
/// shifts), so it too depends only on `(seed, epoch, batch)`.
pub type BatchFn<B, I, O> = Arc<dyn Fn(Vec<I>, u64, &Device<B>) -> O + Send + Sync + 'static>;

/// A batch function from a burn [`Batcher`] that has no randomness of its own.
pub fn unseeded<B, I, O, T>(batcher: T) -> BatchFn<B, I, O>
where
    B: Backend,
    T: Batcher<B, I, O> + 'static,
{
    Arc::new(move |items, _seed, device| batcher.batch(items, device))
}

/// Which items an epoch reads.
#[derive(Clone, Copy, Debug)]
pub enum Draw {
    /// `batches` batches of items drawn uniformly with replacement, fresh every epoch
    /// (nanoGPT's `get_batch`): training.
    Replacement {
        /// Batches per epoch.
        batches: usize,
    },
    /// The same seeded sample of `items` items (without replacement) every epoch: validation.
    Fixed {
        /// Items per epoch (at most the dataset's length).
        items: usize,
    },
}

/// The batches of one epoch drawn with replacement from `len` items by the generator `seed`:
/// `batches · batch_size` indices, uniform. In draw order, `batches` batches of `batch_size`;
/// with `lengths`, sorted by length (a stable sort of a random draw: ties stay in random order),
/// cut into `batches` runs of about equal tokens (more short items in a batch, fewer long ones)
/// and the batches shuffled.
pub fn replacement_batches(
    len: usize,
    batches: usize,
    batch_size: usize,
    seed: u64,
    lengths: Option<&[usize]>,
) -> Vec<Vec<usize>> {
    replacement_batches_in_groups(len, batches, batch_size, seed, lengths, 1)
}

/// [`replacement_batches`] whose length-sorted batches are cut only between runs of `group`
/// items (consecutive in length order), so that every batch holds a multiple of `group` items:
/// what a batch split across `group` devices needs (one item at least for each). `group` 1 is
/// `replacement_batches`; without `lengths` batches are `batch_size` items whatever `group`.
pub fn replacement_batches_in_groups(
    len: usize,
    batches: usize,
    batch_size: usize,
    seed: u64,
    lengths: Option<&[usize]>,
    group: usize,
) -> Vec<Vec<usize>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut drawn: Vec<usize> = (0..batches * batch_size)
        .map(|_| rng.random_range(0..len.max(1)))
        .collect();
    let Some(lengths) = lengths else {
        return drawn
            .chunks(batch_size.max(1))
            .map(<[usize]>::to_vec)
            .collect();
    };
    let length = |i: usize| lengths.get(i).copied().unwrap_or(0);
    drawn.sort_by_key(|&i| length(i));
    let mut grouped = if group <= 1 {
        balanced(
            &drawn,
            &drawn.iter().map(|&i| length(i)).collect::<Vec<_>>(),
            batches,
        )
    } else {
        // The same cut over runs of `group` items, each as long as its items together.
        let runs: Vec<usize> = (0..drawn.len().div_ceil(group)).collect();
        let run_lengths: Vec<usize> = drawn
            .chunks(group)
            .map(|run| run.iter().map(|&i| length(i)).sum())
            .collect();
        balanced(&runs, &run_lengths, batches)
            .into_iter()
            .map(|cut| {
                cut.iter()
                    .flat_map(|&r| drawn.chunks(group).nth(r).unwrap_or_default().to_vec())
                    .collect()
            })
            .collect()
    };
    grouped.shuffle(&mut rng);
    grouped
}

/// `items` (sorted by length) cut into `n` non-empty runs whose lengths sum to about the same:
/// run `k` ends where the running sum first reaches `k/n` of the total.
fn balanced(items: &[usize], lengths: &[usize], n: usize) -> Vec<Vec<usize>> {
    let n = n.clamp(1, items.len().max(1));
    let total: usize = lengths.iter().sum();
    let mut runs = Vec::with_capacity(n);
    let (mut start, mut sum) = (0, 0);
    for (at, &length) in lengths.iter().enumerate() {
        sum += length;
        let k = runs.len() + 1;
        let left = items.len() - (at + 1); // items after this one
                                           // Cut when the run has its share, or when every later item must start a run.
        let due = sum * n >= k * total || left == n - k;
        if k < n && due && left >= n - k {
            runs.push(items[start..=at].to_vec());
            start = at + 1;
        }
    }
    runs.push(items[start..].to_vec());
    runs
}

/// The fraction of positions that are padding in `batches`, each padded to its longest item
/// (`lengths[i]` is item `i`'s length).
pub fn padding_fraction(batches: &[Vec<usize>], lengths: &[usize]) -> f64 {
    let (mut real, mut padded) = (0usize, 0usize);
    for batch in batches {
        let longest = batch.iter().map(|&i| lengths[i]).max().unwrap_or(0);
        real += batch.iter().map(|&i| lengths[i]).sum::<usize>();
        padded += longest * batch.len();
    }
    if padded == 0 {
        0.0
    } else {
        1.0 - real as f64 / padded as f64
    }
}

/// splitmix64 of `a` and `b`: independent-looking seeds from a seed and a counter.
pub fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b
        .wrapping_add(0x9e37_79b9_7f4a_7c15)
        .wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A [`DataLoader`] whose epochs are reproducible; see the module docs.
pub struct EpochLoader<B: Backend, I, O> {
    dataset: Arc<dyn Dataset<I>>,
    batch: BatchFn<B, I, O>,
    device: B::Device,
    draw: Draw,
    batch_size: usize,
    workers: usize,
    seed: u64,
    /// Epochs begun so far, shared with the copies `to_device` makes (and with the session, which
    /// sets it to the epoch a resumed run starts after).
    epoch: Arc<AtomicUsize>,
    /// Reseed the backend's generator and the dropout stream before every batch.
    reseed_backend: bool,
    /// Batches the next epoch begins with as if already read (a run resumed mid-epoch); taken
    /// (reset to 0) when the epoch begins.
    skip: Option<Arc<AtomicUsize>>,
    /// The part of each epoch's items this loader serves (`slice`).
    range: Option<Range<usize>>,
    /// `(j, k)`: this loader serves the `j`-th of `k` shares of every batch (data-parallel
    /// training: one loader per device).
    shard: Option<(usize, usize)>,
    /// Each item's length, when batches group similar lengths (see [`Self::by_length`]).
    lengths: Option<Arc<Vec<usize>>>,
    /// The run's checkpoints, whose reads every epoch waits for (see [`Self::after_checkpoints`]).
    checkpoints: Option<Arc<CheckpointWatch>>,
}

impl<B: Backend, I, O> Clone for EpochLoader<B, I, O> {
    fn clone(&self) -> Self {
        Self {
            dataset: self.dataset.clone(),
            batch: self.batch.clone(),
            device: self.device.clone(),
            draw: self.draw,
            batch_size: self.batch_size,
            workers: self.workers,
            seed: self.seed,
            epoch: self.epoch.clone(),
            reseed_backend: self.reseed_backend,
            skip: self.skip.clone(),
            range: self.range.clone(),
            shard: self.shard,
            lengths: self.lengths.clone(),
            checkpoints: self.checkpoints.clone(),
        }
    }
}

impl<B, I, O> EpochLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + 'static,
    O: Send + 'static,
{
    /// A loader of `dataset` in batches of `batch_size`, made by `workers` threads (at least 1).
    /// `epoch` counts the epochs begun; set it to `k` to start after epoch `k`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dataset: impl Dataset<I> + 'static,
        batch: BatchFn<B, I, O>,
        device: B::Device,
        draw: Draw,
        batch_size: usize,
        workers: usize,
        seed: u64,
        epoch: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            dataset: Arc::new(dataset),
            batch,
            device,
            draw,
            batch_size: batch_size.max(1),
            workers: workers.max(1),
            seed,
            epoch,
            reseed_backend: false,
            skip: None,
            range: None,
            shard: None,
            lengths: None,
            checkpoints: None,
        }
    }

    /// Serves the `index`-th of `count` shares of every batch: items `index`, `index + count`,
    /// `index + 2·count`, … of it (in length-grouped epochs every batch holds a multiple of
    /// `count` items, similar lengths side by side, so each share gets one of each run), on
    /// `device`. The `count` loaders of one run read disjoint items that together are the
    /// unsharded batch. Each share's dropout masks and augmentation are drawn from seeds of
    /// their own (mixed with `index`).
    pub fn shard(mut self, index: usize, count: usize, device: B::Device) -> Self {
        if count > 1 {
            self.shard = Some((index, count));
        }
        self.device = device;
        self
    }

    /// Also reseeds the backend's random generator and the dropout stream from
    /// `(seed, epoch, batch)` as each batch is made (on the training thread, right before the
    /// step that uses it), so a run resumed at any batch draws the masks the uninterrupted run
    /// drew.
    pub fn reseeding_backend(mut self) -> Self {
        self.reseed_backend = true;
        self
    }

    /// The next epoch to begin starts after the number of batches in `skip` (then set back to
    /// 0): what a run resumed mid-epoch trained already. Their items are not read.
    pub fn skipping(mut self, skip: Arc<AtomicUsize>) -> Self {
        self.skip = Some(skip);
        self
    }

    /// Batches of similar lengths (`lengths[i]` is item `i`'s): an epoch drawn with replacement
    /// reads the same items as without, sorted by length, cut into batches and the batches
    /// shuffled — the same items and tokens per epoch, far less padding, still a pure function
    /// of `(seed, epoch)`. No effect on [`Draw::Fixed`].
    pub fn by_length(mut self, lengths: Vec<usize>) -> Self {
        self.lengths = Some(Arc::new(lengths));
        self
    }

    /// Begins no epoch (no tensor operation) while the checkpoint thread of `watch` is still
    /// reading a checkpoint's tensors: see [`CheckpointWatch::wait_for_reads`]. burn-train saves
    /// checkpoints between epochs (train, validate, checkpoint), so one wait per epoch, before
    /// its first tensor operation, keeps every batch clear of the reads.
    pub fn after_checkpoints(mut self, watch: Arc<CheckpointWatch>) -> Self {
        self.checkpoints = Some(watch);
        self
    }
}

impl<B: Backend, I, O> EpochLoader<B, I, O> {
    /// The dataset indices of `epoch`'s batches, in order.
    pub fn batches(&self, epoch: usize) -> Vec<Vec<usize>> {
        let len = self.dataset.len();
        let all = match self.draw {
            Draw::Replacement { batches } => replacement_batches_in_groups(
                len,
                batches,
                self.batch_size,
                mix(self.seed, epoch as u64),
                self.lengths.as_ref().map(|l| l.as_slice()),
                self.shard.map_or(1, |(_, count)| count),
            ),
            Draw::Fixed { items } => {
                let mut order: Vec<usize> = (0..len).collect();
                order.shuffle(&mut StdRng::seed_from_u64(mix(self.seed, 0x5eed)));
                order.truncate(items);
                order
                    .chunks(self.batch_size)
                    .map(<[usize]>::to_vec)
                    .collect()
            }
        };
        let all = match self.shard {
            Some((index, count)) => all
                .into_iter()
                .map(|batch| batch.into_iter().skip(index).step_by(count).collect())
                .collect(),
            None => all,
        };
        let Some(range) = &self.range else {
            return all;
        };
        // The items at positions `range` of the epoch, batch boundaries kept.
        let mut at = 0;
        let mut kept = Vec::new();
        for batch in all {
            let (from, to) = (range.start.max(at), range.end.min(at + batch.len()));
            if from < to {
                kept.push(batch[from - at..to - at].to_vec());
            }
            at += batch.len();
        }
        kept
    }

    /// The batches of epoch `epoch` (1-based) after its first `skip`, whatever epoch the loader's
    /// own count stands at: what a data-parallel peer reads, told the epoch by the first.
    pub fn epoch_iter(&self, epoch: usize, skip: usize) -> EpochIter<B, I, O>
    where
        I: Send + Sync + 'static,
    {
        let epoch_batches = Arc::new(self.batches(epoch));
        let items: usize = epoch_batches.iter().map(Vec::len).sum();
        let batches = epoch_batches.len();
        let skip = skip.min(batches);
        let skipped: usize = epoch_batches[..skip].iter().map(Vec::len).sum();
        let workers = self.workers.min((batches - skip).max(1));
        // Worker `w` reads the items of batches w, w + workers, …; the iterator takes them
        // round-robin, so they come out in order however the threads are scheduled. The
        // batch's tensors are made by the iterator, on the training thread: on burn's GPU
        // backends each thread has its own stream, and tensors made on a loader thread that
        // ends with the epoch were measured to corrupt a validation now and then on wgpu.
        // A shard's batches draw their own augmentation and dropout masks.
        let own = |seed: u64| match self.shard {
            Some((index, _)) => mix(seed, 0x5a4d_0000 | index as u64),
            None => seed,
        };
        let seed = own(mix(self.seed, epoch as u64));
        let receivers = (0..workers)
            .map(|w| {
                let (sender, receiver) = sync_channel(2);
                let (epoch_batches, dataset) = (epoch_batches.clone(), self.dataset.clone());
                std::thread::Builder::new()
                    .name(format!("loader-{w}"))
                    .spawn(move || {
                        for j in (skip + w..batches).step_by(workers) {
                            let chunk = &epoch_batches[j];
                            let items: Vec<I> =
                                chunk.iter().filter_map(|&i| dataset.get(i)).collect();
                            if sender.send((items, chunk.len())).is_err() {
                                return; // the epoch was cut short
                            }
                        }
                    })
                    .expect("cannot start a data-loading thread");
                receiver
            })
            .collect();
        EpochIter::<B, I, O> {
            receivers,
            batch: self.batch.clone(),
            device: self.device.clone(),
            seed,
            reseed: self
                .reseed_backend
                .then(|| own(mix(self.seed, (epoch as u64) << 32 | 0xd409))),
            first: skip,
            next: skip,
            batches,
            progress: Progress::new(skipped, items),
        }
    }

    /// The dataset indices of `epoch`'s items, in order.
    pub fn indices(&self, epoch: usize) -> Vec<usize> {
        self.batches(epoch).concat()
    }

    fn items_per_epoch(&self) -> usize {
        let all = match self.draw {
            Draw::Replacement { batches } => batches * self.batch_size,
            Draw::Fixed { items } => items.min(self.dataset.len()),
        };
        let all = match self.shard {
            Some((index, count)) => (all + count - 1 - index) / count,
            None => all,
        };
        match &self.range {
            Some(range) => range.end.min(all).saturating_sub(range.start),
            None => all,
        }
    }
}

impl<B, I, O> DataLoader<B, O> for EpochLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + 'static,
    O: Send + 'static,
{
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        if let Some(watch) = &self.checkpoints {
            watch.wait_for_reads();
        }
        let epoch = self.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        let skip = self
            .skip
            .as_ref()
            .map_or(0, |skip| skip.swap(0, Ordering::SeqCst));
        Box::new(self.epoch_iter(epoch, skip))
    }

    fn num_items(&self) -> usize {
        EpochLoader::<B, I, O>::items_per_epoch(self)
    }

    fn to_device(&self, device: &B::Device) -> Arc<dyn DataLoader<B, O>> {
        let mut copy = self.clone();
        copy.device = device.clone();
        Arc::new(copy)
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<B, O>> {
        let mut copy = self.clone();
        let offset = self.range.as_ref().map_or(0, |r| r.start);
        copy.range = Some(offset + start..offset + end);
        Arc::new(copy)
    }
}

/// One epoch of an [`EpochLoader`].
pub struct EpochIter<B: Backend, I, O> {
    /// Each batch's items, with how many were asked for.
    receivers: Vec<Receiver<(Vec<I>, usize)>>,
    batch: BatchFn<B, I, O>,
    device: B::Device,
    /// The epoch's seed, mixed with each batch's index for its batch function.
    seed: u64,
    /// The epoch's seed of the backend's generator and the dropout stream, mixed with each
    /// batch's index, when they are reseeded.
    reseed: Option<u64>,
    /// The first batch the epoch reads (after those skipped).
    first: usize,
    next: usize,
    batches: usize,
    progress: Progress,
}

impl<B: Backend, I, O> Iterator for EpochIter<B, I, O> {
    type Item = O;

    fn next(&mut self) -> Option<O> {
        if self.next >= self.batches {
            return None;
        }
        // A worker only stops early when reading an item panicked: an epoch silently cut
        // short would train fewer steps than it reports.
        let worker = (self.next - self.first) % self.receivers.len();
        let (items, asked) = self.receivers[worker]
            .recv()
            .expect("a data-loading thread failed (see its message above)");
        if let Some(seed) = self.reseed {
            crate::kernels::seed::<B>(&self.device, mix(seed, self.next as u64));
        }
        let made = (self.batch)(items, mix(self.seed, self.next as u64), &self.device);
        self.next += 1;
        self.progress.items_processed += asked;
        Some(made)
    }
}

impl<B: Backend, I, O> DataLoaderIterator<O> for EpochIter<B, I, O> {
    fn progress(&self) -> Progress {
        self.progress.clone()
    }
}
