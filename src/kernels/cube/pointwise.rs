//! Element-wise kernels: GELU and its derivative, dropout (Philox drawn in the kernel), AdamW.
//! One unit per element; arithmetic in `f32` whatever the storage type.

use cubecl::prelude::*;

/// `1/√2`.
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// `Φ(x)`, the standard normal CDF (erf form).
#[cube]
fn normal_cdf(x: f32) -> f32 {
    0.5f32 * (1.0f32 + Erf::erf(x * FRAC_1_SQRT_2))
}

/// `φ(x)`, the standard normal density.
#[cube]
fn normal_pdf(x: f32) -> f32 {
    f32::exp(-0.5f32 * x * x) * FRAC_1_SQRT_2PI
}

/// `x·Φ(x)`, GELU of one number.
#[cube]
pub(super) fn gelu_value(x: f32) -> f32 {
    x * normal_cdf(x)
}

/// `y = x·Φ(x)`.
#[cube(launch)]
pub fn gelu_kernel<F: Float>(x: &Tensor<F>, y: &mut Tensor<F>, #[define(F)] _dtype: StorageType) {
    let i = ABSOLUTE_POS;
    if i >= x.len() {
        terminate!();
    }
    let v = f32::cast_from(x[i]);
    y[i] = F::cast_from(v * normal_cdf(v));
}

/// `y = x·Φ(x)` and `d = Φ(x) + x·φ(x)`; with `dropped`, both times the multiplier of the
/// dropout mask keyed `(key_lo, key_hi)` (`y` rounded as GELU and then dropout round it). A
/// unit takes the four elements of one Philox block (see [`dropout_kernel`]).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn gelu_forward_kernel<F: Float>(
    x: &Tensor<F>,
    y: &mut Tensor<F>,
    d: &mut Tensor<F>,
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    scale: f32,
    #[comptime] dropped: bool,
    #[define(F)] _dtype: StorageType,
) {
    let block = ABSOLUTE_POS;
    if block * 4 >= x.len() {
        terminate!();
    }
    if dropped {
        let words = philox_block(block as u32, key_lo, key_hi);
        #[unroll]
        for w in 0..4u32 {
            let m = block_multiplier(words, w, threshold, scale);
            gelu_one(x, y, d, block * 4 + w as usize, m);
        }
    } else {
        #[unroll]
        for w in 0..4u32 {
            gelu_one(x, y, d, block * 4 + w as usize, 1.0f32);
        }
    }
}

/// [`gelu_forward_kernel`] at element `i` (nothing past the end), times the dropout multiplier
/// `m` (1 without dropout: `x · 1` is exact, so the same bits as no multiplication).
#[cube]
fn gelu_one<F: Float>(x: &Tensor<F>, y: &mut Tensor<F>, d: &mut Tensor<F>, i: usize, m: f32) {
    if i < x.len() {
        let v = f32::cast_from(x[i]);
        let cdf = normal_cdf(v);
        // GELU rounded to F first, as the layer's output without dropout is.
        let gelu = f32::cast_from(F::cast_from(v * cdf));
        let derivative = cdf + v * normal_pdf(v);
        y[i] = F::cast_from(gelu * m);
        d[i] = F::cast_from(derivative * m);
    }
}

/// `dx = grad · (Φ(x) + x·φ(x))`.
#[cube(launch)]
pub fn gelu_backward_kernel<F: Float>(
    x: &Tensor<F>,
    grad: &Tensor<F>,
    dx: &mut Tensor<F>,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= x.len() {
        terminate!();
    }
    let v = f32::cast_from(x[i]);
    let g = f32::cast_from(grad[i]);
    dx[i] = F::cast_from(g * (normal_cdf(v) + v * normal_pdf(v)));
}

/// Philox4x32-10's multipliers and key increments (as in `kernels::dropout`).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// The four words of the Philox4x32-10 block `n` (counter `[n, 0, 0, 0]`) keyed `(key_lo,
/// key_hi)`: the mask's elements `4n .. 4n + 4`, as in the CPU stream.
#[derive(CubeType, Clone, Copy)]
pub struct PhiloxBlock {
    /// Word 0: element `4n + 0`.
    pub w0: u32,
    /// Word 1: element `4n + 1`.
    pub w1: u32,
    /// Word 2: element `4n + 2`.
    pub w2: u32,
    /// Word 3: element `4n + 3`.
    pub w3: u32,
}

