"""Parallel layout: the `parallel` config group (`conf/parallel/*.yaml`).

    python -m paddle.distributed.launch --nproc_per_node 4 llmtrain/pretrain.py +parallel=dp2tp2

`parallel` is deliberately absent from the defaults list: `+parallel=NAME`
appends it, and no `+parallel=` means one device. Any field can be overridden
after the file is chosen (`+parallel=tp2 parallel.pp=2`).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelConfig:
    name: str = "custom"
    """Label of the layout (used in run names); the option files set it to their file name."""

    dp: int = 1
    """Data-parallel degree: replicas that each see a different share of the global batch."""

    tp: int = 1
    """Tensor (model) parallel degree, Megatron style: heads, FFN width and vocabulary split across ranks."""

    pp: int = 1
    """Pipeline-parallel degree: the layer stack cut into this many stages."""

    sharding: int = 1
    """Sharding (ZeRO) degree: data-parallel ranks that also split optimizer state (and more, by stage)."""

    sharding_stage: int = 1
    """ZeRO stage when sharding > 1: 1 optimizer states, 2 + gradients, 3 + parameters."""

    zero3_segment_size: int = 1048576
    """ZeRO-3 only: parameters with fewer elements than this stay whole on every rank (Paddle's `segment_size`)."""

    pp_schedule: str = "1f1b"
    """Pipeline schedule: `1f1b`, or `interleaved` (virtual stages; needs pp > 2 and virtual_pp > 1)."""

    virtual_pp: int = 1
    """Model chunks per pipeline rank for the interleaved schedule (1 = plain 1F1B)."""

    ep: int = 1
    """Expert-parallel degree (Mixture-of-Experts models): each group of ep data-parallel ranks spreads the routed
    experts over its members, num_experts / ep each. Carved out of dp (adds no processes); must divide dp."""

    ep_dispatcher: str = "allgather"
    """How tokens reach their experts under ep > 1: `allgather` (gloo and NCCL) or `alltoall` (NCCL only, GPU)."""

    order: list = field(default_factory=lambda: ["dp", "pp", "sharding", "tp"])
    """Nesting of the process grid from outermost to innermost (fleet's `hybrid_configs.order`; `tp` = fleet's `mp`).
    Innermost ranks are adjacent, so put the most communication-heavy axis (tp) last."""

    def world(self) -> int:
        """Processes this layout needs: dp x tp x pp x sharding."""
        return self.dp * self.tp * self.pp * self.sharding

    def data_parallel(self) -> int:
        """Ranks that read different data: dp x sharding."""
        return self.dp * self.sharding
