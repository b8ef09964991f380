//! The fused operations as CubeCL kernels, for burn's CubeCL backends (wgpu, CUDA): flash-style
//! attention forward and backward ([`attention`]), LayerNorm, the cross-entropy and the embedding
//! table's gradient ([`rows`]), GELU, dropout and AdamW ([`pointwise`]), a decoding step's
//! products with their LayerNorm, GELU, residual addition and cache append ([`decode`]). Each
//! kernel reads any float storage type and computes in `f32`; what they do not take (a head
//! dimension over [`MAX_HEAD_DIM`], more elements than 32-bit indices reach) goes to the
//! composed form. The softmax stays composed and the linear layer is burn's own (autotuned)
//! matmul, its products in half precision when asked ([`linear`]).

pub(crate) mod attention;
#[cfg(all(feature = "cuda-backend", feature = "wgpu-backend"))]
pub mod cuda_source;
mod decode;
mod linear;
mod pointwise;
mod products;
pub use products::pinned_launches;
mod rows;

use super::{composed, AdamWItem, DropoutMask, LabBackend, NormPrimitive};
use attention::{LayoutLaunch, TILE};
use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, TensorMetadata};
use burn_cubecl::kernel::{into_contiguous, slice};
use burn_cubecl::ops::{permute, reshape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;
use cubecl::server::{MemoryLayout, MemoryLayoutDescriptor};
use cubecl::zspace::metadata::Metadata;
pub use launches::{launches, on_behalf_of};
use rows::{EMBED_COLUMNS, EMBED_ROWS, GRAD_CHUNK, ROW_UNITS};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Counting launches, for the tests that check that the kernels ran (not a fallback to the
/// composed form). Each count goes to the thread whose work the kernel does: the caller's, or —
/// with burn's fusion, which runs a thread's queued operations on the device's own thread —
/// the thread that queued it ([`on_behalf_of`]), so tests side by side never count each
/// other's launches.
mod launches {
    use std::cell::Cell;
    use std::collections::HashMap;
    use std::sync::{LazyLock, Mutex};
    use std::thread::{self, ThreadId};

    static LAUNCHES: LazyLock<Mutex<HashMap<ThreadId, u64>>> = LazyLock::new(Default::default);

    thread_local! {
        static OWNER: Cell<Option<ThreadId>> = const { Cell::new(None) };
    }

    /// How many of these kernels were launched for this thread's work.
    pub fn launches() -> u64 {
        let counts = LAUNCHES.lock().unwrap_or_else(|e| e.into_inner());
        counts.get(&thread::current().id()).copied().unwrap_or(0)
    }

    /// Runs `f`, counting the kernels it launches as `owner`'s.
    pub fn on_behalf_of<R>(owner: ThreadId, f: impl FnOnce() -> R) -> R {
        crate::kernels::with_local(&OWNER, owner, f)
    }

    /// Counts one launch.
    pub(super) fn count() {
        let owner = OWNER
            .with(Cell::get)
            .unwrap_or_else(|| thread::current().id());
        let mut counts = LAUNCHES.lock().unwrap_or_else(|e| e.into_inner());
        *counts.entry(owner).or_default() += 1;
    }
}

/// The largest head dimension the attention kernels take (a row of it lives in registers).
pub const MAX_HEAD_DIM: usize = 128;

/// How every tensor these kernels write is laid out: contiguous, as they write it at row-major
/// offsets. A runtime's own layout for a new tensor need not be: CUDA's pads each row to a
/// multiple of up to 512 bytes (a `[n, 65]` `f32` tensor gets rows 128 wide), which burn's own
/// kernels read through the strides but a kernel writing `out[i]` scrambles — the H200 run
/// whose fused path trained nothing (the logits' gradient `[n, 65]` was written that way; wgpu
/// lays every tensor out contiguously, so it never showed there).
pub fn output_layout(shape: Shape, dtype: DType) -> MemoryLayoutDescriptor {
    MemoryLayoutDescriptor::contiguous(shape, dtype.size())
}

/// Whether every new output is filled with NaN before its kernel runs ([`poison_outputs`]).
static POISON: AtomicBool = AtomicBool::new(false);

/// Fills every tensor these kernels allocate for their outputs with NaN before the kernel
/// writes it, from now on in this process (for the tests). Memory a runtime hands out may hold
/// anything: wgpu zeroes a new buffer, CUDA does not, and a reused one holds what was there.
/// So a kernel that leaves an element unwritten, or reads an output before writing it, can
/// pass on one runtime and be wrong on another; with the poison every such element is NaN on
/// any runtime. The filling is not counted in [`launches`]; correct kernels give the same
/// results with it.
pub fn poison_outputs(on: bool) {
    POISON.store(on, Ordering::Relaxed);
}

/// Poisons our kernels' outputs ([`poison_outputs`]) until the guard is dropped, then sets it
/// back as it was: the on-device kernel check runs so, as a kernel that leaves an element
/// unwritten on one device's grid (its cube size chosen by the device) may not on another's.
pub fn poisoned() -> impl Drop {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            POISON.store(self.0, Ordering::Relaxed);
        }
    }
    Restore(POISON.swap(true, Ordering::Relaxed))
}

/// A new tensor of `dtype` on `like`'s device, laid out by [`output_layout`].
fn empty_as<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    let layout = output_layout(shape.clone(), dtype);
    let MemoryLayout { memory, strides } = like.client.empty_tensors(vec![layout]).remove(0);
    let meta = Metadata::new(shape, strides);
    let out = CubeTensor::new(
        like.client.clone(),
        memory,
        meta,
        like.device.clone(),
        dtype,
    );
    if POISON.load(Ordering::Relaxed) && out.meta.num_elements() > 0 {
        let (count, dim) = elementwise(&out);
        pointwise::fill_kernel::launch::<R>(
            &out.client,
            count,
            dim,
            out.clone().into_tensor_arg(),
            f32::NAN,
            dtype.into(),
        );
    }
    out
}

/// A new tensor on `like`'s device with its dtype (contiguous: [`output_layout`]).
fn empty<R: CubeRuntime>(like: &CubeTensor<R>, shape: impl Into<Shape>) -> CubeTensor<R> {
    empty_as(like, shape.into(), like.dtype)
}

/// A new `f32` tensor on `like`'s device (scratch sums; contiguous: [`output_layout`]).
fn empty_f32<R: CubeRuntime>(like: &CubeTensor<R>, shape: impl Into<Shape>) -> CubeTensor<R> {
    empty_as(like, shape.into(), DType::F32)
}

/// One unit per element of `x`.
fn elementwise<R: CubeRuntime>(x: &CubeTensor<R>) -> (CubeCount, CubeDim) {
    units(x, x.meta.num_elements())
}

/// One unit per four elements of `x` (one Philox block of a dropout mask each).
fn elementwise_blocks<R: CubeRuntime>(x: &CubeTensor<R>) -> (CubeCount, CubeDim) {
    units(x, x.meta.num_elements().div_ceil(4))
}

