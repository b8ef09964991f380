//! The fused operations on burn's fusion backend (on with `--features wgpu` or `cuda`): each is
//! registered in the fusion stream as one custom operation that, when the stream runs, calls the
//! inner backend's kernel ([`super::cube`] on wgpu and CUDA) on the inner tensors. burn's own
//! fusion goes on fusing the element-wise operations around them.

use super::{composed, AdamWItem, DropoutMask, LabBackend, NormPrimitive};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, FloatDType, Shape};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};
use std::sync::Arc;

/// What a custom operation runs on the inner backend: float inputs, int inputs → outputs.
type Run<B> = dyn Fn(Vec<FloatTensor<B>>, Vec<IntTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync;

/// One of our operations in the fusion stream.
struct Custom<B: FusionBackend> {
    desc: CustomOpIr,
    /// How many of the inputs are float tensors (the rest are int tensors).
    floats: usize,
    run: Arc<Run<B>>,
    /// The thread that queued it: fusion may run it on the device's thread.
    #[cfg_attr(not(feature = "cube-kernels"), allow(dead_code))]
    owner: std::thread::ThreadId,
}

impl<B: FusionBackend> std::fmt::Debug for Custom<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "transformer-lab {}", self.desc.id)
    }
}

impl<B: FusionBackend> Operation<B::FusionRuntime> for Custom<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let (floats, ints) = self.desc.inputs.split_at(self.floats);
        let floats = floats
            .iter()
            .map(|ir| handles.get_float_tensor::<B>(ir))
            .collect();
        let ints = ints
            .iter()
            .map(|ir| handles.get_int_tensor::<B>(ir))
            .collect();
        #[cfg(feature = "cube-kernels")]
        let outputs = super::cube::on_behalf_of(self.owner, || (self.run)(floats, ints));
        #[cfg(not(feature = "cube-kernels"))]
        let outputs = (self.run)(floats, ints);
        for (ir, tensor) in self.desc.outputs.iter().zip(outputs) {
            handles.register_float_tensor::<B>(&ir.id, tensor);
        }
    }
}

/// A tensor of the fusion backend over `B`.
type Tensor<B> = FusionTensor<<B as FusionBackend>::FusionRuntime>;

