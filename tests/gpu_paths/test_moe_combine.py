"""GPU-only branch `moe-combine`: the MoE combine (step 7 of `llmtrain.models.experts`) as Paddle's fused kernel.

    python -m pytest tests/gpu_paths/test_moe_combine.py -q

`llmtrain.paddle_compat.moe_kernels` chooses `paddle.incubate.nn.functional.moe_combine` on a CUDA device with the
tested Paddle release. On CPU the rehearsal makes llmtrain believe it runs on a GPU and replaces the kernel by a
stand-in bound to the installed function's signature (`checked`) whose reference is written from the kernel's
contract, not from llmtrain's tensor ops: numpy loops over tokens and choices, y[t] = sum_j w[t, j] x[idx[t, j]],
and the kernel's backward (dx[idx[t, j]] += w[t, j] dy[t], dw[t, j] = <dy[t], x[idx[t, j]]>), after the checks
Paddle 3.3.1's kernel makes (x 2-D, `scatter_index` int32 [T, k] inside x's rows, weights of x's dtype). A moe-tiny
shaped MoE layer (router, experts, shared expert) must give the same output and gradients (tokens, router,
every weight) as the tensor-op combine, dropless and with capacity drops: 1e-6, the same fp32 sums in another
order. On a GPU the real kernel runs against the tensor-op path (`GPU_TOL`, not yet measured). Another Paddle
release falls back to the tensor ops with one warning.
"""
from __future__ import annotations

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF
import pytest
from paddle.autograd import PyLayer

from gpu_rehearsal import ON_GPU, checked, reaches
from llmtest import compose
from llmtrain.config import to_config
from llmtrain.models.moe import MoEFeedForward
from llmtrain.models.roles import Roles
from llmtrain.paddle_compat import kernels, moe_kernels

GPU_TOL = 1e-5
"""|fused - tensor ops| on a GPU, fp32: not yet measured."""


def _bf16(a: np.ndarray) -> np.ndarray:
    return paddle.to_tensor(a).astype("bfloat16").astype("float32").numpy()


class _Combine(PyLayer):
    """moe_combine's contract with its backward, in numpy loops (independent of llmtrain's gather + sum)."""

    @staticmethod
    def forward(ctx, x, weight, index):
        low = x.dtype == paddle.bfloat16  # the kernel's bf16 instance rounds every product and every partial sum
        xs, ws, ids = x.astype("float32").numpy(), weight.astype("float32").numpy(), index.numpy()
        ctx.saved = (xs, ws, ids)
        y = np.zeros((ws.shape[0], xs.shape[1]), np.float32)
        for t in range(ws.shape[0]):
            for j in range(ws.shape[1]):
                y[t] = _bf16(y[t] + _bf16(ws[t, j] * xs[ids[t, j]])) if low else y[t] + ws[t, j] * xs[ids[t, j]]
        return paddle.to_tensor(y).astype(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xs, ws, ids = ctx.saved
        d = dy.numpy()
        dx, dw = np.zeros_like(xs), np.zeros_like(ws)
        for t in range(ws.shape[0]):
            for j in range(ws.shape[1]):
                dx[ids[t, j]] += ws[t, j] * d[t]
                dw[t, j] = float(d[t] @ xs[ids[t, j]])
        return paddle.to_tensor(dx), paddle.to_tensor(dw)


def reference_moe_combine(x, combine_weights, scatter_index, **_defaults):
    """What the GPU kernel computes, after the checks its wrapper and kernel make (Paddle 3.3.1)."""
    assert x.ndim == 2, f"moe_combine: x must be 2-D, got {x.shape}"
    assert scatter_index.dtype == paddle.int32, f"moe_combine: int32 scatter_index only, got {scatter_index.dtype}"
    assert combine_weights.dtype == x.dtype, (combine_weights.dtype, x.dtype)
    assert list(scatter_index.shape) == list(combine_weights.shape) and combine_weights.ndim == 2
    ids = scatter_index.numpy()
    assert ids.min() >= 0 and ids.max() < x.shape[0], (ids.min(), ids.max(), x.shape)
    return _Combine.apply(x, combine_weights, scatter_index)


def _layer(factor: float):
    cfg = to_config(compose(["model=moe-tiny", f"model.moe_capacity_factor={factor}", "model.vocab_size=64"])).model
    paddle.seed(4)
    return MoEFeedForward(cfg, Roles(), index=1)


def _trained(layer):
    return [p for p in layer.parameters() if not p.stop_gradient]  # not the expert bias (moved by counts)


def _run(layer, x):
    y = layer(x)
    layer.loss_terms.clear()
    grads = paddle.grad((y * y).sum(), [x, *_trained(layer)])
    return [y.numpy(), *(g.numpy() for g in grads)]


@pytest.mark.parametrize("factor", [0.0, 0.5], ids=["dropless", "capacity"])
def test_the_gpu_combine_equals_the_tensor_ops(monkeypatch, factor):
    layer = _layer(factor)
    x = paddle.randn([1, 40, layer.cfg.hidden_size])
    x.stop_gradient = False
    with monkeypatch.context() as cpu:
        cpu.setattr(moe_kernels, "fused_combine_available", lambda: False)
        want = _run(layer, x)
    stand_in = None
    if not ON_GPU:
        monkeypatch.setattr(kernels, "on_gpu", lambda: True)
        stand_in = checked(IF.moe_combine, reference_moe_combine, ("x", "combine_weights", "scatter_index"))
        monkeypatch.setattr(IF, "moe_combine", stand_in)
    with reaches("moe-combine"):
        got = _run(layer, x)
    if stand_in is not None:
        (call,) = stand_in.calls  # one kernel for the layer's combine: rows of the expert-major buffer
        experts, top_k = layer.cfg.moe_num_experts, layer.cfg.moe_top_k
        assert call["x"].shape[0] % experts == 0 and call["x"].shape[1] == layer.cfg.hidden_size
        assert list(call["scatter_index"].shape) == [40, top_k]
        if factor:  # dropped choices reach the kernel with weight 0
            assert (call["combine_weights"].numpy() == 0).any()
    tol = GPU_TOL if ON_GPU else 1e-6
    names = ["y", "dx", *(n for n, p in layer.named_parameters() if not p.stop_gradient)]
    for name, a, b in zip(names, got, want):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)


