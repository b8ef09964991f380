//! The products of linear layers on `64`-row blocks through the `gemm` crate, split across the
//! cores by rows when large enough.

use super::pointwise::{gelu_in_place, Derivative};
use super::{multiversion, uninit, written};
use crate::kernels::DropoutMask;
use rayon::prelude::*;

/// A matrix operand: `(pointer, row stride, column stride)` in elements.
pub(super) type Operand = (*const f32, usize, usize);

/// `dst = A·B` (`accumulate`: `dst += A·B`) for `A` `m × k` and `B` `k × n`, with `dst`
/// row-major (`ld` apart): one single-threaded call of the `gemm` crate, the product kernel
/// flex itself uses (the parallelism is across blocks of rows, in [`product`]).
///
/// # Safety
/// Every operand must be valid for its extent, and `dst` not alias them.
#[inline(always)]
pub(super) unsafe fn matmul(
    [m, n, k]: [usize; 3],
    dst: *mut f32,
    ld: usize,
    accumulate: bool,
    (a, a_rs, a_cs): Operand,
    (b, b_rs, b_cs): Operand,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        ld as isize,
        accumulate,
        a,
        a_cs as isize,
        a_rs as isize,
        b,
        b_cs as isize,
        b_rs as isize,
        1.0,
        1.0,
        false,
        false,
        false,
        gemm::Parallelism::None,
    )
}

/// A read-only matrix in any layout: element `(r, c)` is at `offset + r·rs + c·cs` of `data`.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    /// The storage the strides index.
    pub data: &'a [f32],
    /// Index of element `(0, 0)`.
    pub offset: usize,
    /// `[rows, columns]`.
    pub shape: [usize; 2],
    /// `[row stride, column stride]`.
    pub strides: [usize; 2],
}

impl Matrix<'_> {
    /// As a product operand, checked to lie inside its storage.
    fn operand(&self) -> Operand {
        let [r, c] = self.shape;
        let [rs, cs] = self.strides;
        if r > 0 && c > 0 {
            let last = self.offset + (r - 1) * rs + (c - 1) * cs;
            assert!(last < self.data.len(), "matrix view out of bounds");
        }
        (self.data[self.offset..].as_ptr(), rs, cs)
    }

    /// The transposed view.
    fn t(self) -> Self {
        let ([r, c], [rs, cs]) = (self.shape, self.strides);
        Self {
            shape: [c, r],
            strides: [cs, rs],
            ..self
        }
    }
}

/// Products of at least this many multiply-adds are split across the cores, by rows: each
/// core runs a single-threaded product on its own block of rows. (The `gemm` crate's own
/// threading loses at these sizes: `768 × 128 × 128` took 262 µs on two cores against 230 µs
/// on one.)
const PARALLEL_PRODUCT: usize = 1 << 21;
/// Fewest rows of one block of a split product.
const PRODUCT_ROWS: usize = 64;

/// Output elements of one part of a block of rows that has an epilogue (`256 KiB`: in the
/// core's second-level cache when the epilogue reads them).
const EPILOGUE_ELEMENTS: usize = 1 << 16;

/// What a product's destination starts from.
#[derive(Clone, Copy)]
enum Start<'a> {
    /// Nothing: `dst = A·B` (`dst` may be uninitialised).
    Empty,
    /// `bias` in every row: `dst = bias + A·B` (`dst` may be uninitialised; each block of
    /// rows writes its bias rows just before its product, on the core that runs it).
    Bias(&'a [f32]),
}

/// What runs on a part of a product's rows as soon as they are made, on the core that made
/// them (while they are in its cache): `(first row, rows, whether the product ran unsplit)`.
type Epilogue<'a> = &'a (dyn Fn(usize, usize, bool) + Sync);

