"""Per-rank memory accounting helpers (llmtrain/train/memory.py) on one process.

    python -m pytest tests/train/test_memory.py -q

The layouts themselves are checked on real runs by tests/parallel/test_parity.py.
"""
from __future__ import annotations

import paddle

from llmtrain.train.memory import _span, _union_bytes


def test_views_of_one_buffer_count_once():
    buf = paddle.zeros([10], dtype="float32")  # [10] fp32: 40 bytes
    head, tail = buf._slice(0, 6), buf._slice(4, 10)  # [6] and [6], overlapping in [4, 6)
    other = paddle.zeros([3], dtype="float32")
    assert _union_bytes([_span(head), _span(tail)]) == 40
    assert _union_bytes([_span(head), _span(other)]) == 24 + 12
    assert _union_bytes([_span(buf), _span(head), _span(tail)]) == 40
    assert _union_bytes([]) == 0
