"""GPU-only branch `alltoall-dispatch`: `parallel.ep_dispatcher=alltoall`, expert parallelism over NCCL's all-to-all.

    python -m pytest tests/gpu_paths/test_alltoall_dispatch.py -q

Paddle's gloo backend has no all-to-all, so on CPU llmtrain refuses this dispatcher and CI runs the all-gather one.
The rehearsal runs an ep group of two ranks as two threads of this process: `paddle.get_device` answers "gpu:0"
while `ExpertParallelRoles` builds each rank's experts (so it picks `AllToAllDispatch`), and
`paddle.distributed.alltoall_single` is a stand-in checked against the installed signature that moves each rank's
split blocks to their destinations through shared memory (a barrier per call, as the collective synchronises the
group). Each rank's outputs, and the gradients of its tokens, routing weights and local experts, must equal one
process holding all four experts on both ranks' tokens (1e-6). This is the dispatcher as on main; the "moe"
engineer's rewrite updates this rehearsal. On a GPU it is not run (it needs an ep group; `GPU_PATHS` says so).
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import paddle
import paddle.distributed as dist
import pytest

from gpu_rehearsal import ON_GPU, checked, reaches
from llmtrain.models.experts import Experts
from llmtrain.models.roles import Roles
from llmtrain.parallel import experts as ep_module
from llmtrain.parallel.strategy import Topology

EP, E, K, T = 2, 4, 2, 6


class ThreadGroup:
    """All-to-all among the threads of one process: thread `local.rank` is that rank of the group."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.board: dict = {}
        self.local = threading.local()

    def alltoall_single(self, out_tensor, in_tensor, in_split_sizes, out_split_sizes, group, sync_op):
        """Block j of in_tensor (rows, split by in_split_sizes or evenly) goes to rank j; out_tensor receives the
        blocks from ranks 0..world-1 in order (their sizes must match out_split_sizes when given)."""
        assert group is self and sync_op is True
        rank, n = self.local.rank, in_tensor.shape[0]
        sizes = list(in_split_sizes) if in_split_sizes is not None else [n // self.world] * self.world
        if sum(sizes) != n or len(sizes) != self.world:
            raise ValueError(f"rank {rank}: split sizes {sizes} for {n} rows over {self.world} ranks")
        self.board[rank] = np.split(in_tensor.numpy(), np.cumsum(sizes)[:-1])
        self.barrier.wait()
        got = [self.board[j][rank] for j in range(self.world)]
        self.barrier.wait()  # every rank has read its blocks before the next call overwrites the board
        if out_split_sizes is not None and [len(g) for g in got] != list(out_split_sizes):
            raise ValueError(f"rank {rank}: received {[len(g) for g in got]} rows, out_split_sizes {out_split_sizes}")
        data = np.concatenate(got)
        if list(data.shape) != list(out_tensor.shape) or str(out_tensor.dtype).split(".")[-1] != str(data.dtype):
            raise ValueError(f"rank {rank}: out_tensor {out_tensor.shape} {out_tensor.dtype}, received {data.shape}")
        out_tensor.set_value(paddle.to_tensor(data))


def _cfg(tiny_llama):
    return dataclasses.replace(tiny_llama, hidden_size=16, moe_num_experts=E, moe_top_k=K, moe_ffn_hidden_size=8)


def _inputs(rng, h):
    index = rng.integers(0, E, (EP, T, K)).astype(np.int64)
    index[0, 1, 1] = index[1, 4, 0] = -1  # choices dropped by capacity
    index[1, :, :] = np.where(index[1] == 0, 1, index[1])  # rank 1's tokens never choose expert 0
    return (rng.standard_normal((EP, T, h)).astype(np.float32), index,
            rng.random((EP, T, K)).astype(np.float32), rng.standard_normal((EP, T, h)).astype(np.float32))


@pytest.mark.skipif(ON_GPU, reason="needs an ep group of GPUs; the CPU rehearsal runs it as threads")
def test_two_rank_alltoall_equals_one_process(tiny_llama, monkeypatch):
    cfg = _cfg(tiny_llama)
    rng = np.random.default_rng(0)
    weights = {n: (0.3 * rng.standard_normal(s)).astype(np.float32)
               for n, s in (("w_gate", (E, 16, 8)), ("w_up", (E, 16, 8)), ("w_down", (E, 8, 16)))}
    x, index, weight, cot = _inputs(rng, 16)
    group = ThreadGroup(EP)
    stand_in = checked(dist.alltoall_single, group.alltoall_single,
                       ("out_tensor", "in_tensor", "in_split_sizes", "out_split_sizes", "group"))
    monkeypatch.setattr(ep_module.dist, "alltoall_single", stand_in)
    layers = []
    with reaches("alltoall-dispatch"), monkeypatch.context() as gpu:
        gpu.setattr(paddle, "get_device", lambda *a: "gpu:0")
        for r in range(EP):
            roles = ep_module.ExpertParallelRoles(Roles(), Topology(ep_rank=r, ep_group=group), EP, "alltoall")
            layers.append(roles.experts(cfg))
    assert all(isinstance(layer.dispatcher, ep_module.AllToAllDispatch) for layer in layers)
    for r, layer in enumerate(layers):
        for name, full in weights.items():
            getattr(layer, name).set_value(paddle.to_tensor(full[r * E // EP:(r + 1) * E // EP]))
    results, errors = {}, []

    def rank_main(r):
        group.local.rank = r
        try:
            xt, wt = paddle.to_tensor(x[r], stop_gradient=False), paddle.to_tensor(weight[r], stop_gradient=False)
            y = layers[r](xt, paddle.to_tensor(index[r]), wt)
            (y * paddle.to_tensor(cot[r])).sum().backward()
            results[r] = (y.numpy(), xt.grad.numpy(), wt.grad.numpy(),
                          {n: getattr(layers[r], n).grad.numpy() for n in weights})
        except BaseException as e:  # noqa: BLE001 -- reported on the main thread; frees the other rank
            errors.append((r, e))
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(EP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0][1]
    # one process: all experts, both ranks' tokens
    full = Experts(cfg, E)
    for name, w in weights.items():
        getattr(full, name).set_value(paddle.to_tensor(w))
    xt = paddle.to_tensor(x.reshape(EP * T, 16), stop_gradient=False)
    wt = paddle.to_tensor(weight.reshape(EP * T, K), stop_gradient=False)
    y = full(xt, paddle.to_tensor(index.reshape(EP * T, K)), wt)
    (y * paddle.to_tensor(cot.reshape(EP * T, 16))).sum().backward()
    for r in range(EP):
        rows = slice(r * T, (r + 1) * T)
        np.testing.assert_allclose(results[r][0], y.numpy()[rows], atol=1e-6, rtol=0)
        np.testing.assert_allclose(results[r][1], xt.grad.numpy()[rows], atol=1e-6, rtol=0)
        np.testing.assert_allclose(results[r][2], wt.grad.numpy()[rows], atol=1e-6, rtol=0)
        for name in weights:
            want = getattr(full, name).grad.numpy()[r * E // EP:(r + 1) * E // EP]
            np.testing.assert_allclose(results[r][3][name], want, atol=1e-6, rtol=0, err_msg=name)
    assert len(stand_in.calls) >= 2 * 4  # per rank: counts, rows, ids, weights forward; the backward exchanges


def test_cpu_refuses_the_alltoall_dispatcher(tiny_llama):
    roles = ep_module.ExpertParallelRoles(Roles(), Topology(ep_rank=0, ep_group=None), EP, "alltoall")
    if ON_GPU:
        pytest.skip("a GPU builds it")
    with pytest.raises(RuntimeError, match="ep_dispatcher=alltoall needs NCCL"):
        roles.experts(_cfg(tiny_llama))
