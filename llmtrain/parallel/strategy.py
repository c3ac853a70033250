"""Turn a validated `Layout` into `fleet.DistributedStrategy` and start fleet.

    topo = init_distributed(layout, seed)   # every rank, before building the model

On CPU the stand-ins of `llmtrain.paddle_compat.cpu_backend` are installed first
(gloo collectives in place of GPU-only kernels); on GPU nothing is patched.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import paddle
import paddle.distributed as dist

from llmtrain.parallel.groups import KINDS
from llmtrain.parallel.layout import Layout

FLEET_AXIS = {"dp": "dp", "pp": "pp", "sharding": "sharding", "tp": "mp", "cp": "sep"}


def build_strategy(layout: Layout, seed: int, on_cpu: Optional[bool] = None):
    """The fleet strategy for `layout`: hybrid degrees and order, pipeline micro-batching, TP init seed, and on GPU
    the accepted communication-overlap knobs (`llmtrain.parallel.overlap`; on CPU they are logged, not applied)."""
    from paddle.distributed import fleet

    from llmtrain.parallel.overlap import apply_overlap

    strategy = fleet.DistributedStrategy()
    order = [FLEET_AXIS[a] for a in layout.grid]  # fleet's grid always has a sep axis: cp, trivial when cp = 1
    strategy.hybrid_configs = {
        "dp_degree": layout.dp,
        "mp_degree": layout.tp,
        "pp_degree": layout.pp,
        "sharding_degree": layout.sharding,
        "sep_degree": layout.cp,
        "order": order,
    }
    strategy.pipeline_configs = {
        "accumulate_steps": layout.grad_accum,
        "micro_batch_size": layout.micro_batch,
    }
    strategy.tensor_parallel_configs = {"tensor_init_seed": seed}
    if layout.v_shape:  # fleet.distributed_model's choice of DualPipeVParallel (llmtrain/parallel/dualpipe.py)
        strategy.hybrid_configs["pp_configs"].use_dualpipev = True
    skipped = apply_overlap(strategy, layout, paddle.get_device() == "cpu" if on_cpu is None else on_cpu)
    if skipped:
        from llmtrain.utils.log import log0

        log0(f"CPU run: GPU-only communication knobs accepted but not applied here: {', '.join(skipped)}")
    return strategy


@dataclass
class Topology:
    """Where this process sits in the layout, and its process groups: `group(kind)`, `rank_in(kind)`, `ranks(kind)`
    for the kinds of `Layout.group_ranks` (dp, sharding, pp, cp, tp, data, ep, edp), created once by
    `init_distributed`. A one-process topology (or a stand-in whose layout has one rank) is rank 0 of size 1 in
    every kind."""

    rank: int = 0
    world: int = 1
    layout: Layout = field(default_factory=Layout)
    """The validated layout whose groups these are."""
    groups: dict = field(default_factory=dict)
    """kind -> this rank's process group of that kind (kinds of one member have none)."""
    hcg: Optional[Any] = None
    """fleet's HybridCommunicateGroup (None on a single process): what fleet's own layers and wrappers take."""
    on_cpu: bool = True
    singles: dict = field(default_factory=dict)
    """kind -> this rank's one-member process group of that kind, made only where a fleet object needs a group even
    of one rank (`single_member_kinds`)."""
    _members: dict = field(default_factory=dict, repr=False, compare=False)

    def ranks(self, kind: str) -> list[int]:
        """The global ranks of this rank's group of `kind`, in group order."""
        if kind not in self._members:
            self._members[kind] = [self.rank] if self.layout.world == 1 else \
                next(g for g in self.layout.group_ranks(kind) if self.rank in g)
        return self._members[kind]

    def rank_in(self, kind: str) -> int:
        """This rank's index in its group of `kind`."""
        return self.ranks(kind).index(self.rank)

    def size(self, kind: str) -> int:
        """Members of this rank's group of `kind` (the degree)."""
        return len(self.ranks(kind))

    def group(self, kind: str):
        """This rank's process group of `kind`, or None when that group has one member."""
        return self.groups.get(kind)

    def process_group(self, kind: str):
        """This rank's process group of `kind`, one-member groups included where `init_distributed` made them
        (`single_member_kinds`); None otherwise."""
        return self.groups.get(kind) or self.singles.get(kind)

    data_rank = property(lambda self: self.rank_in("data"), doc="Index among the data-parallel readers (dp x sharding).")
    data_world = property(lambda self: self.size("data"), doc="Data-parallel readers: dp x sharding.")
    dp_rank = property(lambda self: self.rank_in("dp"), doc="Rank in the (pure) data-parallel group.")
    tp_rank = property(lambda self: self.rank_in("tp"))
    pp_rank = property(lambda self: self.rank_in("pp"))
    sharding_rank = property(lambda self: self.rank_in("sharding"))
    cp_rank = property(lambda self: self.rank_in("cp"), doc="Rank in the context-parallel group: it holds chunks "
                                                            "cp_rank and 2·cp-1-cp_rank of each sequence.")
    cp_world = property(lambda self: self.size("cp"), doc="Context-parallel degree (ranks sharing one sequence).")
    cp_group = property(lambda self: self.group("cp"), doc="The context-parallel group (fleet's `sep`), or None.")
    ep_rank = property(lambda self: self.rank_in("ep"), doc="Which block of num_experts / ep experts this rank holds.")
    ep_group = property(lambda self: self.group("ep"), doc="The ranks sharing out the experts, or None.")
    expert_dp_group = property(lambda self: self.group("edp"), doc="The ranks holding the same experts, or None.")

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def data_group(self):
        """Groups over which data-parallel quantities (tokens, loss) are summed: dp then sharding."""
        return [g for g in (self.group("dp"), self.group("sharding")) if g is not None]

    def members(self) -> dict:
        """{kind: the global ranks of this rank's group of that kind} for every kind (memory.json names them)."""
        return {kind: self.ranks(kind) for kind in KINDS}


