//! Element-wise kernels: exact GELU (with its derivative for training), dropout, and the
//! optimizer's passes: the sum of squares global-norm clipping takes, its rescale, and AdamW's
//! update.

use super::{dot, erf, exp, min_tasks, multiversion, uninit, written, CHUNK};
use crate::kernels::{AdamWStep, DropoutMask};
use rayon::prelude::*;
use std::mem::MaybeUninit;

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

multiversion! {
    fn gelu_chunk(x: &[f32], y: &mut [f32]) {
        for (y, &x) in y.iter_mut().zip(x) {
            *y = 0.5 * x * (1.0 + erf(x * FRAC_1_SQRT_2));
        }
    }
}

/// `(GELU(x), GELU'(x))`: the arithmetic every training GELU kernel here shares.
#[inline(always)]
fn gelu_and_derivative(x: f32) -> (f32, f32) {
    let cdf = erf(x * FRAC_1_SQRT_2).mul_add(0.5, 0.5);
    let pdf = FRAC_1_SQRT_2PI * exp(-0.5 * x * x);
    (x * cdf, x.mul_add(pdf, cdf))
}

multiversion! {
    fn gelu_with_derivative_chunk(
        x: &[f32],
        y: &mut [MaybeUninit<f32>],
        derivative: &mut [MaybeUninit<f32>],
    ) {
        for ((y, d), &x) in y.iter_mut().zip(derivative.iter_mut()).zip(x) {
            let (gelu, slope) = gelu_and_derivative(x);
            y.write(gelu);
            d.write(slope);
        }
    }
}

multiversion! {
    /// [`gelu_with_derivative_chunk`] times the dropout multipliers `derivative` holds on entry.
    fn gelu_dropout_with_derivative_chunk(
        x: &[f32],
        y: &mut [MaybeUninit<f32>],
        derivative: &mut [f32],
    ) {
        for ((y, d), &x) in y.iter_mut().zip(derivative.iter_mut()).zip(x) {
            let (gelu, slope) = gelu_and_derivative(x);
            y.write(gelu * *d);
            *d *= slope;
        }
    }
}

multiversion! {
    /// [`gelu_with_derivative_chunk`] with GELU written over its input.
    fn gelu_in_place_chunk(xy: &mut [f32], derivative: &mut [MaybeUninit<f32>]) {
        for (x, d) in xy.iter_mut().zip(derivative.iter_mut()) {
            let (gelu, slope) = gelu_and_derivative(*x);
            *x = gelu;
            d.write(slope);
        }
    }
}

multiversion! {
    /// [`gelu_dropout_with_derivative_chunk`] with the output written over its input.
    fn gelu_dropout_in_place_chunk(xy: &mut [f32], derivative: &mut [f32]) {
        for (x, d) in xy.iter_mut().zip(derivative.iter_mut()) {
            let (gelu, slope) = gelu_and_derivative(*x);
            *x = gelu * *d;
            *d *= slope;
        }
    }
}

/// Where [`gelu_in_place`] writes GELU's derivative.
pub enum Derivative<'a> {
    /// Into this (uninitialised) buffer.
    Plain(&'a mut [MaybeUninit<f32>]),
    /// Into this buffer, times the dropout mask's multipliers of elements `first..` (the
    /// elements' place in the whole tensor whose part this is).
    Masked {
        /// The buffer (its values on entry are not read).
        out: &'a mut [f32],
        /// The mask.
        mask: DropoutMask,
        /// The mask's element of the buffer's first element.
        first: u64,
    },
}

/// GELU of every element of `xy` written over it and its derivative into `derivative`, both
/// times the mask's multipliers where [`Derivative::Masked`]: the values of
/// [`gelu_with_derivative`] bit for bit, for a product's output that is read nowhere else
/// (GELU as the product's epilogue). In parallel chunks when `parallel`, else on this thread.
pub fn gelu_in_place(xy: &mut [f32], derivative: Derivative, parallel: bool) {
    let n = xy.len();
    let min_len = if parallel { min_tasks(n) } else { usize::MAX };
    match derivative {
        Derivative::Plain(d) => {
            assert_eq!(d.len(), n, "a derivative for each element");
            xy.par_chunks_mut(CHUNK)
                .zip(d.par_chunks_mut(CHUNK))
                .with_min_len(min_len)
                .for_each(|(xy, d)| gelu_in_place_chunk(xy, d));
        }
        Derivative::Masked { out, mask, first } => {
            assert_eq!(out.len(), n, "a derivative for each element");
            xy.par_chunks_mut(CHUNK)
                .zip(out.par_chunks_mut(CHUNK))
                .enumerate()
                .with_min_len(min_len)
                .for_each(|(c, (xy, d))| {
                    mask.fill(first + (c * CHUNK) as u64, d);
                    gelu_dropout_in_place_chunk(xy, d);
                });
        }
    }
}

