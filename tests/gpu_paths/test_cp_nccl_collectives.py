"""GPU-only branch `cp-nccl-collectives`: context parallelism's reduce-scatter, all-to-all and ring shift in their
NCCL forms (llmtrain/paddle_compat/collectives.py; on CPU processes the gloo stand-ins of
llmtrain/paddle_compat/cpu_backend/context_parallel.py replace them, so CI's launched runs never call these).

    python -m pytest tests/gpu_paths/test_cp_nccl_collectives.py -q

Each exchange runs whole, forward and backward, on a cp group played by threads (tests/gpu_paths/cp_threads.py):
`paddle.distributed.reduce_scatter`, `alltoall` and `batch_isend_irecv` are stand-ins bound to the installed
functions' signatures (`checked`) that move the threads' tensors as the collectives define, with global ranks
([4, 7, 9] for cp3, so a ring that sent to group ranks instead of global ones fails). Checked: every rank's output
and the gradients of its q, k, v equal one device's attention over the whole sequence
(`gpu_references.dense_attention`, no llmtrain code) within 1e-5 (fp32: only summation order differs), for the
ring (batch_isend_irecv: keys forward, their gradients with them), all-gather (its backward's reduce-scatter) and
all-to-all (Ulysses, both directions), cp2 and cp3; and the calls themselves (peers, piece counts).

The collectives need a group of GPUs, so on a GPU this rehearsal runs the same threads and stand-ins (the real
NCCL forms run in the acceptance step `cp_exchanges`, scripts/gpu_acceptance.py: cp2 on two GPUs, each exchange).
"""
from __future__ import annotations

import numpy as np
import paddle.distributed as dist
import pytest

from cp_threads import ThreadGroup, random_tensors, run_exchange, whole_sequence, worst_error
from gpu_rehearsal import reaches

TOL = 1e-5
"""fp32 on both sides; the exchanges sum the same terms in another order (measured <= 2e-6)."""
RANKS = {2: [3, 5], 3: [4, 7, 9]}
"""Global ranks of the played groups' members."""


def _core(q, k, v, causal, mask=None, segments=None, **options):
    """The model's attention core for a2a: whole sequence, heads/cp (independent math)."""
    from gpu_references import dense_attention

    assert mask is None and segments is None and not any(options.values())
    return dense_attention(q, k, v, causal=causal)


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("comm", ["ring", "allgather", "a2a"])
def test_exchange_over_the_nccl_forms_equals_one_device(comm, cp, monkeypatch):
    rng = np.random.default_rng(cp)
    nh, nkv = (6, 3) if comm == "a2a" and cp == 3 else (4, 2)
    if comm == "a2a" and cp == 2:
        nkv = 2
    tensors = random_tensors(rng, b=2, s=4 * cp, nh=nh, nkv=nkv, d=8, dv=8)
    group = ThreadGroup(cp, RANKS[cp])
    stand_ins = group.install(monkeypatch)
    with reaches("cp-nccl-collectives"):
        got = run_exchange(group, comm, tensors, core=_core)
    err = worst_error(got, whole_sequence(tensors), cp)
    assert max(err.values()) <= TOL, (comm, cp, err)
    calls = {name: s.calls for name, s in stand_ins.items()}
    if comm == "ring":  # forward: cp-1 shifts of (k, v); backward: cp-1 of (k, v) and cp of (dk, dv), per rank
        assert len(calls["batch_isend_irecv"]) == cp * ((cp - 1) * 2 + cp)
        for c in calls["batch_isend_irecv"]:
            ops = c["p2p_op_list"]
            sends = {op.peer for op in ops if op.op is dist.isend}
            recvs = {op.peer for op in ops if op.op is dist.irecv}
            assert len(sends) == len(recvs) == 1 and sends <= set(RANKS[cp]) and recvs <= set(RANKS[cp])
    if comm == "allgather":
        assert len(calls["reduce_scatter"]) == 2 * cp  # dk and dv on each rank
        assert all(len(c["tensor_list"]) == cp for c in calls["reduce_scatter"])
    if comm == "a2a":  # q, k, v to heads and the output back; the backward the same four, inverted
        assert len(calls["alltoall"]) == 8 * cp
        assert all(len(c["in_tensor_list"]) == cp for c in calls["alltoall"])


def test_ring_sends_to_the_next_global_rank(monkeypatch):
    """The ring shift alone: group rank i sends to global rank ranks[i+1] and receives rank ranks[i-1]'s tensors."""
    import paddle

    from llmtrain.paddle_compat import collectives

    group = ThreadGroup(3, RANKS[3])
    stand_ins = group.install(monkeypatch)

    def rank_main(r):
        return [t.numpy() for t in collectives.ring_shift([paddle.full([2, 3], float(r))], group).wait()]

    with reaches("cp-nccl-collectives"):
        got = group.run(rank_main)
    assert [float(g[0][0, 0]) for g in got] == [2.0, 0.0, 1.0]
    peers = sorted((op.op is dist.isend, op.peer) for c in stand_ins["batch_isend_irecv"].calls
                   for op in c["p2p_op_list"])
    assert peers == sorted([(True, 7), (True, 9), (True, 4), (False, 9), (False, 4), (False, 7)])