/// `n` units in cubes of the size the device of `x` prefers.
fn units<R: CubeRuntime>(x: &CubeTensor<R>, n: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&x.client, n);
    (calculate_cube_count_elemwise(&x.client, n, dim), dim)
}

/// The cubes of a row kernel over `n` rows of `d`, and whether a plane takes a row: where the
/// device's planes can add up their units' values and a row has at most [`PLANE_ROW_MAX`]
/// columns, cubes of [`PLANE_ROWS_UNITS`] units, one plane a row (8 rows a cube on a 32-wide
/// plane: a row's sums with no barrier, and 8 rows in flight where one cube a row of 384
/// columns kept 3 of its 128 units busy on each and waited at 9 barriers a sum); otherwise one
/// cube of [`ROW_UNITS`] a row (a vocabulary's logits: 50,257 columns are better spread over a
/// cube). Over a 2-D grid (a grid dimension holds at most 65,535 cubes).
fn row_grid<R: CubeRuntime>(
    client: &ComputeClient<R>,
    n: usize,
    d: usize,
) -> (CubeCount, CubeDim, bool) {
    let planes = row_planes(client).filter(|_| d <= PLANE_ROW_MAX);
    let (per_cube, units, planes) = match planes {
        // The kernel takes CUBE_DIM / PLANE_DIM rows a cube: at least this many, however wide
        // the device's planes turn out.
        Some(widest) => (PLANE_ROWS_UNITS as usize / widest, PLANE_ROWS_UNITS, true),
        None => (1, ROW_UNITS, false),
    };
    let cubes = n.div_ceil(per_cube);
    let x = cubes.clamp(1, 65_535);
    (
        CubeCount::Static(x as u32, cubes.div_ceil(x) as u32, 1),
        CubeDim::new_1d(units),
        planes,
    )
}

/// Units of a row kernel's cube where a plane takes a row.
const PLANE_ROWS_UNITS: u32 = 256;

/// The longest row a plane takes (64 columns a unit on a 32-wide plane).
const PLANE_ROW_MAX: usize = 2048;

/// The widest plane of the device where the row kernels give a plane a row (its planes can add
/// up their units' values and hold at most [`PLANE_ROWS_UNITS`]), unless a test forbids it.
/// [`planes_shuffle`] says whether the planes can.
fn row_planes<R: CubeRuntime>(client: &ComputeClient<R>) -> Option<usize> {
    let widest = client.properties().hardware.plane_size_max as usize;
    (planes_shuffle(client)
        && (1..=PLANE_ROWS_UNITS as usize).contains(&widest)
        && !CUBE_ROWS.load(Ordering::Relaxed))
    .then_some(widest)
}

/// Set by tests: the row kernels take a cube a row even where a plane could.
static CUBE_ROWS: AtomicBool = AtomicBool::new(false);

/// Makes the row kernels (LayerNorm, the cross-entropy) take one cube a row even where a plane
/// could (`true`), or choose as they do: for tests, which check both forms.
#[doc(hidden)]
pub fn force_cube_rows(on: bool) {
    CUBE_ROWS.store(on, Ordering::Relaxed);
}

/// Whether the row kernels give a plane a row of `d` columns on `device` (for tests).
#[doc(hidden)]
pub fn rows_in_planes<R: CubeRuntime>(device: &R::Device, d: usize) -> bool {
    row_grid(&R::client(device), 1, d).2
}

/// One launch of AdamW over the parameters of `items` (within one launch's binding limit,
/// sharing the learning rate and betas).
fn adamw_launch<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    items: Vec<AdamWItem<CubeBackend<R, F, I, BT>>>,
    clip: &CubeTensor<R>,
    has_clip: bool,
) -> Vec<(CubeTensor<R>, CubeTensor<R>, CubeTensor<R>)> {
    let step = items[0].step;
    let (mut first, mut strided) = (0u64, 0u64);
    let (mut params, mut grads, mut ms, mut vs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut decays, mut c1s, mut c2s) = (Vec::new(), Vec::new(), Vec::new());
    // Each parameter its own cubes (up to 2,047, so 32 of them stay within a grid dimension's
    // 65,535; a larger parameter loops).
    let units = 256;
    let (mut starts, mut cubes, mut total) = (Vec::new(), Vec::new(), 0u32);
    for (y, item) in items.into_iter().enumerate() {
        let param = into_contiguous(item.param);
        // The gradient is read at its own strides (a transposed or sliced view is not copied).
        strided |= u64::from(!item.grad.is_contiguous()) << y;
        let (m, v) = match item.moments {
            Some((m, v)) => (into_contiguous(m), into_contiguous(v)),
            // Not read by the kernel at the first step.
            None => {
                first |= 1 << y;
                (param.clone(), param.clone())
            }
        };
        let own = param.meta.num_elements().div_ceil(units).clamp(1, 2_047) as u32;
        starts.push(total);
        cubes.push(own);
        total += own;
        decays.push(item.step.weight_decay);
        c1s.push(1.0 - item.step.beta_1.powi(item.step.time));
        c2s.push(1.0 - item.step.beta_2.powi(item.step.time));
        grads.push(item.grad);
        ms.push(m);
        vs.push(v);
        params.push(param);
    }
    let outputs = || -> Vec<CubeTensor<R>> { params.iter().map(|p| empty(p, p.shape())).collect() };
    let (p_out, m_out, v_out) = (outputs(), outputs(), outputs());
    let args = |xs: &[CubeTensor<R>]| xs.iter().map(|x| x.clone().into_tensor_arg()).collect();
    launches::count();
    pointwise::adamw_kernel::launch::<R>(
        &clip.client,
        CubeCount::Static(total, 1, 1),
        CubeDim::new_1d(units as u32),
        args(&params),
        args(&grads),
        args(&ms),
        args(&vs),
        clip.clone().into_tensor_arg(),
        args(&p_out),
        args(&m_out),
        args(&v_out),
        starts.into_iter().collect(),
        cubes.into_iter().collect(),
        decays.into_iter().collect(),
        c1s.into_iter().collect(),
        c2s.into_iter().collect(),
        step.lr,
        step.beta_1,
        step.beta_2,
        step.epsilon,
        first,
        strided,
        has_clip,
        params[0].dtype.into(),
    );
    p_out
        .into_iter()
        .zip(m_out)
        .zip(v_out)
        .map(|((p, m), v)| (p, m, v))
        .collect()
}

/// How many tensors one launch of a kernel over a sequence of them takes: `per` bindings each
/// and `fixed` besides, within the device's binding limit, at most 32 (the kernel holds a
/// branch per tensor), and at most 64 (a bit of a `u64` mask each).
fn group_size<R: CubeRuntime>(like: &CubeTensor<R>, per: u32, fixed: u32) -> usize {
    let bindings = like.client.properties().hardware.max_bindings;
    (bindings.saturating_sub(fixed + 1) / per).clamp(1, 32) as usize
}

/// `b` to be written in place where it is held once (as burn's `slice_assign`), else a copy.
fn writable<R: CubeRuntime>(b: CubeTensor<R>) -> CubeTensor<R> {
    match b.can_mut() && b.is_nonoverlapping() {
        true => b,
        false => b.copy(),
    }
}

