"""CPU rehearsal of `GPU-ONLY(fused-rope-scaled)` (llmtrain/models/layers.py `Rotary.apply_qk`): the fused RoPE kernel
gets the scaled (YaRN, dynamic NTK, ...) cos/sin table, rows picked by position_ids.

    python -m pytest tests/gpu_paths/test_fused_rope_scaled.py -q

Paddle 3.3.1's `fused_rotary_position_embedding` has no CPU kernel: here it is replaced by a reference of its
rotate-half form (use_neox_rotary_style=False) that gathers the table's rows at position_ids, after binding the
call to the installed function's signature. The fused branch must equal the unfused one for every scaling kind,
with positions past the original length and packed positions.
"""
from __future__ import annotations

import inspect

import numpy as np
import paddle
import pytest

import paddle.incubate.nn.functional as inc
from llmtrain.models.config import RopeScaling
from gpu_rehearsal import reaches
from llmtrain.models.layers import Rotary

REAL = inc.fused_rotary_position_embedding


def reference_fused_rope(q, k=None, v=None, sin=None, cos=None, position_ids=None, use_neox_rotary_style=True,
                         time_major=False, rotary_emb_base=10000.0):
    inspect.signature(REAL).bind(q, k, v, sin=sin, cos=cos, position_ids=position_ids,
                                 use_neox_rotary_style=use_neox_rotary_style)
    assert not use_neox_rotary_style  # rotate-half, as llmtrain calls it
    c, s_ = cos[0, :, 0], sin[0, :, 0]  # [P, d]
    if position_ids is None:
        c, s_ = c[: q.shape[1]][None, :, None], s_[: q.shape[1]][None, :, None]
    else:
        c = paddle.gather(c, position_ids.reshape([-1])).reshape([*position_ids.shape, 1, -1])
        s_ = paddle.gather(s_, position_ids.reshape([-1])).reshape([*position_ids.shape, 1, -1])

    def rot(x):
        x1, x2 = x.chunk(2, axis=-1)
        return x * c + paddle.concat([-x2, x1], axis=-1) * s_

    return rot(q), rot(k), None


SCALINGS = [RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=16),
            RopeScaling(type="dynamic", factor=2.0, original_max_position_embeddings=16),
            RopeScaling(type="llama3", factor=8.0, original_max_position_embeddings=16),
            RopeScaling(type="linear", factor=2.0)]


@pytest.mark.parametrize("scaling", SCALINGS, ids=[r.type for r in SCALINGS])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_rope_takes_the_scaled_table(scaling, packed, monkeypatch):
    monkeypatch.setattr(inc, "fused_rotary_position_embedding", reference_fused_rope)
    rng = np.random.default_rng(0)
    q = paddle.to_tensor(rng.standard_normal([2, 40, 4, 16]).astype(np.float32))
    k = paddle.to_tensor(rng.standard_normal([2, 40, 2, 16]).astype(np.float32))
    pos = paddle.to_tensor(np.tile(np.concatenate([np.arange(30), np.arange(10)]), (2, 1))) if packed else None
    with reaches("fused-rope-scaled"):
        fused = Rotary(16, 10000.0, fused=True, max_positions=64, scaling=scaling).apply_qk(q, k, pos)
    plain = Rotary(16, 10000.0, fused=False, max_positions=64, scaling=scaling).apply_qk(q, k, pos)
    unscaled = Rotary(16, 10000.0, fused=False, max_positions=64).apply_qk(q, k, pos)
    for a, b, u in zip(fused, plain, unscaled):
        assert np.abs(a.numpy() - b.numpy()).max() < 1e-6
        assert np.abs(b.numpy() - u.numpy()).max() > 1e-2  # the scaling is in the table
