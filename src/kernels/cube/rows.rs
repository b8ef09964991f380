//! Row kernels: LayerNorm forward and backward, the cross-entropy and its gradient. Where the
//! device's planes can add up their units' values, one plane a row (several rows a cube), each
//! unit striding over the row and the plane's own sum or maximum reducing it, with no barrier;
//! elsewhere one cube of [`ROW_UNITS`] units a row, reducing through shared memory (a fixed
//! tree). Either way the sums are the same run to run. Also the gradient of an
//! embedding table, which sums rows of the output gradient into the rows their ids name.

use super::pointwise::dropout_multiplier;
use cubecl::prelude::*;

/// Units of the cube that handles one row.
pub const ROW_UNITS: u32 = 128;

/// Rows summed by one cube of the LayerNorm parameter-gradient kernel.
pub const GRAD_CHUNK: u32 = 64;

/// The row handled by this cube (rows laid out over a 2-D grid of cubes, see `row_grid`).
#[cube]
fn cube_row() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// Where a unit of a LayerNorm kernel stands: its row, and its place among the units that
/// share the row (it takes columns `lane, lane + width, …`).
#[derive(CubeType, Clone, Copy)]
pub struct RowPlace {
    /// The row.
    pub row: usize,
    /// This unit's place among the row's units.
    pub lane: usize,
    /// How many units share the row.
    pub width: usize,
}

/// This unit's [`RowPlace`]: with `planes`, one plane a row (the cube's planes take
/// consecutive rows), otherwise the whole cube a row.
#[cube]
pub fn row_place(#[comptime] planes: bool) -> RowPlace {
    let mut place = RowPlace {
        row: cube_row(),
        lane: UNIT_POS_X as usize,
        width: CUBE_DIM_X as usize,
    };
    if planes {
        place.row =
            cube_row() * (CUBE_DIM_X / PLANE_DIM) as usize + (UNIT_POS_X / PLANE_DIM) as usize;
        place.lane = UNIT_POS_PLANE as usize;
        place.width = PLANE_DIM as usize;
    }
    place
}

/// The sum of `value` over the units of a row: with `planes` by the plane's own sum (no
/// barrier), otherwise by [`cube_sum`] (every unit of the cube must call it).
#[cube]
fn row_total(shared: &mut SharedMemory<f32>, value: f32, #[comptime] planes: bool) -> f32 {
    if planes {
        plane_sum(value)
    } else {
        cube_sum(shared, value)
    }
}

/// The maximum of `value` over the units of a row (as [`row_total`]).
#[cube]
fn row_maximum(shared: &mut SharedMemory<f32>, value: f32, #[comptime] planes: bool) -> f32 {
    if planes {
        plane_max(value)
    } else {
        cube_max(shared, value)
    }
}

/// The sum of `value` over the cube's units, through `shared` (every unit must call it).
#[cube]
pub fn cube_sum(shared: &mut SharedMemory<f32>, value: f32) -> f32 {
    let u = UNIT_POS_X as usize;
    shared[u] = value;
    sync_cube();
    let mut stride = (CUBE_DIM_X / 2) as usize;
    while stride > 0 {
        if u < stride {
            let other = shared[u + stride];
            shared[u] += other;
        }
        sync_cube();
        stride /= 2;
    }
    let total = shared[0];
    sync_cube();
    total
}

/// The maximum of `value` over the cube's units, through `shared` (every unit must call it).
#[cube]
fn cube_max(shared: &mut SharedMemory<f32>, value: f32) -> f32 {
    let u = UNIT_POS_X as usize;
    shared[u] = value;
    sync_cube();
    let mut stride = (CUBE_DIM_X / 2) as usize;
    while stride > 0 {
        if u < stride {
            let other = shared[u + stride];
            shared[u] = f32::max(shared[u], other);
        }
        sync_cube();
        stride /= 2;
    }
    let total = shared[0];
    sync_cube();
    total
}

/// LayerNorm of the rows of `x` `[n, d]`: `y`, and each row's mean and `1/σ`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward_kernel<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    y: &mut Tensor<F>,
    mean: &mut Tensor<F>,
    rstd: &mut Tensor<F>,
    epsilon: f32,
    #[comptime] has_beta: bool,
    #[comptime] planes: bool,
    #[define(F)] _dtype: StorageType,
) {
    let place = row_place(planes);
    if place.row >= mean.len() {
        terminate!();
    }
    let mut shared = SharedMemory::<f32>::new(ROW_UNITS as usize);
    let d = x.shape(1);
    let base = place.row * d;
    let mut s = 0.0f32;
    let mut j = place.lane;
    while j < d {
        s += f32::cast_from(x[base + j]);
        j += place.width;
    }
    let mu = row_total(&mut shared, s, planes) / f32::cast_from(d as u32);
    normalise_row(
        x,
        gamma,
        beta,
        y,
        mean,
        rstd,
        &mut shared,
        place,
        mu,
        epsilon,
        has_beta,
        planes,
    );
}

