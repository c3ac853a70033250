"""fleet internals the parallel plan needs on every device (read in Paddle 3.3.1).

    hidden = c_identity(hidden, mp_group)          # tied LM head under tp
    mark_secondary_shared_copies(pipeline_layer)   # a tied table counted once in the pipeline's norm

`c_identity` is fleet's private `mp_ops._c_identity` (forward identity, backward
all-reduce over the tensor-parallel group; on CPU the stand-in of `cpu_backend`).
`PipelineLayer.shared_comm` lists, per shared layer, the ranks holding a copy; fleet's
`HybridParallelClipGrad` skips parameters with `is_firstly_shared=False`, but Paddle
3.3.1's `_synchronize_shared_weights` compares `param.name` with attribute names and so
never sets it — without this mark a tied table is counted on every stage holding it.
"""
from __future__ import annotations

from llmtrain.paddle_compat.version import require_tested_paddle


def c_identity(tensor, group):
    """Identity forward, all-reduce of the gradient over `group` backward."""
    require_tested_paddle()
    from paddle.distributed.fleet.layers.mpu import mp_ops

    return mp_ops._c_identity(tensor, group=group)


def mp_allreduce(tensor, group):
    """Sum over `group` forward, identity backward (fleet's private `mp_ops._mp_allreduce`; CPU: the stand-in)."""
    require_tested_paddle()
    from paddle.distributed.fleet.layers.mpu import mp_ops

    return mp_ops._mp_allreduce(tensor, group=group)


def mark_secondary_shared_copies(pipe) -> None:
    """Mark the copy of each shared (tied) weight on every rank but the first of its group."""
    require_tested_paddle()
    import paddle.distributed as dist

    rank = dist.get_rank()
    for comm in getattr(pipe, "shared_comm", {}).values():
        if rank != min(comm["ranks"]):
            for attr in comm["weight_attr"]:
                getattr(comm["layer"], attr).is_firstly_shared = False
