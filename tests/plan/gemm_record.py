"""Records the GEMMs llmtrain's Paddle model calls from Python (shapes), for tests/plan/test_op_sequence.py and
test_twin_ops.py.

    record = _Record(monkeypatch)      # before the model is built (layers keep references to the functions)
    record.on = True; loss = model(...); record.on = False; record.shapes   # [(m, n, k, batch), ...]
"""
from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F
from paddle.distributed.fleet import utils as fleet_utils


def _shape(x, y, transpose_x=False, transpose_y=False) -> tuple:
    """(m, n, k, batch) of x @ y as the planner writes a GEMM: a 2-D right operand folds x's leading dims into m."""
    xs, ys = list(x.shape), list(y.shape)
    if transpose_x:
        xs[-2], xs[-1] = xs[-1], xs[-2]
    if transpose_y:
        ys[-2], ys[-1] = ys[-1], ys[-2]
    if len(ys) == 2:
        return math.prod(xs[:-1]), ys[-1], xs[-1], 1
    return xs[-2], ys[-1], xs[-1], math.prod(xs[:-2])


class _Record:
    """Patches paddle.matmul, paddle.bmm, F.linear and the math attention core (before the model is built: layers
    keep references) to record each GEMM's shape while `on` (`in_core`: called inside the core), and fleet's
    recompute (imported by `llmtrain.models.recompute.checkpointed` at each call) to mark the GEMMs run inside a
    recomputed function (`again`: its second run, in the backward)."""

    def __init__(self, monkeypatch, mine=lambda: True):
        self.on, self.shapes, self.inside, self.again, self.core = False, [], 0, [], 0
        self.in_core = []  # per recorded shape: called inside the math attention core
        matmul, bmm, linear = paddle.matmul, paddle.bmm, F.linear
        recompute = fleet_utils.recompute

        def add(shape):
            if self.on and mine():  # `mine`: the calling thread is the one traced (a cp rank of threads)
                self.shapes.append(shape)
                self.in_core.append(self.core > 0)
                if self.inside:
                    self.again.append(shape)

        def rec_matmul(x, y, transpose_x=False, transpose_y=False, name=None):
            add(_shape(x, y, transpose_x, transpose_y))
            return matmul(x, y, transpose_x, transpose_y, name)

        def rec_bmm(x, y, name=None):
            add(_shape(x, y))
            return bmm(x, y, name)

        def rec_linear(x, weight, bias=None, name=None):
            add(_shape(x, weight))
            return linear(x, weight, bias, name)

        def rec_recompute(fn, *args, **kwargs):
            def marked(*a, **k):
                self.inside += 1
                try:
                    return fn(*a, **k)
                finally:
                    self.inside -= 1

            return recompute(marked, *args, **kwargs)

        monkeypatch.setattr(paddle, "matmul", rec_matmul)
        monkeypatch.setattr(paddle, "bmm", rec_bmm)
        monkeypatch.setattr(F, "linear", rec_linear)
        monkeypatch.setattr(fleet_utils, "recompute", rec_recompute)
        from llmtrain.models import layers, mla

        math_attention = layers.math_attention

        def rec_core(*args, **kwargs):  # (read by choose_attention when a layer is built)
            self.core += 1
            try:
                return math_attention(*args, **kwargs)
            finally:
                self.core -= 1

        monkeypatch.setattr(layers, "math_attention", rec_core)
        monkeypatch.setattr(mla, "math_attention", rec_core)  # (MLA tells the math core apart by identity)