/// The residual addition and the LayerNorm after it: `s = x + h ⊙ M` (`x + h` unless
/// `dropped`; `M` the dropout mask keyed `(key_lo, key_hi)`, rounded as the dropout kernel
/// rounds) and the LayerNorm of its rows, `y`, mean and `1/σ`. Each unit reads back the sums
/// it wrote, so the statistics are those of the stored sum, as when the two run apart.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn add_layer_norm_forward_kernel<F: Float>(
    x: &Tensor<F>,
    h: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    sum: &mut Tensor<F>,
    y: &mut Tensor<F>,
    mean: &mut Tensor<F>,
    rstd: &mut Tensor<F>,
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    scale: f32,
    epsilon: f32,
    #[comptime] has_beta: bool,
    #[comptime] dropped: bool,
    #[comptime] planes: bool,
    #[define(F)] _dtype: StorageType,
) {
    let place = row_place(planes);
    if place.row >= mean.len() {
        terminate!();
    }
    let mut shared = SharedMemory::<f32>::new(ROW_UNITS as usize);
    let d = x.shape(1);
    let base = place.row * d;
    let mut s = 0.0f32;
    let mut j = place.lane;
    while j < d {
        let i = base + j;
        let mut branch = h[i];
        if dropped {
            let m = dropout_multiplier(i as u32, key_lo, key_hi, threshold, scale);
            branch = F::cast_from(f32::cast_from(branch) * m);
        }
        let v = F::cast_from(f32::cast_from(x[i]) + f32::cast_from(branch));
        sum[i] = v;
        s += f32::cast_from(v);
        j += place.width;
    }
    let mu = row_total(&mut shared, s, planes) / f32::cast_from(d as u32);
    normalise_row(
        sum,
        gamma,
        beta,
        y,
        mean,
        rstd,
        &mut shared,
        place,
        mu,
        epsilon,
        has_beta,
        planes,
    );
}

/// The rest of a LayerNorm row once its mean `mu` is known: the variance, `y`, and the row's
/// mean and `1/σ` (every unit of the cube must call it).
#[cube]
#[allow(clippy::too_many_arguments)]
fn normalise_row<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    y: &mut Tensor<F>,
    mean: &mut Tensor<F>,
    rstd: &mut Tensor<F>,
    shared: &mut SharedMemory<f32>,
    place: RowPlace,
    mu: f32,
    epsilon: f32,
    #[comptime] has_beta: bool,
    #[comptime] planes: bool,
) {
    let d = x.shape(1);
    let row = place.row;
    let base = row * d;
    let units = place.width;
    let mut s2 = 0.0f32;
    let mut j = place.lane;
    while j < d {
        let c = f32::cast_from(x[base + j]) - mu;
        s2 += c * c;
        j += units;
    }
    let var = row_total(shared, s2, planes) / f32::cast_from(d as u32);
    let r = 1.0f32 / f32::sqrt(var + epsilon);
    let mut j = place.lane;
    while j < d {
        let mut out = (f32::cast_from(x[base + j]) - mu) * r * f32::cast_from(gamma[j]);
        if has_beta {
            out += f32::cast_from(beta[j]);
        }
        y[base + j] = F::cast_from(out);
        j += units;
    }
    if place.lane == 0 {
        mean[row] = F::cast_from(mu);
        rstd[row] = F::cast_from(r);
    }
}

