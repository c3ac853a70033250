"""GPU-only branch `alltoall-dispatch`: `parallel.ep_dispatcher=alltoall` (or `auto` on GPU), expert parallelism
moving the expert-major buffer with NCCL's all-to-all.

    python -m pytest tests/gpu_paths/test_alltoall_dispatch.py -q

Paddle's gloo backend has no all-to-all, so on CPU llmtrain refuses this dispatcher (`auto` takes the all-gather
one) and CI runs the all-gather transport. The rehearsal runs an ep group of two ranks as two threads of this
process: `paddle.get_device` answers "gpu:0" while `ExpertParallelRoles` builds each rank's experts (so it picks
`AllToAllExchange`), and `paddle.distributed.alltoall_single` is a stand-in checked against the installed signature
that moves each rank's blocks to their destinations through shared memory (a barrier per call, as the collective
synchronises the group); the dropless capacity's all-reduce MAX is a thread stand-in too. Each rank's outputs, and
the gradients of its tokens, routing weights and local experts, must equal one process holding all four experts on
both ranks' tokens (1e-6 absolute and relative: the same fp32 GEMMs on the same rows, summed in another order, as
the buffers have other capacities and row orders), dropless and with a capacity; every exchange moves the whole
buffer [ep, E_local, C, h] with equal blocks (no split sizes), four per rank and step (to the experts and back,
forward and backward). On a GPU it is not run (it needs an ep group;
the acceptance step `ep_alltoall` runs the dispatcher there).
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
from llmtrain.models.moe import route
from llmtrain.models.roles import Roles
from llmtrain.parallel import experts as ep_module
from llmtrain.parallel.layout import Layout
from llmtrain.parallel.strategy import Topology

EP, E, K, T, H = 2, 4, 2, 6, 16


class ThreadGroup:
    """Collectives among the threads of one process: thread `local.rank` is that rank of the group."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.board: dict = {}
        self.local = threading.local()

    def _share(self, value):
        """Every rank's `value`, in rank order (two barriers: the board is read before the next call writes it)."""
        self.board[self.local.rank] = value
        self.barrier.wait()
        got = [self.board[j] for j in range(self.world)]
        self.barrier.wait()
        return got

    def alltoall_single(self, out_tensor, in_tensor, in_split_sizes, out_split_sizes, group, sync_op):
        """Block j of in_tensor (rows, split by in_split_sizes or evenly) goes to rank j; out_tensor receives the
        blocks from ranks 0..world-1 in order (their sizes must match out_split_sizes when given)."""
        assert group is self and sync_op is True
        rank, n = self.local.rank, in_tensor.shape[0]
        sizes = list(in_split_sizes) if in_split_sizes is not None else [n // self.world] * self.world
        if sum(sizes) != n or len(sizes) != self.world:
            raise ValueError(f"rank {rank}: split sizes {sizes} for {n} rows over {self.world} ranks")
        got = [blocks[rank] for blocks in self._share(np.split(in_tensor.numpy(), np.cumsum(sizes)[:-1]))]
        if out_split_sizes is not None and [len(g) for g in got] != list(out_split_sizes):
            raise ValueError(f"rank {rank}: received {[len(g) for g in got]} rows, out_split_sizes {out_split_sizes}")
        data = np.concatenate(got)
        if list(data.shape) != list(out_tensor.shape) or str(out_tensor.dtype).split(".")[-1] != str(data.dtype):
            raise ValueError(f"rank {rank}: out_tensor {out_tensor.shape} {out_tensor.dtype}, received {data.shape}")
        out_tensor.set_value(paddle.to_tensor(data))

    def all_reduce(self, tensor, op, group, sync_op):
        assert group is self and sync_op is True and op == dist.ReduceOp.MAX
        tensor.set_value(paddle.to_tensor(np.max(np.stack(self._share(tensor.numpy())), axis=0)))


def _topo(rank, group):
    """Rank `rank` of an ep-EP layout whose ep group is `group` (the thread group standing in for NCCL)."""
    return Topology(rank=rank, world=EP, layout=Layout(dp=EP, ep=EP), groups={} if group is None else {"ep": group})


def _cfg(tiny_llama, factor):
    return dataclasses.replace(tiny_llama, hidden_size=H, moe_num_experts=E, moe_top_k=K, moe_ffn_hidden_size=8,
                               moe_capacity_factor=factor)


def _inputs(rng, factor):
    """x [EP, T, h], index [EP, T, k] (-1: dropped), weight [EP, T, k], output cotangent [EP, T, h]."""
    x = rng.standard_normal((EP, T, H)).astype(np.float32)
    if factor:  # each rank routes its own tokens with the capacity (as MoEFeedForward does)
        routed = [route(paddle.to_tensor(rng.standard_normal((T, E)).astype(np.float32)), K, capacity_factor=factor)
                  for _ in range(EP)]
        index = np.stack([r.index.numpy() for r in routed])
        assert (index < 0).any()  # the capacity dropped some choices
    else:
        index = rng.integers(0, E, (EP, T, K)).astype(np.int64)
        index[0, 1, 1] = index[1, 4, 0] = -1  # choices dropped upstream
        index[1] = np.where(index[1] == 0, 1, index[1])  # rank 1's tokens never choose expert 0
    return x, index, rng.random((EP, T, K)).astype(np.float32), rng.standard_normal((EP, T, H)).astype(np.float32)


@pytest.mark.skipif(ON_GPU, reason="needs an ep group of GPUs; the CPU rehearsal runs it as threads")
@pytest.mark.parametrize("factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_two_rank_alltoall_equals_one_process(tiny_llama, monkeypatch, factor):
    cfg = _cfg(tiny_llama, factor)
    rng = np.random.default_rng(0)
    weights = {n: (0.3 * rng.standard_normal(s)).astype(np.float32)
               for n, s in (("w_gate", (E, H, 8)), ("w_up", (E, H, 8)), ("w_down", (E, 8, H)))}
    x, index, weight, cot = _inputs(rng, factor)
    group = ThreadGroup(EP)
    stand_in = checked(dist.alltoall_single, group.alltoall_single,
                       ("out_tensor", "in_tensor", "in_split_sizes", "out_split_sizes", "group"))
    monkeypatch.setattr(ep_module.dist, "alltoall_single", stand_in)
    reduce_max = checked(dist.all_reduce, group.all_reduce, ("tensor", "op", "group"))
    monkeypatch.setattr(ep_module.dist, "all_reduce", reduce_max)
    layers = []
    with reaches("alltoall-dispatch"), monkeypatch.context() as gpu:
        gpu.setattr(paddle, "get_device", lambda *a: "gpu:0")
        for r in range(EP):
            roles = ep_module.ExpertParallelRoles(Roles(), _topo(r, group), EP, "auto")
            layers.append(roles.experts(cfg))
    assert all(isinstance(layer.dispatcher.exchange, ep_module.AllToAllExchange) for layer in layers)
    for r, layer in enumerate(layers):
        for name, full in weights.items():
            getattr(layer, name).set_value(paddle.to_tensor(full[r * E // EP:(r + 1) * E // EP]))
    results, errors = {}, []

    def rank_main(r):
        group.local.rank = r
        try:
            xt, wt = paddle.to_tensor(x[r], stop_gradient=False), paddle.to_tensor(weight[r], stop_gradient=False)
            with reaches("alltoall-dispatch"):
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
    # one process: all experts, both ranks' tokens; the routing (and its drops) as the ranks had it
    full = Experts(_cfg(tiny_llama, 0.0), E)
    for name, w in weights.items():
        getattr(full, name).set_value(paddle.to_tensor(w))
    xt = paddle.to_tensor(x.reshape(EP * T, H), stop_gradient=False)
    wt = paddle.to_tensor(weight.reshape(EP * T, K), stop_gradient=False)
    y = full(xt, paddle.to_tensor(index.reshape(EP * T, K)), wt)
    (y * paddle.to_tensor(cot.reshape(EP * T, H))).sum().backward()
    for r in range(EP):
        rows = slice(r * T, (r + 1) * T)
        np.testing.assert_allclose(results[r][0], y.numpy()[rows], atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(results[r][1], xt.grad.numpy()[rows], atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(results[r][2], wt.grad.numpy()[rows], atol=1e-6, rtol=1e-6)
        for name in weights:
            want = getattr(full, name).grad.numpy()[r * E // EP:(r + 1) * E // EP]
            np.testing.assert_allclose(results[r][3][name], want, atol=1e-6, rtol=1e-6, err_msg=name)
    loads = np.stack([(index[r][..., None] == np.arange(E)).sum((0, 1)) for r in range(EP)])
    cap = int(np.ceil(factor * T * K / E)) if factor else int(loads.max())  # dropless: the group's largest load
    assert len(stand_in.calls) == 4 * EP
    for call in stand_in.calls:  # the whole buffer, equal blocks
        assert call["in_split_sizes"] is None and call["out_split_sizes"] is None
        assert list(call["in_tensor"].shape) == [EP, E // EP, cap, H] == list(call["out_tensor"].shape)


def test_cpu_refuses_the_alltoall_dispatcher_and_auto_takes_allgather(tiny_llama):
    if ON_GPU:
        pytest.skip("on a GPU the all-to-all dispatcher is built over NCCL; this test checks the CPU build refuses it")
    roles = ep_module.ExpertParallelRoles(Roles(), _topo(0, None), EP, "alltoall")
    with pytest.raises(RuntimeError, match="ep_dispatcher=alltoall needs NCCL"):
        roles.experts(_cfg(tiny_llama, 0.0))
    auto = ep_module.ExpertParallelRoles(Roles(), _topo(0, None), EP, "auto")
    assert isinstance(auto.experts(_cfg(tiny_llama, 0.0)).dispatcher.exchange, ep_module.AllGatherExchange)
