"""A context-parallel group played by threads of one process, for the cp rehearsals (tests/gpu_paths/test_cp_*.py).

    group = ThreadGroup(cp, ranks=[4, 7, 9])        # global ranks of the group's members, in group order
    stand_ins = group.install(monkeypatch)          # dist.all_gather, reduce_scatter, alltoall, batch_isend_irecv
    results = group.run(lambda rank: ...)           # one thread per rank; results[r] is rank r's return value

The NCCL forms in llmtrain/paddle_compat/collectives.py call `paddle.distributed.reduce_scatter`, `alltoall` and
`batch_isend_irecv`, which need a process group of GPUs. Here each is replaced by `gpu_rehearsal.checked` around a
method of this group (the installed function's signature binds every call) that moves the threads' tensors through
shared memory: every call is a rendezvous of all ranks (a barrier before and after reading, as the collective
synchronises the group), and `batch_isend_irecv` delivers each posted send to the receive whose peer names the
sender's GLOBAL rank, as NCCL's does. `dist.all_gather` (which gloo has, so it is no GPU-only branch) is replaced
the same way so that the whole exchange runs in threads. `group.rank` answers the calling thread's rank.

A `reaches` block's tracer is handed to the threads (`threading.settrace`), so marked lines that run in them count.
"""
from __future__ import annotations

import sys
import threading

import numpy as np
import paddle
import paddle.distributed as dist

from gpu_rehearsal import checked


class _Done:
    def wait(self):
        return True

    def is_completed(self):
        return True