/// `(GELU(x), GELU'(x))` of every element, for training's forward pass; with a dropout `mask`,
/// both times its multipliers: GELU then dropout (the values bit for bit those of the two
/// apart), and the derivative the backward pass multiplies by.
pub fn gelu_with_derivative(x: &[f32], mask: Option<DropoutMask>) -> (Vec<f32>, Vec<f32>) {
    if let Some(mask) = mask {
        return gelu_dropout_with_derivative(x, mask);
    }
    let n = x.len();
    let (mut y, mut derivative) = (uninit(n), uninit(n));
    let (ys, ds) = (
        &mut y.spare_capacity_mut()[..n],
        &mut derivative.spare_capacity_mut()[..n],
    );
    ys.par_chunks_mut(CHUNK)
        .zip(ds.par_chunks_mut(CHUNK))
        .zip(x.par_chunks(CHUNK))
        .with_min_len(min_tasks(n))
        .for_each(|((y, d), x)| gelu_with_derivative_chunk(x, y, d));
    // SAFETY: the chunks cover all `n` elements of both, and each kernel writes its chunk.
    unsafe { (written(y, n), written(derivative, n)) }
}

fn gelu_dropout_with_derivative(x: &[f32], mask: DropoutMask) -> (Vec<f32>, Vec<f32>) {
    let n = x.len();
    let (mut y, mut derivative) = (uninit(n), vec![0.0; n]);
    let ys = &mut y.spare_capacity_mut()[..n];
    ys.par_chunks_mut(CHUNK)
        .zip(derivative.par_chunks_mut(CHUNK))
        .zip(x.par_chunks(CHUNK))
        .enumerate()
        .with_min_len(min_tasks(n))
        .for_each(|(c, ((y, d), x))| {
            mask.fill((c * CHUNK) as u64, d);
            gelu_dropout_with_derivative_chunk(x, y, d);
        });
    // SAFETY: the chunks cover all `n` elements, and each kernel writes its chunk.
    (unsafe { written(y, n) }, derivative)
}

/// Exact GELU of every element.
pub fn gelu(x: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    y.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .with_min_len(min_tasks(x.len()))
        .for_each(|(y, x)| gelu_chunk(x, y));
    y
}

/// `x ⊙ M` for the dropout mask `M` (element `e` of `x` times the mask's element `e`), in
/// parallel chunks, each drawing its own part of the mask.
pub fn dropout(x: &[f32], mask: DropoutMask) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    y.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .enumerate()
        .with_min_len(min_tasks(x.len()))
        .for_each(|(c, (y, x))| {
            mask.fill((c * CHUNK) as u64, y);
            y.iter_mut().zip(x).for_each(|(y, &x)| *y *= x);
        });
    y
}

multiversion! {
    fn adamw_chunk(
        param: AdamWParam,
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        scale: f32,
        first: bool,
        step: AdamWStep,
    ) {
        let AdamWStep { lr, beta_1, beta_2, epsilon, weight_decay, time } = step;
        let (c1, c2) = (1.0 - beta_1.powi(time), 1.0 - beta_2.powi(time));
        let (b1, b2) = if first { (0.0, 0.0) } else { (beta_1, beta_2) };
        let keep = 1.0 - lr * weight_decay;
        let update = |p: f32, g: f32, m: &mut f32, v: &mut f32| {
            let g = g * scale;
            *m = *m * b1 + g * (1.0 - beta_1);
            *v = *v * b2 + g * g * (1.0 - beta_2);
            let delta = (*m / c1) / ((*v / c2).sqrt() + epsilon);
            p * keep - delta * lr
        };
        let moments = m.iter_mut().zip(v.iter_mut());
        match param {
            AdamWParam::InPlace(param) => {
                for ((p, &g), (m, v)) in param.iter_mut().zip(grad).zip(moments) {
                    *p = update(*p, g, m, v);
                }
            }
            AdamWParam::Into { from, to } => {
                for (((p, &old), &g), (m, v)) in to.iter_mut().zip(from).zip(grad).zip(moments) {
                    p.write(update(old, g, m, v));
                }
            }
        }
    }
}