/// LayerNorm's input gradient, row by row: with `x̂ = (x − μ)/σ` and `g = dy ⊙ γ`,
/// `dx = (g − mean(g) − x̂ · mean(g ⊙ x̂)) / σ`; with `has_residual`, plus `residual` (the
/// gradient the input has from its other readers; otherwise not read), rounded as an addition
/// of the two stored gradients rounds.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_kernel<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    mean: &Tensor<F>,
    rstd: &Tensor<F>,
    dy: &Tensor<F>,
    residual: &Tensor<F>,
    dx: &mut Tensor<F>,
    #[comptime] has_residual: bool,
    #[comptime] planes: bool,
    #[define(F)] _dtype: StorageType,
) {
    let place = row_place(planes);
    let row = place.row;
    if row >= mean.len() {
        terminate!();
    }
    let mut shared = SharedMemory::<f32>::new(ROW_UNITS as usize);
    let d = x.shape(1);
    let base = row * d;
    let units = place.width;
    let mu = f32::cast_from(mean[row]);
    let r = f32::cast_from(rstd[row]);
    let mut sg = 0.0f32;
    let mut sgx = 0.0f32;
    let mut j = place.lane;
    while j < d {
        let g = f32::cast_from(dy[base + j]) * f32::cast_from(gamma[j]);
        let xh = (f32::cast_from(x[base + j]) - mu) * r;
        sg += g;
        sgx += g * xh;
        j += units;
    }
    let inv_d = 1.0f32 / f32::cast_from(d as u32);
    let mean_g = row_total(&mut shared, sg, planes) * inv_d;
    let mean_gx = row_total(&mut shared, sgx, planes) * inv_d;
    let mut j = place.lane;
    while j < d {
        let g = f32::cast_from(dy[base + j]) * f32::cast_from(gamma[j]);
        let xh = (f32::cast_from(x[base + j]) - mu) * r;
        let mut out = F::cast_from((g - mean_g - xh * mean_gx) * r);
        if has_residual {
            out = F::cast_from(f32::cast_from(out) + f32::cast_from(residual[base + j]));
        }
        dx[base + j] = out;
        j += units;
    }
}

/// LayerNorm's parameter gradients, first stage: for each chunk of [`GRAD_CHUNK`] rows (cube
/// `y`) and column (unit `x`), the partial sums `Σ dy·x̂` and `Σ dy` into `partial`
/// `[2, chunks, d]`.
#[cube(launch)]
pub fn layer_norm_grad_partial_kernel<F: Float>(
    x: &Tensor<F>,
    mean: &Tensor<F>,
    rstd: &Tensor<F>,
    dy: &Tensor<F>,
    partial: &mut Tensor<f32>,
    #[define(F)] _dtype: StorageType,
) {
    let col = ABSOLUTE_POS_X as usize;
    let d = x.shape(1);
    let n = x.shape(0);
    if col >= d {
        terminate!();
    }
    let chunk = CUBE_POS_Y as usize;
    let chunks = CUBE_COUNT_Y as usize;
    let start = chunk * GRAD_CHUNK as usize;
    let mut end = start + GRAD_CHUNK as usize;
    if end > n {
        end = n;
    }
    let mut sg = 0.0f32;
    let mut sb = 0.0f32;
    for row in start..end {
        let g = f32::cast_from(dy[row * d + col]);
        let xh = (f32::cast_from(x[row * d + col]) - f32::cast_from(mean[row]))
            * f32::cast_from(rstd[row]);
        sg += g * xh;
        sb += g;
    }
    partial[chunk * d + col] = sg;
    partial[(chunks + chunk) * d + col] = sb;
}

/// Columns a cube of [`layer_norm_grad_reduce_kernel`] takes.
pub const REDUCE_COLUMNS: u32 = 32;

/// Units a column of [`layer_norm_grad_reduce_kernel`]: its chunks dealt out among them.
pub const REDUCE_LANES: u32 = 8;

/// Second stage: each column's partial sums added up → `dgamma`, `dbeta` `[d]`. A cube takes
/// [`REDUCE_COLUMNS`] columns with [`REDUCE_LANES`] units each: lane `l` adds chunks `l, l + 8,
/// …` in order, and then the lanes' sums are added in lane order (the same bits every run).
/// One unit adding a column's 256 chunks in turn (16,384 rows) waited on 256 reads one after
/// another, with a few hundred units busy on the whole device.
#[cube(launch)]
pub fn layer_norm_grad_reduce_kernel<F: Float>(
    partial: &Tensor<f32>,
    dgamma: &mut Tensor<F>,
    dbeta: &mut Tensor<F>,
    chunks: u32,
    #[define(F)] _dtype: StorageType,
) {
    let u = UNIT_POS_X as usize;
    let columns = REDUCE_COLUMNS as usize;
    let lanes = REDUCE_LANES as usize;
    let col = CUBE_POS_X as usize * columns + u % columns;
    let lane = u / columns;
    let d = dgamma.len();
    let chunks = chunks as usize;
    let mut sg = 0.0f32;
    let mut sb = 0.0f32;
    if col < d {
        let mut c = lane;
        while c < chunks {
            sg += partial[c * d + col];
            sb += partial[(chunks + c) * d + col];
            c += lanes;
        }
    }
    let mut gammas = SharedMemory::<f32>::new((REDUCE_COLUMNS * REDUCE_LANES) as usize);
    let mut betas = SharedMemory::<f32>::new((REDUCE_COLUMNS * REDUCE_LANES) as usize);
    gammas[u] = sg;
    betas[u] = sb;
    sync_cube();
    if lane == 0 && col < d {
        let mut tg = 0.0f32;
        let mut tb = 0.0f32;
        #[unroll]
        for l in 0..REDUCE_LANES as usize {
            tg += gammas[l * columns + u];
            tb += betas[l * columns + u];
        }
        dgamma[col] = F::cast_from(tg);
        dbeta[col] = F::cast_from(tb);
    }
}

