"""CPU rehearsal of `GPU-ONLY(flashmask-window)` (llmtrain/models/layers.py `flash_attention_gpu`): a causal sliding
window (and packed examples) through Paddle's flashmask attention with per-key first masked rows.

    python -m pytest tests/gpu_paths/test_flashmask_window.py -q

Paddle 3.3.1's `flashmask_attention` has no CPU kernel, so the branch runs here with it replaced by a reference of
its documented causal semantics (startend_row_indices [b, 1, s, 1]: for key column j, rows >= the value are masked;
rows < j are masked by causality), after the call's arguments are bound to the installed function's signature. The
branch must equal the math path's windowed attention, with and without packed segments.
"""
from __future__ import annotations

import inspect

import numpy as np
import paddle
import pytest

import paddle.nn.functional.flash_attention as fa
from gpu_rehearsal import reaches
from llmtrain.models.layers import flash_attention_gpu, math_attention

REAL = fa.flashmask_attention


def reference_flashmask(query, key, value, startend_row_indices=None, *, causal=False, **kw):
    inspect.signature(REAL).bind(query, key, value, startend_row_indices, causal=causal, **kw)  # a call Paddle takes
    assert causal and list(startend_row_indices.shape)[1:] == [1, query.shape[1], 1]
    assert startend_row_indices.dtype == paddle.int32
    b, s, nh, d = query.shape
    rows = np.arange(s)[:, None]
    start = startend_row_indices.numpy()[:, 0, :, 0]  # [b, s_k]
    allowed = (rows >= np.arange(s)[None, :])[None] & (rows[None] < start[:, None, :])  # [b, s_q, s_k]
    q, k, v = (t.numpy().astype(np.float64) for t in (query, key, value))
    g = nh // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d) + np.where(allowed[:, None], 0.0, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return paddle.to_tensor(np.einsum("bhqk,bkhd->bqhd", p, v).astype(np.float32))


@pytest.mark.parametrize("packed", [False, True])
def test_windowed_flashmask_branch_equals_the_math_path(packed, monkeypatch):
    monkeypatch.setattr(fa, "flashmask_attention", reference_flashmask)
    rng = np.random.default_rng(0)
    q = paddle.to_tensor(rng.standard_normal([2, 24, 4, 8]).astype(np.float32))
    k, v = (paddle.to_tensor(rng.standard_normal([2, 24, 2, 8]).astype(np.float32)) for _ in range(2))
    seg = paddle.to_tensor(np.array([[0] * 10 + [1] * 14, [0] * 24])) if packed else None
    with reaches("flashmask-window"):
        got = flash_attention_gpu(q, k, v, True, None, seg, window=5).numpy()
    want = math_attention(q, k, v, True, None, seg, window=5).numpy()
    assert np.abs(got - want).max() < 1e-5
    full = math_attention(q, k, v, True, None, seg).numpy()
    assert np.abs(full - want).max() > 1e-2  # the window changed the result
