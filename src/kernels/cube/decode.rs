//! The linear layers of a decoding step, one launch each with what surrounds them: a
//! generated token has one row a sequence, so a LayerNorm before a product, a GELU or the
//! residual addition after it, and the cache's append of the keys and values each cost a launch
//! of their own for a few hundred numbers. Here a cube takes the LayerNorm statistics of the
//! rows it needs (a few hundred numbers) and normalises them once into shared memory; the bias,
//! GELU and residual addition are applied as each output is written; and the query, key and
//! value product writes its keys and values into the cache's buffers ([`decode_qkv_kernel`]).
//!
//! A cube of up to [`MAX_UNITS`] units takes up to [`MAX_ROWS`] rows and a block of output
//! columns ([`Plan`]). The units are groups of [`GROUP`]; the shares of each column are added
//! in a fixed order (a tree through shared memory), so the sums are the same run to run. Where
//! the weight's rows are contiguous (`w` `[i, o]` row-major, a linear layer's), a group takes
//! 32 adjacent columns and the cube's groups split the inner dimension: each load of the weight
//! reads 32 consecutive numbers. Where the inner dimension is contiguous (a tied output layer
//! reads the embedding table transposed), each group takes one column and its units read along
//! it. Each unit keeps four loads of the weight in flight (a row of a few hundred numbers is
//! otherwise a chain of memory latencies).

use super::pointwise::gelu_value;
use cubecl::prelude::*;

/// The most units of a cube (fewer where the device allows fewer).
pub const MAX_UNITS: u32 = 1024;

/// The most rows a cube takes (more rows take more cubes, each reading the weight again from
/// cache); fewer where there are fewer.
pub const MAX_ROWS: usize = 4;

/// Units of a group: the columns a group takes when the weight's rows are contiguous, or the
/// units that share one column when its columns are.
pub const GROUP: u32 = 32;

/// How a decoding step's product is cut into cubes: rows and units a cube, and the numbers of
/// shared memory it holds (each unit's share of every row's sums, or the cube's rows
/// normalised, whichever is more).
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// Rows a cube (1, 2 or 4).
    pub rows: usize,
    /// Units a cube (a power of two, at least [`GROUP`]).
    pub units: u32,
    /// `f32` numbers of shared memory.
    pub shared: usize,
}

impl Plan {
    /// For `n` rows of `d_in` (normalised in shared memory with `normed`, the weight's inner
    /// dimension contiguous with `along_k`) on a device whose cubes take at most `max_units`
    /// units and `max_shared` bytes of shared memory; `None` where the normalised rows do not
    /// fit. Where a group takes 32 columns, the cube has as many groups as give each unit
    /// about 16 of the inner dimension (a narrow layer's few columns are then still read by
    /// many units); where a group takes one column, 8 groups.
    pub fn new(
        n: usize,
        d_in: usize,
        normed: bool,
        along_k: bool,
        max_units: u32,
        max_shared: usize,
    ) -> Option<Self> {
        let rows = n.clamp(1, MAX_ROWS).next_power_of_two();
        let groups = match along_k {
            true => 8,
            false => d_in.div_ceil(16).next_power_of_two() as u32,
        };
        let most = 1 << max_units.clamp(GROUP, MAX_UNITS).ilog2();
        let units = (groups * GROUP).min(most);
        let sums = rows * units as usize;
        let shared = match normed {
            true => sums.max(rows * d_in),
            false => sums,
        }
        .next_power_of_two();
        (shared * 4 <= max_shared).then_some(Self {
            rows,
            units,
            shared,
        })
    }

    /// The cubes for `n` rows and `o` output columns.
    pub fn cubes(&self, n: usize, o: usize, along_k: bool) -> CubeCount {
        let columns = self.columns(along_k) as usize;
        CubeCount::Static(o.div_ceil(columns) as u32, n.div_ceil(self.rows) as u32, 1)
    }

    /// The output columns a cube takes: [`GROUP`] where the weight's rows are contiguous, one
    /// per group where its inner dimension is.
    pub fn columns(&self, along_k: bool) -> u32 {
        match along_k {
            true => self.units / GROUP,
            false => GROUP,
        }
    }
}

