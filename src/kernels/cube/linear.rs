//! The linear layer in half precision ([`Precision`](crate::kernels::Precision)): the inputs
//! of each product cast to `f16`/`bf16`, burn's matmul kernels reading them and accumulating
//! and writing `f32` (the tensor cores' mixed mode), so nothing but the product's operands is
//! ever rounded to half precision. With [`pinned_matmul`](crate::kernels::pinned_matmul) set the products run here in `f32`
//! too, by the kernel it names.

use crate::kernels::composed::{prim, tensor};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use burn_cubecl::kernel::matmul::{init_matmul_output, matmul, MatmulStrategy};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

/// The largest magnitude of an `f16` output gradient after scaling: a power of two below
/// `f16`'s largest finite value (65,504), so the scaled gradient never overflows and values
/// down to 2^-39 of the largest (subnormals included) survive the cast.
const F16_GRADIENT_TOP: f32 = 32_768.0;

/// `a·b` for `a` `[n, i]` and `b` `[i, o]` in `half`, accumulated and returned in `out`: by
/// the kernel [`pinned_matmul`](crate::kernels::pinned_matmul) names where it takes the product, else by the one burn's
/// autotune chooses.
fn product<R: CubeRuntime>(a: CubeTensor<R>, b: CubeTensor<R>, out: DType) -> CubeTensor<R> {
    let y = init_matmul_output(&a, &b, out);
    if super::products::launch_pinned(&a, &b, y.clone()) {
        return y;
    }
    matmul(a, b, Some(y), MatmulStrategy::default(), out)
        .unwrap_or_else(|err| panic!("no matmul kernel for half-precision inputs: {err:?}"))
}

/// `x·w + b` with the product in `half`, returned in `out` (`x` and `w` may be `half` already),
/// and the half copies of `x` and `w` it read (kept for the backward pass).
pub(super) fn forward<B, R>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    b: Option<CubeTensor<R>>,
    half: FloatDType,
    out: DType,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    let x = prim(tensor::<B, 2>(x).cast(half));
    let w = prim(tensor::<B, 2>(w).cast(half));
    let y = tensor::<B, 2>(product(x.clone(), w.clone(), out));
    let y = match b {
        Some(b) => prim(y + tensor::<B, 1>(b).unsqueeze()),
        None => prim(y),
    };
    (y, x, w)
}

/// The gradients `(dx = dy·wᵀ, dw = xᵀ·dy, db = Σ_rows dy)` with both products in `half`, in
/// `dy`'s type; under `f16`, `dy` scaled before its cast so its largest magnitude is
/// [`F16_GRADIENT_TOP`], the products unscaled after (the scale stays on the device: no
/// synchronisation). `x` and `w` kept in `half` by [`forward`] are read as they are (the
/// products take their transposes as views), others are cast.
pub(super) fn backward<B, R>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    dy: CubeTensor<R>,
    bias: bool,
    half: FloatDType,
) -> (CubeTensor<R>, CubeTensor<R>, Option<CubeTensor<R>>)
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    let out = dy.dtype;
    let dy = tensor::<B, 2>(dy);
    let db = bias.then(|| prim(dy.clone().sum_dim(0).squeeze_dim::<1>(0)));
    let (dy_half, unscale) = match half {
        FloatDType::F16 => {
            // Clamped so an all-zero gradient gets a finite scale (and stays zero).
            let top = dy.clone().abs().max().clamp_min(1e-30).reshape([1, 1]);
            let scale = top.clone().recip().mul_scalar(F16_GRADIENT_TOP);
            let unscale = top.div_scalar(F16_GRADIENT_TOP);
            ((dy * scale).cast(half), Some(unscale))
        }
        _ => (dy.cast(half), None),
    };
    let x_t = tensor::<B, 2>(x).transpose().cast(half);
    let w_t = tensor::<B, 2>(w).transpose().cast(half);
    let dx = tensor::<B, 2>(product(prim(dy_half.clone()), prim(w_t), out));
    let dw = tensor::<B, 2>(product(prim(x_t), prim(dy_half), out));
    match unscale {
        Some(unscale) => (prim(dx * unscale.clone()), prim(dw * unscale), db),
        None => (prim(dx), prim(dw), db),
    }
}
