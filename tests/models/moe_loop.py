"""The per-expert loop llmtrain's `Experts.forward` ran before the batched dispatcher: a test reference only.

    from moe_loop import loop_forward
    y = loop_forward(layer, x, index, weight)      # same contract as Experts.forward on one device

One `paddle.nonzero` per expert (a host synchronisation each on a GPU), a gather of its tokens, its FFN, and an
`index_add` of the weighted output. tests/models/test_dispatch.py checks the dispatcher against it (outputs and
gradients within 1e-6) and that the host-sync counter catches it; benchmarks/moe.py times it beside the new path
(`installed_loop`).
"""
from __future__ import annotations

import contextlib

import paddle
import paddle.nn.functional as F


def loop_forward(layer, x, index, weight):  # x [T, h]; index, weight [T, k]; every expert on this device
    num_tokens, top_k = index.shape
    flat_index = index.reshape([-1])  # [T k]
    flat_weight = weight.reshape([-1])
    token = paddle.arange(num_tokens, dtype="int64").repeat_interleave(top_k)  # [T k]
    out = paddle.zeros_like(x)  # [T, h]
    served = 0
    for j in range(layer.num_local):
        pos = paddle.nonzero(flat_index == layer.first + j).flatten()  # choices served by expert j
        if pos.shape[0] == 0:
            continue
        served += 1
        rows = paddle.gather(token, pos)  # [n]
        xe = paddle.gather(x, rows)  # [n, h]
        if layer.swiglu:
            inner = F.silu(xe @ layer.w_gate[j]) * (xe @ layer.w_up[j])  # [n, f]
        else:
            inner = F.gelu(xe @ layer.w_up[j], approximate=layer.approximate)
        ye = (inner @ layer.w_down[j]) * paddle.gather(flat_weight, pos).astype(x.dtype)[:, None]  # [n, h]
        out = paddle.index_add(out, rows, 0, ye)
    if served == 0:  # keep the stacked weights in the graph
        out = out + 0.0 * sum(p.sum() for p in layer.parameters()).astype(out.dtype)
    return out


@contextlib.contextmanager
def installed_loop():
    """Within the block every `Experts` layer (one device) runs the old loop instead of the dispatcher."""
    from llmtrain.models.experts import Experts

    saved = Experts.forward
    Experts.forward = loop_forward
    try:
        yield
    finally:
        Experts.forward = saved