/// Block `n` of the Philox stream keyed `(key_lo, key_hi)` (about a hundred instructions).
#[cube]
pub fn philox_block(n: u32, key_lo: u32, key_hi: u32) -> PhiloxBlock {
    let mut c0 = n;
    let mut c1 = 0u32;
    let mut c2 = 0u32;
    let mut c3 = 0u32;
    let mut k0 = key_lo;
    let mut k1 = key_hi;
    #[unroll]
    for _ in 0..10u32 {
        let hi0 = u32::mul_hi(M0, c0);
        let lo0 = M0 * c0;
        let hi1 = u32::mul_hi(M1, c2);
        let lo1 = M1 * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += W0;
        k1 += W1;
    }
    PhiloxBlock {
        w0: c0,
        w1: c1,
        w2: c2,
        w3: c3,
    }
}

/// Word `w` (0 to 3) of `block`.
#[cube]
pub fn philox_word(block: PhiloxBlock, w: u32) -> u32 {
    let mut word = block.w0;
    if w == 1 {
        word = block.w1;
    } else if w == 2 {
        word = block.w2;
    } else if w == 3 {
        word = block.w3;
    }
    word
}

/// The dropout multiplier (`0` or `scale`) of element `e` of the mask keyed `(key_lo,
/// key_hi)`: word `e % 4` of the Philox4x32-10 block `e / 4`, kept where the word is at least
/// `threshold` — the CPU stream's element `e`, bit for bit.
#[cube]
pub fn dropout_multiplier(e: u32, key_lo: u32, key_hi: u32, threshold: u32, scale: f32) -> f32 {
    block_multiplier(
        philox_block(e / 4u32, key_lo, key_hi),
        e % 4u32,
        threshold,
        scale,
    )
}

/// The dropout multiplier (`0` or `scale`) that word `w` of the Philox block `words` gives:
/// kept where the word is at least `threshold`.
#[cube]
pub fn block_multiplier(words: PhiloxBlock, w: u32, threshold: u32, scale: f32) -> f32 {
    select(philox_word(words, w) >= threshold, scale, 0.0f32)
}

/// `y = x ⊙ M` for the dropout mask `M` keyed `(key_lo, key_hi)`; with `residual`,
/// `y = r + x ⊙ M` (a residual connection around a dropped-out sublayer; `r` is otherwise not
/// read), `x ⊙ M` rounded to the storage type first as a dropout and then an addition round it.
/// A unit takes the four elements `4n .. 4n + 4` whose words one Philox block `n` gives: one
/// unit an element drew the same block four times, about a hundred instructions each, more
/// than an element's bytes cost on a GPU.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn dropout_kernel<F: Float>(
    x: &Tensor<F>,
    r: &Tensor<F>,
    y: &mut Tensor<F>,
    key_lo: u32,
    key_hi: u32,
    threshold: u32,
    scale: f32,
    #[comptime] residual: bool,
    #[define(F)] _dtype: StorageType,
) {
    let block = ABSOLUTE_POS;
    if block * 4 >= x.len() {
        terminate!();
    }
    let words = philox_block(block as u32, key_lo, key_hi);
    #[unroll]
    for w in 0..4u32 {
        let i = block * 4 + w as usize;
        if i < x.len() {
            let m = block_multiplier(words, w, threshold, scale);
            let dropped = F::cast_from(f32::cast_from(x[i]) * m);
            if residual {
                y[i] = F::cast_from(f32::cast_from(r[i]) + f32::cast_from(dropped));
            } else {
                y[i] = dropped;
            }
        }
    }
}