/// `γ` of a LayerNorm where there is one (for [`decode_plan`]'s check of the types).
fn norm_gamma<B: Backend>(norm: &Option<NormPrimitive<B>>) -> Option<&FloatTensor<B>> {
    norm.as_ref().map(|norm| &norm.gamma)
}

/// Whether a decoding step's product of `x` `[n, i]` by `w` `[i, o]` runs as one of
/// [`decode`]'s kernels, and how: its plan, and whether `w`'s inner dimension is contiguous.
/// `None` where an operand among `others` has another type, the normalised rows do not fit a
/// cube's shared memory, or an index would pass 32 bits.
fn decode_plan<R: CubeRuntime>(
    x: &CubeTensor<R>,
    w: &CubeTensor<R>,
    normed: bool,
    others: &[Option<&CubeTensor<R>>],
) -> Option<(decode::Plan, bool)> {
    let [n, i] = x.shape().dims();
    let o = w.shape()[1];
    let types = std::iter::once(w)
        .chain(others.iter().copied().flatten())
        .all(|t| t.dtype == x.dtype);
    // Read where it lies when either dimension is contiguous (a tied output layer's transposed
    // table among them); otherwise copied to rows ([`DecodeOperands::new`]).
    let strides = w.meta.strides();
    let along_k = strides[1] != 1 && strides[0] == 1;
    let hardware = &x.client.properties().hardware;
    let plan = decode::Plan::new(
        n,
        i,
        normed,
        along_k,
        hardware.max_units_per_cube,
        hardware.max_shared_memory_size,
    )?;
    let sized = n > 0 && i > 0 && fits(n * i.max(o)) && fits(i * o);
    (types && sized).then_some((plan, along_k))
}

/// The operands of a decoding step's product as [`decode`]'s kernels read them: `x` and the
/// LayerNorm's parameters contiguous, `w` as [`decode_plan`] found it, and an operand that is
/// absent given as `x` (never read: the kernel's switches say so).
struct DecodeOperands<R: CubeRuntime> {
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    beta: CubeTensor<R>,
    w: CubeTensor<R>,
    bias: CubeTensor<R>,
    epsilon: f32,
    normed: bool,
    has_beta: bool,
    has_bias: bool,
}

impl<R: CubeRuntime> DecodeOperands<R> {
    /// `norm`: `(γ, β, ε)`.
    fn new(
        x: CubeTensor<R>,
        norm: Option<(CubeTensor<R>, Option<CubeTensor<R>>, f64)>,
        w: CubeTensor<R>,
        b: Option<CubeTensor<R>>,
        along_k: bool,
    ) -> Self {
        let x = into_contiguous(x);
        let w = match along_k || w.meta.strides()[1] == 1 {
            true => w,
            false => into_contiguous(w),
        };
        let (normed, has_beta, epsilon) = match &norm {
            Some((_, beta, epsilon)) => (true, beta.is_some(), *epsilon as f32),
            None => (false, false, 0.0),
        };
        let (gamma, beta) = match norm {
            Some((gamma, beta, _)) => {
                let gamma = into_contiguous(gamma);
                let beta = beta.map(into_contiguous).unwrap_or_else(|| gamma.clone());
                (gamma, beta)
            }
            None => (x.clone(), x.clone()),
        };
        let has_bias = b.is_some();
        let bias = b.map(into_contiguous).unwrap_or_else(|| x.clone());
        Self {
            x,
            gamma,
            beta,
            w,
            bias,
            epsilon,
            normed,
            has_beta,
            has_bias,
        }
    }
}

/// Whether every index of `n` elements fits the kernels' 32-bit arithmetic.
fn fits(n: usize) -> bool {
    u32::try_from(n).is_ok()
}

