//! The fused operations on flex: the [`super::cpu`] kernels on flex's `f32` storage, read in
//! place (strided views included) and written without copies. Other dtypes take the composed
//! path.

use super::cpu::{self, AttentionShape, Heads, Matrix};
use super::{composed, profile, AdamWItem, DropoutMask, LabBackend};
use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::Flex;
use burn::prelude::*;
use burn::tensor::{DType, TensorData, TensorMetadata};

/// The tensor with its elements contiguous from some offset (a copy only when they are not).
fn contiguous(x: FlexTensor) -> FlexTensor {
    if x.as_slice::<f32>().is_some() {
        x
    } else {
        dense(&x)
    }
}

/// A contiguous copy of `x`. A view whose rows are runs of elements (the last stride 1, e.g.
/// a parameter's gradient sliced from the columns of a packed product's) is copied a row at a
/// time; flex's general copy moves one element at a time.
fn dense(x: &FlexTensor) -> FlexTensor {
    let layout = x.layout();
    let (shape, strides) = (x.shape(), layout.strides());
    let rank = strides.len();
    let n = shape.num_elements();
    if x.dtype() != DType::F32 || rank == 0 || n == 0 || strides[rank - 1] != 1 {
        return x.to_contiguous();
    }
    let Ok(strides) = strides
        .iter()
        .map(|&s| usize::try_from(s))
        .collect::<Result<Vec<_>, _>>()
    else {
        return x.to_contiguous();
    };
    let (src, width) = (x.storage::<f32>(), shape[rank - 1]);
    let mut out = Vec::with_capacity(n);
    let mut index = vec![0; rank - 1];
    for _ in 0..n / width {
        let start = layout.start_offset()
            + index
                .iter()
                .zip(&strides)
                .map(|(i, s)| i * s)
                .sum::<usize>();
        out.extend_from_slice(&src[start..start + width]);
        for dim in (0..rank - 1).rev() {
            index[dim] += 1;
            if index[dim] < shape[dim] {
                break;
            }
            index[dim] = 0;
        }
    }
    from_vec(out, shape)
}

/// The elements of a contiguous `f32` tensor.
fn slice(x: &FlexTensor) -> &[f32] {
    x.as_slice::<f32>().expect("made contiguous")
}

fn from_vec(data: Vec<f32>, shape: Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(data, shape))
}

/// An `[b, h, n, k]` tensor as rows with a contiguous head dimension.
fn heads(x: &FlexTensor) -> Heads<'_> {
    let layout = x.layout();
    let strides = layout.strides();
    Heads {
        data: x.storage::<f32>(),
        offset: layout.start_offset(),
        strides: [
            strides[0] as usize,
            strides[1] as usize,
            strides[2] as usize,
        ],
    }
}

/// `x` with non-negative strides and a contiguous last dimension.
fn rows(x: FlexTensor) -> FlexTensor {
    let layout = x.layout();
    if layout.strides()[3] == 1 && layout.has_positive_strides() {
        x
    } else {
        x.to_contiguous()
    }
}

/// An `[b, h, n, k]` tensor over a buffer laid out `[b, n, h, k]` (how heads are split from
/// and merged into `[b, n, d]`, so the surrounding `swap_dims` costs nothing).
fn interleaved(data: Vec<f32>, shape: AttentionShape, n: usize) -> FlexTensor {
    let AttentionShape { b, h, k, .. } = shape;
    let bytes = TensorData::new(data, [b, n, h, k]).bytes;
    let [sb, sh, sn] = shape.interleaved(n).map(|s| s as isize);
    let layout = Layout::new(Shape::new([b, h, n, k]), vec![sb, sh, sn, 1], 0);
    FlexTensor::new(bytes, layout, DType::F32)
}