/// The sum over the cube's units of each of the `rows` rows' `shared[r·units + u]`, left in
/// `shared[r·units]` (every unit must call it).
#[cube]
fn cube_sums(shared: &mut SharedMemory<f32>, #[comptime] rows: usize) {
    let u = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let mut stride = units / 2;
    while stride > 0 {
        if u < stride {
            #[unroll]
            for r in 0..rows {
                let other = shared[r * units + u + stride];
                shared[r * units + u] += other;
            }
        }
        sync_cube();
        stride /= 2;
    }
}

/// Where row `row` of `x` `[n, d_in]` starts; past the end, the last row's start (what a
/// cube's rows past the end give is never written).
#[cube]
fn row_base(row: usize, n: usize, d_in: usize) -> usize {
    let mut r = row;
    if r >= n {
        r = n - 1;
    }
    r * d_in
}

/// `y = epilogue(LN(x)·w + bias)` for the rows of `x` `[n, i]` (contiguous) and `w` `[i, o]`
/// at any strides, `rows` rows a cube and `shared` numbers of shared memory ([`Plan`]): with
/// `normed`, `x`'s rows normalised first (`γ`, and `β` with `has_beta`; the statistics as the
/// LayerNorm kernel takes them) into shared memory, then `bias` with `has_bias`, GELU with
/// `gelu`, and `residual` `[n, o]` added with `add`. `along_k`: the weight's inner dimension
/// is contiguous (see the module docs). Arithmetic in `f32`; the normalised inputs rounded to
/// `F` as a LayerNorm's output is.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn decode_linear_kernel<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    w: &Tensor<F>,
    bias: &Tensor<F>,
    residual: &Tensor<F>,
    y: &mut Tensor<F>,
    epsilon: f32,
    #[comptime] rows: usize,
    #[comptime] shared_size: usize,
    #[comptime] normed: bool,
    #[comptime] has_beta: bool,
    #[comptime] has_bias: bool,
    #[comptime] gelu: bool,
    #[comptime] add: bool,
    #[comptime] along_k: bool,
    #[define(F)] _dtype: StorageType,
) {
    let first = CUBE_POS_Y as usize * rows;
    let mut shared = SharedMemory::<f32>::new(shared_size);
    let place = column_sums(
        x,
        gamma,
        beta,
        w,
        &mut shared,
        first,
        epsilon,
        rows,
        normed,
        has_beta,
        along_k,
    );
    if place.peer == 0 && place.column < w.shape(1) {
        write_outputs(
            &shared,
            bias,
            residual,
            y,
            place.column,
            first,
            rows,
            has_bias,
            gelu,
            add,
        );
    }
}

/// A decoding step's query, key and value product (`w` `[i, 3·d]`, the three side by side)
/// as [`decode_linear_kernel`] without GELU or residual: the queries into `q` `[n, d]`, and
/// the keys and values straight into a cache's buffers `keys`, `values` `[b, h, cap, d/h]`
/// (any strides) — row `r` is item `r / per_item`'s column `at + r % per_item` — where a
/// launch of its own appended them.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn decode_qkv_kernel<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    w: &Tensor<F>,
    bias: &Tensor<F>,
    q: &mut Tensor<F>,
    keys: &mut Tensor<F>,
    values: &mut Tensor<F>,
    epsilon: f32,
    at: u32,
    per_item: u32,
    #[comptime] rows: usize,
    #[comptime] shared_size: usize,
    #[comptime] normed: bool,
    #[comptime] has_beta: bool,
    #[comptime] has_bias: bool,
    #[comptime] along_k: bool,
    #[define(F)] _dtype: StorageType,
) {
    let first = CUBE_POS_Y as usize * rows;
    let mut shared = SharedMemory::<f32>::new(shared_size);
    let place = column_sums(
        x,
        gamma,
        beta,
        w,
        &mut shared,
        first,
        epsilon,
        rows,
        normed,
        has_beta,
        along_k,
    );
    if place.peer == 0 && place.column < w.shape(1) {
        let n = x.shape(0);
        let d = q.shape(1);
        let column = place.column;
        let width = keys.shape(3);
        #[unroll]
        for r in 0..rows {
            let row = first + r;
            if row < n {
                let value = F::cast_from(column_total(&shared, bias, column, r, has_bias));
                if column < d {
                    q[row * d + column] = value;
                } else {
                    let inner = (column - d) % d;
                    let item = row / per_item as usize;
                    let position = at as usize + row % per_item as usize;
                    let i = item * keys.stride(0)
                        + (inner / width) * keys.stride(1)
                        + position * keys.stride(2)
                        + (inner % width) * keys.stride(3);
                    if column < 2 * d {
                        keys[i] = value;
                    } else {
                        values[i] = value;
                    }
                }
            }
        }
    }
}