impl<R, F, I, BT> LabBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn mixed_precision(device: &Self::Device, dtype: FloatDType) -> bool {
        Self::supports_dtype(device, dtype.into())
    }

    fn autotunes() -> bool {
        true
    }

    fn time_products(
        device: &Self::Device,
        plan: &crate::kernels::matmul::MatmulPlan,
        progress: &mut dyn FnMut(&crate::kernels::matmul::ProductTiming),
    ) -> anyhow::Result<Vec<crate::kernels::matmul::ProductTiming>> {
        Ok(products::time_products::<Self, R>(device, plan, progress))
    }

    fn fused_linear(x: CubeTensor<R>, w: CubeTensor<R>, b: Option<CubeTensor<R>>) -> CubeTensor<R> {
        Self::fused_linear_keeping(x, w, b).0
    }

    fn fused_decode_linear(
        x: CubeTensor<R>,
        norm: Option<NormPrimitive<Self>>,
        w: CubeTensor<R>,
        b: Option<CubeTensor<R>>,
        gelu: bool,
        residual: Option<CubeTensor<R>>,
    ) -> CubeTensor<R> {
        let others = [b.as_ref(), residual.as_ref(), norm_gamma(&norm)];
        let Some((plan, along_k)) = decode_plan(&x, &w, norm.is_some(), &others) else {
            return composed::decode_linear::<Self>(x, norm, w, b, gelu, residual);
        };
        let o = w.shape()[1];
        let step = DecodeOperands::new(x, norm.map(NormPrimitive::parts), w, b, along_k);
        let y = empty(&step.x, [step.x.shape()[0], o]);
        let add = residual.is_some();
        let residual = residual
            .map(into_contiguous)
            .unwrap_or_else(|| step.x.clone());
        let dtype = step.x.dtype;
        launches::count();
        decode::decode_linear_kernel::launch::<R>(
            &step.x.client,
            plan.cubes(step.x.shape()[0], o, along_k),
            CubeDim::new_1d(plan.units),
            step.x.clone().into_tensor_arg(),
            step.gamma.into_tensor_arg(),
            step.beta.into_tensor_arg(),
            step.w.into_tensor_arg(),
            step.bias.into_tensor_arg(),
            residual.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            step.epsilon,
            plan.rows,
            plan.shared,
            step.normed,
            step.has_beta,
            step.has_bias,
            gelu,
            add,
            along_k,
            dtype.into(),
        );
        y
    }

    fn fused_decode_qkv(
        x: CubeTensor<R>,
        norm: Option<NormPrimitive<Self>>,
        w: CubeTensor<R>,
        b: Option<CubeTensor<R>>,
        keys: CubeTensor<R>,
        values: CubeTensor<R>,
        at: usize,
    ) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
        let [items, h, capacity, width] = keys.shape().dims();
        let [n, _] = x.shape().dims();
        let (d, o) = (h * width, w.shape()[1]);
        let others = [b.as_ref(), norm_gamma(&norm), Some(&keys), Some(&values)];
        let plan = decode_plan(&x, &w, norm.is_some(), &others).filter(|_| {
            o == 3 * d
                && n.is_multiple_of(items.max(1))
                && values.shape() == keys.shape()
                && at + n / items.max(1) <= capacity
                && fits(keys.meta.num_elements())
        });
        let Some((plan, along_k)) = plan else {
            return composed::decode_qkv::<Self>(x, norm, w, b, keys, values, at);
        };
        let (keys, values) = (writable(keys), writable(values));
        let step = DecodeOperands::new(x, norm.map(NormPrimitive::parts), w, b, along_k);
        let q = empty(&step.x, [n, d]);
        let dtype = step.x.dtype;
        launches::count();
        decode::decode_qkv_kernel::launch::<R>(
            &step.x.client,
            plan.cubes(n, o, along_k),
            CubeDim::new_1d(plan.units),
            step.x.clone().into_tensor_arg(),
            step.gamma.into_tensor_arg(),
            step.beta.into_tensor_arg(),
            step.w.into_tensor_arg(),
            step.bias.into_tensor_arg(),
            q.clone().into_tensor_arg(),
            keys.clone().into_tensor_arg(),
            values.clone().into_tensor_arg(),
            step.epsilon,
            at as u32,
            (n / items) as u32,
            plan.rows,
            plan.shared,
            step.normed,
            step.has_beta,
            step.has_bias,
            along_k,
            dtype.into(),
        );
        (q, keys, values)
    }

    fn fused_linear_keeping(
        x: CubeTensor<R>,
        w: CubeTensor<R>,
        b: Option<CubeTensor<R>>,
    ) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
        match super::precision().half() {
            // The layer's output in the model's float type, whatever its operands' type.
            Some(half) => linear::forward::<Self, R>(x, w, b, half, F::dtype()),
            // A kernel named for every product (`f32` operands, nothing cast).
            None if super::pinned_matmul().is_some() => {
                linear::forward::<Self, R>(x, w, b, FloatDType::F32, F::dtype())
            }
            None => (composed::linear::<Self>(x.clone(), w.clone(), b), x, w),
        }
    }

    fn fused_linear_backward(
        x: CubeTensor<R>,
        w: CubeTensor<R>,
        dy: CubeTensor<R>,
        bias: bool,
    ) -> (CubeTensor<R>, CubeTensor<R>, Option<CubeTensor<R>>) {
        // Operands kept in half precision are read in it, whatever the precision now.
        let kept = (x.dtype != dy.dtype).then(|| FloatDType::from(x.dtype));
        match super::precision().half().or(kept) {
            Some(half) => linear::backward::<Self, R>(x, w, dy, bias, half),
            None if super::pinned_matmul().is_some() => {
                linear::backward::<Self, R>(x, w, dy, bias, FloatDType::F32)
            }
            None => composed::linear_backward::<Self>(x, w, dy, bias),
        }
    }

    fn fused_gelu(x: CubeTensor<R>) -> CubeTensor<R> {
        let x = into_contiguous(x);
        let y = empty(&x, x.shape());
        let (count, dim) = elementwise(&x);
        let dtype = x.dtype;
        launches::count();

        pointwise::gelu_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            y.clone().into_tensor_arg(),
            dtype.into(),
        );
        y
    }

    fn fused_gelu_forward(
        x: CubeTensor<R>,
        mask: Option<DropoutMask>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        if mask.is_some() && !fits(x.meta.num_elements()) {
            return composed::gelu_forward::<Self>(x, mask);
        }
        let x = into_contiguous(x);
        let (y, d) = (empty(&x, x.shape()), empty(&x, x.shape()));
        let (count, dim) = elementwise_blocks(&x);
        let dtype = x.dtype;
        let keys = mask.unwrap_or(DropoutMask::new(0.0, 0));
        launches::count();

        pointwise::gelu_forward_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            y.clone().into_tensor_arg(),
            d.clone().into_tensor_arg(),
            keys.seed as u32,
            (keys.seed >> 32) as u32,
            keys.threshold_u32(),
            keys.scale(),
            mask.is_some(),
            dtype.into(),
        );
        (y, d)
    }

    fn fused_gelu_backward(x: CubeTensor<R>, grad: CubeTensor<R>) -> CubeTensor<R> {
        let (x, grad) = (into_contiguous(x), into_contiguous(grad));
        let dx = empty(&x, x.shape());
        let (count, dim) = elementwise(&x);
        let dtype = x.dtype;
        launches::count();

        pointwise::gelu_backward_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            grad.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            dtype.into(),
        );
        dx
    }

    fn fused_dropout(x: CubeTensor<R>, mask: DropoutMask) -> CubeTensor<R> {
        if !fits(x.meta.num_elements()) {
            return composed::dropout::<Self>(x, mask);
        }
        dropout(x, None, mask)
    }

    fn fused_dropout_add(x: CubeTensor<R>, h: CubeTensor<R>, mask: DropoutMask) -> CubeTensor<R> {
        if !fits(h.meta.num_elements()) {
            let dropped = composed::dropout::<Self>(h, mask);
            return <Self as burn::tensor::ops::FloatTensorOps<Self>>::float_add(x, dropped);
        }
        dropout(h, Some(x), mask)
    }

    fn write_columns_pair(
        keys: CubeTensor<R>,
        values: CubeTensor<R>,
        at: usize,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let n = k.meta.num_elements();
        let same =
            k.shape() == v.shape() && keys.shape() == values.shape() && k.dtype == keys.dtype;
        if !same || !fits(2 * n) || !fits(keys.meta.num_elements()) {
            return (
                composed::write_columns::<Self>(keys, at, k),
                composed::write_columns::<Self>(values, at, v),
            );
        }
        let (keys, values) = (writable(keys), writable(values));
        let units = 256;
        let cubes = (2 * n).div_ceil(units);
        let (x, y) = (cubes.clamp(1, 65_535), cubes.div_ceil(65_535).max(1));
        launches::count();
        pointwise::write_columns_kernel::launch::<R>(
            &keys.client,
            CubeCount::Static(x as u32, y as u32, 1),
            CubeDim::new_1d(units as u32),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            keys.clone().into_tensor_arg(),
            values.clone().into_tensor_arg(),
            at as u32,
            keys.dtype.into(),
        );
        (keys, values)
    }

    fn fused_sum_squares_all(xs: Vec<CubeTensor<R>>) -> CubeTensor<R> {
        if xs.iter().any(|x| !fits(x.meta.num_elements())) {
            return composed::sum_squares_all::<Self>(xs);
        }
        // Each gradient's squares summed by up to 256 cubes into its own partial sums (several
        // gradients a launch, each read where it lies), then every partial sum added in one
        // cube in a fixed order.
        let parts: Vec<usize> = xs
            .iter()
            .map(|x| x.meta.num_elements().div_ceil(4096).clamp(1, 256))
            .collect();
        let partial = empty_f32(&xs[0], [parts.iter().sum::<usize>()]);
        let mut offset = 0;
        let group = group_size(&xs[0], 1, 1);
        for (xs, parts) in xs.chunks(group).zip(parts.chunks(group)) {
            let strided = xs.iter().enumerate().fold(0u64, |mask, (y, x)| {
                mask | (u64::from(!x.is_contiguous()) << y)
            });
            let mut cubes = 0;
            let starts: SequenceArg<R, u32> = parts
                .iter()
                .map(|p| {
                    cubes += p;
                    (cubes - p) as u32
                })
                .collect();
            launches::count();
            rows::sum_squares_many_kernel::launch::<R>(
                &partial.client,
                CubeCount::Static(cubes as u32, 1, 1),
                CubeDim::new_1d(ROW_UNITS),
                xs.iter().map(|x| x.clone().into_tensor_arg()).collect(),
                partial.clone().into_tensor_arg(),
                offset as u32,
                starts,
                parts.iter().map(|&p| p as u32).collect(),
                xs.iter().map(|x| x.meta.num_elements() as u32).collect(),
                strided,
                xs[0].dtype.into(),
            );
            offset += cubes;
        }
        let out = empty(&xs[0], [1]);
        launches::count();
        rows::sum_partials_kernel::launch::<R>(
            &out.client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(ROW_UNITS),
            partial.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            out.dtype.into(),
        );
        out
    }

    fn fused_adamw_all(
        items: Vec<AdamWItem<Self>>,
        clip: Option<CubeTensor<R>>,
    ) -> Vec<(CubeTensor<R>, CubeTensor<R>, CubeTensor<R>)> {
        let Some(like) = items.first().map(|item| item.param.clone()) else {
            return Vec::new();
        };
        let has_clip = clip.is_some();
        let clip = clip.unwrap_or_else(|| like.clone());
        // Parameters taken together share a launch's learning rate and betas (one optimizer
        // step's always do); seven bindings each and the clipping factor's.
        let group = group_size(&like, 7, 1);
        let mut out = Vec::with_capacity(items.len());
        let mut items = items.into_iter().peekable();
        while let Some(head) = items.next() {
            let lead = head.step;
            let shared = |item: &AdamWItem<Self>| {
                let (a, b) = (item.step, lead);
                (a.lr, a.beta_1, a.beta_2, a.epsilon) == (b.lr, b.beta_1, b.beta_2, b.epsilon)
            };
            let mut batch = vec![head];
            while batch.len() < group && items.peek().is_some_and(&shared) {
                batch.extend(items.next());
            }
            out.extend(adamw_launch(batch, &clip, has_clip));
        }
        out
    }

    fn fused_layer_norm_forward(
        x: CubeTensor<R>,
        gamma: CubeTensor<R>,
        beta: Option<CubeTensor<R>>,
        epsilon: f64,
    ) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
        let x = into_contiguous(x);
        let gamma = into_contiguous(gamma);
        let [n, _] = x.shape().dims();
        let has_beta = beta.is_some();
        let beta = beta.map(into_contiguous).unwrap_or_else(|| gamma.clone());
        let (y, mean, rstd) = (empty(&x, x.shape()), empty(&x, [n]), empty(&x, [n]));
        let (count, dim, planes) = row_grid(&x.client, n, x.shape()[1]);
        let dtype = x.dtype;
        launches::count();

        rows::layer_norm_forward_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            gamma.into_tensor_arg(),
            beta.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            mean.clone().into_tensor_arg(),
            rstd.clone().into_tensor_arg(),
            epsilon as f32,
            has_beta,
            planes,
            dtype.into(),
        );
        (y, mean, rstd)
    }

    fn fused_add_layer_norm_forward(
        x: CubeTensor<R>,
        h: CubeTensor<R>,
        mask: Option<DropoutMask>,
        gamma: CubeTensor<R>,
        beta: Option<CubeTensor<R>>,
        epsilon: f64,
    ) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
        if !fits(h.meta.num_elements()) {
            return composed::add_layer_norm_forward::<Self>(x, h, mask, gamma, beta, epsilon);
        }
        let [x, h, gamma] = [x, h, gamma].map(into_contiguous);
        let [n, _] = x.shape().dims();
        let has_beta = beta.is_some();
        let beta = beta.map(into_contiguous).unwrap_or_else(|| gamma.clone());
        let (sum, y) = (empty(&x, x.shape()), empty(&x, x.shape()));
        let (mean, rstd) = (empty(&x, [n]), empty(&x, [n]));
        let (count, dim, planes) = row_grid(&x.client, n, x.shape()[1]);
        let dtype = x.dtype;
        let keys = mask.unwrap_or(DropoutMask::new(0.0, 0));
        launches::count();

        rows::add_layer_norm_forward_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            h.into_tensor_arg(),
            gamma.into_tensor_arg(),
            beta.into_tensor_arg(),
            sum.clone().into_tensor_arg(),
            y.clone().into_tensor_arg(),
            mean.clone().into_tensor_arg(),
            rstd.clone().into_tensor_arg(),
            keys.seed as u32,
            (keys.seed >> 32) as u32,
            keys.threshold_u32(),
            keys.scale(),
            epsilon as f32,
            has_beta,
            mask.is_some(),
            planes,
            dtype.into(),
        );
        (sum, y, mean, rstd)
    }

    fn fused_layer_norm_backward(
        x: CubeTensor<R>,
        gamma: CubeTensor<R>,
        mean: CubeTensor<R>,
        rstd: CubeTensor<R>,
        dy: CubeTensor<R>,
        residual: Option<CubeTensor<R>>,
    ) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
        let [x, gamma, mean, rstd, dy] = [x, gamma, mean, rstd, dy].map(into_contiguous);
        let [n, d] = x.shape().dims();
        let dtype = x.dtype;
        let client = x.client.clone();
        let dx = empty(&x, [n, d]);
        let has_residual = residual.is_some();
        let residual = residual.map(into_contiguous).unwrap_or_else(|| dy.clone());
        let (count, dim, planes) = row_grid(&x.client, n, d);
        launches::count();

        rows::layer_norm_backward_kernel::launch::<R>(
            &client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            gamma.into_tensor_arg(),
            mean.clone().into_tensor_arg(),
            rstd.clone().into_tensor_arg(),
            dy.clone().into_tensor_arg(),
            residual.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            has_residual,
            planes,
            dtype.into(),
        );
        // dγ, dβ: partial sums over chunks of rows, then the chunks added in order.
        let chunks = n.div_ceil(GRAD_CHUNK as usize).max(1);
        let partial = empty_f32(&x, [2, chunks, d]);
        let columns = 64u32;
        launches::count();

        rows::layer_norm_grad_partial_kernel::launch::<R>(
            &client,
            CubeCount::Static(d.div_ceil(columns as usize) as u32, chunks as u32, 1),
            CubeDim::new_1d(columns),
            x.clone().into_tensor_arg(),
            mean.into_tensor_arg(),
            rstd.into_tensor_arg(),
            dy.into_tensor_arg(),
            partial.clone().into_tensor_arg(),
            dtype.into(),
        );
        let (dgamma, dbeta) = (empty(&x, [d]), empty(&x, [d]));
        launches::count();

        rows::layer_norm_grad_reduce_kernel::launch::<R>(
            &client,
            CubeCount::Static(d.div_ceil(rows::REDUCE_COLUMNS as usize) as u32, 1, 1),
            CubeDim::new_1d(rows::REDUCE_COLUMNS * rows::REDUCE_LANES),
            partial.into_tensor_arg(),
            dgamma.clone().into_tensor_arg(),
            dbeta.clone().into_tensor_arg(),
            chunks as u32,
            dtype.into(),
        );
        (dx, dgamma, dbeta)
    }

    fn fused_embedding_backward(
        weight: CubeTensor<R>,
        grad: CubeTensor<R>,
        ids: CubeTensor<R>,
    ) -> CubeTensor<R> {
        let [v, d] = weight.shape().dims();
        let n = ids.meta.num_elements();
        if v > MAX_EMBED_ROWS || n == 0 || d == 0 || !fits(n * d) || !fits(v * d) {
            return <Self as burn::tensor::ops::ModuleOps<Self>>::embedding_backward(
                weight, grad, ids,
            );
        }
        let grad = into_contiguous(reshape(grad, Shape::new([n, d])));
        let ids = into_contiguous(reshape(ids, Shape::new([n])));
        // Chunks of about EMBED_CHUNK rows, as many as the partial sums' room allows.
        let chunks = n
            .div_ceil(EMBED_CHUNK)
            .min(EMBED_PARTIALS / (v * d))
            .clamp(1, 65_535);
        let chunk = n.div_ceil(chunks);
        let partial = empty_f32(&grad, [chunks, v, d]);
        let dtypes = [grad.dtype.into(), ids.dtype.into()];
        launches::count();

        rows::embedding_grad_partial_kernel::launch::<R>(
            &grad.client,
            CubeCount::Static(
                d.div_ceil(EMBED_COLUMNS as usize) as u32,
                chunks as u32,
                v.div_ceil(EMBED_ROWS as usize) as u32,
            ),
            CubeDim::new_1d(EMBED_COLUMNS),
            ids.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            partial.clone().into_tensor_arg(),
            chunk as u32,
            dtypes,
        );
        let out = empty(&grad, [v, d]);
        let (count, dim) = elementwise(&out);
        launches::count();

        rows::embedding_grad_reduce_kernel::launch::<R>(
            &grad.client,
            count,
            dim,
            partial.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            grad.dtype.into(),
        );
        out
    }

    fn fused_cross_entropy_forward(
        logits: CubeTensor<R>,
        targets: CubeTensor<R>,
        smoothing: f32,
        ignore: Option<usize>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let (logits, targets) = (into_contiguous(logits), into_contiguous(targets));
        let [n, v] = logits.shape().dims();
        let (loss, lse) = (empty(&logits, [n]), empty(&logits, [n]));
        let (count, dim, planes) = row_grid(&logits.client, n, v);
        let dtypes = [logits.dtype.into(), targets.dtype.into()];
        launches::count();

        rows::cross_entropy_forward_kernel::launch::<R>(
            &logits.client,
            count,
            dim,
            logits.clone().into_tensor_arg(),
            targets.into_tensor_arg(),
            loss.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            smoothing,
            ignore_index(ignore),
            planes,
            dtypes,
        );
        (loss, lse)
    }

    fn fused_cross_entropy_backward(
        logits: CubeTensor<R>,
        targets: CubeTensor<R>,
        lse: CubeTensor<R>,
        grad: CubeTensor<R>,
        smoothing: f32,
        ignore: Option<usize>,
    ) -> CubeTensor<R> {
        let [logits, targets, lse, grad] = [logits, targets, lse, grad].map(into_contiguous);
        let dx = empty(&logits, logits.shape());
        let (count, dim) = elementwise(&logits);
        let dtypes = [logits.dtype.into(), targets.dtype.into()];
        launches::count();

        rows::cross_entropy_backward_kernel::launch::<R>(
            &logits.client,
            count,
            dim,
            logits.clone().into_tensor_arg(),
            targets.into_tensor_arg(),
            lse.into_tensor_arg(),
            grad.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            smoothing,
            ignore_index(ignore),
            dtypes,
        );
        dx
    }

    fn fused_attention_forward(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        causal: bool,
        pad: Option<CubeTensor<R>>,
        dropout: Option<DropoutMask>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let [b, h, t, kd] = q.shape().dims();
        let s = k.shape()[2];
        if !attention_fits([b, h, t, s, kd]) {
            return composed::attention_forward::<Self>(q, k, v, causal, pad, dropout);
        }
        let out = empty(&q, [b, h, t, kd]);
        let strides = [h * t * kd, t * kd, kd, 0];
        let lse = attention_forward::<R>(&q, &k, &v, &out, strides, causal, pad, dropout);
        (out, lse)
    }

    fn fused_packed_attention_forward(
        qkv: CubeTensor<R>,
        heads: usize,
        causal: bool,
        pad: Option<CubeTensor<R>>,
        dropout: Option<DropoutMask>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let [b, t, d3] = qkv.shape().dims();
        let (d, kd) = (d3 / 3, d3 / 3 / heads);
        if !attention_fits([b, heads, t, t, kd]) {
            return composed::packed_attention_forward::<Self>(qkv, heads, causal, pad, dropout);
        }
        let [q, k, v] = split_packed(qkv, heads);
        // The output is written with its heads merged, `[b, t, d]`.
        let out = empty(&q, [b, t, d]);
        let strides = [t * d, kd, d, 0];
        let lse = attention_forward::<R>(&q, &k, &v, &out, strides, causal, pad, dropout);
        (out, lse)
    }

    fn fused_attention_backward(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        o: CubeTensor<R>,
        lse: CubeTensor<R>,
        d_o: CubeTensor<R>,
        causal: bool,
        pad: Option<CubeTensor<R>>,
        dropout: Option<DropoutMask>,
    ) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
        let [b, h, t, kd] = q.shape().dims();
        let s = k.shape()[2];
        if !attention_fits([b, h, t, s, kd]) {
            return composed::attention_backward::<Self>(
                q, k, v, o, lse, d_o, causal, pad, dropout,
            );
        }
        // dq `[b, h, t, k]`, then dk and dv `[b, h, s, k]` one after the other in one buffer.
        let dq = empty(&q, [b, h, t, kd]);
        let n = b * h * s * kd;
        let dkv = empty(&q, [2 * n]);
        let inputs = AttentionInputs {
            q,
            k,
            v,
            o,
            d_o,
            lse,
        };
        let grads = [
            (&dq, [h * t * kd, t * kd, kd, 0]),
            (&dkv, [h * s * kd, s * kd, kd, 0]),
        ];
        attention_backward::<R>(inputs, grads, n, causal, pad, dropout);
        // One range: the buffer has one dimension.
        let half = |i: usize| {
            let range = i * n..(i + 1) * n;
            reshape(
                slice(dkv.clone(), std::slice::from_ref(&range)),
                Shape::new([b, h, s, kd]),
            )
        };
        (dq, half(0), half(1))
    }

    fn fused_packed_attention_backward(
        qkv: CubeTensor<R>,
        o: CubeTensor<R>,
        lse: CubeTensor<R>,
        d_o: CubeTensor<R>,
        heads: usize,
        causal: bool,
        pad: Option<CubeTensor<R>>,
        dropout: Option<DropoutMask>,
    ) -> CubeTensor<R> {
        let [b, t, d3] = qkv.shape().dims();
        let (d, kd) = (d3 / 3, d3 / 3 / heads);
        if !attention_fits([b, heads, t, t, kd]) {
            return composed::packed_attention_backward::<Self>(
                qkv, o, lse, d_o, heads, causal, pad, dropout,
            );
        }
        let [q, k, v] = split_packed(qkv, heads);
        let to_heads =
            |x: CubeTensor<R>| permute(reshape(x, Shape::new([b, t, heads, kd])), &[0, 2, 1, 3]);
        let (o, d_o) = (to_heads(o), to_heads(into_contiguous(d_o)));
        // dq, dk, dv written side by side into one `[b, t, 3·d]` gradient, heads merged.
        let grad = empty(&q, [b, t, d3]);
        let inputs = AttentionInputs {
            q,
            k,
            v,
            o,
            d_o,
            lse,
        };
        let grads = [(&grad, [t * d3, kd, d3, 0]), (&grad, [t * d3, kd, d3, d])];
        attention_backward::<R>(inputs, grads, d, causal, pad, dropout);
        grad
    }
}