/// A 2-D tensor as a strided matrix (copied first only if a stride is negative).
fn matrix(x: &FlexTensor) -> Matrix<'_> {
    let layout = x.layout();
    let strides = layout.strides();
    let shape = x.shape();
    Matrix {
        data: x.storage::<f32>(),
        offset: layout.start_offset(),
        shape: [shape[0], shape[1]],
        strides: [strides[0] as usize, strides[1] as usize],
    }
}

/// `x` with non-negative strides (a 2-D view [`matrix`] can read).
fn positive(x: FlexTensor) -> FlexTensor {
    if x.layout().has_positive_strides() {
        x
    } else {
        x.to_contiguous()
    }
}

/// The class indices held by an integer tensor `[n]`, each checked to be below `classes` (or
/// `ignore`, which may lie outside).
fn class_indices(x: FlexTensor, classes: usize, ignore: Option<usize>) -> Vec<usize> {
    let data = x.into_data().convert::<i64>();
    let values = data.as_slice::<i64>().expect("converted to i64");
    values
        .iter()
        .map(|&y| {
            let y = usize::try_from(y).unwrap_or(usize::MAX);
            assert!(
                y < classes || Some(y) == ignore,
                "cross-entropy target {y} outside 0..{classes}"
            );
            y
        })
        .collect()
}

/// The floating-point operations of `products` products the size of `x·w` (`x` `[n, i]`, `w`
/// `[i, o]`): `2·n·i·o` each, for the profile's rate.
fn product_flops(x: &FlexTensor, w: &FlexTensor, products: usize) -> f64 {
    let (x, w) = (x.shape(), w.shape());
    (2 * products * x[0] * x[1] * w[1]) as f64
}

fn is_f32(x: &FlexTensor) -> bool {
    x.dtype() == DType::F32
}

/// `x`'s elements in row-major order as rows of its last dimension at one stride, read where
/// they lie (`None` where the layout is not such rows: a transposed view, a negative stride).
fn strided(x: &FlexTensor) -> Option<cpu::Strided<'_>> {
    if let Some(data) = x.as_slice::<f32>() {
        return Some(data.into());
    }
    let layout = x.layout();
    let (shape, strides) = (x.shape(), layout.strides());
    let rank = strides.len();
    if x.dtype() != DType::F32 || rank == 0 || strides[rank - 1] != 1 {
        return None;
    }
    let width = shape[rank - 1];
    let len = shape.num_elements();
    if len == 0 {
        return None;
    }
    // The leading dimensions must step through rows evenly: each stride the next one's times
    // its size (dimensions of size 1 are skipped: their stride is never used).
    let mut stride = None;
    let mut expect = None;
    for d in (0..rank - 1).rev() {
        if shape[d] == 1 {
            continue;
        }
        let s = usize::try_from(strides[d]).ok()?;
        match expect {
            None => stride = Some(s),
            Some(e) if e != s => return None,
            Some(_) => {}
        }
        expect = Some(s * shape[d]);
    }
    let stride = stride.unwrap_or(width);
    if stride < width {
        return None;
    }
    let data = x.storage::<f32>();
    let offset = layout.start_offset();
    let last = offset + (len / width - 1) * stride + width;
    (last <= data.len()).then_some(cpu::Strided {
        data,
        offset,
        width,
        stride,
        len,
    })
}

/// `x` as it is where [`strided`] reads it in place, else a contiguous copy.
fn readable(x: FlexTensor) -> FlexTensor {
    if strided(&x).is_some() {
        x
    } else {
        dense(&x)
    }
}