/// Row `r` of this unit's column as [`column_sums`] left it in `shared`, plus the column's
/// bias with `has_bias`.
#[cube]
fn column_total<F: Float>(
    shared: &SharedMemory<f32>,
    bias: &Tensor<F>,
    column: usize,
    r: usize,
    #[comptime] has_bias: bool,
) -> f32 {
    let mut sum = shared[r * CUBE_DIM_X as usize + UNIT_POS_X as usize];
    if has_bias {
        sum += f32::cast_from(bias[column]);
    }
    sum
}

/// Where a unit of a decoding step's product stands once the shares are added: its output
/// column, and its place among the units sharing it (the first, `peer` 0, holds the sums).
#[derive(CubeType, Clone, Copy)]
struct Place {
    column: usize,
    peer: usize,
}

/// Each output column's sums over the inner dimension for the cube's `rows` rows of `x`
/// (normalised first with `normed`) times `w`, left in `shared[r·units + u]` of the first
/// unit of the column's peers (every unit must call it).
#[cube]
#[allow(clippy::too_many_arguments)]
fn column_sums<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    w: &Tensor<F>,
    shared: &mut SharedMemory<f32>,
    first: usize,
    epsilon: f32,
    #[comptime] rows: usize,
    #[comptime] normed: bool,
    #[comptime] has_beta: bool,
    #[comptime] along_k: bool,
) -> Place {
    let u = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let group = GROUP as usize;
    let d_in = x.shape(1);
    let d_out = w.shape(1);

    if normed {
        normalise_rows(x, gamma, beta, shared, first, epsilon, rows, has_beta);
    }
    // This unit's column, and its share of the inner dimension: `start, start + step, …`;
    // its place among the units sharing the column (`peer` of `peers`, `stride` apart).
    let mut column = CUBE_POS_X as usize * group + u % group;
    let mut start = u / group;
    let mut step = units / group;
    let mut peer = u / group;
    let mut peers = units / group;
    let stride = comptime!(if along_k { 1usize } else { GROUP as usize });
    if along_k {
        column = CUBE_POS_X as usize * (units / group) + u / group;
        start = u % group;
        step = group;
        peer = u % group;
        peers = group;
    }
    let mut acc = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        acc[r] = 0.0f32;
    }
    if column < d_out {
        let at = column * w.stride(1);
        let w0 = w.stride(0);
        let mut k = start;
        // Four of the weight's numbers loaded together, then added in their order.
        while k + 3 * step < d_in {
            let mut four = Array::<f32>::new(4usize);
            #[unroll]
            for q in 0..4usize {
                four[q] = f32::cast_from(w[(k + q * step) * w0 + at]);
            }
            #[unroll]
            for q in 0..4usize {
                accumulate(
                    x,
                    shared,
                    &mut acc,
                    four[q],
                    k + q * step,
                    first,
                    rows,
                    normed,
                );
            }
            k += 4 * step;
        }
        while k < d_in {
            let weight = f32::cast_from(w[k * w0 + at]);
            accumulate(x, shared, &mut acc, weight, k, first, rows, normed);
            k += step;
        }
    }
    if normed {
        // The normalised rows are read by every unit before their memory takes the sums.
        sync_cube();
    }

    // Each column's shares added up by a tree over its peers (a power of two), left with the
    // first of them.
    #[unroll]
    for r in 0..rows {
        shared[r * units + u] = acc[r];
    }
    sync_cube();
    let mut half = peers / 2;
    while half > 0 {
        if peer < half {
            #[unroll]
            for r in 0..rows {
                let other = shared[r * units + u + half * stride];
                shared[r * units + u] += other;
            }
        }
        sync_cube();
        half /= 2;
    }
    Place { column, peer }
}

