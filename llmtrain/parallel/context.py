"""Context parallelism (`parallel.cp`): each sequence split over cp ranks, causally load-balanced.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py model=llama-tiny +parallel=cp2
    python -m pytest tests/parallel/test_context.py -q

The plan, in the order a step meets it:
- Chunks (`ChunkLayout`). A sequence of s positions is cut into 2·cp chunks of c = s / (2·cp); rank r of the cp
  group holds chunks r and 2·cp-1-r, so under a causal mask every rank has the same attention work (one early,
  one late chunk; Megatron-Core's and torchtitan's head-tail split). Every rank of a cp group reads the same
  samples (data ranks are dp x sharding) and keeps its 2·c positions of each (`localize`): input ids, labels,
  loss mask, the positions RoPE / learned embeddings use (global positions, or the per-document ones of
  `data.reset_position_ids`) and the document ids of `data.document_mask`. Tokens are counted before this cut,
  from the whole sample, so they are never multiplied or divided by cp.
- Attention (`ContextParallelRoles.attention_core`). Everything but attention is per-position and runs on the
  local 2·c positions unchanged; the attention core is wrapped with the exchange `parallel.cp_comm` picks
  (llmtrain/parallel/context_exchange.py: ring, all-gather or all-to-all), which lets each local query see the
  keys it needs and no others.
- Loss (`ContextParallelLoss`). A rank's loss terms cover its positions only: the micro-batch's loss sum is summed
  over cp in the forward (its backward passes each rank's own terms the gradient unchanged) and the token count
  too, so every cp rank holds the micro-batch's exact mean loss, as one process would.
- Gradients: each rank's parameter gradients are its positions' part, summed over cp and averaged over dp by
  fleet's `sep` support (HybridParallelOptimizer all-reduces over the dp x sep group, scaled by 1/dp; pipeline
  and sharding stage 1 the same).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle.distributed as dist
import paddle.nn as nn
from paddle.autograd import PyLayer

from llmtrain.contracts.steps import StepHook
from llmtrain.parallel.context_chunks import ChunkLayout
from llmtrain.parallel.context_checks import context_problems  # noqa: F401  (its home before the split)

@dataclass
class ContextStats:
    """What this rank's attention did and held under cp (written into memory.json as the rank's "context" entry)."""

    cp_rank: int = 0
    chunks: list = field(default_factory=list)
    """The chunk indices this rank holds."""
    index_ranges: list = field(default_factory=list)
    """[first, last] sequence index of each chunk the first micro-batch's rows gave this rank."""
    positions: list = field(default_factory=list)
    """[first, last] position id (RoPE / learned embedding) of each chunk, row 0 of the first micro-batch."""
    local_positions: int = 0
    """Positions of one row this rank processes (2 c)."""
    score_pairs: int = 0
    """Query-key score elements this rank's attention computed (summed over batch, heads, layers and calls)."""
    exchange_bytes: int = 0
    """Bytes of keys/values (and their gradients) this rank sent through the cp exchange."""

    def record_batch(self, layout: ChunkLayout, rank: int, local: dict) -> None:
        """Note the chunks and positions of the first micro-batch seen (once)."""
        if self.chunks:
            return
        c, idx = layout.chunk, layout.index(rank)
        pos = np.asarray(local["position_ids"])[0]
        self.chunks = list(layout.chunks(rank))
        self.index_ranges = [[int(idx[i * c]), int(idx[(i + 1) * c - 1])] for i in range(2)]
        self.positions = [[int(pos[i * c]), int(pos[(i + 1) * c - 1])] for i in range(2)]
        self.local_positions = int(idx.size)

    def report(self) -> dict:
        return {"cp_rank": self.cp_rank, "chunks": self.chunks, "index_ranges": self.index_ranges,
                "positions": self.positions, "local_positions": self.local_positions,
                "score_pairs": self.score_pairs, "exchange_bytes": self.exchange_bytes}


class ContextParallelRoles:
    """The layer factory under cp > 1: `inner`'s layers (plain, tp or tp + sp), with every attention core wrapped
    in this rank's exchange (`llmtrain.parallel.context_exchange.ContextAttention`)."""

    def __init__(self, inner, plan: "ContextPlan"):
        self._inner, self._plan = inner, plan

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def attention_core(self, core):
        from llmtrain.parallel.context_exchange import ContextAttention

        wrapped = ContextAttention(self._inner.attention_core(core), self._plan.comm, self._plan.group,
                                   self._plan.stats)
        self._plan.cores.append(wrapped)
        return wrapped


class _SumOverCp(PyLayer):
    """Forward: the sum over the cp group. Backward: the gradient unchanged (each rank's own terms)."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, dy):
        return dy


class ContextParallelLoss(nn.Layer):
    """`(loss_sum, tokens)` of this rank's positions -> the micro-batch's, summed over cp (see the module doc)."""

    def __init__(self, inner, group):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, logits, labels):
        loss_sum, tokens = self.inner(logits, labels)
        tokens = tokens.detach().clone()
        dist.all_reduce(tokens, group=self.group)
        return _SumOverCp.apply(loss_sum, self.group), tokens


class ContextPlan(StepHook):
    """This rank's context-parallel plan: its roles, micro-batch cut, loss wrapper and report."""

    def __init__(self, topo, comm: str):
        self.rank, self.cp, self.group, self.comm = topo.cp_rank, topo.cp_world, topo.cp_group, comm
        self.stats = ContextStats(cp_rank=self.rank)
        self.cores: list = []

    def roles(self, inner) -> ContextParallelRoles:
        return ContextParallelRoles(inner, self)

    def localize(self, mb: dict) -> dict:
        """A micro-batch of whole samples -> this rank's chunks of them (`ChunkLayout.localize`)."""
        layout = ChunkLayout(np.asarray(mb["input_ids"]).shape[1], self.cp)
        local = layout.localize(mb, self.rank)
        self.stats.record_batch(layout, self.rank, local)
        return local

    def loss(self, loss_fn):
        return ContextParallelLoss(loss_fn, self.group)

    def after_step(self, record) -> None:
        for core in self.cores:  # the first step's counts are the report's; later steps are not counted
            core.recording = False

    def report(self) -> dict:
        return self.stats.report()
