//! The fused operations on `Autodiff<B>`: one graph node each, whose backward pass is the inner
//! backend's fused backward (a kernel on flex, wgpu and CUDA; the composed form on ndarray).

use super::composed::rows;
use super::{DropoutMask, LabBackend};
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::TensorMetadata;

#[derive(Debug)]
struct Gelu;

impl<B: LabBackend> Backward<B, 1> for Gelu {
    type State = FloatTensor<B>; // GELU'(x)

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let derivative = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::fused_mul(grad, derivative)
        });
    }
}

#[derive(Debug)]
struct Dropout;

impl<B: LabBackend> Backward<B, 1> for Dropout {
    type State = DropoutMask; // drawn again: y = x⊙M, so dx = dy⊙M

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let mask = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::fused_dropout(grad, mask)
        });
    }
}

#[derive(Debug)]
struct DropoutAdd;

impl<B: LabBackend> Backward<B, 2> for DropoutAdd {
    type State = Option<DropoutMask>; // y = x + h⊙M: dx = dy, dh = dy⊙M (y = x + h: dh = dy)

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [x, h] = ops.parents;
        if let Some(h) = h {
            let dh = match ops.state {
                Some(mask) => B::fused_dropout(grad.clone(), mask),
                None => grad.clone(),
            };
            grads.register::<B>(h.id, dh);
        }
        if let Some(x) = x {
            grads.register::<B>(x.id, grad);
        }
    }
}

#[derive(Debug)]
struct Softmax;

impl<B: LabBackend> Backward<B, 1> for Softmax {
    type State = FloatTensor<B>; // the output p

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let p = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::fused_softmax_backward(p, grad)
        });
    }
}

#[derive(Debug)]
struct LayerNorm;

/// `(x [n, d], γ, mean, 1/σ)`, and `x` as the graph knows it, `[..., d]` (where its gradient
/// from other readers collects).
type LayerNormState<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<Autodiff<B>>,
);

impl<B: LabBackend> Backward<B, 3> for LayerNorm {
    type State = LayerNormState<B>;

    /// The input's gradient from the readers whose backward passes ran first is taken out and
    /// added in the LayerNorm backward's pass, where registering `dx` would have added the two
    /// in a pass of their own. burn runs the deepest nodes first; in a residual stream the next
    /// addition reads the sublayer's output, so it is deeper than the LayerNorm and has run.
    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (x, gamma, mean, rstd, input) = ops.state;
        let dy = rows::<B>(grads.consume::<B>(&ops.node));
        let residual = match &ops.parents[0] {
            Some(_) => grads.remove::<B>(&input).map(rows::<B>),
            None => None,
        };
        let (dx, dgamma, dbeta) = B::fused_layer_norm_backward(x, gamma, mean, rstd, dy, residual);
        let dx = B::float_reshape(dx, input.primitive.shape());
        for (parent, grad) in ops.parents.into_iter().zip([dx, dgamma, dbeta]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

#[derive(Debug)]
struct Attention;

/// What attention's backward needs: q, k, v, the output, the log-sum-exp, causal, padding.
#[derive(Clone, Debug)]
struct AttentionState<B: LabBackend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    o: FloatTensor<B>,
    lse: FloatTensor<B>,
    causal: bool,
    pad: Option<FloatTensor<B>>,
    dropout: Option<DropoutMask>,
}

impl<B: LabBackend> Backward<B, 3> for Attention {
    type State = AttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let AttentionState {
            q,
            k,
            v,
            o,
            lse,
            causal,
            pad,
            dropout,
        } = ops.state;
        let d_o = grads.consume::<B>(&ops.node);
        let (dq, dk, dv) = B::fused_attention_backward(q, k, v, o, lse, d_o, causal, pad, dropout);
        for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

#[derive(Debug)]
struct PackedAttention;

/// What packed self-attention's backward needs.
#[derive(Clone, Debug)]
struct PackedAttentionState<B: LabBackend> {
    qkv: FloatTensor<B>,
    o: FloatTensor<B>,
    lse: FloatTensor<B>,
    heads: usize,
    causal: bool,
    pad: Option<FloatTensor<B>>,
    dropout: Option<DropoutMask>,
}

impl<B: LabBackend> Backward<B, 1> for PackedAttention {
    type State = PackedAttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let PackedAttentionState {
            qkv,
            o,
            lse,
            heads,
            causal,
            pad,
            dropout,
        } = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |d_o| {
            B::fused_packed_attention_backward(qkv, o, lse, d_o, heads, causal, pad, dropout)
        });
    }
}