/// [`LabBackend::fused_linear_backward`] of `f32` operands on the processor; with `derivative`
/// (contiguous, `x`'s shape), `dx` multiplied by it ([`LabBackend::fused_gelu_linear_backward`]).
fn linear_backward(
    x: FlexTensor,
    w: FlexTensor,
    dy: FlexTensor,
    bias: bool,
    derivative: Option<FlexTensor>,
) -> (FlexTensor, FlexTensor, Option<FlexTensor>) {
    let (x, w) = (positive(x), positive(w));
    let dy = if dy.layout().strides()[1] == 1 {
        positive(dy)
    } else {
        dy.to_contiguous()
    };
    let ([n, i], o) = ([x.shape()[0], x.shape()[1]], w.shape()[1]);
    let (dx, dw, db) = cpu::linear_backward(
        matrix(&x),
        matrix(&w),
        matrix(&dy),
        bias,
        derivative.as_ref().map(slice),
    );
    (
        from_vec(dx, Shape::new([n, i])),
        from_vec(dw, Shape::new([i, o])),
        db.map(|db| from_vec(db, Shape::new([o]))),
    )
}

/// `x` contiguous from the start of its buffer, to be updated in place (in place where the
/// buffer is not shared; flex copies it on write otherwise).
fn owned(x: FlexTensor) -> FlexTensor {
    let layout = x.layout();
    if layout.is_contiguous() && layout.start_offset() == 0 {
        x
    } else {
        dense(&x)
    }
}

impl LabBackend for Flex {
    const TIMED_KERNELS: bool = true;

    fn write_columns(buffer: FlexTensor, at: usize, value: FlexTensor) -> FlexTensor {
        let [b, h, s, k] = buffer.shape().dims();
        let n = value.shape()[2];
        let whole = buffer.layout().contiguous_offsets() == Some((0, b * h * s * k));
        let (mut buffer, value) = (buffer, contiguous(value));
        if whole && buffer.dtype() == DType::F32 && value.dtype() == DType::F32 {
            // In place where the buffer is held once.
            if let Some(dst) = buffer.try_storage_mut::<f32>() {
                for (head, columns) in slice(&value).chunks_exact(n * k).enumerate() {
                    let from = (head * s + at) * k;
                    dst[from..from + n * k].copy_from_slice(columns);
                }
                return buffer;
            }
        }
        composed::write_columns::<Flex>(buffer, at, value)
    }

    fn fused_cross_entropy_forward(
        logits: FlexTensor,
        targets: FlexTensor,
        smoothing: f32,
        ignore: Option<usize>,
    ) -> (FlexTensor, FlexTensor) {
        let _timer = profile::Timer::new("cross-entropy");
        if !is_f32(&logits) {
            return composed::cross_entropy_forward::<Flex>(logits, targets, smoothing, ignore);
        }
        let logits = contiguous(logits);
        let [n, v] = logits.shape().dims();
        let targets = class_indices(targets, v, ignore);
        let (loss, lse) = cpu::cross_entropy(slice(&logits), v, &targets, smoothing, ignore);
        (
            from_vec(loss, Shape::new([n])),
            from_vec(lse, Shape::new([n])),
        )
    }

    fn fused_cross_entropy_backward(
        logits: FlexTensor,
        targets: FlexTensor,
        lse: FlexTensor,
        grad: FlexTensor,
        smoothing: f32,
        ignore: Option<usize>,
    ) -> FlexTensor {
        let _timer = profile::Timer::new("cross-entropy");
        if !is_f32(&logits) {
            return composed::cross_entropy_backward::<Flex>(
                logits, targets, lse, grad, smoothing, ignore,
            );
        }
        let (logits, lse, grad) = (contiguous(logits), contiguous(lse), contiguous(grad));
        let shape = logits.shape();
        let v = shape[1];
        let targets = class_indices(targets, v, ignore);
        let dx = cpu::cross_entropy_backward(
            slice(&logits),
            v,
            &targets,
            slice(&lse),
            slice(&grad),
            smoothing,
            ignore,
        );
        from_vec(dx, shape)
    }

    fn fused_gelu(x: FlexTensor) -> FlexTensor {
        let _timer = profile::Timer::new("GELU");
        if !is_f32(&x) {
            return composed::gelu::<Flex>(x);
        }
        let x = contiguous(x);
        from_vec(cpu::gelu(slice(&x)), x.shape())
    }