/// One AdamW step (see `kernels::AdamWStep`) of each parameter of `params`: parameter `y`
/// takes the `cubes[y]` cubes from `starts[y]` on, element by element in a loop striding over
/// them (each cube finds its parameter by comparing its position with every start, unrolled:
/// one branch taken per cube, no cube idle). Bit `y` of `first` says parameter `y` has no
/// moments yet (its `ms[y]`, `vs[y]` are then not read), of `strided` that its gradient is a
/// strided view of the parameter's shape (read at its strides, not copied first); with
/// `has_clip` every gradient is multiplied by `clip[0]`, global-norm clipping's factor, as it
/// is read. `c1s[y]`, `c2s[y]` are the bias corrections `1 − βᵗ`, `decays[y]` the decay.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn adamw_kernel<F: Float>(
    params: &Sequence<Tensor<F>>,
    grads: &Sequence<Tensor<F>>,
    ms: &Sequence<Tensor<F>>,
    vs: &Sequence<Tensor<F>>,
    clip: &Tensor<F>,
    params_out: &mut Sequence<Tensor<F>>,
    ms_out: &mut Sequence<Tensor<F>>,
    vs_out: &mut Sequence<Tensor<F>>,
    starts: Sequence<u32>,
    cubes: Sequence<u32>,
    decays: Sequence<f32>,
    c1s: Sequence<f32>,
    c2s: Sequence<f32>,
    lr: f32,
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    #[comptime] first: u64,
    #[comptime] strided: u64,
    #[comptime] has_clip: bool,
    #[define(F)] _dtype: StorageType,
) {
    let count = params.len().comptime();
    #[unroll]
    for y in 0..count {
        let start = *starts.index(y);
        let own = *cubes.index(y);
        if CUBE_POS_X >= start && CUBE_POS_X < start + own {
            let step = (own * CUBE_DIM_X) as usize;
            let param = params.index(y);
            let grad = grads.index(y);
            let m = ms.index(y);
            let v = vs.index(y);
            let param_out = params_out.index_mut(y);
            let m_out = ms_out.index_mut(y);
            let v_out = vs_out.index_mut(y);
            let decay = *decays.index(y);
            let c1 = *c1s.index(y);
            let c2 = *c2s.index(y);
            let n = param.len();
            let mut i = ((CUBE_POS_X - start) * CUBE_DIM_X + UNIT_POS_X) as usize;
            while i < n {
                let mut at = i;
                if comptime!((strided >> y) & 1 == 1) {
                    at = crate::kernels::cube::rows::strided_offset(grad, i);
                }
                let mut g = f32::cast_from(grad[at]);
                if has_clip {
                    g = f32::cast_from(F::cast_from(g * f32::cast_from(clip[0])));
                }
                let mut m_new = (1.0f32 - beta_1) * g;
                let mut v_new = (1.0f32 - beta_2) * g * g;
                if comptime!((first >> y) & 1 == 0) {
                    m_new += beta_1 * f32::cast_from(m[i]);
                    v_new += beta_2 * f32::cast_from(v[i]);
                }
                let delta = (m_new / c1) / (f32::sqrt(v_new / c2) + epsilon);
                let p = f32::cast_from(param[i]) * (1.0f32 - lr * decay) - lr * delta;
                param_out[i] = F::cast_from(p);
                m_out[i] = F::cast_from(m_new);
                v_out[i] = F::cast_from(v_new);
                i += step;
            }
        }
    }
}

/// Every element of `out` set to `value` (see [`super::poison_outputs`]).
#[cube(launch)]
pub fn fill_kernel<F: Float>(out: &mut Tensor<F>, value: f32, #[define(F)] _dtype: StorageType) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    out[i] = F::cast_from(value);
}

/// A key–value cache's append, keys and values in one launch: `k` and `v` `[b, h, n, kd]` (any
/// strides) written into columns `at..at + n` of `keys` and `values` `[b, h, s, kd]` (at their
/// strides), one unit per element of the two; the grid is 2-D when it needs more than 65,535
/// cubes.
#[cube(launch)]
pub fn write_columns_kernel<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    keys: &mut Tensor<F>,
    values: &mut Tensor<F>,
    at: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X) as usize;
    let (heads, cols, kd) = (k.shape(1), k.shape(2), k.shape(3));
    let n = k.shape(0) * heads * cols * kd;
    if i >= 2 * n {
        terminate!();
    }
    let mut e = i;
    if i >= n {
        e = i - n;
    }
    let x = e % kd;
    let c = (e / kd) % cols;
    let h = (e / (kd * cols)) % heads;
    let b = e / (kd * cols * heads);
    let column = at as usize + c;
    if i < n {
        let from = b * k.stride(0) + h * k.stride(1) + c * k.stride(2) + x * k.stride(3);
        let to =
            b * keys.stride(0) + h * keys.stride(1) + column * keys.stride(2) + x * keys.stride(3);
        keys[to] = k[from];
    } else {
        let from = b * v.stride(0) + h * v.stride(1) + c * v.stride(2) + x * v.stride(3);
        let to = b * values.stride(0)
            + h * values.stride(1)
            + column * values.stride(2)
            + x * values.stride(3);
        values[to] = v[from];
    }
}