/// `dst (m × n, row-major) = start + A·B` on one core or, when `parallel` and the product is
/// large enough, on every core by blocks of rows; with an `epilogue`, each block in parts of
/// `EPILOGUE_ELEMENTS / n` rows (at least [`PRODUCT_ROWS`]), each part's epilogue run on it as
/// soon as its product is made.
///
/// # Safety
/// `dst` must be valid for `m × n` writes and alias neither operand; it may be
/// uninitialised.
unsafe fn product(
    dst: *mut f32,
    start: Start,
    a: Matrix,
    b: Matrix,
    parallel: bool,
    epilogue: Option<Epilogue>,
) {
    let ([m, k], n) = (a.shape, b.shape[1]);
    assert_eq!(k, b.shape[0], "inner dimensions differ");
    if let Start::Bias(bias) = start {
        assert_eq!(bias.len(), n, "bias width");
    }
    let (a, b) = (a.operand(), b.operand());
    let blocks = if parallel && m * n * k >= PARALLEL_PRODUCT {
        rayon::current_num_threads().min(m / PRODUCT_ROWS)
    } else {
        1
    };
    let rows = m.div_ceil(blocks.max(1));
    let (dst, a_rows) = (SendPtr(dst), SendPtr(a.0.cast_mut()));
    let b_ptr = SendPtr(b.0.cast_mut());
    let block = |block: usize| {
        let (begin, end) = (block * rows, (block * rows + rows).min(m));
        // With an epilogue, the block's rows go in parts whose output is still in the core's
        // cache when the epilogue reads it.
        let part = match epilogue {
            Some(_) => (EPILOGUE_ELEMENTS / n.max(1)).max(PRODUCT_ROWS),
            None => (end - begin).max(1),
        };
        for first in (begin..end).step_by(part) {
            let count = part.min(end - first);
            // SAFETY: the parts are disjoint rows of `dst` and of A, all in bounds (the
            // operands were checked; `dst` is the caller's promise).
            unsafe {
                let dst = dst.get().add(first * n);
                if let Start::Bias(bias) = start {
                    for r in 0..count {
                        std::ptr::copy_nonoverlapping(bias.as_ptr(), dst.add(r * n), n);
                    }
                }
                matmul(
                    [count, n, k],
                    dst,
                    n,
                    matches!(start, Start::Bias(_)),
                    (a_rows.get().add(first * a.1).cast_const(), a.1, a.2),
                    (b_ptr.get().cast_const(), b.1, b.2),
                )
            }
            if let Some(epilogue) = epilogue {
                epilogue(first, count, blocks <= 1);
            }
        }
    };
    if blocks <= 1 {
        block(0)
    } else {
        (0..m.div_ceil(rows)).into_par_iter().for_each(block)
    }
}

/// A destination pointer handed to another rayon task.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: each pointer is written by one task only, while its buffer lives.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `y = x·w + b` for `x` `n × i`, `w` `i × o`: each block of rows is the bias, then the
/// product accumulated onto it (one pass over `y`, no separate broadcast add).
pub fn linear(x: Matrix, w: Matrix, bias: Option<&[f32]>) -> Vec<f32> {
    let (n, o) = (x.shape[0], w.shape[1]);
    let mut y = uninit(n * o);
    let start = bias.map_or(Start::Empty, Start::Bias);
    // SAFETY: `y` has room for `n × o`; the product (and the bias) write them all before any
    // is read.
    unsafe {
        product(y.as_mut_ptr(), start, x, w, true, None);
        written(y, n * o)
    }
}

