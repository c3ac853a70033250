"""CPU rehearsal of GPU-ONLY(cp-flash): the all-gather exchange's query chunks through flashmask attention.

    python -m pytest tests/gpu_paths/test_cp_flash.py -q

On GPU each local query chunk attends to the gathered keys up to its end through
`paddle.nn.functional.flash_attention.flashmask_attention` with a column-wise bidirectional mask
(`context_exchange._flash_prefix`). Here flashmask is replaced by a math reference of its documented semantics
(`causal=False`, startend_row_indices [b, h, sk, 2]: key j is masked for rows >= [..., 0] and for rows < [..., 1])
with the installed function's signature, and for every query chunk of cp2 and cp3 layouts, with and without
documents, the result must equal the CPU kernel with the causal and document mask built from sequence indices.
"""
from __future__ import annotations

import inspect

import numpy as np
import paddle
import pytest

from llmtrain.parallel.context_chunks import ChunkLayout
from llmtrain.parallel.context_attention import block_forward, keep_mask
from llmtrain.parallel.context_exchange import _flash_prefix


def ref_flashmask_attention(query, key, value, startend_row_indices=None, *, dropout=0.0, causal=False,
                            window_size=None, return_softmax_lse=False, return_seed_offset=False,
                            fixed_seed_offset=None, rng_name="", training=True, name=None, softmax_scale=None,
                            block_mask=None):
    assert not causal and startend_row_indices.shape[-1] == 2 and startend_row_indices.dtype == paddle.int32
    sq = query.shape[1]
    rows = paddle.arange(sq, dtype="int32").reshape([1, sq, 1])  # [1, sq, 1]
    lower, upper = startend_row_indices[:, 0, :, 0], startend_row_indices[:, 0, :, 1]  # [b, sk]
    keep = paddle.logical_and(rows < lower.unsqueeze(1), rows >= upper.unsqueeze(1))  # [b, sq, sk]
    return block_forward(query, key, value, keep)[0]


def _params(f):
    return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]


def test_the_reference_has_flashmask_attentions_signature():
    from paddle.nn.functional.flash_attention import flashmask_attention

    assert _params(ref_flashmask_attention) == _params(flashmask_attention)


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("documents", [False, True])
def test_flashmask_prefix_equals_the_cpu_prefix(cp, documents, monkeypatch):
    import paddle.nn.functional.flash_attention as fa

    monkeypatch.setattr(fa, "flashmask_attention", ref_flashmask_attention)
    layout = ChunkLayout(seq_len=2 * cp * 4, cp=cp)
    c, s = layout.chunk, layout.seq_len
    paddle.seed(2)
    k, v = paddle.randn([2, s, 2, 8]), paddle.randn([2, s, 2, 8])
    lengths = [5, 9, s]  # documents of the sequence (the last one runs to the end)
    seg = paddle.to_tensor(np.repeat(np.repeat(np.arange(3), [5, 9, s - 14])[None], 2, 0)) if documents else None
    assert sum(lengths[:2]) < s
    for i in range(2 * cp):  # query chunk i (on some rank) over the keys up to its end
        q = paddle.randn([2, c, 4, 8])
        end = (i + 1) * c
        got = _flash_prefix(q, k[:, :end], v[:, :end], True, seg, i * c)
        keep = keep_mask(paddle.arange(i * c, end), paddle.arange(end), True,
                         None if seg is None else seg[:, i * c:end], None if seg is None else seg[:, :end])
        want = block_forward(q, k[:, :end], v[:, :end], keep)[0]
        assert float((got - want).abs().max()) <= 1e-6, (cp, documents, i)