/// The LayerNorm of the cube's rows of `x` into `shared[r·d_in + k]`, rounded to `F`: the
/// mean, then the variance about it, each added up by every unit of the cube (every unit must
/// call it).
#[cube]
#[allow(clippy::too_many_arguments)]
fn normalise_rows<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    shared: &mut SharedMemory<f32>,
    first: usize,
    epsilon: f32,
    #[comptime] rows: usize,
    #[comptime] has_beta: bool,
) {
    let u = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let n = x.shape(0);
    let d_in = x.shape(1);
    let size = f32::cast_from(d_in as u32);
    let mut mean = Array::<f32>::new(rows);
    let mut rstd = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        mean[r] = 0.0f32;
    }
    row_sums(x, shared, &mean, first, rows, false);
    #[unroll]
    for r in 0..rows {
        mean[r] = shared[r * units] / size;
    }
    sync_cube();
    row_sums(x, shared, &mean, first, rows, true);
    #[unroll]
    for r in 0..rows {
        rstd[r] = 1.0f32 / f32::sqrt(shared[r * units] / size + epsilon);
    }
    sync_cube();
    let mut k = u;
    while k < d_in {
        let g = f32::cast_from(gamma[k]);
        let mut b = 0.0f32;
        if has_beta {
            b = f32::cast_from(beta[k]);
        }
        #[unroll]
        for r in 0..rows {
            let v = f32::cast_from(x[row_base(first + r, n, d_in) + k]);
            let normalised = (v - mean[r]) * rstd[r] * g + b;
            shared[r * d_in + k] = f32::cast_from(F::cast_from(normalised));
        }
        k += units;
    }
    sync_cube();
}

/// Each of the cube's `rows` rows of `x` added up by all its units into `shared[r·units]`:
/// the numbers themselves, or with `squared` their squared distances from `mean[r]` (every
/// unit must call it).
#[cube]
fn row_sums<F: Float>(
    x: &Tensor<F>,
    shared: &mut SharedMemory<f32>,
    mean: &Array<f32>,
    first: usize,
    #[comptime] rows: usize,
    #[comptime] squared: bool,
) {
    let u = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let n = x.shape(0);
    let d_in = x.shape(1);
    #[unroll]
    for r in 0..rows {
        let mut s = 0.0f32;
        let mut k = u;
        while k < d_in {
            let v = f32::cast_from(x[row_base(first + r, n, d_in) + k]);
            if squared {
                let c = v - mean[r];
                s += c * c;
            } else {
                s += v;
            }
            k += units;
        }
        shared[r * units + u] = s;
    }
    sync_cube();
    cube_sums(shared, rows);
}

/// Adds `weight` times element `k` of each of the cube's `rows` rows of `x` (normalised in
/// `shared` with `normed`) to `acc`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn accumulate<F: Float>(
    x: &Tensor<F>,
    shared: &SharedMemory<f32>,
    acc: &mut Array<f32>,
    weight: f32,
    k: usize,
    first: usize,
    #[comptime] rows: usize,
    #[comptime] normed: bool,
) {
    let d_in = x.shape(1);
    if normed {
        #[unroll]
        for r in 0..rows {
            acc[r] += shared[r * d_in + k] * weight;
        }
    } else {
        #[unroll]
        for r in 0..rows {
            acc[r] += f32::cast_from(x[row_base(first + r, x.shape(0), d_in) + k]) * weight;
        }
    }
}

/// Column `column` of the cube's `rows` rows of `y` from the sums in shared memory, then the
/// bias, GELU and the residual addition as [`decode_linear_kernel`] says.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_outputs<F: Float>(
    shared: &SharedMemory<f32>,
    bias: &Tensor<F>,
    residual: &Tensor<F>,
    y: &mut Tensor<F>,
    column: usize,
    first: usize,
    #[comptime] rows: usize,
    #[comptime] has_bias: bool,
    #[comptime] gelu: bool,
    #[comptime] add: bool,
) {
    let n = y.shape(0);
    let d_out = y.shape(1);
    #[unroll]
    for r in 0..rows {
        let row = first + r;
        if row < n {
            let mut sum = column_total(shared, bias, column, r, has_bias);
            if gelu {
                sum = gelu_value(f32::cast_from(F::cast_from(sum)));
            }
            if add {
                sum = f32::cast_from(F::cast_from(sum))
                    + f32::cast_from(residual[row * d_out + column]);
            }
            y[row * d_out + column] = F::cast_from(sum);
        }
    }
}