/// Columns of an embedding gradient one cube of [`embedding_grad_partial_kernel`] sums (one
/// unit each).
pub const EMBED_COLUMNS: u32 = 32;

/// Table rows one cube of [`embedding_grad_partial_kernel`] sums into: its shared memory holds
/// `EMBED_ROWS × EMBED_COLUMNS` sums (8 KB).
pub const EMBED_ROWS: u32 = 64;

/// An embedding table's gradient, first stage: cube `(x, y, z)` sums, for the columns
/// `32x .. 32x + 32` and the table rows `64z .. 64z + 64`, the rows of `grad` `[n, d]` in chunk
/// `y` (`chunk` rows from `y · chunk`) whose ids name one of those table rows, in row order,
/// into `partial[y]` `[v, d]` (every row of its block written, zero where no id named it). Each
/// unit owns one column of the block's sums, so no unit reads another's and no barrier is
/// needed.
#[cube(launch)]
pub fn embedding_grad_partial_kernel<F: Float, I: Int>(
    ids: &Tensor<I>,
    grad: &Tensor<F>,
    partial: &mut Tensor<f32>,
    chunk: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let d = grad.shape(1);
    let n = grad.shape(0);
    let v = partial.shape(1);
    let col = ABSOLUTE_POS_X as usize;
    if col >= d {
        terminate!();
    }
    let unit = UNIT_POS_X as usize;
    let width = EMBED_COLUMNS as usize;
    let first = CUBE_POS_Z * EMBED_ROWS;
    let mut sums = SharedMemory::<f32>::new((EMBED_ROWS * EMBED_COLUMNS) as usize);
    for r in 0..EMBED_ROWS as usize {
        sums[r * width + unit] = 0.0f32;
    }
    let start = CUBE_POS_Y as usize * chunk as usize;
    let mut end = start + chunk as usize;
    if end > n {
        end = n;
    }
    for row in start..end {
        let id = u32::cast_from(ids[row]);
        if id >= first && id < first + EMBED_ROWS {
            sums[(id - first) as usize * width + unit] += f32::cast_from(grad[row * d + col]);
        }
    }
    let base = CUBE_POS_Y as usize * v;
    for r in 0..EMBED_ROWS as usize {
        let table_row = first as usize + r;
        if table_row < v {
            partial[(base + table_row) * d + col] = sums[r * width + unit];
        }
    }
}

/// Second stage: each element of the gradient `[v, d]` is its chunks' partial sums added in
/// chunk order.
#[cube(launch)]
pub fn embedding_grad_reduce_kernel<F: Float>(
    partial: &Tensor<f32>,
    out: &mut Tensor<F>,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    let size = out.len();
    if i >= size {
        terminate!();
    }
    let chunks = partial.shape(0);
    let mut sum = 0.0f32;
    for c in 0..chunks {
        sum += partial[c * size + i];
    }
    out[i] = F::cast_from(sum);
}

/// The label-smoothed cross-entropy of each row of `logits` `[n, v]`:
/// `−(1−ε)(x_y − lse) − ε(mean(x) − lse)`, `0` where the target is `ignore`; and `lse`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_forward_kernel<F: Float, I: Int>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    loss: &mut Tensor<F>,
    lse: &mut Tensor<F>,
    smoothing: f32,
    ignore: i32,
    #[comptime] planes: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let place = row_place(planes);
    let row = place.row;
    if row >= loss.len() {
        terminate!();
    }
    let mut shared = SharedMemory::<f32>::new(ROW_UNITS as usize);
    let v = logits.shape(1);
    let base = row * v;
    let units = place.width;
    let mut m = f32::new(-3.0e38);
    let mut j = place.lane;
    while j < v {
        m = f32::max(m, f32::cast_from(logits[base + j]));
        j += units;
    }
    let m = row_maximum(&mut shared, m, planes);
    let mut se = 0.0f32;
    let mut sx = 0.0f32;
    let mut j = place.lane;
    while j < v {
        let x = f32::cast_from(logits[base + j]);
        se += f32::exp(x - m);
        sx += x;
        j += units;
    }
    let se = row_total(&mut shared, se, planes);
    let sx = row_total(&mut shared, sx, planes);
    if place.lane == 0 {
        let l = m + f32::ln(se);
        let y = i32::cast_from(targets[row]);
        let mut out = 0.0f32;
        if y != ignore {
            let picked = f32::cast_from(logits[base + y as usize]);
            out = (1.0f32 - smoothing) * (l - picked)
                + smoothing * (l - sx / f32::cast_from(v as u32));
        }
        loss[row] = F::cast_from(out);
        lse[row] = F::cast_from(l);
    }
}

