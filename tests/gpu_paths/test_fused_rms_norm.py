"""GPU-only branch `fused-rms-norm`: `model.fuse_rms_norm` (on by default on GPU) through Paddle's fused kernel.

    python -m pytest tests/gpu_paths/test_fused_rms_norm.py -q

On CPU Paddle 3.3.1's kernel dies with SIGILL on AVX2-only machines (llmtrain/paddle_compat/kernels.py), so the
rehearsal replaces `paddle.incubate.nn.functional.fused_rms_norm` by the checked reference of
tests/gpu_paths/gpu_references.py and lets llmtrain believe it runs on a GPU: the tiny Llama's logits and every
gradient with the fused norm (the `auto` default on a GPU) equal the unfused norm's, and the layer alone equals
it on a [b, s, h] input. On a GPU the real kernel runs (fp32; bound `GPU_TOL`, not yet measured).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF
import pytest

import gpu_references as ref
from gpu_rehearsal import ON_GPU, checked, reaches
from llmtrain.contracts.steps import mean_loss
from llmtrain.models import build_model
from llmtrain.models.config import FUSE_SWITCHES
from llmtrain.models.init import init_parameters
from llmtrain.models.layers import RMSNorm
from llmtrain.models.stages import canonical_parameters
from llmtrain.paddle_compat import kernels

GPU_TOL = 1e-4
"""|fused - unfused| relative to the largest value, fp32 on a GPU: not yet measured."""


@pytest.fixture
def gpu(monkeypatch):
    if ON_GPU:
        return None
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    stand_in = checked(IF.fused_rms_norm, ref.fused_rms_norm, ref.RMS_NORM_ARGS)
    monkeypatch.setattr(IF, "fused_rms_norm", stand_in)
    return stand_in


def _step(cfg, ids, labels):
    paddle.seed(0)
    model = build_model(cfg)
    params = canonical_parameters(model)
    init_parameters(params, cfg, 5)
    for name, p in params:  # norm weights away from 1, so that a dropped weight shows
        if "norm" in name:
            p.set_value(p + paddle.uniform(p.shape, min=-0.5, max=0.5, seed=len(name)))
    logits = model(ids)
    mean_loss(model.loss_fn(logits, (labels, paddle.ones(labels.shape, dtype="float32")))).backward()
    return logits.numpy(), {name: p.grad.numpy() for name, p in params}


def _close(got, want, tol):
    assert float(np.abs(got - want).max()) <= tol * max(1.0, float(np.abs(want).max()))


def test_model_with_the_gpu_default_equals_the_unfused_norm(gpu, tiny_llama):
    others = {k: "false" for k in FUSE_SWITCHES if k != "fuse_rms_norm"}
    fused = dataclasses.replace(tiny_llama, fuse_rms_norm="auto", norm_eps=1e-5, **others)
    plain = dataclasses.replace(fused, fuse_rms_norm="false")
    assert fused.fused("fuse_rms_norm") and not plain.fused("fuse_rms_norm")
    rng = np.random.default_rng(2)
    ids = paddle.to_tensor(rng.integers(0, fused.vocab_size, (2, 10)))
    labels = paddle.to_tensor(rng.integers(0, fused.vocab_size, (2, 10)))
    with reaches("fused-rms-norm"):
        logits, grads = _step(fused, ids, labels)
    if gpu is not None:  # every norm of the model went through the kernel: 2 per block and the final one
        assert len(gpu.calls) == 2 * fused.num_layers + 1
        assert {c["begin_norm_axis"] for c in gpu.calls} == {2} and {c["epsilon"] for c in gpu.calls} == {1e-5}
    want_logits, want_grads = _step(plain, ids, labels)
    tol = GPU_TOL if ON_GPU else 1e-5
    _close(logits, want_logits, tol)
    for name in want_grads:
        _close(grads[name], want_grads[name], 10 * tol)


@pytest.mark.parametrize("shape", [[2, 5, 24], [7, 24]])
def test_layer_equals_the_unfused_norm(gpu, shape):
    x = paddle.to_tensor(np.random.default_rng(1).standard_normal(shape).astype(np.float32) * 3)
    fused, plain = RMSNorm(24, 1e-6, fused=True), RMSNorm(24, 1e-6)
    w = paddle.to_tensor(np.linspace(0.5, 1.5, 24).astype(np.float32))
    fused.weight.set_value(w)
    plain.weight.set_value(w)
    with reaches("fused-rms-norm"):
        got = fused(x)
    assert got.shape == x.shape
    _close(got.numpy(), plain(x).numpy(), GPU_TOL if ON_GPU else 1e-6)
