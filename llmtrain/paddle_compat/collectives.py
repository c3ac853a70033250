"""The collectives context parallelism needs beyond all-gather/all-reduce, one module so the CPU stand-ins can
replace them: reduce-scatter, all-to-all and the ring shift (send to the next rank, receive from the previous).

    from llmtrain.paddle_compat import collectives
    rows = collectives.reduce_scatter(x, group)                  # x [n k, ...] partial sums -> this rank's [k, ...]
    parts = collectives.all_to_all(pieces, group)                # piece j to rank j; returns the piece from each rank
    shift = collectives.ring_shift(tensors, group); got = shift.wait()   # from the previous rank of the ring

The functions here are the NCCL (GPU) forms, on Paddle 3.x's public `paddle.distributed` API; on CPU,
`llmtrain.paddle_compat.cpu_backend.install()` replaces them with stand-ins built from gloo's all-gather and
all-reduce (`cpu_backend/context_parallel.py`: gloo has neither reduce-scatter nor all-to-all, and its
synchronous send/recv cannot post a ring's sends and receives at once). Callers look them up on this module at
call time (`collectives.reduce_scatter(...)`), never import the names, so the replacement is seen.
"""
from __future__ import annotations

import paddle
import paddle.distributed as dist


def _peers(group):
    """(previous, next) global ranks of this rank in `group`'s ring (its rank order)."""
    i, n = group.rank, group.nranks
    return group.ranks[(i - 1) % n], group.ranks[(i + 1) % n]


def reduce_scatter(x, group):
    """x [n k, ...] (a partial sum on each of the group's n ranks) -> this rank's rows [k, ...] of the sum."""
    parts = [p.contiguous() for p in paddle.split(x, group.nranks, axis=0)]
    out = paddle.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)  # GPU-ONLY(cp-nccl-collectives)
    return out


def all_to_all(pieces: list, group) -> list:
    """pieces[j] (same shape on every rank) goes to the group's rank j; returns [piece rank j sent to this rank]."""
    out: list = []
    dist.alltoall(out, [p.contiguous() for p in pieces], group=group)  # GPU-ONLY(cp-nccl-collectives)
    return out


class RingShift:
    """Asynchronous transfer of tensors one step around the ring: `wait()` returns the previous rank's tensors
    (same shapes and dtypes as the ones sent). Started before the work it overlaps, waited after."""

    def __init__(self, tensors: list, group):
        prev, nxt = _peers(group)
        self.received = [paddle.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, prev, group) for r in self.received]
        self.tasks = dist.batch_isend_irecv(ops)  # GPU-ONLY(cp-nccl-collectives)

    def wait(self) -> list:
        for task in self.tasks:
            task.wait()
        return self.received


def ring_shift(tensors: list, group) -> RingShift:
    """Start sending `tensors` to the next rank of `group` and receiving the previous rank's."""
    return RingShift(tensors, group)