/// The gradient of the row losses for their gradient `grad` `[n]`:
/// `grad · (softmax(row) − (1−ε)·onehot(y) − ε/v)`, zero on ignored rows; one unit per logit.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_backward_kernel<F: Float, I: Int>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    lse: &Tensor<F>,
    grad: &Tensor<F>,
    dx: &mut Tensor<F>,
    smoothing: f32,
    ignore: i32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= logits.len() {
        terminate!();
    }
    let v = logits.shape(1);
    let row = i / v;
    let j = i % v;
    let y = i32::cast_from(targets[row]);
    let mut out = 0.0f32;
    if y != ignore {
        let p = f32::exp(f32::cast_from(logits[i]) - f32::cast_from(lse[row]));
        let mut target = smoothing / f32::cast_from(v as u32);
        if j == y as usize {
            target += 1.0f32 - smoothing;
        }
        out = f32::cast_from(grad[row]) * (p - target);
    }
    dx[i] = F::cast_from(out);
}

/// Where element `i` of `x` (counted in row-major order of its shape) lies in its buffer, for a
/// tensor of any strides (a gradient that is a transposed or sliced view).
#[cube]
pub fn strided_offset<F: Float>(x: &Tensor<F>, i: usize) -> usize {
    let rank = x.rank();
    let mut rest = i;
    let mut offset = 0usize;
    for k in 0..rank {
        let d = rank - 1 - k;
        let size = x.shape(d);
        offset += (rest % size) * x.stride(d);
        rest /= size;
    }
    offset
}

/// Global-norm clipping's first stage for several gradients in one launch: gradient `xs[y]`
/// (any shape and strides) takes the `C = parts[y]` cubes from `starts[y]` on, whose cube `c`
/// sums the squares of its elements `c·U + u`, `c·U + u + C·U`, … (`U` units) into
/// `partial[base + starts[y] + c]`, in a fixed order; bit `y` of `strided` says `xs[y]` is read
/// at its strides. Each cube finds its gradient by comparing its position with every start,
/// unrolled: one branch taken per cube, no cube idle.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn sum_squares_many_kernel<F: Float>(
    xs: &Sequence<Tensor<F>>,
    partial: &mut Tensor<f32>,
    base: u32,
    starts: Sequence<u32>,
    parts: Sequence<u32>,
    sizes: Sequence<u32>,
    #[comptime] strided: u64,
    #[define(F)] _dtype: StorageType,
) {
    let mut shared = SharedMemory::<f32>::new(ROW_UNITS as usize);
    let count = xs.len().comptime();
    #[unroll]
    for y in 0..count {
        let start = *starts.index(y);
        let cubes = *parts.index(y);
        if CUBE_POS_X >= start && CUBE_POS_X < start + cubes {
            let x = xs.index(y);
            let c = CUBE_POS_X - start;
            let n = *sizes.index(y) as usize;
            let step = (cubes * CUBE_DIM_X) as usize;
            let mut i = (c * CUBE_DIM_X + UNIT_POS_X) as usize;
            let mut s = 0.0f32;
            while i < n {
                let mut at = i;
                if comptime!((strided >> y) & 1 == 1) {
                    at = strided_offset(x, i);
                }
                let v = f32::cast_from(x[at]);
                s += v * v;
                i += step;
            }
            let total = cube_sum(&mut shared, s);
            if UNIT_POS_X == 0 {
                partial[(base + CUBE_POS_X) as usize] = total;
            }
        }
    }
}

/// The second stage: every partial sum added in a fixed order by one cube → `out[0]`.
#[cube(launch)]
pub fn sum_partials_kernel<F: Float>(
    partial: &Tensor<f32>,
    out: &mut Tensor<F>,
    #[define(F)] _dtype: StorageType,
) {
    let mut shared = SharedMemory::<f32>::new(ROW_UNITS as usize);
    let n = partial.len();
    let mut i = UNIT_POS_X as usize;
    let mut s = 0.0f32;
    while i < n {
        s += partial[i];
        i += CUBE_DIM_X as usize;
    }
    let total = cube_sum(&mut shared, s);
    if UNIT_POS_X == 0 {
        out[0] = F::cast_from(total);
    }
}
