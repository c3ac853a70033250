"""Expert parallelism (`parallel.ep`): each ep rank holds num_experts / ep routed experts; tokens travel to them.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py model=moe-tiny +parallel=ep2
    python -m pytest tests/parallel/test_experts.py -q

Groups. EP is carved out of the data-parallel ranks (as PaddleNLP's
`use_expert_parallel`): the dp ranks of one (tp, pp, sharding) coordinate are
cut into groups of ep consecutive ranks (the *ep group*: together they hold
every expert once, rank j of a group the j-th block of num_experts / ep); the
ranks holding the same block form the *expert-data-parallel group* (dp / ep
ranks). Dense parameters stay replicated over dp as before. With ZeRO-1 sharding
(`parallel.sharding` = ep) the ep group is the sharding group instead: its ranks
hold different experts, so the experts stay out of the sharded optimizer's
partition and each rank updates its own; the dense parameters' optimizer state
is partitioned as without experts. Under pipeline parallelism every stage has its
own ep groups (the dp ranks of that stage) for its own layers' experts.

Dispatch. A dispatcher has `dispatch(x, index, weight)` -> the (token, expert,
weight) rows this rank's experts must serve, and `combine(y)` -> this rank's
tokens' summed expert outputs. Two implementations:
- `AllGatherDispatch` (what CI runs; gloo and NCCL): every rank all-gathers the
  group's tokens [ep T, h] and choices, computes its experts on the choices that
  name them, and the partial outputs are summed back to their owners. Paddle's
  gloo process group has all_gather and all_reduce but no reduce_scatter and no
  all-to-all (Paddle 3.3.1), so the sum-back is an all_reduce of [ep T, h]
  followed by taking this rank's rows: ep x the bytes of a reduce-scatter.
  Autograd: the gradient of an all-gather is a reduce-scatter (the same
  all_reduce + rows) and vice versa (`_AllGather`, `_ReduceScatter`).
- `AllToAllDispatch` (NCCL only, GPU): each choice row goes to the rank of its
  expert with `alltoall_single` (split sizes exchanged first) and comes back
  the same way. A thin path, NOT tested here: there is no all-to-all on CPU.

Tensor parallelism: experts are replicated over the tp ranks, not split (each
tp rank of a dp position holds the same block and dispatches the same tokens in
its own ep group): fine-grained experts are narrow (96 to 1408 wide in the
presets), so splitting them would add an all-reduce per expert call for little
memory, and the dispatcher stays independent of tp. The price is tp x the
expert compute. (Megatron-style expert tensor parallelism is absent.)

Gradients. Expert parameters are marked `no_sync` (so `paddle.DataParallel`
and fleet's start-up broadcasts skip them) and left out of fleet's gradient
synchronisation (dp all-reduce, ZeRO-1 reduce); right after it, still before the
clip, `ExpertGradSync` sums them over the expert-data-parallel group and divides
by the data-parallel degree (a holder's gradient already sums the losses of its
ep group's ranks through the dispatcher's backward), giving the one-process
gradient of the mean loss. The global grad norm counts each expert once:
`GlobalNormClip` / fleet's hybrid clip sum the squares of expert gradients over
the ep group (`expert_group`; under sharding fleet's own all-reduce over the
sharding group does it), dense ones as before.
"""
from __future__ import annotations

import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

from llmtrain.contracts import tags
from llmtrain.models.experts import Experts


def expert_groups(hcg, ep: int, rank: int):
    """(ep_rank, ep group, expert-data-parallel group or None) of this rank; every rank creates every group.

    With sharding (stage 1, ep == sharding degree) the ep group is fleet's sharding group and the ranks holding the
    same experts are fleet's dp group; otherwise both are carved out of the dp ranks."""
    if hcg.get_sharding_parallel_world_size() > 1:
        edp = hcg.get_data_parallel_group() if hcg.get_data_parallel_world_size() > 1 else None
        return hcg.get_sharding_parallel_rank(), hcg.get_sharding_parallel_group(), edp
    ep_rank, ep_group, edp_group = 0, None, None
    for dp_ranks in hcg.topology().get_comm_list("data"):  # one list per (pp, sharding, sep, tp) coordinate
        for start in range(0, len(dp_ranks), ep):
            members = dp_ranks[start:start + ep]
            group = dist.new_group(members)
            if rank in members:
                ep_rank, ep_group = members.index(rank), group
        if len(dp_ranks) > ep:
            for j in range(ep):
                members = dp_ranks[j::ep]
                group = dist.new_group(members)
                if rank in members:
                    edp_group = group
    return ep_rank, ep_group, edp_group