    fn fused_mul(a: FlexTensor, b: FlexTensor) -> FlexTensor {
        let _timer = profile::Timer::new("GELU (its derivative)");
        if !is_f32(&a) || !is_f32(&b) || a.shape() != b.shape() {
            return <Flex as burn::tensor::ops::FloatTensorOps<Flex>>::float_mul(a, b);
        }
        // The product commutes bit for bit: write into whichever buffer is not shared.
        let (into, other) = match !a.is_unique() && b.is_unique() {
            true => (b, a),
            false => (a, b),
        };
        let (mut into, other) = (owned(into), contiguous(other));
        let n = into.shape().num_elements();
        cpu::mul(&mut into.storage_mut::<f32>()[..n], slice(&other));
        into
    }

    fn fused_gelu_forward(x: FlexTensor, mask: Option<DropoutMask>) -> (FlexTensor, FlexTensor) {
        let _timer = profile::Timer::new("GELU");
        if !is_f32(&x) {
            return composed::gelu_forward::<Flex>(x, mask);
        }
        let x = contiguous(x);
        let (y, derivative) = cpu::gelu_with_derivative(slice(&x), mask);
        (from_vec(y, x.shape()), from_vec(derivative, x.shape()))
    }

    fn fused_layer_norm_forward(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: Option<FlexTensor>,
        epsilon: f64,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        let _timer = profile::Timer::new("LayerNorm");
        if !is_f32(&x) {
            return composed::layer_norm_forward::<Flex>(x, gamma, beta, epsilon);
        }
        let (x, gamma, beta) = (contiguous(x), contiguous(gamma), beta.map(contiguous));
        let shape = x.shape();
        let (n, d) = (shape[0], shape[1]);
        let (y, mean, rstd) = cpu::layer_norm(
            slice(&x),
            d,
            slice(&gamma),
            beta.as_ref().map(slice),
            epsilon as f32,
        );
        (
            from_vec(y, shape),
            from_vec(mean, Shape::new([n])),
            from_vec(rstd, Shape::new([n])),
        )
    }

    fn fused_add_layer_norm_forward(
        x: FlexTensor,
        h: FlexTensor,
        mask: Option<DropoutMask>,
        gamma: FlexTensor,
        beta: Option<FlexTensor>,
        epsilon: f64,
    ) -> (FlexTensor, FlexTensor, FlexTensor, FlexTensor) {
        let _timer = profile::Timer::new("residual + LayerNorm");
        if !is_f32(&x) {
            return composed::add_layer_norm_forward::<Flex>(x, h, mask, gamma, beta, epsilon);
        }
        let [x, h, gamma] = [x, h, gamma].map(contiguous);
        let beta = beta.map(contiguous);
        let shape = x.shape();
        let (n, d) = (shape[0], shape[1]);
        let (s, y, mean, rstd) = cpu::add_layer_norm(
            slice(&x),
            slice(&h),
            mask,
            d,
            slice(&gamma),
            beta.as_ref().map(slice),
            epsilon as f32,
        );
        (
            from_vec(s, shape.clone()),
            from_vec(y, shape),
            from_vec(mean, Shape::new([n])),
            from_vec(rstd, Shape::new([n])),
        )
    }

    fn fused_layer_norm_backward(
        x: FlexTensor,
        gamma: FlexTensor,
        mean: FlexTensor,
        rstd: FlexTensor,
        dy: FlexTensor,
        residual: Option<FlexTensor>,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        let _timer = profile::Timer::new("LayerNorm");
        if !is_f32(&x) {
            return composed::layer_norm_backward::<Flex>(x, gamma, mean, rstd, dy, residual);
        }
        let [x, gamma, mean, rstd, dy] = [x, gamma, mean, rstd, dy].map(contiguous);
        let residual = residual.map(contiguous);
        let shape = x.shape();
        let d = shape[1];
        let (dx, dgamma, dbeta) = cpu::layer_norm_backward(
            slice(&x),
            d,
            slice(&gamma),
            slice(&mean),
            slice(&rstd),
            slice(&dy),
            residual.as_ref().map(slice),
        );
        (
            from_vec(dx, shape),
            from_vec(dgamma, Shape::new([d])),
            from_vec(dbeta, Shape::new([d])),
        )
    }