class ThreadGroup:
    """`n` ranks as threads; quacks like the Paddle group llmtrain's exchanges read (rank, nranks, ranks)."""

    backend = "NCCL"

    def __init__(self, n: int, ranks=None):
        self.nranks = n
        self.ranks = list(ranks) if ranks is not None else list(range(n))
        self.barrier = threading.Barrier(n, timeout=120)
        self.board: dict = {}
        self.local = threading.local()

    @property
    def rank(self) -> int:
        return self.local.rank

    def _exchange(self, mine):
        """Every rank posts `mine`; returns {rank: posted value} once all have posted."""
        self.board[self.rank] = mine
        self.barrier.wait()
        got = dict(self.board)
        self.barrier.wait()  # all have read before the next call overwrites the board
        return got

    def _check(self, group):
        assert group is self, f"a collective on another group: {group}"

    # the Paddle functions, by their parameter names (bound through `checked`)
    def all_gather(self, tensor_list, tensor, group=None, sync_op=True):
        self._check(group)
        got = self._exchange(tensor.numpy())
        tensor_list.extend(paddle.to_tensor(got[r]) for r in range(self.nranks))

    def reduce_scatter(self, tensor, tensor_list, op=dist.ReduceOp.SUM, group=None, sync_op=True):
        """tensor = sum over ranks of their tensor_list[this rank] (`checked` lets no other op through)."""
        self._check(group)
        if len(tensor_list) != self.nranks:
            raise ValueError(f"reduce_scatter: {len(tensor_list)} blocks for {self.nranks} ranks")
        got = self._exchange([t.numpy() for t in tensor_list])
        total = sum(got[r][self.rank].astype(np.float64) for r in range(self.nranks))
        if list(total.shape) != list(tensor.shape):
            raise ValueError(f"reduce_scatter: output {tensor.shape}, blocks {list(total.shape)}")
        tensor.copy_(paddle.to_tensor(total.astype(got[self.rank][self.rank].dtype)), False)

    def alltoall(self, out_tensor_list, in_tensor_list, group=None, sync_op=True):
        self._check(group)
        if len(in_tensor_list) != self.nranks or out_tensor_list:
            raise ValueError(f"alltoall: {len(in_tensor_list)} inputs for {self.nranks} ranks, output list "
                             f"{len(out_tensor_list)} long (must start empty)")
        got = self._exchange([t.numpy() for t in in_tensor_list])
        out_tensor_list.extend(paddle.to_tensor(got[r][self.rank]) for r in range(self.nranks))

    def batch_isend_irecv(self, p2p_op_list):
        me = self.ranks[self.rank]
        sends = {}
        for op in p2p_op_list:
            if op.op is dist.isend:
                assert op.group is self, op.group
                sends.setdefault((me, op.peer), []).append(op.tensor.numpy())
        got = self._exchange(sends)
        posted: dict = {}
        for r in range(self.nranks):
            for key, tensors in got[r].items():
                posted.setdefault(key, []).extend(tensors)
        taken: dict = {}
        for op in p2p_op_list:
            if op.op is dist.irecv:
                key = (op.peer, me)
                i = taken.get(key, 0)
                if i >= len(posted.get(key, [])):
                    raise RuntimeError(f"rank {me}: irecv from {op.peer}, which sent nothing to it (sends {sorted(posted)})")
                data = posted[key][i]
                taken[key] = i + 1
                if list(data.shape) != list(op.tensor.shape):
                    raise ValueError(f"rank {me}: irecv buffer {op.tensor.shape} for {list(data.shape)}")
                op.tensor.copy_(paddle.to_tensor(data), False)
        return [_Done() for _ in p2p_op_list]

    def install(self, monkeypatch) -> dict:
        """Replace the four `paddle.distributed` functions by checked stand-ins of this group; returns them by name."""
        stand_ins = {
            "all_gather": checked(dist.all_gather, self.all_gather, ("tensor_list", "tensor", "group")),
            "reduce_scatter": checked(dist.reduce_scatter, self.reduce_scatter, ("tensor", "tensor_list", "group")),
            "alltoall": checked(dist.alltoall, self.alltoall, ("out_tensor_list", "in_tensor_list", "group")),
            "batch_isend_irecv": checked(dist.batch_isend_irecv, self.batch_isend_irecv, ("p2p_op_list",)),
        }
        for name, f in stand_ins.items():
            monkeypatch.setattr(dist, name, f)
        return stand_ins

    def run(self, fn) -> list:
        """fn(rank) on one thread per rank (the calling thread's tracer handed on); returns [fn(r) for each r]."""
        results, errors = [None] * self.nranks, []

        def main(r):
            self.local.rank = r
            try:
                results[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 -- re-raised on the calling thread; frees the others
                errors.append((r, e))
                self.barrier.abort()

        tracer = sys.gettrace()
        threading.settrace(tracer)
        try:
            threads = [threading.Thread(target=main, args=(r,)) for r in range(self.nranks)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
        finally:
            threading.settrace(None)
        if errors:
            raise errors[0][1]
        return results



def run_exchange(group: ThreadGroup, comm: str, tensors: dict, dtype: str = "float32", core=None,
                 segments=None) -> list[dict]:
    """llmtrain's exchange `comm` on every rank of `group` (threads): each rank gets its chunks of the whole-sequence
    arrays `tensors` (q [b, s, nh, d], k/v [b, s, nkv, d(v)], cot [b, s, nh, dv]: the output's cotangent) in
    `dtype`, runs `ContextAttention` forward and backward, and returns {"out", "q", "k", "v"} (output and gradients,
    float32 numpy [b, 2c, ...]) and its "stats" (`ContextStats`)."""
    from llmtrain.parallel.context import ContextStats
    from llmtrain.parallel.context_chunks import ChunkLayout
    from llmtrain.parallel.context_exchange import ContextAttention

    layout = ChunkLayout(tensors["q"].shape[1], group.nranks)

    def rank_main(r):
        idx = layout.index(r)
        local = {n: paddle.to_tensor(np.ascontiguousarray(a[:, idx])).astype(dtype) for n, a in tensors.items()}
        for n in ("q", "k", "v"):
            local[n].stop_gradient = False
        seg = None if segments is None else paddle.to_tensor(np.ascontiguousarray(segments[:, idx]))
        stats = ContextStats(cp_rank=r)
        out = ContextAttention(core, comm, group, stats)(local["q"], local["k"], local["v"], True, None, seg)
        (out.astype("float32") * local["cot"].astype("float32")).sum().backward()
        got = {n: local[n].grad.astype("float32").numpy() for n in ("q", "k", "v")}
        got["out"], got["stats"] = out.astype("float32").numpy(), stats
        return got

    return group.run(rank_main)


def whole_sequence(tensors: dict, segments=None) -> dict:
    """The same attention on one device over the whole sequence (causal, documents by `segments` [b, s]): output
    and the gradients of q, k, v (float32 numpy), through `gpu_references.dense_attention` (no llmtrain code)."""
    from gpu_references import dense_attention

    t = {n: paddle.to_tensor(a.astype(np.float32)) for n, a in tensors.items()}
    for n in ("q", "k", "v"):
        t[n].stop_gradient = False
    drop = None
    if segments is not None:
        seg = paddle.to_tensor(segments)
        drop = (seg.unsqueeze(-1) != seg.unsqueeze(-2)).unsqueeze(1)  # [b, 1, s, s]: other documents
    out = dense_attention(t["q"], t["k"], t["v"], drop=drop, causal=True)
    (out * t["cot"]).sum().backward()
    return {"out": out.numpy(), **{n: t[n].grad.numpy() for n in ("q", "k", "v")}}


def random_tensors(rng, b: int, s: int, nh: int, nkv: int, d: int, dv: int, dtype: str = "float32") -> dict:
    """q, k, v and the output's cotangent, as values `dtype` holds exactly (rounded through it), float32 numpy."""
    shapes = {"q": (b, s, nh, d), "k": (b, s, nkv, d), "v": (b, s, nkv, dv), "cot": (b, s, nh, dv)}
    return {n: paddle.to_tensor(rng.standard_normal(sh).astype(np.float32)).astype(dtype).astype("float32").numpy()
            for n, sh in shapes.items()}


def worst_error(got: list[dict], want: dict, cp: int) -> dict:
    """Largest |got - want| over the ranks' positions, per output/gradient name."""
    from llmtrain.parallel.context_chunks import ChunkLayout

    layout = ChunkLayout(want["out"].shape[1], cp)
    return {n: max(float(np.abs(g[n] - want[n][:, layout.index(r)]).max()) for r, g in enumerate(got))
            for n in ("out", "q", "k", "v")}
