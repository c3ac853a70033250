"""Fused paths (`model.fuse_*`) equal their unfused references on CPU where Paddle 3.3.1's CPU build has them.

    python -m pytest tests/models/test_fused.py -q

fuse_swiglu (Paddle's swiglu kernel), fuse_qkv and fuse_ffn (one matmul of concatenated
weights) run here: forward and every gradient are compared with the unfused path on the
same weights. fuse_rms_norm and fuse_rope have no working CPU kernel (see
llmtrain/paddle_compat/kernels.py) and are refused on CPU; on a GPU (scripts/gpu_acceptance.sh
runs this file there) every switch is compared, in fp32.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import pytest

from llmtrain.config import compose_config, to_config
from llmtrain.models import build_model
from llmtrain.models.config import FUSE_SWITCHES, fusion_problems
from llmtrain.models.decoder import canonical_parameters
from llmtrain.models.init import init_parameters
from llmtrain.paddle_compat.kernels import CPU_KERNELS, on_gpu

FUSIONS = {k: "true" for k in FUSE_SWITCHES if on_gpu() or CPU_KERNELS[k]}
"""Every switch on GPU (scripts/gpu_acceptance.sh runs this file there); on CPU the three with CPU kernels."""


def _run(cfg, ids, labels):
    paddle.seed(0)
    model = build_model(cfg)
    init_parameters(canonical_parameters(model), cfg, 11)
    logits = model(ids)
    loss = model.loss_fn(logits, (labels, paddle.ones(labels.shape, dtype="float32")))
    loss.backward()
    grads = {name: p.grad.numpy() for name, p in canonical_parameters(model)}
    return logits.numpy(), grads


@pytest.mark.parametrize("bias", [False, True])
def test_fusions_equal_unfused_forward_and_grads(tiny_llama, bias):
    base = dataclasses.replace(tiny_llama, bias=bias, **{k: "false" for k in FUSE_SWITCHES})
    fused = dataclasses.replace(base, **FUSIONS)
    assert all(fused.fused(k) for k in FUSIONS) and not any(base.fused(k) for k in FUSE_SWITCHES)
    rng = np.random.default_rng(3)
    ids = paddle.to_tensor(rng.integers(0, base.vocab_size, (2, 12)))
    labels = paddle.to_tensor(rng.integers(0, base.vocab_size, (2, 12)))
    ref_logits, ref_grads = _run(base, ids, labels)
    got_logits, got_grads = _run(fused, ids, labels)
    assert sorted(got_grads) == sorted(ref_grads)  # canonical names unchanged: q_proj/k_proj/v_proj, gate/up
    np.testing.assert_allclose(got_logits, ref_logits, rtol=0, atol=1e-5)
    for name in ref_grads:
        np.testing.assert_allclose(got_grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_swiglu_kernel_alone():
    from llmtrain.paddle_compat.kernels import swiglu

    rng = np.random.default_rng(0)
    g = paddle.to_tensor(rng.standard_normal((3, 5, 8)).astype("float32"), stop_gradient=False)
    u = paddle.to_tensor(rng.standard_normal((3, 5, 8)).astype("float32"), stop_gradient=False)
    out = swiglu(g, u)
    (out * out).sum().backward()
    dg, du = g.grad.numpy(), u.grad.numpy()
    g.clear_grad(), u.clear_grad()
    ref = paddle.nn.functional.silu(g) * u
    (ref * ref).sum().backward()
    np.testing.assert_allclose(out.numpy(), ref.numpy(), atol=1e-6)
    np.testing.assert_allclose(dg, g.grad.numpy(), atol=1e-5)
    np.testing.assert_allclose(du, u.grad.numpy(), atol=1e-5)


def test_auto_is_off_on_cpu_and_gpu_only_switches_refused(tiny_llama, tiny_gpt):
    assert all(tiny_llama.fused(k) == on_gpu() for k in FUSE_SWITCHES)  # auto: on for GPU only
    assert fusion_problems(tiny_llama, on_gpu=False) == []
    forced = dataclasses.replace(tiny_llama, fuse_rms_norm="true", fuse_rope="True", fuse_qkv="yes")
    problems = fusion_problems(forced, on_gpu=False)
    assert any("model.fuse_rms_norm=true: GPU-only" in p for p in problems), problems
    assert any("model.fuse_rope=true: GPU-only" in p for p in problems), problems
    assert any("model.fuse_qkv='yes': expected auto, true or false" in p for p in problems), problems
    assert fusion_problems(dataclasses.replace(forced, fuse_qkv="auto"), on_gpu=True) == []
    gpt = dataclasses.replace(tiny_gpt, fuse_rms_norm="true", fuse_swiglu="true")
    problems = fusion_problems(gpt, on_gpu=True)
    assert "model.fuse_rms_norm=true needs model.norm=rmsnorm (this model has norm=layernorm)" in problems
    assert "model.fuse_swiglu=true needs model.activation=swiglu (this model has activation=gelu_tanh)" in problems


def test_hydra_switches_compose():
    cfg = to_config(compose_config(["model=llama-tiny", "model.fuse_qkv=true", "model.fuse_ffn=false"]))
    assert cfg.model.fused("fuse_qkv") and not cfg.model.fused("fuse_ffn") and cfg.model.fused("fuse_rope") == on_gpu()