def _rows(t, rank: int, world: int):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


class _AllGather(PyLayer):
    """x [T, ...] on each of the group's ranks -> [ep T, ...] in rank order; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group, rank, world):
        ctx.group, ctx.rank, ctx.world = group, rank, world
        parts = []
        dist.all_gather(parts, x.contiguous(), group=group)
        return paddle.concat(parts, axis=0)

    @staticmethod
    def backward(ctx, dy):
        dy = dy.clone()
        dist.all_reduce(dy, group=ctx.group)
        return _rows(dy, ctx.rank, ctx.world)


class _ReduceScatter(PyLayer):
    """y [ep T, ...] partial sums on each rank -> this rank's rows of the sum [T, ...]; backward: all-gather."""

    @staticmethod
    def forward(ctx, y, group, rank, world):
        ctx.group = group
        total = y.clone()
        dist.all_reduce(total, group=group)
        return _rows(total, rank, world)

    @staticmethod
    def backward(ctx, dy):
        parts = []
        dist.all_gather(parts, dy.contiguous(), group=ctx.group)
        return paddle.concat(parts, axis=0)


class AllGatherDispatch:
    """All-gather the ep group's tokens, compute local experts on all of them, sum the outputs back (gloo/NCCL)."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world

    def dispatch(self, x, index, weight):  # x [T, h]; index, weight [T, k]
        x_all = _AllGather.apply(x, self.group, self.rank, self.world)  # [ep T, h]
        parts = []
        dist.all_gather(parts, index.contiguous(), group=self.group)
        index_all = paddle.concat(parts, axis=0)  # [ep T, k], no gradient
        weight_all = _AllGather.apply(weight, self.group, self.rank, self.world)  # [ep T, k]
        return x_all, index_all, weight_all

    def combine(self, y):  # [ep T, h] partial (this rank's experts only)
        return _ReduceScatter.apply(y, self.group, self.rank, self.world)  # [T, h]


class _AllToAll(PyLayer):
    """Rows of x sent in blocks of `send` sizes, received in blocks of `recv` sizes; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = paddle.empty([sum(recv), *x.shape[1:]], dtype=x.dtype)
        dist.alltoall_single(out, x.contiguous(), send, recv, group=group)
        return out

    @staticmethod
    def backward(ctx, dy):
        dx = paddle.empty([sum(ctx.send), *dy.shape[1:]], dtype=dy.dtype)
        dist.alltoall_single(dx, dy.contiguous(), ctx.recv, ctx.send, group=ctx.group)
        return dx


