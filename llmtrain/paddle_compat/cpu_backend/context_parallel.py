"""Context-parallel collectives on CPU: `llmtrain.paddle_compat.collectives` rebuilt from gloo's all-gather and
all-reduce.

Use: installed by `llmtrain.paddle_compat.cpu_backend.install()`; afterwards the context-parallel exchanges
(llmtrain/parallel/context_exchange.py) run on CPU processes of `python -m paddle.distributed.launch`.

Why. Paddle 3.3.1's ProcessGroupGloo implements all_gather, all_reduce, broadcast, gather, scatter, reduce, send
and recv, but no reduce-scatter and no all-to-all (`dist.reduce_scatter` / `dist.alltoall` raise), and its
send/recv are synchronous rendezvous matched by one tag counter per group, so the NCCL-style "post the ring's send
and receive, then wait" (`batch_isend_irecv`) deadlocks. The stand-ins give the same numbers with more traffic:

  reduce_scatter(x [n k, ...])  all_reduce (sum) of x, then this rank's rows: n x the bytes of a reduce-scatter
  all_to_all(pieces)            all_gather of every rank's stacked pieces, then piece `rank` of each: n x the bytes
  ring_shift(tensors)           all_gather of each tensor, then the previous rank's: n x the bytes of one send,
                                done at once (nothing overlaps on CPU); `wait()` returns it

On GPU none of this is installed and the NCCL forms in `collectives.py` run.
"""
from __future__ import annotations

import paddle
import paddle.distributed as dist

from .. import collectives
from ..patching import replace


def _contiguous(x):
    return x if x.is_contiguous() else x.contiguous()


def reduce_scatter(x, group):
    """x [n k, ...] partial sums -> this rank's rows [k, ...] of the sum."""
    total = x.clone()
    dist.all_reduce(total, group=group)
    k = x.shape[0] // group.nranks
    return total[group.rank * k:(group.rank + 1) * k].clone()


def all_to_all(pieces: list, group) -> list:
    """pieces[j] to rank j; returns the piece every rank sent here, in rank order."""
    gathered: list = []
    dist.all_gather(gathered, _contiguous(paddle.stack(pieces)), group=group)  # [n, ...] from each rank
    return [g[group.rank].clone() for g in gathered]


class _DoneShift:
    """A ring shift already completed (what `collectives.RingShift.wait()` returns)."""

    def __init__(self, received: list):
        self.received = received

    def wait(self) -> list:
        return self.received


def ring_shift(tensors: list, group):
    """The previous rank's `tensors` (the group's rank order is the ring)."""
    prev = (group.rank - 1) % group.nranks
    received = []
    for t in tensors:
        gathered: list = []
        dist.all_gather(gathered, _contiguous(t), group=group)
        received.append(gathered[prev])
    return _DoneShift(received)


def install_patches() -> None:
    replace(collectives, "reduce_scatter", reduce_scatter)
    replace(collectives, "all_to_all", all_to_all)
    replace(collectives, "ring_shift", ring_shift)