def test_the_gpu_combine_gets_bf16_expert_outputs_as_fp32(monkeypatch):
    """Under AMP the expert outputs are bf16: with model.moe_router_dtype=fp32 (the default) the kernel is handed
    them and the weights in fp32 (it sums in its input dtype), and the result is cast once to bf16; with `amp` it
    gets both in bf16. The tensor-op combine over the same bf16 rows is the reference (1e-6 before the one
    rounding, so equal after it up to one bf16 ulp where a sum sits on a rounding boundary)."""
    from llmtrain.models.dispatch import combine, expert_slots

    paddle.seed(6)
    index = paddle.argsort(paddle.rand([20, 8]), axis=-1)[:, :2]  # [T, k]
    slots = expert_slots(index, 8, capacity=None)
    y = paddle.randn([8, slots.capacity, 16]).astype("bfloat16")  # [E, C, h]
    weight = paddle.nn.functional.softmax(paddle.randn([20, 2]), axis=-1)
    with monkeypatch.context() as cpu:
        cpu.setattr(moe_kernels, "fused_combine_available", lambda: False)
        want = combine(y, slots, weight).astype("float32").numpy()
    if not ON_GPU:
        monkeypatch.setattr(kernels, "on_gpu", lambda: True)
        stand_in = checked(IF.moe_combine, reference_moe_combine, ("x", "combine_weights", "scatter_index"))
        monkeypatch.setattr(IF, "moe_combine", stand_in)
    with reaches("moe-combine"):
        got = combine(y, slots, weight)
        old = combine(y, slots, weight, fp32=False)
    assert got.dtype == old.dtype == paddle.bfloat16
    if not ON_GPU:
        assert [(c["x"].dtype, c["combine_weights"].dtype) for c in stand_in.calls] == [
            (paddle.float32, paddle.float32), (paddle.bfloat16, paddle.bfloat16)]
    np.testing.assert_allclose(got.astype("float32").numpy(), want, rtol=2**-7, atol=0)
    # summed in bf16, the kernel rounds every product and partial sum: further from the fp32 sum
    assert np.abs(old.astype("float32").numpy() - want).max() > np.abs(got.astype("float32").numpy() - want).max()


def test_another_paddle_release_falls_back_to_the_tensor_ops(monkeypatch):
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    monkeypatch.setattr(paddle, "__version__", "3.4.0")
    monkeypatch.setattr(moe_kernels, "_WARNED", False)
    called = []
    monkeypatch.setattr(IF, "moe_combine", lambda *a, **k: called.append(a))
    with pytest.warns(UserWarning, match="moe_combine kernel was read in paddle 3.3.1"):
        assert not moe_kernels.fused_combine_available()
    assert not moe_kernels.fused_combine_available()  # warned once
    layer = _layer(0.0)
    layer(paddle.randn([1, 8, layer.cfg.hidden_size]))
    assert called == []