    fn fused_softmax(x: FlexTensor) -> FlexTensor {
        let _timer = profile::Timer::new("softmax");
        if !is_f32(&x) {
            return composed::softmax::<Flex>(x);
        }
        let x = contiguous(x);
        let shape = x.shape();
        from_vec(cpu::softmax(slice(&x), shape[1]), shape)
    }

    fn fused_softmax_backward(p: FlexTensor, dp: FlexTensor) -> FlexTensor {
        let _timer = profile::Timer::new("softmax");
        if !is_f32(&p) {
            return composed::softmax_backward::<Flex>(p, dp);
        }
        let (p, dp) = (contiguous(p), contiguous(dp));
        let shape = p.shape();
        from_vec(
            cpu::softmax_backward(slice(&p), slice(&dp), shape[1]),
            shape,
        )
    }

    fn fused_attention_forward(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        causal: bool,
        pad: Option<FlexTensor>,
        dropout: Option<DropoutMask>,
    ) -> (FlexTensor, FlexTensor) {
        let _timer = profile::Timer::new("attention");
        if !is_f32(&q) {
            return composed::attention_forward::<Flex>(q, k, v, causal, pad, dropout);
        }
        let shape = attention_shape(&q, &k);
        let [q, k, v] = [q, k, v].map(rows);
        let pad = pad.map(contiguous);
        let (o, lse) = cpu::attention_forward(
            shape,
            heads(&q),
            heads(&k),
            heads(&v),
            causal,
            pad.as_ref().map(slice),
            dropout,
        );
        let AttentionShape { b, h, t, .. } = shape;
        (
            interleaved(o, shape, t),
            from_vec(lse, Shape::new([b, h, t])),
        )
    }

    fn fused_dropout(x: FlexTensor, mask: DropoutMask) -> FlexTensor {
        let _timer = profile::Timer::new("dropout");
        if !is_f32(&x) {
            return composed::dropout::<Flex>(x, mask);
        }
        let x = contiguous(x);
        let shape = x.shape();
        from_vec(cpu::dropout(slice(&x), mask), shape)
    }

    fn fused_sum_squares(x: FlexTensor) -> FlexTensor {
        if !is_f32(&x) {
            return composed::sum_squares::<Flex>(x);
        }
        // A view is read where it lies, as in a list of one.
        Self::fused_sum_squares_all(vec![x])
    }

    fn fused_sum_squares_all(xs: Vec<FlexTensor>) -> FlexTensor {
        let _timer = profile::Timer::new("clipping (sum of squares)");
        if !xs.iter().all(is_f32) {
            return composed::sum_squares_each::<Flex>(xs, Self::fused_sum_squares);
        }
        let xs: Vec<FlexTensor> = xs.into_iter().map(readable).collect();
        let views: Vec<_> = xs.iter().map(|x| strided(x).expect("readable")).collect();
        from_vec(vec![cpu::sum_squares_all(&views)], Shape::new([1]))
    }

    fn fused_scale(x: FlexTensor, s: FlexTensor) -> FlexTensor {
        let _timer = profile::Timer::new("clipping (rescale)");
        if !is_f32(&x) || !is_f32(&s) {
            return composed::scale::<Flex>(x, s);
        }
        let factor = slice(&contiguous(s))[0];
        if factor == 1.0 {
            return x; // x·1 is x, bit for bit (NaN and infinities too)
        }
        let n = x.shape().num_elements();
        let mut x = owned(x);
        cpu::scale(&mut x.storage_mut::<f32>()[..n], factor);
        x
    }