/// `x ⊙ M`, or with `residual` `r + x ⊙ M`, in one launch.
fn dropout<R: CubeRuntime>(
    x: CubeTensor<R>,
    residual: Option<CubeTensor<R>>,
    mask: DropoutMask,
) -> CubeTensor<R> {
    let x = into_contiguous(x);
    let has_residual = residual.is_some();
    let r = residual.map(into_contiguous).unwrap_or_else(|| x.clone());
    let y = empty(&x, x.shape());
    let (count, dim) = elementwise_blocks(&x);
    let dtype = x.dtype;
    launches::count();

    pointwise::dropout_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        r.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        mask.seed as u32,
        (mask.seed >> 32) as u32,
        mask.threshold_u32(),
        mask.scale(),
        has_residual,
        dtype.into(),
    );
    y
}

/// The largest embedding table whose gradient our kernels sum: each cube of the first stage
/// reads every id of its chunk, once for each block of [`EMBED_ROWS`] table rows, so past a few
/// thousand rows (GPT-2's 50,257) burn's sum, one unit a column, reads less.
pub const MAX_EMBED_ROWS: usize = 4096;

/// Rows of the output gradient in one chunk of the embedding gradient's first stage.
const EMBED_CHUNK: usize = 256;

/// The most partial sums the embedding gradient's first stage keeps (16 MB of `f32`): a table
/// of `v × d` gets at most this over `v · d` chunks.
const EMBED_PARTIALS: usize = 1 << 22;

