"""GPU-only branch `fused-rope`: `model.fuse_rope` (on by default on GPU) through Paddle's fused rotary kernel.

    python -m pytest tests/gpu_paths/test_fused_rope.py -q

Paddle 3.3.1's CPU build has no kernel for `fused_rotary_position_embedding`; the rehearsal replaces it by the
checked reference of tests/gpu_paths/gpu_references.py, which also makes the GPU kernel's shape checks
(fused_rope_kernel.cu: sin/cos [1, S, 1, d] in q's dtype, S == s without position_ids, S >= s with them, every
position inside the table). Checked: `Rotary.apply_qk` fused equals the unfused rotation for positions 0..s-1,
packed positions restarting per example and positions past a prefix (decoding), with GQA; and the tiny Llama's
logits and gradients with the GPU default. On a GPU the real kernel runs (fp32; bound `GPU_TOL`, not measured).
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF
import pytest

import gpu_references as ref
from gpu_rehearsal import ON_GPU, checked, reaches
from llmtrain.models import build_model
from llmtrain.models.config import FUSE_SWITCHES
from llmtrain.models.init import init_parameters
from llmtrain.models.layers import Rotary
from llmtrain.models.stages import canonical_parameters
from llmtrain.paddle_compat import kernels

GPU_TOL = 1e-5
"""|fused - unfused| relative to the largest value, fp32 on a GPU: not yet measured."""


@pytest.fixture
def gpu(monkeypatch):
    if ON_GPU:
        return None
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    stand_in = checked(IF.fused_rotary_position_embedding, ref.fused_rotary_position_embedding, ref.ROPE_ARGS)
    monkeypatch.setattr(IF, "fused_rotary_position_embedding", stand_in)
    return stand_in


def _close(got, want, tol=None):
    tol = (GPU_TOL if ON_GPU else 1e-6) if tol is None else tol
    assert float(np.abs(got - want).max()) <= tol * max(1.0, float(np.abs(want).max()))


POSITIONS = {
    "none": None,
    "packed": np.array([[0, 1, 2, 3, 0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]]),
    "offset": np.array([[20 + i for i in range(10)], [5 + i for i in range(10)]]),
}


@pytest.mark.parametrize("kind", sorted(POSITIONS))
def test_apply_qk_fused_equals_unfused(gpu, kind):
    rng = np.random.default_rng(4)
    q = paddle.to_tensor(rng.standard_normal((2, 10, 4, 16)).astype(np.float32))
    k = paddle.to_tensor(rng.standard_normal((2, 10, 2, 16)).astype(np.float32))
    pos = None if POSITIONS[kind] is None else paddle.to_tensor(POSITIONS[kind])
    fused, plain = Rotary(16, 10000.0, fused=True, max_positions=32), Rotary(16, 10000.0, max_positions=32)
    with reaches("fused-rope"):
        got_q, got_k = fused.apply_qk(q, k, pos)
    want_q, want_k = plain.apply_qk(q, k, pos)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    _close(got_q.numpy(), want_q.numpy())
    _close(got_k.numpy(), want_k.numpy())
    if gpu is not None:
        (call,) = gpu.calls
        assert call["use_neox_rotary_style"] is False and call["v"] is None


def test_model_with_the_gpu_default_equals_unfused(gpu, tiny_llama):
    others = {k: "false" for k in FUSE_SWITCHES if k != "fuse_rope"}
    fused = dataclasses.replace(tiny_llama, fuse_rope="auto", **others)
    plain = dataclasses.replace(fused, fuse_rope="false")
    assert fused.fused("fuse_rope") and not plain.fused("fuse_rope")
    ids = paddle.to_tensor(np.random.default_rng(6).integers(0, fused.vocab_size, (2, 12)))
    out = {}
    for name, cfg in (("fused", fused), ("plain", plain)):
        paddle.seed(0)
        model = build_model(cfg)
        params = canonical_parameters(model)
        init_parameters(params, cfg, 9)
        with reaches("fused-rope") if name == "fused" else contextlib.nullcontext():
            logits = model(ids)
        logits.sum().backward()
        out[name] = logits.numpy(), {n: p.grad.numpy() for n, p in params}
    _close(out["fused"][0], out["plain"][0], GPU_TOL if ON_GPU else 1e-5)
    for n, g in out["plain"][1].items():
        _close(out["fused"][1][n], g, GPU_TOL if ON_GPU else 1e-5)