/// `(GELU(x·w + b), GELU'(x·w + b))` for `x` `n × i`, `w` `i × o`, both times the dropout
/// mask's multipliers where given: [`linear`] then [`super::gelu_with_derivative`], the same
/// values, with GELU as the product's epilogue. Each core's rows go through GELU in parts of
/// about [`EPILOGUE_ELEMENTS`], each as soon as its product is made, in place, while it is in
/// that core's cache: the pre-activation is not read back from memory, and GELU's output is not
/// a third buffer.
pub fn linear_gelu(
    x: Matrix,
    w: Matrix,
    bias: Option<&[f32]>,
    mask: Option<DropoutMask>,
) -> (Vec<f32>, Vec<f32>) {
    let (n, o) = (x.shape[0], w.shape[1]);
    let mut y = uninit(n * o);
    // The masked kernel multiplies the multipliers drawn into the buffer: it must be initialised.
    let mut derivative = match mask {
        Some(_) => vec![0.0; n * o],
        None => uninit(n * o),
    };
    let (y_ptr, d_ptr) = (SendPtr(y.as_mut_ptr()), SendPtr(derivative.as_mut_ptr()));
    let epilogue = |first: usize, rows: usize, unsplit: bool| {
        let (start, len) = (first * o, rows * o);
        // SAFETY: the product wrote these rows of `y`; only this part's epilogue touches them
        // and the same rows of the derivative, which has room for all `n × o` (zeroed where
        // masked, so initialised where read as `f32`s).
        let (xy, d) = unsafe {
            (
                std::slice::from_raw_parts_mut(y_ptr.get().add(start), len),
                d_ptr.get().add(start),
            )
        };
        let derivative = match mask {
            None => Derivative::Plain(unsafe { std::slice::from_raw_parts_mut(d.cast(), len) }),
            Some(mask) => Derivative::Masked {
                out: unsafe { std::slice::from_raw_parts_mut(d, len) },
                mask,
                first: start as u64,
            },
        };
        gelu_in_place(xy, derivative, unsplit);
    };
    let start = bias.map_or(Start::Empty, Start::Bias);
    // SAFETY: `y` has room for `n × o`; the product (and the bias) write them all, then each
    // part's epilogue writes the same rows of the derivative.
    unsafe {
        product(y_ptr.get(), start, x, w, true, Some(&epilogue));
        (written(y, n * o), written(derivative, n * o))
    }
}

multiversion! {
    fn column_sums(dy: Matrix, out: &mut [f32]) {
        let [n, o] = dy.shape;
        for r in 0..n {
            let start = dy.offset + r * dy.strides[0];
            for (acc, &g) in out.iter_mut().zip(&dy.data[start..start + o]) {
                *acc += g;
            }
        }
    }
}

/// The gradients `(dx = dy·wᵀ, dw = xᵀ·dy, db = Σ_rows dy)` of [`linear`]. The two products
/// are independent and of equal size: each runs on its own core (two single-core products are
/// faster than two split ones at these sizes), in the [`Form`] measured fastest for its shape.
/// `dy` must have unit column stride.
///
/// With `derivative` (`x` an element-wise function's output, e.g. GELU's, whose derivative the
/// forward pass kept), `dx` comes out multiplied by it, element by element — the gradient of
/// that function's input — on the core that made `dx`, as soon as it is made: `dw`'s product
/// (its inner dimension the rows of `x`) takes longer, and the multiplication fills that wait
/// instead of a pass of its own after both.
pub fn linear_backward(
    x: Matrix,
    w: Matrix,
    dy: Matrix,
    bias: bool,
    derivative: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    linear_backward_in(None, x, w, dy, bias, derivative)
}

/// [`linear_backward`] with `dx`'s and `dw`'s products in the given forms, or (`None`) in the
/// forms chosen for their shapes. Every choice gives the same bits: for the tests of that.
pub fn linear_backward_in(
    forms: Option<[Form; 2]>,
    x: Matrix,
    w: Matrix,
    dy: Matrix,
    bias: bool,
    derivative: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    let ([n, i], o) = (x.shape, w.shape[1]);
    assert_eq!(dy.strides[1], 1, "dy rows must be contiguous");
    assert_eq!([i, o], w.shape, "weight shape");
    assert_eq!([n, o], dy.shape, "dy shape");
    if let Some(derivative) = derivative {
        assert_eq!(
            derivative.len(),
            n * i,
            "a derivative for each input element"
        );
    }
    let (mut dx, mut dw) = (uninit(n * i), uninit(i * o));
    let (dx_ptr, dw_ptr) = (SendPtr(dx.as_mut_ptr()), SendPtr(dw.as_mut_ptr()));
    // With more than two cores each product may split further.
    let split = rayon::current_num_threads() > 2;
    let key = |gradient| Key {
        gradient,
        shape: [n, i, o],
        strides: [x.strides, w.strides],
    };
    let db = rayon::join(
        || {
            let run = |form, dst| input_gradient(form, dst, dy, w, split);
            match forms {
                Some([form, _]) => run(form, dx_ptr.get()),
                // SAFETY: the destination has room for `dx`, which each form writes whole.
                None => unsafe { tuned(key(Gradient::Input), dx_ptr.get(), n * i, run) },
            }
            if let Some(derivative) = derivative {
                // SAFETY: the product wrote all `n × i` elements, and no one else holds them.
                let dx = unsafe { std::slice::from_raw_parts_mut(dx_ptr.get(), n * i) };
                super::pointwise::mul(dx, derivative);
            }
        },
        || {
            let run = |form, dst| weight_gradient(form, dst, x, dy, split);
            match forms {
                Some([_, form]) => run(form, dw_ptr.get()),
                // SAFETY: as dx's.
                None => unsafe { tuned(key(Gradient::Weight), dw_ptr.get(), i * o, run) },
            }
            bias.then(|| {
                let mut db = vec![0.0; o];
                column_sums(dy, &mut db);
                db
            })
        },
    )
    .1;
    // SAFETY: each product wrote all of its destination's elements.
    unsafe { (written(dx, n * i), written(dw, i * o), db) }
}