/// A read-only tensor's elements in row-major order, stored as rows of `width` elements that
/// start `stride` apart: a contiguous slice, or a view such as a parameter's gradient sliced
/// from the columns of a packed product's, read where it lies instead of copied whole first.
#[derive(Clone, Copy, Debug)]
pub struct Strided<'a> {
    /// The storage the rows lie in.
    pub data: &'a [f32],
    /// Index of the first element.
    pub offset: usize,
    /// Elements of one row.
    pub width: usize,
    /// Distance between the starts of two rows, at least `width`.
    pub stride: usize,
    /// Number of elements (whole rows).
    pub len: usize,
}

impl<'a> From<&'a [f32]> for Strided<'a> {
    fn from(x: &'a [f32]) -> Self {
        Self {
            data: x,
            offset: 0,
            width: x.len().max(1),
            stride: x.len().max(1),
            len: x.len(),
        }
    }
}

impl<'a> Strided<'a> {
    /// Elements `start..start + n` in order: borrowed where they lie in one run, else gathered
    /// row piece by row piece into `buf` (one task's chunk, while it is about to be read).
    fn range<'b>(&self, start: usize, n: usize, buf: &'b mut Vec<f32>) -> &'b [f32]
    where
        'a: 'b,
    {
        assert!(start + n <= self.len, "a range inside the tensor");
        let (row, column) = (start / self.width, start % self.width);
        let first = self.offset + row * self.stride + column;
        if self.width == self.stride || column + n <= self.width {
            return &self.data[first..first + n];
        }
        buf.clear();
        let (mut at, mut left) = (first, n);
        let mut piece = self.width - column;
        while left > 0 {
            let take = piece.min(left);
            buf.extend_from_slice(&self.data[at..at + take]);
            left -= take;
            at += piece + self.stride - self.width; // the next row's start
            piece = self.width;
        }
        buf
    }

    /// Its chunks of [`CHUNK`] elements in order, each as `(self, start, length)`.
    fn chunks(self) -> impl Iterator<Item = (Strided<'a>, usize, usize)> {
        (0..self.len)
            .step_by(CHUNK)
            .map(move |start| (self, start, CHUNK.min(self.len - start)))
    }
}

/// One parameter's share of [`adamw_all`]: the parameter (updated where [`AdamWParam`] says),
/// its moments, updated in place (`first`: they hold zeros and this is step 1's
/// initialisation), and its gradient.
pub struct AdamWSlices<'a> {
    /// The parameter.
    pub param: AdamWParam<'a>,
    /// Its gradient, as many elements as the parameter.
    pub grad: Strided<'a>,
    /// The first moment.
    pub m: &'a mut [f32],
    /// The second moment.
    pub v: &'a mut [f32],
    /// Whether this is the parameter's first step.
    pub first: bool,
    /// The step's settings.
    pub step: AdamWStep,
}

/// Where [`adamw_all`] writes a parameter's new values.
pub enum AdamWParam<'a> {
    /// Over the old ones, in their buffer.
    InPlace(&'a mut [f32]),
    /// Into a buffer of their own, the old values read from `from` (a buffer someone else
    /// still holds, such as the training loop's copy of the module: updating a copy of it in
    /// place would read and write it twice), as many elements as `from`.
    Into {
        /// The old values.
        from: &'a [f32],
        /// The new values' buffer; every element is written.
        to: &'a mut [MaybeUninit<f32>],
    },
}

impl<'a> AdamWParam<'a> {
    fn len(&self) -> usize {
        match self {
            AdamWParam::InPlace(p) => p.len(),
            AdamWParam::Into { from, to } => {
                assert_eq!(from.len(), to.len(), "a new value per parameter element");
                from.len()
            }
        }
    }