#[derive(Debug)]
struct Linear;

impl<B: LabBackend> Backward<B, 3> for Linear {
    /// `(x, w, whether there is a bias)`, as [`LabBackend::fused_linear_keeping`] kept them.
    type State = (FloatTensor<B>, FloatTensor<B>, bool);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (x, w, bias) = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let (dx, dw, db) = B::fused_linear_backward(x, w, dy, bias);
        for (parent, grad) in ops.parents.into_iter().zip([Some(dx), Some(dw), db]) {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

#[derive(Debug)]
struct FeedForward;

/// What [`FeedForward`]'s backward needs: each product's input and weight as
/// [`LabBackend::fused_linear_keeping`] kept them (the second's input is the activation's
/// output), whether each has a bias, and GELU's derivative (dropout's multipliers in it).
#[derive(Clone, Debug)]
struct FeedForwardState<B: LabBackend> {
    x: [FloatTensor<B>; 2],
    w: [FloatTensor<B>; 2],
    bias: [bool; 2],
    derivative: FloatTensor<B>,
}

impl<B: LabBackend> Backward<B, 5> for FeedForward {
    type State = FeedForwardState<B>;

    /// The second product's backward (its input gradient times GELU's derivative on the core
    /// that made it, [`LabBackend::fused_gelu_linear_backward`]), then the first's.
    fn backward(self, ops: Ops<Self::State, 5>, grads: &mut Gradients, _: &mut Checkpointer) {
        let FeedForwardState {
            x: [x1, x2],
            w: [w1, w2],
            bias: [bias1, bias2],
            derivative,
        } = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let (dh, dw2, db2) = B::fused_gelu_linear_backward(x2, w2, dy, bias2, derivative);
        let (dx, dw1, db1) = B::fused_linear_backward(x1, w1, dh, bias1);
        let all = [Some(dx), Some(dw1), db1, Some(dw2), db2];
        for (parent, grad) in ops.parents.into_iter().zip(all) {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

#[derive(Debug)]
struct CrossEntropy;

/// What the cross-entropy's backward needs: logits, targets, log-sum-exp, ε, the ignored class.
#[derive(Clone, Debug)]
struct CrossEntropyState<B: LabBackend> {
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    smoothing: f32,
    ignore: Option<usize>,
}

impl<B: LabBackend> Backward<B, 1> for CrossEntropy {
    type State = CrossEntropyState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let CrossEntropyState {
            logits,
            targets,
            lse,
            smoothing,
            ignore,
        } = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::fused_cross_entropy_backward(logits, targets, lse, grad, smoothing, ignore)
        });
    }
}

#[derive(Debug)]
struct EmbeddingLookup;

impl<B: LabBackend> Backward<B, 1> for EmbeddingLookup {
    /// The table (its shape, device and type) and the ids.
    type State = (FloatTensor<B>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (weight, ids) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::fused_embedding_backward(weight, grad, ids)
        });
    }
}

/// A bias (LayerNorm's, a linear layer's), the graph node its gradient goes to; without a bias,
/// a constant stands in for it (it takes no gradient).
fn bias<B: LabBackend, C: CheckpointStrategy>(
    beta: Option<FloatTensor<Autodiff<B, C>>>,
    like: &FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    beta.unwrap_or_else(|| {
        let dtype = like.dtype().into();
        Autodiff::<B, C>::float_zeros([1].into(), &B::float_device(like), dtype)
    })
}