/// Two ways to run one of [`linear_backward`]'s products. They give the same bits (the `gemm`
/// crate sums each element's products in the same order either way; checked on each shape's
/// first call, and [`Form::AsIs`] kept for good where they differ) but not the same speed:
/// `gemm` makes the destination column-major, transposing the whole product when it is not,
/// so the operand its kernel's rows run along, and whether it must repack the other, depends
/// on which matrix is transposed. Which is faster depends on the shape and on the kernel
/// `gemm` picks for the processor. Timed here on a 2-core Zen 4 (AVX-512), copies included:
/// `dx` of `768 × 128 → 512` 991–994 µs as is, 897–900 through the copy of `w`; `dw` of
/// `768 × 128 → 384` 777–789 µs as is, 671–674 as `dwᵀ`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Form {
    /// `dx = dy·wᵀ` reading `w` through transposed strides; `dw = xᵀ·dy` likewise.
    AsIs,
    /// `dx = dy·(a transposed copy of w)`; `dw` transposed from the product `dyᵀ·x`.
    Transposed,
}

/// Which of [`linear_backward`]'s products.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Gradient {
    /// `dx`.
    Input,
    /// `dw`.
    Weight,
}

/// What a product's best form is chosen for: which product, `[rows, inputs, outputs]`, and
/// the strides of `x` and `w`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Key {
    gradient: Gradient,
    shape: [usize; 3],
    strides: [[usize; 2]; 2],
}

/// Calls timed in each form before a shape's form is chosen (alternating, after the first
/// call, which compares their bits).
const TRIALS: usize = 3;

/// Where a shape's choice stands.
enum Tuning {
    /// Being tried (unless the first call, comparing the forms' bits, finds they differ):
    /// the times of the timed calls so far, by form.
    Trying([Vec<f64>; 2]),
    /// Chosen, for the rest of the process.
    Chosen(Form),
}

/// Every shape's choice.
static TUNING: std::sync::LazyLock<std::sync::Mutex<std::collections::HashMap<Key, Tuning>>> =
    std::sync::LazyLock::new(Default::default);