/// The target that marks a row as ignored (`-1`, which no class is, when none is).
fn ignore_index(ignore: Option<usize>) -> i32 {
    ignore.and_then(|i| i32::try_from(i).ok()).unwrap_or(-1)
}

/// Whether the attention kernels take heads of this shape `[b, h, t, s, k]`: a head dimension
/// up to [`MAX_HEAD_DIM`], and every weight's index (the dropout mask's element) in 32 bits.
fn attention_fits([b, h, t, s, kd]: [usize; 5]) -> bool {
    kd <= MAX_HEAD_DIM && fits(b * h * t * s) && fits(b * h * t.max(s) * kd * 3)
}

/// Q, K and V `[b, h, t, k]` as views of packed projections `[b, t, 3·h·k]` (no copy: each
/// part is a column slice `[b, t, h·k]`, split into heads by strides and permuted; burn's
/// reshape copies a non-contiguous tensor whose rank it lowers, so no step here lowers one).
fn split_packed<R: CubeRuntime>(qkv: CubeTensor<R>, heads: usize) -> [CubeTensor<R>; 3] {
    let [b, t, d3] = qkv.shape().dims();
    let (d, kd) = (d3 / 3, d3 / 3 / heads);
    let qkv = into_contiguous(qkv);
    [0, 1, 2].map(|i| {
        let part = slice(qkv.clone(), &[0..b, 0..t, i * d..(i + 1) * d]);
        permute(reshape(part, Shape::new([b, t, heads, kd])), &[0, 2, 1, 3])
    })
}