def world_size_from_env() -> int:
    """Processes in the job, as the launcher says (1 when run directly)."""
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


_ACTIVE: dict = {}
"""The process's fleet topology: fleet.init runs once per process, so a later call reuses its groups."""


def init_distributed(layout: Layout, seed: int) -> Topology:
    """fleet.init(is_collective=True) with our strategy (skipped on a single process), then every group of
    `Layout.group_ranks` that fleet did not create, in one fixed order on every rank (`KINDS`).

    A second call in the same process with the same degrees and batch layout reuses fleet and the groups made
    before, creating only those of a new expert-parallel degree (several runs in one launch, as the parity tests
    do); another grid is refused, since fleet's groups cannot be rebuilt."""
    on_cpu = paddle.get_device() == "cpu"
    if on_cpu:  # freed tensors stay in the process (no page faults per new tensor), as on a GPU
        from llmtrain.paddle_compat.cpu_backend.host_allocator import keep_freed_memory

        keep_freed_memory()
    if not layout.distributed:
        return Topology(layout=layout, on_cpu=on_cpu)
    key = (layout.dp, layout.tp, layout.pp, layout.sharding, layout.cp, tuple(layout.order), layout.grad_accum,
           layout.micro_batch)
    if _ACTIVE:
        if _ACTIVE["key"] != key:
            raise RuntimeError(f"fleet is already initialised for {_ACTIVE['key']}; cannot switch this process to {key}")
        from llmtrain.paddle_compat.fleet import live_strategy
        from llmtrain.parallel.overlap import apply_overlap

        apply_overlap(live_strategy(), layout, on_cpu)  # this run's knobs, read when its optimizer is built
    else:
        from paddle.distributed import fleet

        strategy = build_strategy(layout, seed)
        if on_cpu:
            from llmtrain.paddle_compat import cpu_backend

            cpu_backend.install()
            cpu_backend.check_strategy(strategy)  # refuses fleet options the CPU stand-ins cannot serve
        fleet.init(is_collective=True, strategy=strategy)
        hcg = fleet.get_hybrid_communicate_group()
        _ACTIVE.update(key=key, hcg=hcg, made=_fleet_groups(layout, hcg, dist.get_rank()))
    rank = dist.get_rank()
    made = _ACTIVE["made"]
    mine, singles = {}, {}
    solo = single_member_kinds(layout)
    for kind in KINDS:
        for members in layout.group_ranks(kind):
            keep = len(members) > 1 or kind in solo
            if keep and tuple(members) not in made:
                made[tuple(members)] = dist.new_group(members)  # every rank, every group, the same order
            if rank in members and keep:
                (mine if len(members) > 1 else singles)[kind] = made[tuple(members)]
    return Topology(rank=rank, world=dist.get_world_size(), layout=layout, groups=mine, hcg=_ACTIVE["hcg"],
                    on_cpu=on_cpu, singles=singles)


def single_member_kinds(layout: Layout) -> tuple:
    """Group kinds whose one-member groups are made too: "edp" when stage-1 V2 gives the routed experts buckets of
    their own over it (ep > 1 with parallel.sharding_split_param: `llmtrain.parallel.expert_states`), since
    fleet's buckets read a group object's size and rank even when edp = 1."""
    return ("edp",) if layout.ep > 1 and layout.sharding_split_param and layout.sharding > 1 else ()


FLEET_GROUPS = {"dp": "get_data_parallel_group", "pp": "get_pipe_parallel_group",
                "sharding": "get_sharding_parallel_group", "cp": "get_sep_parallel_group",
                "tp": "get_model_parallel_group"}


def _fleet_groups(layout: Layout, hcg, rank: int) -> dict:
    """{members: process group} of the groups fleet created for this rank, checked against `Layout.group_ranks`;
    every rank records the same keys (members of groups it is not in map to None), so later `new_group` calls
    skip the same groups everywhere."""
    made = {}
    for kind, getter in FLEET_GROUPS.items():
        for members in layout.group_ranks(kind):
            if len(members) > 1:
                made[tuple(members)] = None
                if rank in members:
                    group = getattr(hcg, getter)()
                    if list(group.ranks) != members:
                        raise RuntimeError(f"fleet's {kind} group of rank {rank} is {list(group.ranks)}, the layout "
                                           f"says {members} (order {list(layout.grid)})")
                    made[tuple(members)] = group
    return made
