"""fleet's fused communication buffers (stage-1 sharding V2, tensor fusion, the comm overlaps) on CPU over gloo.

Use: installed by `llmtrain.paddle_compat.cpu_backend.install()`. Afterwards, on CPU, fleet's
`DygraphShardingOptimizerV2` (`sharding_configs.split_param`), V1's `tensor_fusion` / `comm_overlap` and the
pipeline's `dp_comm_overlap` / `sharding_comm_overlap` build their `FusedCommBuffer`s and run unchanged:

    python -m pytest -q tests/parallel/test_parity.py -k "sharding2v2 or tp2sharding2"

What stops them on CPU, read in Paddle 3.3.1 (`fleet/utils/tensor_fusion_helper.py`):

1. `get_current_device_type()` asserts the device is one of `alignment` = {gpu, npu, xpu} (256-byte alignment of
   each parameter inside a buffer); on a CPU build the place's `get_device_type()` raises and the helper reports
   "unknown". Stand-in: "cpu", with a "cpu" entry of 256 added to Paddle's `alignment` table (the GPU's figure),
   so the buffers are laid out, padding included, as on a GPU.
2. V2's `FusedCommBuffer._comm_grads` calls `paddle.distributed.reduce_scatter(out_slice, flat_buffer, ...)` with a
   tensor, not a list; gloo has no reduce-scatter. Stand-in for that tensor form: `all_reduce` (sum, or the op
   given) of a copy of the buffer, then this rank's contiguous `numel / n` elements copied into `out` -- the same
   numbers, n times the traffic, synchronous (a finished task is returned for `sync_op=False`). The list form goes
   to Paddle's function.

On GPU the originals run (NCCL, asynchronous on the communication stream). The GPU path is rehearsed by the same
tests: nothing here changes what fleet computes, only which device answers.
"""
from __future__ import annotations

import paddle
import paddle.distributed as dist
from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh

from ..patching import original, replace

CPU_ALIGNMENT = 256
"""Bytes each parameter's region in a fused buffer is aligned to on CPU: the GPU's figure (tensor_fusion_helper)."""


def get_current_device_type() -> str:
    """"cpu": installed only on CPU (`cpu_backend.install`), where every place is the host."""
    return "cpu"


class _Finished:
    """The task of a collective that already completed (what gloo's synchronous call leaves)."""

    def wait(self):
        return True

    def is_completed(self):
        return True


def reduce_scatter(tensor, tensor_list, op=dist.ReduceOp.SUM, group=None, sync_op=True):
    """Paddle's `dist.reduce_scatter`; its tensor form (a flat [n·k] input, this rank's [k] output) over gloo. As
    Paddle's, nothing for a group this rank is not a member of: `new_group` gives a one-member group rank -1 and no
    process group, and fleet's V2 bucket over one (the routed experts' under edp = 1) then keeps its gradient as it
    is (its slice is the whole buffer, which the GPU path leaves alone the same way)."""
    if group is not None and not group.is_member():
        return None
    if isinstance(tensor_list, (list, tuple)):  # the list form: Paddle's (gloo has none either; unchanged)
        return original(dist, "reduce_scatter")(tensor, tensor_list, op=op, group=group, sync_op=sync_op)
    full = tensor_list.clone()  # [n·k]
    dist.all_reduce(full, op=op, group=group)
    n = group.nranks if group is not None else dist.get_world_size()
    rank = group.rank if group is not None else dist.get_rank()
    k = full._numel() // n
    paddle.assign(full._slice(rank * k, (rank + 1) * k), tensor)  # [k]: this rank's part
    return _Finished()


def install_patches() -> None:
    tfh.alignment.setdefault("cpu", CPU_ALIGNMENT)  # a key added to Paddle's table, read only for the "cpu" device
    replace(tfh, "get_current_device_type", get_current_device_type)
    replace(dist, "reduce_scatter", reduce_scatter)
