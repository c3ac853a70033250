"""GPU-only branch `mla-value-pad`: multi-head latent attention on a GPU pads its values to the q/k head width.

    python -m pytest tests/gpu_paths/test_mla_value_pad.py -q

DeepSeek's MLA has q/k heads of d_nope + d_rope and value heads of d_v; Paddle's flash kernels take one head width
for q, k and v, so on a GPU (`auto`, `flash`) `MLAttention` wraps its core in `padded_value_core`
(llmtrain/models/mla.py). On CPU llmtrain is told it runs on a GPU, the core is handed fp16 q/k/v as under AMP O2,
and flash attention, flashmask attention and SDPA are the checked references of tests/gpu_paths/gpu_references.py,
which refuse q, k, v of different widths as the kernels do. For a plain batch (flash attention), a packed one
(segment ids and restarting positions: flashmask) and one with an additive key-padding mask (SDPA), the layer's
output and every gradient equal the CPU path's (`math`, unpadded, the same roundings), so the padded core must
hand the kernel the mask and the segments as well. On a GPU the real kernels run (bound `GPU_TOL`, not measured).
"""
from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import gpu_references as ref
from gpu_rehearsal import ON_GPU, LowPrecisionCore, RoundedCore, checked, reaches
from llmtrain.models.config import FUSE_SWITCHES, ModelConfig
from llmtrain.models.mla import MLAttention
from llmtrain.paddle_compat import kernels

FA = importlib.import_module("paddle.nn.functional.flash_attention")
GPU_TOL = 5e-2
CPU_TOL = 4 * 2.0**-11
"""Relative to the largest entry: both paths round q, k, v and the output to fp16 at the same points (a value on a
rounding boundary may land one fp16 unit apart)."""
CFG = ModelConfig(name="t-mla", hidden_size=32, num_layers=1, num_heads=4, ffn_hidden_size=48, vocab_size=64,
                  max_position_embeddings=64, position="rope", norm="rmsnorm", norm_eps=1e-6, activation="swiglu",
                  bias=False, tie_embeddings=False, mla_kv_lora_rank=16, mla_q_lora_rank=12, mla_qk_nope_head_dim=8,
                  mla_qk_rope_head_dim=4, mla_v_head_dim=6, **{k: "false" for k in FUSE_SWITCHES})


@pytest.fixture
def gpu(monkeypatch):
    if ON_GPU:
        return None
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    stand_ins = {"flash": checked(FA.flash_attention, ref.flash_attention, ref.FLASH_ARGS),
                 "flashmask": checked(FA.flashmask_attention, ref.flashmask_attention, ref.FLASHMASK_ARGS),
                 "sdpa": checked(F.scaled_dot_product_attention, ref.scaled_dot_product_attention, ref.SDPA_ARGS)}
    monkeypatch.setattr(FA, "flash_attention", stand_ins["flash"])
    monkeypatch.setattr(FA, "flashmask_attention", stand_ins["flashmask"])
    monkeypatch.setattr(F, "scaled_dot_product_attention", stand_ins["sdpa"])
    return stand_ins


SEGMENTS = np.array([[0, 0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1, 1]])
"""Packed rows of 3 and 2 examples (ids non-decreasing along the row)."""
KERNEL = {"plain": "flash", "packed": "flashmask", "padding-mask": "sdpa"}
"""batch kind -> the kernel it reaches on a GPU."""


def _inputs(kind: str) -> dict:
    """MLAttention.forward's inputs besides x for a batch kind."""
    if kind == "packed":
        starts = np.stack([np.searchsorted(r, r) for r in SEGMENTS])  # first position of each position's example
        return {"segments": paddle.to_tensor(SEGMENTS), "positions": paddle.to_tensor(np.arange(9)[None, :] - starts)}
    if kind == "padding-mask":  # additive [b, 1, 1, s]: row 1's last three keys are padding
        mask = np.zeros((2, 1, 1, 9), np.float32)
        mask[1, ..., 6:] = -1e4
        return {"mask": paddle.to_tensor(mask)}
    return {}


def _layer_step(cfg, roles, x, kind):
    paddle.seed(3)
    layer = MLAttention(cfg, roles)
    xt = paddle.to_tensor(x, stop_gradient=False)
    out = layer(xt, **_inputs(kind))
    (out * paddle.to_tensor(np.linspace(-1, 1, out.size, dtype=np.float32).reshape(out.shape))).sum().backward()
    return out.numpy(), {n: p.grad.numpy() for n, p in layer.named_parameters()} | {"x": xt.grad.numpy()}


@pytest.mark.parametrize("kind", sorted(KERNEL))
def test_mla_through_auto_pads_values_and_equals_the_cpu_path(gpu, kind):
    x = np.random.default_rng(1).standard_normal((2, 9, 32)).astype(np.float32)
    with reaches("mla-value-pad"):
        out, grads = _layer_step(dataclasses.replace(CFG, attention="auto"), LowPrecisionCore("float16"), x, kind)
    if gpu is not None:  # only this batch's kernel ran, and it saw one width for q, k and v: d_nope + d_rope = 12
        assert {name: len(s.calls) for name, s in gpu.items()} == {n: int(n == KERNEL[kind]) for n in gpu}
        assert gpu[KERNEL[kind]].calls[0]["value"].shape[-1] == 12
    want, want_grads = _layer_step(dataclasses.replace(CFG, attention="math"), RoundedCore("float16"), x, kind)
    tol = GPU_TOL if ON_GPU else CPU_TOL
    assert out.shape == want.shape and np.abs(out - want).max() <= tol * np.abs(want).max()
    for name, g in want_grads.items():
        assert np.abs(grads[name] - g).max() <= tol * max(np.abs(g).max(), 1e-6), name
