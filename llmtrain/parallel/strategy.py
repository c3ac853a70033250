"""Turn a validated `Layout` into `fleet.DistributedStrategy` and start fleet.

    topo = init_distributed(layout, seed)   # every rank, before building the model

On CPU the stand-ins of `llmtrain.paddle_compat.cpu_backend` are installed first
(gloo collectives in place of GPU-only kernels); on GPU nothing is patched.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

import paddle
import paddle.distributed as dist

from llmtrain.parallel.layout import Layout

FLEET_AXIS = {"dp": "dp", "pp": "pp", "sharding": "sharding", "tp": "mp", "cp": "sep"}


def build_strategy(layout: Layout, seed: int, on_cpu: Optional[bool] = None):
    """The fleet strategy for `layout`: hybrid degrees and order, pipeline micro-batching, TP init seed, and on GPU
    the accepted communication-overlap knobs (`llmtrain.parallel.overlap`; on CPU they are logged, not applied)."""
    from paddle.distributed import fleet

    from llmtrain.parallel.overlap import apply_overlap

    strategy = fleet.DistributedStrategy()
    order = [FLEET_AXIS[a] for a in layout.order]
    if "sep" not in order:  # fleet's grid always has a sep axis: context parallelism (cp), trivial when cp = 1
        order.insert(order.index("mp"), "sep")
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
    skipped = apply_overlap(strategy, layout, paddle.get_device() == "cpu" if on_cpu is None else on_cpu)
    if skipped:
        from llmtrain.utils.log import log0

        log0(f"CPU run: GPU-only communication knobs accepted but not applied here: {', '.join(skipped)}")
    return strategy


@dataclass
class Topology:
    """Where this process sits in the layout."""

    rank: int = 0
    world: int = 1
    data_rank: int = 0
    """Index among data-parallel readers (dp x sharding); tp/pp peers share it."""
    data_world: int = 1
    dp_rank: int = 0
    """Rank in the (pure) data-parallel group."""
    tp_rank: int = 0
    pp_rank: int = 0
    sharding_rank: int = 0
    hcg: Optional[Any] = None
    """fleet's HybridCommunicateGroup (None on a single process)."""
    ep_rank: int = 0
    """Rank in this process's expert-parallel group (which block of experts it holds)."""
    ep_group: Optional[Any] = None
    """The ep consecutive dp ranks that share out the experts (None when ep == 1)."""
    expert_dp_group: Optional[Any] = None
    """The dp ranks holding the same experts as this one (None when dp == ep)."""
    cp_rank: int = 0
    """Rank in this process's context-parallel group: it holds chunks cp_rank and 2·cp-1-cp_rank of each sequence."""
    cp_world: int = 1
    """Context-parallel degree (ranks sharing one sequence)."""
    cp_group: Optional[Any] = None
    """The context-parallel group (fleet's `sep` group; None when cp == 1)."""
    on_cpu: bool = True

    @property
    def is_last_stage(self) -> bool:
        return self.hcg is None or self.pp_rank == self.hcg.get_pipe_parallel_world_size() - 1

    def data_group(self):
        """Groups over which data-parallel quantities (tokens, loss) are summed: dp then sharding."""
        if self.hcg is None:
            return []
        groups = []
        if self.hcg.get_data_parallel_world_size() > 1:
            groups.append(self.hcg.get_data_parallel_group())
        if self.hcg.get_sharding_parallel_world_size() > 1:
            groups.append(self.hcg.get_sharding_parallel_group())
        return groups


def world_size_from_env() -> int:
    """Processes in the job, as the launcher says (1 when run directly)."""
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


_ACTIVE: dict = {}


def init_distributed(layout: Layout, seed: int) -> Topology:
    """fleet.init(is_collective=True) with our strategy (skipped on a single process).

    A second call in the same process with the same degrees and batch layout
    returns the same topology (several runs in one launch, as the parity tests do);
    another layout is refused, since fleet's groups cannot be rebuilt."""
    on_cpu = paddle.get_device() == "cpu"
    if on_cpu:  # freed tensors stay in the process (no page faults per new tensor), as on a GPU
        from llmtrain.paddle_compat.cpu_backend.host_allocator import keep_freed_memory

        keep_freed_memory()
    if not layout.distributed:
        return Topology(on_cpu=on_cpu)
    key = (layout.dp, layout.tp, layout.pp, layout.sharding, layout.cp, tuple(layout.order), layout.grad_accum,
           layout.micro_batch)
    if _ACTIVE:
        if _ACTIVE["key"] != key:
            raise RuntimeError(f"fleet is already initialised for {_ACTIVE['key']}; cannot switch this process to {key}")
        return _with_expert_groups(_ACTIVE["topo"], layout.ep)
    from paddle.distributed import fleet

    strategy = build_strategy(layout, seed)
    if on_cpu:
        from llmtrain.paddle_compat import cpu_backend

        cpu_backend.install()
        cpu_backend.check_strategy(strategy)  # refuses fleet options the CPU stand-ins cannot serve
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    dp_rank, sh_rank = hcg.get_data_parallel_rank(), hcg.get_sharding_parallel_rank()
    topo = Topology(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        data_rank=dp_rank * layout.sharding + sh_rank,
        data_world=layout.data_parallel,
        dp_rank=dp_rank,
        tp_rank=hcg.get_model_parallel_rank(),
        pp_rank=hcg.get_stage_id(),
        sharding_rank=sh_rank,
        hcg=hcg,
        cp_rank=hcg.get_sep_parallel_rank(),
        cp_world=layout.cp,
        cp_group=hcg.get_sep_parallel_group() if layout.cp > 1 else None,
        on_cpu=on_cpu,
    )
    _ACTIVE.update(key=key, topo=topo)
    return _with_expert_groups(topo, layout.ep)


def _with_expert_groups(topo: Topology, ep: int) -> Topology:
    """`topo` with this rank's expert-parallel groups for degree `ep` (created once per degree, on every rank:
    runs in one launch may differ in ep, the groups are carved out of the same dp groups)."""
    if ep <= 1:
        return topo
    if ep not in _EXPERT_GROUPS:
        from llmtrain.parallel.experts import expert_groups

        _EXPERT_GROUPS[ep] = expert_groups(topo.hcg, ep, topo.rank)
    ep_rank, ep_group, edp_group = _EXPERT_GROUPS[ep]
    return dataclasses.replace(topo, ep_rank=ep_rank, ep_group=ep_group, expert_dp_group=edp_group)


_EXPERT_GROUPS: dict = {}
