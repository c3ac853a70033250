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

Dispatch. Every rank lays its own tokens out expert-major, [E, C, h] (`llmtrain.models.dispatch`: the same C on
every rank of the group: the capacity, or dropless the largest expert load of the group, `agree_capacity`, an
all-reduce MAX then the layer's one host read), and the dispatcher moves that buffer, never per-expert slices:

    [E, C, h] = [ep, E_local, C, h]  -- exchange -->  [ep (source rank), E_local, C, h] -> [E_local, ep C, h]
    experts (batched GEMMs) -> [E_local, ep C, h] -> [ep, E_local, C, h]  -- exchange -->  [E, C, h] -> combine

The exchange is an all-to-all with equal blocks (block j of a rank goes to rank j); it is its own transpose, so
its backward is the same exchange (`_Exchange`). Two transports (`parallel.ep_dispatcher`):
- `allgather` (gloo and NCCL; what CI runs): Paddle 3.3.1's gloo process group has no all-to-all, so every rank
  all-gathers the group's [ep, E_local, C, h] buffers and keeps the blocks addressed to it: ep x the bytes of an
  all-to-all (`AllGatherExchange`);
- `alltoall` (NCCL only, GPU): one `alltoall_single` with equal splits (`AllToAllExchange`), rehearsed on CPU with
  `alltoall_single` replaced by a reference built from all_gather (tests/gpu_paths/test_alltoall_dispatch.py);
- `auto` (the default): `alltoall` on a GPU, `allgather` on CPU.

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
from llmtrain.models.dispatch import host_int
from llmtrain.models.experts import Experts


class _Exchange(PyLayer):
    """x [ep, ...] -> [ep, ...]: block j goes to rank j, block i of the result came from rank i (an all-to-all
    with equal blocks); backward: the same exchange of the gradient (the exchange is its own transpose)."""

    @staticmethod
    def forward(ctx, x, exchange):
        ctx.exchange = exchange
        return exchange(x)

    @staticmethod
    def backward(ctx, dy):
        return ctx.exchange(dy)


class AllGatherExchange:
    """The exchange from all_gather (gloo and NCCL): every rank gathers all [ep, ...] buffers, keeps its blocks."""

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank

    def __call__(self, x):  # [ep, ...]
        parts = []
        dist.all_gather(parts, x.contiguous(), group=self.group)  # ep buffers [ep, ...], in rank order
        return paddle.stack([part[self.rank] for part in parts])  # [ep (source), ...]


class AllToAllExchange:
    """The exchange as one `alltoall_single` with equal splits (NCCL only: gloo has no all-to-all)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, x):  # [ep, ...]
        out = paddle.empty_like(x)
        dist.alltoall_single(out, x.contiguous(), None, None, group=self.group)  # GPU-ONLY(alltoall-dispatch)
        return out


class ExpertParallelDispatch:
    """Moves the expert-major buffer between the ep group's ranks (see the module docstring)."""

    def __init__(self, group, world: int, exchange):
        self.group, self.world, self.exchange = group, world, exchange

    def agree_capacity(self, largest_load) -> int:
        """Dropless C: the largest expert load over the group's micro-batches (all-reduce MAX), read once."""
        t = largest_load.reshape([1]).clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return host_int(t)

    def to_experts(self, buffer):  # [E, C, h] this rank's tokens
        experts, cap, hidden = buffer.shape
        local = experts // self.world
        blocks = buffer.reshape([self.world, local, cap, hidden])  # [ep (expert rank), E_l, C, h]
        got = _Exchange.apply(blocks, self.exchange)  # [ep (token rank), E_l, C, h]
        return got.transpose([1, 0, 2, 3]).reshape([local, self.world * cap, hidden])  # [E_l, ep C, h]

    def from_experts(self, out):  # [E_l, ep C, h] outputs of this rank's experts
        local, rows, hidden = out.shape
        blocks = out.reshape([local, self.world, rows // self.world, hidden]).transpose([1, 0, 2, 3])
        back = _Exchange.apply(blocks, self.exchange)  # [ep (expert rank), E_l, C, h] for this rank's tokens
        return back.reshape([local * self.world, rows // self.world, hidden])  # [E, C, h]


def has_alltoall() -> bool:
    """Whether this process's collective backend has an all-to-all (NCCL on a GPU; gloo on CPU has none)."""
    return paddle.get_device() != "cpu"


class ExpertParallelRoles:
    """The layout's `Roles` with the routed experts spread over the ep group; everything else delegated."""

    def __init__(self, inner, topo, ep: int, dispatcher: str = "auto"):
        self._inner, self._topo, self._ep, self._dispatcher = inner, topo, ep, dispatcher

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def exchange(self):
        """The transport of `parallel.ep_dispatcher` (auto: all-to-all where the backend has one)."""
        rank, group = self._topo.ep_rank, self._topo.ep_group
        if self._dispatcher == "alltoall" or (self._dispatcher == "auto" and has_alltoall()):
            if not has_alltoall():
                raise RuntimeError("parallel.ep_dispatcher=alltoall needs NCCL (GPU): Paddle's gloo backend has no "
                                   "all-to-all; use parallel.ep_dispatcher=allgather (or auto) on CPU")
            return AllToAllExchange(group)  # GPU-ONLY(alltoall-dispatch)
        return AllGatherExchange(group, rank)

    def experts(self, cfg) -> Experts:
        local = cfg.moe_num_experts // self._ep
        disp = ExpertParallelDispatch(self._topo.ep_group, self._ep, self.exchange())
        layer = Experts(cfg, local, first=self._topo.ep_rank * local, dispatcher=disp)
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