/// The LayerNorm graph node of `input` `[..., d]` (its rows `x` `[n, d]`) whose forward pass
/// made `(y [..., d], mean, 1/σ)`: parents the input, `γ` and `β`, its output `y`.
fn layer_norm_node<B: LabBackend, C: CheckpointStrategy>(
    input: FloatTensor<Autodiff<B, C>>,
    x: FloatTensor<B>,
    gamma: FloatTensor<Autodiff<B, C>>,
    beta: Option<FloatTensor<Autodiff<B, C>>>,
    (y, mean, rstd): (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>),
) -> FloatTensor<Autodiff<B, C>> {
    let nodes = [input.node.clone(), gamma.node, bias::<B, C>(beta, &y).node];
    match LayerNorm.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((x, gamma.primitive, mean, rstd, input), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

impl<B: LabBackend, C: CheckpointStrategy> LabBackend for Autodiff<B, C> {
    const TIMED_KERNELS: bool = B::TIMED_KERNELS;

    /// burn's lookup node, its backward pass the inner backend's
    /// [`LabBackend::fused_embedding_backward`].
    fn fused_embedding(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        let y = B::embedding(weight.primitive.clone(), ids.clone());
        match EmbeddingLookup
            .prepare::<C>([weight.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((weight.primitive, ids), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        smoothing: f32,
        ignore: Option<usize>,
    ) -> FloatTensor<Self> {
        let (loss, lse) = B::fused_cross_entropy_forward(
            logits.primitive.clone(),
            targets.clone(),
            smoothing,
            ignore,
        );
        match CrossEntropy
            .prepare::<C>([logits.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = CrossEntropyState {
                    logits: logits.primitive,
                    targets,
                    lse,
                    smoothing,
                    ignore,
                };
                prep.finish(state, loss)
            }
            OpsKind::UnTracked(prep) => prep.finish(loss),
        }
    }

    fn mixed_precision(device: &B::Device, dtype: burn::tensor::FloatDType) -> bool {
        B::mixed_precision(device, dtype)
    }

    fn autotunes() -> bool {
        B::autotunes()
    }

    fn fused_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        let (y, x_kept, w_kept) = B::fused_linear_keeping(
            x.primitive,
            w.primitive,
            b.as_ref().map(|b| b.primitive.clone()),
        );
        let (bias, b) = (b.is_some(), bias::<B, C>(b, &y));
        let nodes = [x.node, w.node, b.node];
        match Linear.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x_kept, w_kept, bias), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_feed_forward(
        x: FloatTensor<Self>,
        [w1, w2]: [FloatTensor<Self>; 2],
        [b1, b2]: [Option<FloatTensor<Self>>; 2],
        mask: Option<DropoutMask>,
    ) -> FloatTensor<Self> {
        let primitive = |b: &Option<FloatTensor<Self>>| b.as_ref().map(|b| b.primitive.clone());
        let [h, derivative, x1, w1_kept] =
            B::fused_linear_gelu_keeping(x.primitive, w1.primitive, primitive(&b1), mask);
        let (y, x2, w2_kept) = B::fused_linear_keeping(h, w2.primitive, primitive(&b2));
        let biased = [b1.is_some(), b2.is_some()];
        let (b1, b2) = (bias::<B, C>(b1, &y), bias::<B, C>(b2, &y));
        let nodes = [x.node, w1.node, b1.node, w2.node, b2.node];
        match FeedForward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let state = FeedForwardState {
                    x: [x1, x2],
                    w: [w1_kept, w2_kept],
                    bias: biased,
                    derivative,
                };
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_packed_attention(
        qkv: FloatTensor<Self>,
        heads: usize,
        causal: bool,
        pad: Option<FloatTensor<Self>>,
        dropout: Option<DropoutMask>,
    ) -> FloatTensor<Self> {
        let pad = pad.map(|pad| pad.primitive);
        let qkv_inner = qkv.primitive.clone();
        let (o, lse) =
            B::fused_packed_attention_forward(qkv_inner, heads, causal, pad.clone(), dropout);
        match PackedAttention
            .prepare::<C>([qkv.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = PackedAttentionState {
                    qkv: qkv.primitive,
                    o: o.clone(),
                    lse,
                    heads,
                    causal,
                    pad,
                    dropout,
                };
                prep.finish(state, o)
            }
            OpsKind::UnTracked(prep) => prep.finish(o),
        }
    }

    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match Gelu
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, derivative) = B::fused_gelu_forward(x.primitive, None);
                prep.finish(derivative, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_gelu(x.primitive)),
        }
    }

    /// One graph node, GELU's, whose kept derivative has the mask in it.
    fn fused_gelu_dropout(x: FloatTensor<Self>, mask: DropoutMask) -> FloatTensor<Self> {
        let (y, derivative) = B::fused_gelu_forward(x.primitive, Some(mask));
        match Gelu.prepare::<C>([x.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(derivative, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let p = B::fused_softmax(x.primitive);
        match Softmax.prepare::<C>([x.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(p.clone(), p),
            OpsKind::UnTracked(prep) => prep.finish(p),
        }
    }

    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        let x2 = rows::<B>(x.primitive.clone());
        let (y, mean, rstd) = B::fused_layer_norm_forward(
            x2.clone(),
            gamma.primitive.clone(),
            beta.as_ref().map(|beta| beta.primitive.clone()),
            epsilon,
        );
        let y = B::float_reshape(y, x.primitive.shape());
        layer_norm_node::<B, C>(x, x2, gamma, beta, (y, mean, rstd))
    }

    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        pad: Option<FloatTensor<Self>>,
        dropout: Option<DropoutMask>,
    ) -> FloatTensor<Self> {
        let pad = pad.map(|pad| pad.primitive);
        let (o, lse) = B::fused_attention_forward(
            q.primitive.clone(),
            k.primitive.clone(),
            v.primitive.clone(),
            causal,
            pad.clone(),
            dropout,
        );
        let nodes = [q.node, k.node, v.node];
        match Attention.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let state = AttentionState {
                    q: q.primitive,
                    k: k.primitive,
                    v: v.primitive,
                    o: o.clone(),
                    lse,
                    causal,
                    pad,
                    dropout,
                };
                prep.finish(state, o)
            }
            OpsKind::UnTracked(prep) => prep.finish(o),
        }
    }

    fn fused_dropout_add(
        x: FloatTensor<Self>,
        h: FloatTensor<Self>,
        mask: DropoutMask,
    ) -> FloatTensor<Self> {
        let y = B::fused_dropout_add(x.primitive, h.primitive, mask);
        match DropoutAdd
            .prepare::<C>([x.node, h.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(Some(mask), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    /// Two graph nodes from one kernel: the addition (parents `x`, `h`), whose output the
    /// LayerNorm node (parents the sum, `γ`, `β`) reads, each with its own backward pass, as if
    /// [`Self::fused_dropout_add`] and [`Self::fused_layer_norm`] had run.
    fn fused_add_layer_norm(
        x: FloatTensor<Self>,
        h: FloatTensor<Self>,
        mask: Option<DropoutMask>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let shape = x.primitive.shape();
        let (s, y, mean, rstd) = B::fused_add_layer_norm_forward(
            rows::<B>(x.primitive),
            rows::<B>(h.primitive),
            mask,
            gamma.primitive.clone(),
            beta.as_ref().map(|beta| beta.primitive.clone()),
            epsilon,
        );
        let y = B::float_reshape(y, shape.clone());
        let sum = B::float_reshape(s.clone(), shape);
        let sum = match DropoutAdd
            .prepare::<C>([x.node, h.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(mask, sum),
            OpsKind::UnTracked(prep) => prep.finish(sum),
        };
        let y = layer_norm_node::<B, C>(sum.clone(), s, gamma, beta, (y, mean, rstd));
        (sum, y)
    }

    fn fused_dropout(x: FloatTensor<Self>, mask: DropoutMask) -> FloatTensor<Self> {
        let y = B::fused_dropout(x.primitive, mask);
        match Dropout.prepare::<C>([x.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(mask, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}