/// The launch settings shared by the attention kernels: the output's strides `[batch item,
/// head, position, offset]` (and a second offset), and the dropout mask.
fn layout<R: CubeRuntime>(
    heads: usize,
    strides: [usize; 4],
    offset_2: usize,
    dropout: Option<DropoutMask>,
) -> attention::LayoutLaunch<R> {
    let [out_batch, out_head, out_row, out_offset] = strides.map(|x| x as u32);
    let (key, threshold, scale) = match dropout {
        Some(mask) => (mask.seed, mask.threshold_u32(), mask.scale()),
        None => (0, 0, 1.0),
    };
    LayoutLaunch::new(
        heads as u32,
        out_batch,
        out_head,
        out_row,
        out_offset,
        offset_2 as u32,
        key as u32,
        (key >> 32) as u32,
        threshold,
        scale,
    )
}

/// The padding mask `[b, s]` contiguous, or (not read) `like` where there is none.
fn pad_arg<R: CubeRuntime>(
    pad: Option<CubeTensor<R>>,
    like: &CubeTensor<R>,
) -> (CubeTensor<R>, bool) {
    match pad {
        Some(pad) => (into_contiguous(pad), true),
        None => (like.clone(), false),
    }
}

/// Runs the forward kernel, writing the output at `strides` into `out`; returns the
/// log-sum-exp `[b, h, t]`.
#[allow(clippy::too_many_arguments)]
fn attention_forward<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    out: &CubeTensor<R>,
    strides: [usize; 4],
    causal: bool,
    pad: Option<CubeTensor<R>>,
    dropout: Option<DropoutMask>,
) -> CubeTensor<R> {
    let [b, h, t, kd] = q.shape().dims();
    let lse = empty(q, [b, h, t]);
    let (pad, has_pad) = pad_arg(pad, q);
    launches::count();
    if t == 1 && !causal && dropout.is_none() {
        // One query row per head (a decoding step): the keys dealt out to the cube's units.
        attention::attention_decode_kernel::launch::<R>(
            &q.client,
            CubeCount::Static(1, (b * h) as u32, 1),
            CubeDim::new_1d(attention::DECODE_UNITS),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            pad.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            layout::<R>(h, strides, 0, None),
            kd,
            has_pad,
            q.dtype.into(),
        );
        return lse;
    }

    if attention_tiles(&q.client, kd) {
        attention::attention_forward_tiles_kernel::launch::<R>(
            &q.client,
            CubeCount::Static(t.div_ceil(TILE as usize) as u32, (b * h) as u32, 1),
            CubeDim::new_1d(attention::TILES_UNITS),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            pad.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            layout::<R>(h, strides, 0, dropout),
            kd,
            causal,
            has_pad,
            dropout.is_some(),
            q.dtype.into(),
        );
        return lse;
    }
    let split = row_split(&q.client, kd);
    attention::attention_forward_kernel::launch::<R>(
        &q.client,
        CubeCount::Static(t.div_ceil(TILE as usize) as u32, (b * h) as u32, 1),
        CubeDim::new_1d(TILE * split as u32),
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        pad.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        layout::<R>(h, strides, 0, dropout),
        kd,
        causal,
        has_pad,
        dropout.is_some(),
        split,
        q.dtype.into(),
    );
    lse
}

