"""CPU rehearsal of `GPU-ONLY(moe-combine)` (llmtrain/models/dispatch.py `combine`): the MoE combine through Paddle's
fused `moe_combine`, the kernel replaced by a reference whose call is bound to the installed function's signature and
checked against the kernel's contract.

    python -m pytest tests/gpu_paths/test_moe_combine.py -q

`llmtrain.paddle_compat.moe_kernels` chooses the kernel on a CUDA device with the tested Paddle: here the device
query says GPU, `paddle.incubate.nn.functional.moe_combine` is the reference (y[t] = sum_j w[t, j] x[idx[t, j]],
the GPU kernel's loop in Paddle 3.3.1), and the layer's outputs and gradients must equal the tensor-op path's.
"""
from __future__ import annotations

import inspect

import numpy as np
import paddle
import paddle.incubate.nn.functional as incubate
import pytest

from llmtrain.models.config import ModelConfig
from llmtrain.models.experts import Experts
from llmtrain.models.moe import route
from llmtrain.paddle_compat import kernels

REAL = incubate.moe_combine


def reference(calls: list):
    def moe_combine(x, combine_weights, scatter_index, name=None):
        inspect.signature(REAL).bind(x, combine_weights, scatter_index, name=name)
        tokens, top_k = combine_weights.shape
        assert x.ndim == 2 and combine_weights.dtype == x.dtype, (x.shape, combine_weights.dtype, x.dtype)
        assert scatter_index.dtype == paddle.int32 and list(scatter_index.shape) == [tokens, top_k]
        assert 0 <= int(scatter_index.min()) and int(scatter_index.max()) < x.shape[0]
        calls.append(list(x.shape))
        rows = paddle.gather(x, scatter_index.reshape([-1]).astype("int64")).reshape([tokens, top_k, x.shape[1]])
        return (rows * combine_weights.unsqueeze(-1)).sum(1)
    assert [p.name for p in inspect.signature(moe_combine).parameters.values()] == \
        list(inspect.signature(REAL).parameters)
    return moe_combine


def run(layer, x, logits, factor):
    r = route(logits, 2, capacity_factor=factor)
    y = layer(x, r.index, r.weight)
    return [y.numpy(), *(g.numpy() for g in paddle.grad((y * y).sum(), [x, logits, *layer.parameters()]))]


@pytest.mark.parametrize("factor", [0.0, 0.5])
def test_the_gpu_combine_calls_moe_combine_as_its_signature_says(monkeypatch, factor):
    cfg = ModelConfig(name="m", hidden_size=16, num_layers=2, num_heads=2, ffn_hidden_size=24, vocab_size=64,
                      activation="swiglu", bias=False, moe_num_experts=8, moe_top_k=2, moe_ffn_hidden_size=8,
                      moe_capacity_factor=factor)
    paddle.seed(2)
    layer = Experts(cfg, 8)
    x, logits = paddle.randn([20, 16]), paddle.randn([20, 8])
    x.stop_gradient = logits.stop_gradient = False
    want = run(layer, x, logits, factor)
    calls = []
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    monkeypatch.setattr(incubate, "moe_combine", reference(calls))
    got = run(layer, x, logits, factor)
    assert len(calls) == 1 and calls[0][0] % 8 == 0 and calls[0][1] == 16  # [E C, h]: the expert-major rows
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(paddle, "__version__", "3.4.0")  # another release: the tensor ops, with a warning
    from llmtrain.paddle_compat import moe_kernels

    monkeypatch.setattr(moe_kernels, "_WARNED", False)
    with pytest.warns(UserWarning, match="moe_combine kernel was read in paddle 3.3.1"):
        run(layer, x, logits, factor)
    assert len(calls) == 1
