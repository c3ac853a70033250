"""Sequence-parallel collectives for CPU: fleet's `sequence_parallel_utils.all_gather` / `reduce_scatter` on gloo.

Use: installed by `llmtrain.paddle_compat.cpu_backend.install()`. Afterwards fleet's
`ScatterOp`, `GatherOp`, `AllGatherOp`, `ReduceScatterOp`, `ColumnSequenceParallelLinear`
and `RowSequenceParallelLinear` (paddle/distributed/fleet/utils/sequence_parallel_utils.py)
run on CPU processes: their PyLayers look the two module-level functions up by name at
call time, so replacing the functions is enough (`scatter`, a slice, is left alone).

Why. In Paddle 3.3.1 `all_gather` calls `group.process_group.all_gather(input, output)`
into one preallocated tensor and `reduce_scatter` calls `dist.stream.reduce_scatter`;
gloo implements neither form (it has no reduce-scatter at all). The stand-ins keep the
GPU semantics on axis 0 (the sequence axis of a [s, b, h] tensor; tp rank r owns rows
r*s/n .. (r+1)*s/n):

  all_gather(x [s/n, ...])     -> [s, ...]   `dist.all_gather` into a list, concatenated in rank order
  reduce_scatter(x [s, ...])   -> [s/n, ...] `dist.all_reduce` (sum) of the whole tensor, then this
                                             rank's rows: the same numbers as a reduce-scatter, with n
                                             times its traffic (an honest stand-in, not a fast one)

On GPU the originals (NCCL all-gather / reduce-scatter on the model-parallel group) run.
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.utils import sequence_parallel_utils as sp_utils

from ..patching import replace


def _mp_group():
    return fleet.get_hybrid_communicate_group().get_model_parallel_group()


def all_gather(input):  # noqa: A002 -- Paddle's parameter name
    """[s/n, ...] on each tp rank -> [s, ...] (rank order)."""
    group = _mp_group()
    parts: list = []
    dist.all_gather(parts, input if input.is_contiguous() else input.contiguous(), group=group)
    return paddle.concat(parts, axis=0)


def reduce_scatter(input):  # noqa: A002
    """[s, ...] partial sums on each tp rank -> this rank's [s/n, ...] of the sum."""
    group = _mp_group()
    n = group.nranks
    assert input.shape[0] % n == 0, f"sequence length {input.shape[0]} is not divisible by tp={n}"
    total = input.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    rows = input.shape[0] // n
    return total[group.rank * rows:(group.rank + 1) * rows].clone()


def install_patches() -> None:
    replace(sp_utils, "all_gather", all_gather)
    replace(sp_utils, "reduce_scatter", reduce_scatter)