    fn fused_adamw_all(
        items: Vec<AdamWItem<Self>>,
        clip: Option<FlexTensor>,
    ) -> Vec<(FlexTensor, FlexTensor, FlexTensor)> {
        let _timer = profile::Timer::new("AdamW");
        let f32s = items
            .iter()
            .all(|item| is_f32(&item.param) && is_f32(&item.grad));
        if !f32s || clip.as_ref().is_some_and(|c| !is_f32(c)) {
            return composed::adamw_each::<Flex>(items, clip);
        }
        // Clipping's factor is multiplied in as each gradient is read (by 1 when none).
        let factor = clip.map_or(1.0, |c| slice(&contiguous(c))[0]);
        let mut held: Vec<_> = items
            .into_iter()
            .map(|item| {
                let shape = item.param.shape();
                let grad = readable(item.grad);
                let first = item.moments.is_none();
                let (m, v) = match item.moments {
                    Some((m, v)) => (owned(m), owned(v)),
                    None => {
                        let zeros = || from_vec(vec![0.0; shape.num_elements()], shape.clone());
                        (zeros(), zeros())
                    }
                };
                // A parameter whose buffer someone else holds too (burn's `Learner` keeps the
                // module it hands the optimizer a clone of) is read where it lies and its new
                // values written to a buffer of their own, in the same pass: updating it in
                // place would first copy it whole, on one core.
                let param = owned(item.param);
                let new = (!param.is_unique()).then(|| cpu::uninit(shape.num_elements()));
                (param, new, grad, m, v, first, item.step)
            })
            .collect();
        let slices = held
            .iter_mut()
            .map(|(p, new, grad, m, v, first, step)| {
                let n = grad.shape().num_elements();
                let param = match new {
                    Some(new) => cpu::AdamWParam::Into {
                        from: &p.storage::<f32>()[..n],
                        to: &mut new.spare_capacity_mut()[..n],
                    },
                    None => cpu::AdamWParam::InPlace(&mut p.storage_mut::<f32>()[..n]),
                };
                cpu::AdamWSlices {
                    param,
                    grad: strided(grad).expect("readable"),
                    m: &mut m.storage_mut::<f32>()[..n],
                    v: &mut v.storage_mut::<f32>()[..n],
                    first: *first,
                    step: *step,
                }
            })
            .collect();
        cpu::adamw_all(slices, factor);
        held.into_iter()
            .map(|(p, new, _, m, v, ..)| {
                let p = match new {
                    // SAFETY: `adamw_all` wrote every element of the new buffer.
                    Some(new) => from_vec(
                        unsafe { cpu::written(new, p.shape().num_elements()) },
                        p.shape(),
                    ),
                    None => p,
                };
                (p, m, v)
            })
            .collect()
    }

    fn fused_linear(x: FlexTensor, w: FlexTensor, b: Option<FlexTensor>) -> FlexTensor {
        let _timer = profile::Timer::with_flops("linear", product_flops(&x, &w, 1));
        if !is_f32(&x) {
            return composed::linear::<Flex>(x, w, b);
        }
        let (x, w, b) = (positive(x), positive(w), b.map(contiguous));
        let n = x.shape()[0];
        let o = w.shape()[1];
        let y = cpu::linear(matrix(&x), matrix(&w), b.as_ref().map(slice));
        from_vec(y, Shape::new([n, o]))
    }

    fn fused_linear_gelu_keeping(
        x: FlexTensor,
        w: FlexTensor,
        b: Option<FlexTensor>,
        mask: Option<DropoutMask>,
    ) -> [FlexTensor; 4] {
        let _timer = profile::Timer::with_flops("linear (GELU merged)", product_flops(&x, &w, 1));
        if !is_f32(&x) {
            return composed::linear_gelu_keeping::<Flex>(x, w, b, mask);
        }
        let (x, w, b) = (positive(x), positive(w), b.map(contiguous));
        let shape = Shape::new([x.shape()[0], w.shape()[1]]);
        let (y, derivative) = cpu::linear_gelu(matrix(&x), matrix(&w), b.as_ref().map(slice), mask);
        [
            from_vec(y, shape.clone()),
            from_vec(derivative, shape),
            x,
            w,
        ]
    }