class AllToAllDispatch:
    """NCCL only (GPU; untested on CPU, where gloo has no all-to-all): each choice row travels to its expert's rank.

    dispatch: the T k choice rows sorted by destination rank, split sizes exchanged,
    rows (token vector, expert id, weight) sent with `alltoall_single`; the experts
    see [R, h] rows with one choice each. combine: the outputs travel back by the
    reverse exchange and are summed per source token."""

    def __init__(self, group, rank: int, world: int, num_experts: int):
        self.group, self.rank, self.world = group, rank, world
        self.per_rank = num_experts // world

    def dispatch(self, x, index, weight):
        num_tokens, top_k = index.shape
        flat = index.reshape([-1])  # [T k]
        token = paddle.arange(num_tokens, dtype="int64").repeat_interleave(top_k)
        dest = paddle.where(flat >= 0, flat // self.per_rank, paddle.full_like(flat, self.world))  # dropped: last
        order = paddle.argsort(dest, stable=True)
        keep = int((flat >= 0).astype("int64").sum())
        order = order[:keep]
        send = paddle.bincount(dest[order], minlength=self.world)[: self.world].astype("int64")
        recv = paddle.empty_like(send)
        dist.alltoall_single(recv, send, group=self.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        self._ctx = (num_tokens, paddle.gather(token, order), send_l, recv_l)
        rows = _AllToAll.apply(paddle.gather(x, paddle.gather(token, order)), send_l, recv_l, self.group)
        ids = paddle.empty([sum(recv_l)], dtype="int64")
        dist.alltoall_single(ids, paddle.gather(flat, order), send_l, recv_l, group=self.group)
        w = _AllToAll.apply(paddle.gather(weight.reshape([-1]), order), send_l, recv_l, self.group)
        return rows, ids[:, None], w[:, None]

    def combine(self, y):  # [R, h] weighted outputs of the received rows
        num_tokens, token, send_l, recv_l = self._ctx
        back = _AllToAll.apply(y, recv_l, send_l, self.group)  # [kept choices, h] in send order
        out = paddle.zeros([num_tokens, y.shape[-1]], dtype=y.dtype)
        return paddle.index_add(out, token, 0, back)


class ExpertParallelRoles:
    """The layout's `Roles` with the routed experts spread over the ep group; everything else delegated."""

    def __init__(self, inner, topo, ep: int, dispatcher: str = "allgather"):
        self._inner, self._topo, self._ep, self._dispatcher = inner, topo, ep, dispatcher

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def experts(self, cfg) -> Experts:
        local = cfg.moe_num_experts // self._ep
        rank, group = self._topo.ep_rank, self._topo.ep_group
        if self._dispatcher == "alltoall":
            if paddle.get_device() == "cpu":
                raise RuntimeError("parallel.ep_dispatcher=alltoall needs NCCL (GPU): Paddle's gloo backend has no "
                                   "all-to-all; use parallel.ep_dispatcher=allgather on CPU")
            disp = AllToAllDispatch(group, rank, self._ep, cfg.moe_num_experts)  # GPU-ONLY(alltoall-dispatch)
        else:
            disp = AllGatherDispatch(group, rank, self._ep)
        layer = Experts(cfg, local, first=rank * local, dispatcher=disp)
        for p in layer.parameters():
            p.no_sync = True  # not averaged by paddle.DataParallel: ExpertGradSync reduces them
        return layer


def expert_parameters(model) -> list:
    return [p for p in model.parameters() if is_expert(p)]


class ExpertGradSync:
    """After the backward: expert grads summed over the expert-data-parallel group, divided by the data-parallel degree."""

    def __init__(self, model, topo, data_parallel: int):
        self.params = expert_parameters(model)
        self.group = topo.expert_dp_group
        self.scale = 1.0 / data_parallel

    @paddle.no_grad()
    def __call__(self) -> None:
        for p in self.params:
            g = p.grad
            if g is None:
                continue
            if self.group is not None:
                dist.all_reduce(g, group=self.group)
            g.scale_(self.scale)


def attach_expert_parallel(core, optimizer, clip, layout, topo) -> None:
    """Under ep > 1: fleet's gradient synchronisation (dp all-reduce, ZeRO-1 reduce) leaves expert gradients alone
    and the expert gradient reduction runs right after it, before the clip (every layout, the pipeline's too); the
    clip counts each expert once. With sharding the experts stay out of the ZeRO-1 partition: each rank updates its
    own (`keep_local_in_zero1`), and fleet's norm all-reduce over the sharding group (= the ep group) already sums
    each expert once."""
    if layout.ep <= 1:
        return
    from llmtrain.paddle_compat.optim import keep_local_in_zero1, skip_in_dp_grad_sync

    skip_in_dp_grad_sync(optimizer, is_expert, after=ExpertGradSync(core, topo, layout.data_parallel))
    if layout.sharding > 1:
        keep_local_in_zero1(optimizer, is_expert)
    else:
        clip.expert_group = topo.ep_group


def is_expert(param) -> bool:
    """A stacked routed-expert tensor (its values differ per ep rank)."""
    return tags.is_expert(param)
