//! The fused operations on `Autodiff<B>`: one graph node each, whose backward pass is the inner
//! backend's fused backward (a kernel on flex, wgpu and CUDA; the composed form on ndarray).

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
            B::float_mul(grad, derivative)
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
    type State = DropoutMask; // y = x + h⊙M: dx = dy, dh = dy⊙M

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let mask = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [x, h] = ops.parents;
        if let Some(h) = h {
            grads.register::<B>(h.id, B::fused_dropout(grad.clone(), mask));
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

/// `(x, γ, mean, 1/σ)`.
type LayerNormState<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
);

impl<B: LabBackend> Backward<B, 3> for LayerNorm {
    type State = LayerNormState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (x, gamma, mean, rstd) = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let (dx, dgamma, dbeta) = B::fused_layer_norm_backward(x, gamma, mean, rstd, dy);
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
    /// `(x, w, whether there is a bias)`.
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

impl<B: LabBackend, C: CheckpointStrategy> LabBackend for Autodiff<B, C> {
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
        let y = B::fused_linear(
            x.primitive.clone(),
            w.primitive.clone(),
            b.as_ref().map(|b| b.primitive.clone()),
        );
        // Without a bias, a constant stands in for its node (it takes no gradient).
        let bias = b.is_some();
        let b_node = match b {
            Some(b) => b.node,
            None => Self::float_zeros([1].into(), &B::float_device(&y), y.dtype().into()).node,
        };
        let nodes = [x.node, w.node, b_node];
        match Linear.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x.primitive, w.primitive, bias), y),
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
                let (y, derivative) = B::fused_gelu_forward(x.primitive);
                prep.finish(derivative, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_gelu(x.primitive)),
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
        let (y, mean, rstd) = B::fused_layer_norm_forward(
            x.primitive.clone(),
            gamma.primitive.clone(),
            beta.as_ref().map(|beta| beta.primitive.clone()),
            epsilon,
        );
        // Without a bias, a constant stands in for its node (it takes no gradient).
        let beta_node = match beta {
            Some(beta) => beta.node,
            None => Self::float_zeros([1].into(), &B::float_device(&y), y.dtype().into()).node,
        };
        let nodes = [x.node, gamma.node, beta_node];
        match LayerNorm.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x.primitive, gamma.primitive, mean, rstd), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
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
            OpsKind::Tracked(prep) => prep.finish(mask, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_dropout(x: FloatTensor<Self>, mask: DropoutMask) -> FloatTensor<Self> {
        let y = B::fused_dropout(x.primitive, mask);
        match Dropout.prepare::<C>([x.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(mask, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}
