"""Collectives over every rank of the job, in the few forms the divergence guard and the checkpointer use.

    python -m pytest -q tests/train/test_guard_fast.py      # the same code against a scripted stand-in
    comm = JobComm(topo.world)
    comm.all_reduce_sum(t)               # in place over the whole job (a no-op on one process)
    step = comm.broadcast_ints([7])[0]   # rank 0's values on every rank (the others pass None)

Every rank must make the same calls in the same order. `JobComm` goes through `paddle.distributed` on the
default (global) group; code that takes a `comm` argument runs unchanged against any object with these two
methods and `world`, such as the scripted ranks of tests/train/fake_job.py (one process playing rank 1 of 2).
"""
from __future__ import annotations

from typing import Optional

import paddle
import paddle.distributed as dist


class JobComm:
    """The job-wide all-reduce and broadcast (identities on one process)."""

    def __init__(self, world: int):
        self.world = world

    def all_reduce_sum(self, t: paddle.Tensor) -> paddle.Tensor:
        """Sum `t` over every rank, in place; returns it."""
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def broadcast_ints(self, values: Optional[list], src: int = 0) -> list[int]:
        """Rank `src`'s list of ints on every rank (two broadcasts: the length, then the values)."""
        if self.world == 1:
            return [int(v) for v in values]
        n = paddle.to_tensor([len(values) if values is not None else 0], dtype="int64")
        dist.broadcast(n, src=src)
        count = int(n.numpy()[0])
        if count == 0:
            return []
        data = paddle.to_tensor(list(values) if values is not None else [0] * count, dtype="int64")
        dist.broadcast(data, src=src)
        return [int(v) for v in data.numpy().tolist()]