/// What the attention backward kernels read.
struct AttentionInputs<R: CubeRuntime> {
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    o: CubeTensor<R>,
    d_o: CubeTensor<R>,
    lse: CubeTensor<R>,
}

/// Runs the two backward kernels: dq into `grads[0]` at its strides, dk and dv into `grads[1]`
/// at its strides, dv `dv_offset` elements after dk.
fn attention_backward<R: CubeRuntime>(
    inputs: AttentionInputs<R>,
    grads: [(&CubeTensor<R>, [usize; 4]); 2],
    dv_offset: usize,
    causal: bool,
    pad: Option<CubeTensor<R>>,
    dropout: Option<DropoutMask>,
) {
    let AttentionInputs {
        q,
        k,
        v,
        o,
        d_o,
        lse,
    } = inputs;
    let [b, h, t, kd] = q.shape().dims();
    let s = k.shape()[2];
    let lse = into_contiguous(lse);
    let delta = empty_f32(&q, [b, h, t]);
    let (pad, has_pad) = pad_arg(pad, &q);
    let client = q.client.clone();
    let dtype = q.dtype;
    let [(dq, dq_strides), (dkv, dkv_strides)] = grads;
    let dq_layout = layout::<R>(h, dq_strides, 0, dropout);
    let dkv_layout = layout::<R>(h, dkv_strides, dkv_strides[3] + dv_offset, dropout);
    let query_cubes = CubeCount::Static(t.div_ceil(TILE as usize) as u32, (b * h) as u32, 1);
    let key_cubes = CubeCount::Static(s.div_ceil(TILE as usize) as u32, (b * h) as u32, 1);
    launches::count();

    if attention_tiles(&client, kd) {
        attention::attention_backward_queries_tiles_kernel::launch::<R>(
            &client,
            query_cubes,
            CubeDim::new_1d(attention::TILES_UNITS),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            o.into_tensor_arg(),
            d_o.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            pad.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dq_layout,
            kd,
            causal,
            has_pad,
            dropout.is_some(),
            dtype.into(),
        );
        launches::count();
        attention::attention_backward_keys_tiles_kernel::launch::<R>(
            &client,
            key_cubes,
            CubeDim::new_1d(attention::TILES_UNITS),
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            d_o.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            pad.into_tensor_arg(),
            dkv.clone().into_tensor_arg(),
            dkv_layout,
            kd,
            causal,
            has_pad,
            dropout.is_some(),
            dtype.into(),
        );
        return;
    }
    let split = row_split(&client, kd);
    attention::attention_backward_queries_kernel::launch::<R>(
        &client,
        query_cubes,
        CubeDim::new_1d(TILE * split as u32),
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        o.into_tensor_arg(),
        d_o.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        pad.clone().into_tensor_arg(),
        dq.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        dq_layout,
        kd,
        causal,
        has_pad,
        dropout.is_some(),
        split,
        dtype.into(),
    );
    launches::count();

    attention::attention_backward_keys_kernel::launch::<R>(
        &client,
        key_cubes,
        CubeDim::new_1d(TILE * split as u32),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        d_o.into_tensor_arg(),
        lse.into_tensor_arg(),
        delta.into_tensor_arg(),
        pad.into_tensor_arg(),
        dkv.clone().into_tensor_arg(),
        dkv_layout,
        kd,
        causal,
        has_pad,
        dropout.is_some(),
        split,
        dtype.into(),
    );
}

/// Whether the device's planes can shuffle and add up their units' values: cubecl marks plane
/// operations on a GPU with subgroups, and its Vulkan path's subgroup support as plane
/// synchronisation, which a CPU Vulkan driver such as lavapipe has too (the kernels that need
/// them run there and are tested); WGSL without subgroups has neither.
fn planes_shuffle<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    use cubecl::features::Plane;
    let plane = client.properties().features.plane;
    plane.contains(Plane::Ops) || plane.contains(Plane::Sync)
}

/// Whether attention with heads `kd` wide runs the tiled kernels (forward and both backward,
/// [`attention::attention_forward_tiles_kernel`]) on this device: for heads 16, 32 or 64 wide
/// where the device's planes shuffle and hold 8 units (a row's 8 units of the scores add up its
/// weights by shuffles), unless a test forces a row split.
fn attention_tiles<R: CubeRuntime>(client: &ComputeClient<R>, kd: usize) -> bool {
    attention::tiles_take(kd)
        && planes_shuffle(client)
        && client.properties().hardware.plane_size_min >= 8
        && FORCED_ROW_SPLIT.load(Ordering::Relaxed) == 0
}

/// Whether attention with heads `kd` wide runs the tiled kernels on `device` (for tests, which
/// must know which kernels they check).
#[doc(hidden)]
pub fn attention_in_tiles<R: CubeRuntime>(device: &R::Device, kd: usize) -> bool {
    attention_tiles(&R::client(device), kd)
}

/// A row split the tests force on the attention row kernels (0: [`row_split`]'s own), which
/// also keeps the tiled kernels out.
static FORCED_ROW_SPLIT: AtomicUsize = AtomicUsize::new(0);

/// Makes attention run the row kernels (forward and backward) and share each row among `split`
/// units (1, 2, 4 or 8; it must divide the head width and fit in the device's plane), or with
/// `None` choose as it does (see [`row_split`], [`attention_tiles`]): for tests, which check
/// every split on small heads.
#[doc(hidden)]
pub fn force_attention_row_split(split: Option<usize>) {
    FORCED_ROW_SPLIT.store(split.unwrap_or(0), Ordering::Relaxed);
}

/// How many units share a row in the attention row kernels (forward, and both backward): one
/// for every 16 columns of the head, at most 8 (a power of two dividing the head width; 4 for a
/// 64-wide head), each holding every `split`-th column, their dot products added through plane
/// shuffles — where the device's planes shuffle ([`planes_shuffle`]) and hold that many units;
/// else 1. Found by `bench/gpu/registers.sh`: with one unit a row both backward kernels reached
/// a GPU's 255 registers a unit and spilled, and the forward held 168.
fn row_split<R: CubeRuntime>(client: &ComputeClient<R>, kd: usize) -> usize {
    let properties = client.properties();
    let shuffles = planes_shuffle(client);
    let forced = FORCED_ROW_SPLIT.load(Ordering::Relaxed);
    if forced > 0 {
        let fits =
            kd.is_multiple_of(forced) && forced <= properties.hardware.plane_size_min as usize;
        assert!(
            fits && (forced == 1 || shuffles),
            "forced split {forced} does not fit"
        );
        return forced;
    }
    let mut split = 1;
    while shuffles
        && split < 8
        && kd.is_multiple_of(2 * split)
        && kd / (2 * split) >= 16
        && 2 * split <= properties.hardware.plane_size_min as usize
    {
        split *= 2;
    }
    split
}