/// Runs `run(form, dst)` for a product of `len` elements into `dst` in the form chosen for
/// `key`: on its first call both forms (the second into a buffer), to compare their bits;
/// then each form in turn, timed, [`TRIALS`] times; then the faster one (by median).
///
/// # Safety
/// `dst` must be writable for `len` elements, and `run` must write all of them.
unsafe fn tuned(key: Key, dst: *mut f32, len: usize, run: impl Fn(Form, *mut f32)) {
    /// What this call does.
    enum Call {
        /// Run this form, untimed: chosen, or the only one (`dx` of a `w` whose columns are
        /// strided).
        Run(Form),
        /// Run both and compare their bits.
        Compare,
        /// Run this form and time it.
        Time(Form),
    }
    let call = if key.gradient == Gradient::Input && key.strides[1][1] != 1 {
        Call::Run(Form::AsIs)
    } else {
        let mut tuning = TUNING.lock().unwrap_or_else(|e| e.into_inner());
        match tuning.get(&key) {
            None => {
                tuning.insert(key, Tuning::Trying([Vec::new(), Vec::new()]));
                Call::Compare
            }
            // Each form in turn, the transposed one first.
            Some(Tuning::Trying([as_is, transposed])) => {
                Call::Time(if as_is.len() < transposed.len() {
                    Form::AsIs
                } else {
                    Form::Transposed
                })
            }
            Some(Tuning::Chosen(form)) => Call::Run(*form),
        }
    };
    match call {
        Call::Run(form) => run(form, dst),
        Call::Compare => {
            run(Form::AsIs, dst);
            let mut other = uninit(len);
            run(Form::Transposed, other.as_mut_ptr());
            let other = written(other, len);
            let same = std::slice::from_raw_parts(dst, len)
                .iter()
                .zip(&other)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            if !same {
                let mut tuning = TUNING.lock().unwrap_or_else(|e| e.into_inner());
                tuning.insert(key, Tuning::Chosen(Form::AsIs));
            }
        }
        Call::Time(form) => {
            let began = std::time::Instant::now();
            run(form, dst);
            let seconds = began.elapsed().as_secs_f64();
            let mut tuning = TUNING.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(Tuning::Trying(times)) = tuning.get_mut(&key) {
                times[form as usize].push(seconds);
                if times.iter().all(|t| t.len() >= TRIALS) {
                    let median = |mut t: Vec<f64>| {
                        t.sort_by(f64::total_cmp);
                        t[t.len() / 2]
                    };
                    let [as_is, transposed] = std::mem::take(times).map(median);
                    let form = if transposed < as_is {
                        Form::Transposed
                    } else {
                        Form::AsIs
                    };
                    tuning.insert(key, Tuning::Chosen(form));
                }
            }
        }
    }
}

/// `dx = dy·wᵀ` into `dst` (`n × i`, row-major) in `form` ([`Form::Transposed`] needs `w`'s
/// columns contiguous).
fn input_gradient(form: Form, dst: *mut f32, dy: Matrix, w: Matrix, split: bool) {
    let [i, o] = w.shape;
    match form {
        // SAFETY: the caller's `dst` has room for `n × i`.
        Form::AsIs => unsafe { product(dst, Start::Empty, dy, w.t(), split, None) },
        Form::Transposed => {
            let (w_ptr, rs, _) = w.operand();
            assert_eq!(w.strides[1], 1, "w's columns must be contiguous");
            let mut wt = uninit(i * o);
            // SAFETY: `w` was checked to lie in its storage; `wt` has room for `o` rows of `i`.
            let wt = unsafe {
                super::tile::transpose_into(w_ptr, rs, [i, o], wt.as_mut_ptr(), i);
                written(wt, i * o)
            };
            let wt = Matrix {
                data: &wt,
                offset: 0,
                shape: [o, i],
                strides: [i, 1],
            };
            // SAFETY: as above.
            unsafe { product(dst, Start::Empty, dy, wt, split, None) }
        }
    }
}

/// `dw = xᵀ·dy` into `dst` (`i × o`, row-major) in `form`.
fn weight_gradient(form: Form, dst: *mut f32, x: Matrix, dy: Matrix, split: bool) {
    let (i, o) = (x.shape[1], dy.shape[1]);
    match form {
        // SAFETY: the caller's `dst` has room for `i × o`.
        Form::AsIs => unsafe { product(dst, Start::Empty, x.t(), dy, split, None) },
        Form::Transposed => {
            let mut t = uninit(o * i);
            // SAFETY: `t` has room for `o × i`; `dst` for `i` rows of `o`, each written once.
            unsafe {
                product(t.as_mut_ptr(), Start::Empty, dy.t(), x, split, None);
                super::tile::transpose_into(t.as_ptr(), i, [o, i], dst, o);
            }
        }
    }
}