    /// Its chunks of [`CHUNK`] elements in order, each written where this one is.
    fn chunks(self) -> Box<dyn Iterator<Item = AdamWParam<'a>> + 'a> {
        match self {
            AdamWParam::InPlace(p) => Box::new(p.chunks_mut(CHUNK).map(AdamWParam::InPlace)),
            AdamWParam::Into { from, to } => Box::new(
                from.chunks(CHUNK)
                    .zip(to.chunks_mut(CHUNK))
                    .map(|(from, to)| AdamWParam::Into { from, to }),
            ),
        }
    }
}

/// One AdamW step (see [`AdamWStep`]) of every parameter of `items`, each gradient multiplied
/// by `scale` as it is read (global-norm clipping's factor; `g·1` is `g`, bit for bit). One
/// parallel pass over all of them in chunks of `CHUNK` elements (a small model's parameters
/// are mostly smaller than the size that splits one pass across cores, so one at a time they
/// would each run on one core).
pub fn adamw_all(items: Vec<AdamWSlices<'_>>, scale: f32) {
    let total: usize = items.iter().map(|item| item.param.len()).sum();
    let mut tasks = Vec::new();
    for item in items {
        assert_eq!(
            item.grad.len,
            item.param.len(),
            "a gradient per parameter element"
        );
        let chunks = item
            .param
            .chunks()
            .zip(item.grad.chunks())
            .zip(item.m.chunks_mut(CHUNK).zip(item.v.chunks_mut(CHUNK)));
        tasks.extend(chunks.map(|((p, g), (m, v))| (p, g, m, v, item.first, item.step)));
    }
    tasks
        .into_par_iter()
        .with_min_len(min_tasks(total))
        .for_each_init(Vec::new, |buf, (p, (g, start, n), m, v, first, step)| {
            adamw_chunk(p, g.range(start, n, buf), m, v, scale, first, step)
        });
}

multiversion! {
    fn sum_squares_chunk(x: &[f32]) -> f32 {
        dot(x, x)
    }
}

/// `Σ x²`: chunks of [`CHUNK`] elements (in parallel when large), each summed by [`dot`]'s
/// fixed lanes, their sums added in order — the same bits whatever the threads and the
/// processor.
pub fn sum_squares(x: &[f32]) -> f32 {
    sum_squares_all(&[x.into()])
}

/// `Σ x²` over every element of every tensor of `xs`, the same bits as [`sum_squares`] of each
/// (of a contiguous copy of each) added in order, in one parallel pass over all their chunks.
pub fn sum_squares_all(xs: &[Strided]) -> f32 {
    let total: usize = xs.iter().map(|x| x.len).sum();
    let chunks: Vec<_> = xs.iter().flat_map(|x| x.chunks()).collect();
    let partial: Vec<f32> = chunks
        .into_par_iter()
        .with_min_len(min_tasks(total))
        .map_init(Vec::new, |buf, (x, start, n)| {
            sum_squares_chunk(x.range(start, n, buf))
        })
        .collect();
    let mut at = 0;
    let each = xs.iter().map(|x| {
        let k = x.len.div_ceil(CHUNK);
        at += k;
        partial[at - k..at].iter().sum::<f32>()
    });
    each.reduce(|total, s| total + s).unwrap_or(0.0)
}

/// `x ← x · s` in place (in parallel when large).
pub fn scale(x: &mut [f32], s: f32) {
    let tasks = min_tasks(x.len());
    x.par_chunks_mut(CHUNK)
        .with_min_len(tasks)
        .for_each(|x| scale_chunk(x, s));
}

multiversion! {
    fn scale_chunk(x: &mut [f32], s: f32) {
        x.iter_mut().for_each(|x| *x *= s);
    }
}

/// `x ← x ⊙ y` element by element, in place (in parallel when large): the backward pass of an
/// element-wise function whose derivative the forward pass kept (GELU's).
pub fn mul(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "an element-wise product of equal lengths");
    let tasks = min_tasks(x.len());
    x.par_chunks_mut(CHUNK)
        .zip(y.par_chunks(CHUNK))
        .with_min_len(tasks)
        .for_each(|(x, y)| mul_chunk(x, y));
}

multiversion! {
    fn mul_chunk(x: &mut [f32], y: &[f32]) {
        x.iter_mut().zip(y).for_each(|(x, &y)| *x *= y);
    }
}
