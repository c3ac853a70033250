"""CPU rehearsal of GPU-ONLY(cp-nccl-collectives): context parallelism's reduce-scatter, all-to-all and ring shift in
their NCCL forms (llmtrain/paddle_compat/collectives.py, replaced by gloo stand-ins on CPU).

    python -m pytest tests/gpu_paths/test_cp_nccl_collectives.py -q

`paddle.distributed.reduce_scatter`, `alltoall` and `batch_isend_irecv` are replaced by references with the
installed functions' signatures that play a group of 3 ranks (global ranks 4, 7, 9; this process is group rank 1)
in which every rank holds the same tensors as this one, so the expected results are known: the reduce-scatter's
rows are 3 x this rank's block, the all-to-all returns this rank's piece from every rank, and the ring shift sends
to global rank 9 and receives from global rank 4 (global ranks, as `dist.isend`/`irecv` take them).
"""
from __future__ import annotations

import inspect

import paddle
import paddle.distributed as dist
import pytest

from llmtrain.paddle_compat import collectives


class _Group:
    rank, nranks, ranks = 1, 3, [4, 7, 9]
    backend = "NCCL"


def ref_reduce_scatter(tensor, tensor_list, op=dist.ReduceOp.SUM, group=None, sync_op=True):
    assert len(tensor_list) == group.nranks and op == dist.ReduceOp.SUM
    tensor.copy_(tensor_list[group.rank] * group.nranks, False)  # every rank contributed the same blocks


def ref_alltoall(out_tensor_list, in_tensor_list, group=None, sync_op=True):
    assert len(in_tensor_list) == group.nranks and out_tensor_list == []
    out_tensor_list.extend(in_tensor_list[group.rank].clone() for _ in range(group.nranks))


SENT: list = []


class _Task:
    def wait(self):
        return True


def ref_batch_isend_irecv(p2p_op_list):
    sends = [op for op in p2p_op_list if op.op is dist.isend]
    recvs = [op for op in p2p_op_list if op.op is dist.irecv]
    assert len(sends) == len(recvs)
    for s, r in zip(sends, recvs):  # the previous rank sent what this one sends
        SENT.append((s.peer, r.peer))
        r.tensor.copy_(s.tensor, False)
    return [_Task() for _ in p2p_op_list]


def _params(f):
    return [(p.name, p.kind) for p in inspect.signature(f).parameters.values()]


@pytest.mark.parametrize("ref, name", [(ref_reduce_scatter, "reduce_scatter"), (ref_alltoall, "alltoall"),
                                       (ref_batch_isend_irecv, "batch_isend_irecv")])
def test_references_have_the_installed_signatures(ref, name):
    assert _params(ref) == _params(getattr(dist, name))


def test_nccl_forms_on_a_played_group(monkeypatch):
    monkeypatch.setattr(dist, "reduce_scatter", ref_reduce_scatter)
    monkeypatch.setattr(dist, "alltoall", ref_alltoall)
    monkeypatch.setattr(dist, "batch_isend_irecv", ref_batch_isend_irecv)
    g = _Group()
    x = paddle.arange(12, dtype="float32").reshape([6, 2])
    assert collectives.reduce_scatter(x, g).numpy().tolist() == (x[2:4] * 3).numpy().tolist()
    pieces = [paddle.full([2, 2], float(j)) for j in range(3)]
    got = collectives.all_to_all(pieces, g)
    assert len(got) == 3 and all(p.numpy().tolist() == [[1.0, 1.0]] * 2 for p in got)
    k, v = paddle.randn([2, 4, 2, 8]), paddle.randn([2, 4, 2, 8])
    SENT.clear()
    received = collectives.ring_shift([k, v], g).wait()
    assert SENT == [(9, 4), (9, 4)]  # to the next rank, from the previous one (global ranks)
    assert all(bool((a == b).all()) for a, b in zip(received, [k, v]))