/// Registers `run` as the operation `name` on `floats` and `ints`, making outputs of `shapes`
/// (with the first input's dtype).
fn custom<B: FusionBackend, const N: usize>(
    name: &'static str,
    floats: Vec<Tensor<B>>,
    ints: Vec<Tensor<B>>,
    shapes: [Shape; N],
    run: impl Fn(Vec<FloatTensor<B>>, Vec<IntTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync + 'static,
) -> [Tensor<B>; N] {
    take(custom_many::<B>(name, floats, ints, shapes.into(), run))
}

/// [`custom`] with as many outputs as `shapes` has.
fn custom_many<B: FusionBackend>(
    name: &'static str,
    floats: Vec<Tensor<B>>,
    ints: Vec<Tensor<B>>,
    shapes: Vec<Shape>,
    run: impl Fn(Vec<FloatTensor<B>>, Vec<IntTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync + 'static,
) -> Vec<Tensor<B>> {
    let dtype: DType = floats[0].dtype;
    let outputs = shapes.into_iter().map(|shape| (shape, dtype)).collect();
    custom_typed::<B>(name, floats, ints, outputs, run)
}

/// [`custom_many`] with each output's dtype given (`outputs`: shape and dtype of each).
fn custom_typed<B: FusionBackend>(
    name: &'static str,
    floats: Vec<Tensor<B>>,
    ints: Vec<Tensor<B>>,
    outputs: Vec<(Shape, DType)>,
    run: impl Fn(Vec<FloatTensor<B>>, Vec<IntTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync + 'static,
) -> Vec<Tensor<B>> {
    let client = floats[0].client.clone();
    let streams = OperationStreams::with_inputs(floats.iter().chain(&ints));
    let outputs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype))
        .collect();
    let count = floats.len();
    let inputs: Vec<TensorIr> = floats
        .into_iter()
        .chain(ints)
        .map(|t| t.into_ir())
        .collect();
    let desc = CustomOpIr::new(name, &inputs, &outputs);
    let op = Custom::<B> {
        desc: desc.clone(),
        floats: count,
        run: Arc::new(run),
        owner: std::thread::current().id(),
    };
    client.register(streams, OperationIr::Custom(desc), op)
}

/// The `N` tensors of `v`.
fn take<T, const N: usize>(v: Vec<T>) -> [T; N] {
    v.try_into()
        .unwrap_or_else(|_| unreachable!("the declared number of tensors"))
}

impl<B: FusionBackend + LabBackend> LabBackend for Fusion<B> {
    fn mixed_precision(device: &B::Device, dtype: FloatDType) -> bool {
        B::mixed_precision(device, dtype)
    }

    fn autotunes() -> bool {
        B::autotunes()
    }

    fn time_products(
        device: &B::Device,
        plan: &crate::kernels::matmul::MatmulPlan,
        progress: &mut dyn FnMut(&crate::kernels::matmul::ProductTiming),
    ) -> anyhow::Result<Vec<crate::kernels::matmul::ProductTiming>> {
        B::time_products(device, plan, progress)
    }

    /// In `f32`, fusion's own matmul; in half precision, one custom operation running the inner
    /// backend's mixed-precision product (fusion's matmul returns its inputs' type).
    fn fused_linear(x: Tensor<B>, w: Tensor<B>, b: Option<Tensor<B>>) -> Tensor<B> {
        let precision = super::precision();
        if precision.is_f32() && super::pinned_matmul().is_none() {
            return composed::linear::<Self>(x, w, b);
        }
        let shape = Shape::new([x.shape[0], w.shape[1]]);
        let mut inputs = vec![x, w];
        inputs.extend(b);
        // The operation runs on fusion's server thread: the precision goes with it.
        let [y] = custom::<B, 1>("linear", inputs, vec![], [shape], move |f, _| {
            let mut f = f.into_iter();
            let (x, w) = (f.next().unwrap(), f.next().unwrap());
            let y = super::with_precision(precision, || B::fused_linear(x, w, f.next()));
            vec![y]
        });
        y
    }

    /// In half precision, one custom operation as [`Self::fused_linear`], which also gives the
    /// half copies of the operands the product read.
    fn fused_linear_keeping(
        x: Tensor<B>,
        w: Tensor<B>,
        b: Option<Tensor<B>>,
    ) -> (Tensor<B>, Tensor<B>, Tensor<B>) {
        let precision = super::precision();
        let Some(half) = precision.half() else {
            return (Self::fused_linear(x.clone(), w.clone(), b), x, w);
        };
        let outputs = vec![
            (Shape::new([x.shape[0], w.shape[1]]), x.dtype),
            (x.shape.clone(), DType::from(half)),
            (w.shape.clone(), DType::from(half)),
        ];
        let mut inputs = vec![x, w];
        inputs.extend(b);
        let run = move |f: Vec<FloatTensor<B>>, _| {
            let mut f = f.into_iter();
            let (x, w) = (f.next().unwrap(), f.next().unwrap());
            let (y, x, w) =
                super::with_precision(precision, || B::fused_linear_keeping(x, w, f.next()));
            vec![y, x, w]
        };
        let [y, x, w] = take(custom_typed::<B>(
            "linear_keeping",
            inputs,
            vec![],
            outputs,
            run,
        ));
        (y, x, w)
    }

    fn fused_linear_backward(
        x: Tensor<B>,
        w: Tensor<B>,
        dy: Tensor<B>,
        bias: bool,
    ) -> (Tensor<B>, Tensor<B>, Option<Tensor<B>>) {
        let precision = super::precision();
        let same = x.dtype == dy.dtype && w.dtype == dy.dtype;
        if precision.is_f32() && same && super::pinned_matmul().is_none() {
            return composed::linear_backward::<Self>(x, w, dy, bias);
        }
        let out = dy.dtype;
        let (dx, dw) = (x.shape.clone(), w.shape.clone());
        let mut outputs = vec![(dx, out), (dw.clone(), out)];
        outputs.extend(bias.then(|| (Shape::new([dw[1]]), out)));
        let inputs = vec![x, w, dy];
        let run = move |f: Vec<FloatTensor<B>>, _| {
            let [x, w, dy] = take(f);
            let (dx, dw, db) =
                super::with_precision(precision, || B::fused_linear_backward(x, w, dy, bias));
            [dx, dw].into_iter().chain(db).collect()
        };
        let mut grads =
            custom_typed::<B>("linear_backward", inputs, vec![], outputs, run).into_iter();
        let (dx, dw) = (grads.next().unwrap(), grads.next().unwrap());
        (dx, dw, grads.next())
    }

    fn fused_gelu(x: Tensor<B>) -> Tensor<B> {
        let shape = x.shape.clone();
        let [y] = custom::<B, 1>("gelu", vec![x], vec![], [shape], |f, _| {
            let [x] = take(f);
            vec![B::fused_gelu(x)]
        });
        y
    }

    fn fused_gelu_forward(x: Tensor<B>, mask: Option<DropoutMask>) -> (Tensor<B>, Tensor<B>) {
        let shape = x.shape.clone();
        let [y, d] = custom::<B, 2>(
            "gelu_forward",
            vec![x],
            vec![],
            [shape.clone(), shape],
            move |f, _| {
                let [x] = take(f);
                let (y, d) = B::fused_gelu_forward(x, mask);
                vec![y, d]
            },
        );
        (y, d)
    }

    fn fused_gelu_backward(x: Tensor<B>, grad: Tensor<B>) -> Tensor<B> {
        let shape = x.shape.clone();
        let [dx] = custom::<B, 1>("gelu_backward", vec![x, grad], vec![], [shape], |f, _| {
            let [x, grad] = take(f);
            vec![B::fused_gelu_backward(x, grad)]
        });
        dx
    }

    fn fused_dropout_add(x: Tensor<B>, h: Tensor<B>, mask: DropoutMask) -> Tensor<B> {
        let shape = h.shape.clone();
        let [y] = custom::<B, 1>("dropout_add", vec![x, h], vec![], [shape], move |f, _| {
            let [x, h] = take(f);
            vec![B::fused_dropout_add(x, h, mask)]
        });
        y
    }

    fn fused_dropout(x: Tensor<B>, mask: DropoutMask) -> Tensor<B> {
        let shape = x.shape.clone();
        let [y] = custom::<B, 1>("dropout", vec![x], vec![], [shape], move |f, _| {
            let [x] = take(f);
            vec![B::fused_dropout(x, mask)]
        });
        y
    }

    fn fused_adamw_all(
        items: Vec<AdamWItem<Self>>,
        clip: Option<Tensor<B>>,
    ) -> Vec<(Tensor<B>, Tensor<B>, Tensor<B>)> {
        // One operation for all: the inner backend launches several parameters at a time.
        let mut inputs = Vec::new();
        let mut shapes = Vec::new();
        let mut plan = Vec::new();
        for item in items {
            let shape = item.param.shape.clone();
            plan.push((item.moments.is_some(), item.step));
            inputs.extend([item.param, item.grad]);
            inputs.extend(item.moments.map(|(m, v)| [m, v]).into_iter().flatten());
            shapes.extend([shape.clone(), shape.clone(), shape]);
        }
        let has_clip = clip.is_some();
        inputs.extend(clip);
        let out = custom_many::<B>("adamw_all", inputs, vec![], shapes, move |f, _| {
            let mut f = f.into_iter();
            let items: Vec<AdamWItem<B>> = plan
                .iter()
                .map(|&(has_moments, step)| AdamWItem {
                    param: f.next().unwrap(),
                    grad: f.next().unwrap(),
                    moments: has_moments.then(|| (f.next().unwrap(), f.next().unwrap())),
                    step,
                })
                .collect();
            let clip = has_clip.then(|| f.next().unwrap());
            B::fused_adamw_all(items, clip)
                .into_iter()
                .flat_map(|(p, m, v)| [p, m, v])
                .collect()
        });
        let mut out = out.into_iter();
        std::iter::from_fn(|| Some((out.next()?, out.next()?, out.next()?))).collect()
    }

    fn write_columns_pair(
        keys: Tensor<B>,
        values: Tensor<B>,
        at: usize,
        k: Tensor<B>,
        v: Tensor<B>,
    ) -> (Tensor<B>, Tensor<B>) {
        let shapes = [keys.shape.clone(), values.shape.clone()];
        let inputs = vec![keys, values, k, v];
        let [keys, values] =
            custom::<B, 2>("write_columns", inputs, vec![], shapes, move |f, _| {
                let [keys, values, k, v] = take(f);
                let (keys, values) = B::write_columns_pair(keys, values, at, k, v);
                vec![keys, values]
            });
        (keys, values)
    }

    fn fused_sum_squares_all(xs: Vec<Tensor<B>>) -> Tensor<B> {
        let [total] = custom::<B, 1>("sum_squares_all", xs, vec![], [Shape::new([1])], |f, _| {
            vec![B::fused_sum_squares_all(f)]
        });
        total
    }

    fn fused_decode_linear(
        x: Tensor<B>,
        norm: Option<NormPrimitive<Self>>,
        w: Tensor<B>,
        b: Option<Tensor<B>>,
        gelu: bool,
        residual: Option<Tensor<B>>,
    ) -> Tensor<B> {
        let shape = Shape::new([x.shape[0], w.shape[1]]);
        let (has_norm, has_beta, epsilon) = match &norm {
            Some(norm) => (true, norm.beta.is_some(), norm.epsilon),
            None => (false, false, 0.0),
        };
        let (has_bias, has_residual) = (b.is_some(), residual.is_some());
        let mut inputs = vec![x, w];
        if let Some(norm) = norm {
            inputs.push(norm.gamma);
            inputs.extend(norm.beta);
        }
        inputs.extend(b);
        inputs.extend(residual);
        let [y] = custom::<B, 1>("decode_linear", inputs, vec![], [shape], move |f, _| {
            let mut f = f.into_iter();
            let (x, w) = (f.next().unwrap(), f.next().unwrap());
            let norm = has_norm.then(|| NormPrimitive {
                gamma: f.next().unwrap(),
                beta: has_beta.then(|| f.next().unwrap()),
                epsilon,
            });
            let b = has_bias.then(|| f.next().unwrap());
            let residual = has_residual.then(|| f.next().unwrap());
            vec![B::fused_decode_linear(x, norm, w, b, gelu, residual)]
        });
        y
    }

    fn fused_decode_qkv(
        x: Tensor<B>,
        norm: Option<NormPrimitive<Self>>,
        w: Tensor<B>,
        b: Option<Tensor<B>>,
        keys: Tensor<B>,
        values: Tensor<B>,
        at: usize,
    ) -> (Tensor<B>, Tensor<B>, Tensor<B>) {
        let d = keys.shape[1] * keys.shape[3];
        let shapes = [
            Shape::new([x.shape[0], d]),
            keys.shape.clone(),
            values.shape.clone(),
        ];
        let (has_norm, has_beta, epsilon) = match &norm {
            Some(norm) => (true, norm.beta.is_some(), norm.epsilon),
            None => (false, false, 0.0),
        };
        let has_bias = b.is_some();
        let mut inputs = vec![x, w, keys, values];
        if let Some(norm) = norm {
            inputs.push(norm.gamma);
            inputs.extend(norm.beta);
        }
        inputs.extend(b);
        let [q, keys, values] =
            custom::<B, 3>("decode_qkv", inputs, vec![], shapes, move |f, _| {
                let mut f = f.into_iter();
                let [x, w, keys, values] = [(); 4].map(|()| f.next().unwrap());
                let norm = has_norm.then(|| NormPrimitive {
                    gamma: f.next().unwrap(),
                    beta: has_beta.then(|| f.next().unwrap()),
                    epsilon,
                });
                let b = has_bias.then(|| f.next().unwrap());
                let (q, keys, values) = B::fused_decode_qkv(x, norm, w, b, keys, values, at);
                vec![q, keys, values]
            });
        (q, keys, values)
    }

    fn fused_layer_norm_forward(
        x: Tensor<B>,
        gamma: Tensor<B>,
        beta: Option<Tensor<B>>,
        epsilon: f64,
    ) -> (Tensor<B>, Tensor<B>, Tensor<B>) {
        let shape = x.shape.clone();
        let rows = Shape::new([shape[0]]);
        let has_beta = beta.is_some();
        let mut inputs = vec![x, gamma];
        inputs.extend(beta);
        let shapes = [shape, rows.clone(), rows];
        let [y, mean, rstd] = custom::<B, 3>("layer_norm", inputs, vec![], shapes, move |f, _| {
            let mut f = f.into_iter();
            let (x, gamma) = (f.next().unwrap(), f.next().unwrap());
            let beta = has_beta.then(|| f.next().unwrap());
            let (y, mean, rstd) = B::fused_layer_norm_forward(x, gamma, beta, epsilon);
            vec![y, mean, rstd]
        });
        (y, mean, rstd)
    }

    fn fused_add_layer_norm_forward(
        x: Tensor<B>,
        h: Tensor<B>,
        mask: Option<DropoutMask>,
        gamma: Tensor<B>,
        beta: Option<Tensor<B>>,
        epsilon: f64,
    ) -> (Tensor<B>, Tensor<B>, Tensor<B>, Tensor<B>) {
        let shape = x.shape.clone();
        let rows = Shape::new([shape[0]]);
        let has_beta = beta.is_some();
        let mut inputs = vec![x, h, gamma];
        inputs.extend(beta);
        let shapes = [shape.clone(), shape, rows.clone(), rows];
        let [s, y, mean, rstd] =
            custom::<B, 4>("add_layer_norm", inputs, vec![], shapes, move |f, _| {
                let mut f = f.into_iter();
                let [x, h, gamma] = [(); 3].map(|_| f.next().unwrap());
                let beta = has_beta.then(|| f.next().unwrap());
                let (s, y, mean, rstd) =
                    B::fused_add_layer_norm_forward(x, h, mask, gamma, beta, epsilon);
                vec![s, y, mean, rstd]
            });
        (s, y, mean, rstd)
    }

    fn fused_layer_norm_backward(
        x: Tensor<B>,
        gamma: Tensor<B>,
        mean: Tensor<B>,
        rstd: Tensor<B>,
        dy: Tensor<B>,
        residual: Option<Tensor<B>>,
    ) -> (Tensor<B>, Tensor<B>, Tensor<B>) {
        let shapes = [x.shape.clone(), gamma.shape.clone(), gamma.shape.clone()];
        let mut inputs = vec![x, gamma, mean, rstd, dy];
        inputs.extend(residual);
        let [dx, dgamma, dbeta] =
            custom::<B, 3>("layer_norm_backward", inputs, vec![], shapes, |f, _| {
                let mut f = f.into_iter();
                let [x, gamma, mean, rstd, dy] = [(); 5].map(|_| f.next().unwrap());
                let (dx, dgamma, dbeta) =
                    B::fused_layer_norm_backward(x, gamma, mean, rstd, dy, f.next());
                vec![dx, dgamma, dbeta]
            });
        (dx, dgamma, dbeta)
    }

    fn fused_cross_entropy_forward(
        logits: Tensor<B>,
        targets: Tensor<B>,
        smoothing: f32,
        ignore: Option<usize>,
    ) -> (Tensor<B>, Tensor<B>) {
        let rows = Shape::new([logits.shape[0]]);
        let [loss, lse] = custom::<B, 2>(
            "cross_entropy",
            vec![logits],
            vec![targets],
            [rows.clone(), rows],
            move |f, i| {
                let ([logits], [targets]) = (take(f), take(i));
                let (loss, lse) =
                    B::fused_cross_entropy_forward(logits, targets, smoothing, ignore);
                vec![loss, lse]
            },
        );
        (loss, lse)
    }

    fn fused_embedding_backward(weight: Tensor<B>, grad: Tensor<B>, ids: Tensor<B>) -> Tensor<B> {
        let shape = weight.shape.clone();
        let [dw] = custom::<B, 1>(
            "embedding_backward",
            vec![weight, grad],
            vec![ids],
            [shape],
            |f, i| {
                let ([weight, grad], [ids]) = (take(f), take(i));
                vec![B::fused_embedding_backward(weight, grad, ids)]
            },
        );
        dw
    }

    fn fused_cross_entropy_backward(
        logits: Tensor<B>,
        targets: Tensor<B>,
        lse: Tensor<B>,
        grad: Tensor<B>,
        smoothing: f32,
        ignore: Option<usize>,
    ) -> Tensor<B> {
        let shape = logits.shape.clone();
        let [dx] = custom::<B, 1>(
            "cross_entropy_backward",
            vec![logits, lse, grad],
            vec![targets],
            [shape],
            move |f, i| {
                let ([logits, lse, grad], [targets]) = (take(f), take(i));
                vec![B::fused_cross_entropy_backward(
                    logits, targets, lse, grad, smoothing, ignore,
                )]
            },
        );
        dx
    }

    fn fused_attention_forward(
        q: Tensor<B>,
        k: Tensor<B>,
        v: Tensor<B>,
        causal: bool,
        pad: Option<Tensor<B>>,
        dropout: Option<DropoutMask>,
    ) -> (Tensor<B>, Tensor<B>) {
        let [b, h, t, _] = q.shape.dims();
        let shapes = [q.shape.clone(), Shape::new([b, h, t])];
        let has_pad = pad.is_some();
        let mut inputs = vec![q, k, v];
        inputs.extend(pad);
        let [o, lse] = custom::<B, 2>("attention", inputs, vec![], shapes, move |f, _| {
            let mut f = f.into_iter();
            let [q, k, v] = [f.next().unwrap(), f.next().unwrap(), f.next().unwrap()];
            let pad = has_pad.then(|| f.next().unwrap());
            let (o, lse) = B::fused_attention_forward(q, k, v, causal, pad, dropout);
            vec![o, lse]
        });
        (o, lse)
    }

    fn fused_attention_backward(
        q: Tensor<B>,
        k: Tensor<B>,
        v: Tensor<B>,
        o: Tensor<B>,
        lse: Tensor<B>,
        d_o: Tensor<B>,
        causal: bool,
        pad: Option<Tensor<B>>,
        dropout: Option<DropoutMask>,
    ) -> (Tensor<B>, Tensor<B>, Tensor<B>) {
        let shapes = [q.shape.clone(), k.shape.clone(), v.shape.clone()];
        let has_pad = pad.is_some();
        let mut inputs = vec![q, k, v, o, lse, d_o];
        inputs.extend(pad);
        let [dq, dk, dv] =
            custom::<B, 3>("attention_backward", inputs, vec![], shapes, move |f, _| {
                let mut f = f.into_iter();
                let [q, k, v, o, lse, d_o] = std::array::from_fn(|_| f.next().unwrap());
                let pad = has_pad.then(|| f.next().unwrap());
                let (dq, dk, dv) =
                    B::fused_attention_backward(q, k, v, o, lse, d_o, causal, pad, dropout);
                vec![dq, dk, dv]
            });
        (dq, dk, dv)
    }

    fn fused_packed_attention_forward(
        qkv: Tensor<B>,
        heads: usize,
        causal: bool,
        pad: Option<Tensor<B>>,
        dropout: Option<DropoutMask>,
    ) -> (Tensor<B>, Tensor<B>) {
        let [b, t, d3] = qkv.shape.dims();
        let shapes = [Shape::new([b, t, d3 / 3]), Shape::new([b, heads, t])];
        let has_pad = pad.is_some();
        let mut inputs = vec![qkv];
        inputs.extend(pad);
        let [o, lse] = custom::<B, 2>("packed_attention", inputs, vec![], shapes, move |f, _| {
            let mut f = f.into_iter();
            let qkv = f.next().unwrap();
            let pad = has_pad.then(|| f.next().unwrap());
            let (o, lse) = B::fused_packed_attention_forward(qkv, heads, causal, pad, dropout);
            vec![o, lse]
        });
        (o, lse)
    }

    fn fused_packed_attention_backward(
        qkv: Tensor<B>,
        o: Tensor<B>,
        lse: Tensor<B>,
        d_o: Tensor<B>,
        heads: usize,
        causal: bool,
        pad: Option<Tensor<B>>,
        dropout: Option<DropoutMask>,
    ) -> Tensor<B> {
        let shape = qkv.shape.clone();
        let has_pad = pad.is_some();
        let mut inputs = vec![qkv, o, lse, d_o];
        inputs.extend(pad);
        let [grad] = custom::<B, 1>(
            "packed_attention_backward",
            inputs,
            vec![],
            [shape],
            move |f, _| {
                let mut f = f.into_iter();
                let [qkv, o, lse, d_o] = std::array::from_fn(|_| f.next().unwrap());
                let pad = has_pad.then(|| f.next().unwrap());
                vec![B::fused_packed_attention_backward(
                    qkv, o, lse, d_o, heads, causal, pad, dropout,
                )]
            },
        );
        grad
    }
}
