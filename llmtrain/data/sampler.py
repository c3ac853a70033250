"""Layout-independent data order: global step -> sample ids -> this data rank's micro-batches.

    sampler = StepSampler(global_batch_size=32, micro_batch_size=4, dp_rank=1, dp_world=2)
    ids = sampler.rank_ids(consumed_samples)   # [accumulation, micro_batch] global sample ids

The samples of a step are the ``G`` consecutive ids of the global (blended) stream
starting at ``consumed_samples``; they depend on the seed, the data and ``G`` only.
Rank ``r`` of ``W`` data-parallel ranks (dp x sharding; tp and pp ranks of one data
rank get the same ids) takes the **contiguous** share ``[r*G/W, (r+1)*G/W)`` of the
step, cut into ``G / (m*W)`` micro-batches of ``m`` consecutive ids. Whatever ``W``
and ``m``, the union over ranks of a step's ids is the same set, and resuming
from ``consumed_samples`` continues the same stream with nothing skipped or
repeated.
"""

from __future__ import annotations

import numpy as np


def accumulation_steps(global_batch_size: int, micro_batch_size: int, dp_world: int) -> int:
    """``G / (m * W)``, or a ValueError naming the numbers."""
    G, m, W = int(global_batch_size), int(micro_batch_size), int(dp_world)
    if G <= 0 or m <= 0 or W <= 0:
        raise ValueError(f"global_batch_size={G}, micro_batch_size={m}, data-parallel world={W}: "
                         f"all must be positive")
    if G % (m * W):
        raise ValueError(f"global_batch_size={G} is not a multiple of micro_batch_size={m} x "
                         f"data-parallel world={W} = {m * W}")
    return G // (m * W)


class StepSampler:
    """Which global sample ids each step, and each data rank within it, consumes."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, dp_rank: int = 0, dp_world: int = 1):
        self.accumulation = accumulation_steps(global_batch_size, micro_batch_size, dp_world)
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_world={dp_world})")
        self.global_batch_size, self.micro_batch_size = int(global_batch_size), int(micro_batch_size)
        self.dp_rank, self.dp_world = int(dp_rank), int(dp_world)

    rampup = None
    """A `llmtrain.data.rampup.BatchRampup`, or None: then every step's batch is ``global_batch_size``."""

    def batch_at(self, consumed_samples: int) -> int:
        """Global batch G of the step that starts after ``consumed_samples`` samples."""
        return self.global_batch_size if self.rampup is None else self.rampup.batch_at(consumed_samples)

    def step_ids(self, consumed_samples: int) -> np.ndarray:
        """[G] global ids of the step that starts after ``consumed_samples`` samples."""
        return np.arange(consumed_samples, consumed_samples + self.batch_at(consumed_samples), dtype=np.int64)

    def rank_ids(self, consumed_samples: int) -> np.ndarray:
        """[accumulation, micro_batch] ids of this rank for that step (contiguous share)."""
        ids = self.step_ids(consumed_samples)  # [G]
        ids = ids.reshape(self.dp_world, len(ids) // (self.dp_world * self.micro_batch_size), self.micro_batch_size)
        return ids[self.dp_rank]
