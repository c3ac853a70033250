"""Several linears of one input as ONE GEMM over their concatenated weights, without keeping the concatenation.

    python -m pytest tests/models/test_fused.py -q
    q, k, v = concat_linear(x, [q_proj, k_proj, v_proj])      # x [.., in] -> [.., out_i] each

The fused projections (`model.fuse_qkv`, `fuse_ffn`) run one GEMM x @ [W_1 .. W_n] (+ [b_1 .. b_n]) instead of n:
fewer kernel launches, and under tp / sequence parallelism one collective for the input (`Roles.column_linears`).
Autograd over `paddle.concat` + `F.linear` would keep the concatenated weight [in, sum out_i] for the backward: a copy
of the weights per layer and micro-batch alive until that layer's backward (315 MB per 7B block and
micro-batch in flight). `ConcatLinear` keeps only x and the parameters themselves and concatenates the weights
again in its backward (a transient copy, freed at once):

    forward   W = [W_1 .. W_n] (transient), y = x W + b, split into y_i
    backward  dy = [dy_1 .. dy_n]; dx = dy Wᵀ (W concatenated again); dW_i, db_i = the column blocks of xᵀ dy, sum dy
              (a parameter with stop_gradient, e.g. a LoRA base, gets no gradient and costs no GEMM)

The numbers are those of the concatenating formulation (the same GEMMs). Measured on CPU
(benchmarks/fused_weights.py): this and a GEMM per weight cost the same time there (within 4%) and hold the same
bytes; on a GPU each extra GEMM is a launch, and the planner prices the two host-bound H200 rows (llama-1b mb1,
gpt-1024 mb2) 5% and 14% slower with a GEMM per weight. The routed experts, whose [E, h, 2f] copy is large and whose
two batched GEMMs measured 12% faster on CPU, run two bmm instead (`llmtrain.models.experts`).
"""
from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer


class ConcatLinear(PyLayer):
    """x [.., in], n weights [in, out_i], n biases [out_i] (or none) -> n outputs [.., out_i]."""

    @staticmethod
    def forward(ctx, x, has_bias: bool, *params):  # params: the weights, then (has_bias) the biases
        n = len(params) // 2 if has_bias else len(params)
        weights, biases = params[:n], params[n:]
        ctx.widths = [int(w.shape[1]) for w in weights]
        ctx.save_for_backward(x, *weights)
        ctx.needs = [not p.stop_gradient for p in params]
        y = paddle.matmul(x, paddle.concat(weights, axis=1))  # [.., sum out_i]; the concatenation is not saved
        if biases:
            y = y + paddle.concat(biases, axis=0)
        return tuple(paddle.split(y, ctx.widths, axis=-1))

    @staticmethod
    def backward(ctx, *dys):
        x, *weights = ctx.saved_tensor()
        dys = [paddle.zeros([*x.shape[:-1], w], x.dtype) if d is None else d for d, w in zip(dys, ctx.widths)]
        dy = paddle.concat(dys, axis=-1)  # [.., sum out_i]
        dx = paddle.matmul(dy, paddle.concat(weights, axis=1), transpose_y=True)  # [.., in]; a transient copy
        n = len(weights)
        grads = [None] * len(ctx.needs)
        if any(ctx.needs[:n]):
            dw = paddle.matmul(x.reshape([-1, x.shape[-1]]), dy.reshape([-1, dy.shape[-1]]), transpose_x=True)
            for i, part in enumerate(paddle.split(dw, ctx.widths, axis=1)):  # [in, out_i]
                grads[i] = part if ctx.needs[i] else None
        if any(ctx.needs[n:]):
            db = dy.reshape([-1, dy.shape[-1]]).sum(0)  # [sum out_i]
            for i, part in enumerate(paddle.split(db, ctx.widths, axis=0)):
                grads[n + i] = part if ctx.needs[n + i] else None
        return (dx, *grads)


def concat_linear(x, layers):
    """[x @ W_i + b_i] of `layers` (linears with `weight` [in, out_i] and `bias` [out_i] or None) as one GEMM:
    x [.., in] -> [[.., out_i] ...] (module docstring)."""
    has_bias = layers[0].bias is not None
    gemm = getattr(layers[0], "linear", None)
    if gemm is not None and gemm is not F.linear:  # a compute recipe's GEMM (FP8): on the concatenated weight
        w = paddle.concat([layer.weight for layer in layers], axis=1)  # [in, sum out_i]
        b = paddle.concat([layer.bias for layer in layers], axis=0) if has_bias else None
        y = gemm(x, w, b)  # [.., sum out_i]
        return paddle.split(y, [int(layer.weight.shape[1]) for layer in layers], axis=-1)
    params = [layer.weight for layer in layers] + ([layer.bias for layer in layers] if has_bias else [])
    return list(ConcatLinear.apply(x, has_bias, *params))