    fn fused_linear_backward(
        x: FlexTensor,
        w: FlexTensor,
        dy: FlexTensor,
        bias: bool,
    ) -> (FlexTensor, FlexTensor, Option<FlexTensor>) {
        let _timer = profile::Timer::with_flops("linear", product_flops(&x, &w, 2));
        if !is_f32(&x) {
            return composed::linear_backward::<Flex>(x, w, dy, bias);
        }
        linear_backward(x, w, dy, bias, None)
    }

    fn fused_gelu_linear_backward(
        x: FlexTensor,
        w: FlexTensor,
        dy: FlexTensor,
        bias: bool,
        derivative: FlexTensor,
    ) -> (FlexTensor, FlexTensor, Option<FlexTensor>) {
        let _timer =
            profile::Timer::with_flops("linear (GELU derivative merged)", product_flops(&x, &w, 2));
        if !is_f32(&x) || !is_f32(&derivative) || derivative.shape() != x.shape() {
            return composed::gelu_linear_backward::<Flex>(x, w, dy, bias, derivative);
        }
        linear_backward(x, w, dy, bias, Some(contiguous(derivative)))
    }

    fn fused_packed_attention_backward(
        qkv: FlexTensor,
        o: FlexTensor,
        lse: FlexTensor,
        d_o: FlexTensor,
        heads: usize,
        causal: bool,
        pad: Option<FlexTensor>,
        dropout: Option<DropoutMask>,
    ) -> FlexTensor {
        let _timer = profile::Timer::new("attention");
        if !is_f32(&qkv) {
            return composed::packed_attention_backward::<Flex>(
                qkv, o, lse, d_o, heads, causal, pad, dropout,
            );
        }
        let [qkv, o, lse, d_o] = [qkv, o, lse, d_o].map(contiguous);
        let pad = pad.map(contiguous);
        let [b, t, d3] = [qkv.shape()[0], qkv.shape()[1], qkv.shape()[2]];
        let k = d3 / 3 / heads;
        let shape = AttentionShape {
            b,
            h: heads,
            t,
            s: t,
            k,
        };
        let dqkv = cpu::packed_attention_backward(
            shape,
            slice(&qkv),
            slice(&o),
            slice(&lse),
            slice(&d_o),
            causal,
            pad.as_ref().map(slice),
            dropout,
        );
        from_vec(dqkv, qkv.shape())
    }

    fn fused_attention_backward(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        o: FlexTensor,
        lse: FlexTensor,
        d_o: FlexTensor,
        causal: bool,
        pad: Option<FlexTensor>,
        dropout: Option<DropoutMask>,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        let _timer = profile::Timer::new("attention");
        if !is_f32(&q) {
            return composed::attention_backward::<Flex>(
                q, k, v, o, lse, d_o, causal, pad, dropout,
            );
        }
        let shape = attention_shape(&q, &k);
        let [q, k, v, o, d_o] = [q, k, v, o, d_o].map(rows);
        let (lse, pad) = (contiguous(lse), pad.map(contiguous));
        let (dq, dk, dv) = cpu::attention_backward(
            shape,
            heads(&q),
            heads(&k),
            heads(&v),
            heads(&o),
            slice(&lse),
            heads(&d_o),
            causal,
            pad.as_ref().map(slice),
            dropout,
        );
        (
            interleaved(dq, shape, shape.t),
            interleaved(dk, shape, shape.s),
            interleaved(dv, shape, shape.s),
        )
    }
}

fn attention_shape(q: &FlexTensor, k: &FlexTensor) -> AttentionShape {
    let (qs, ks) = (q.shape(), k.shape());
    AttentionShape {
        b: qs[0],
        h: qs[1],
        t: qs[2],
        s: ks[2],
        k: qs[3],
    }
}
