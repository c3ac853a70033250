"""fleet internals the parallel plan needs on every device (read in Paddle 3.3.1).

    hidden = c_identity(hidden, mp_group)          # tied LM head under tp
    mark_secondary_shared_copies(pipeline_layer)   # a tied table counted once in the pipeline's norm
    set_pipeline_micro_batches(pipeline_parallel, n)   # this step's micro-batch count (batch ramp-up)

`c_identity` is fleet's private `mp_ops._c_identity` (forward identity, backward
all-reduce over the tensor-parallel group; on CPU the stand-in of `cpu_backend`).
`PipelineLayer.shared_comm` lists, per shared layer, the ranks holding a copy; fleet's
`HybridParallelClipGrad` skips parameters with `is_firstly_shared=False`, but Paddle
3.3.1's `_synchronize_shared_weights` compares `param.name` with attribute names and so
never sets it — without this mark a tied table is counted on every stage holding it.

`PipelineParallel` reads its micro-batch count from the strategy once, at construction
(`pipeline_configs.accumulate_steps`), into `self.accumulate_steps`. The 1F1B schedule,
`FakeMicroDataset` (cut and size check of the batch), the loss scale 1/count, the
final-loss broadcast and the delayed grad scale read that attribute on every call; the
only other copies are the user-hook capacities (`forward_hooks`/`backward_hooks`, set to
virtual stages x count at construction). `set_pipeline_micro_batches` sets both.
Interleaved schedules are refused: `fleet.distributed_model` picks their class from the
start-up count (>= 2 x pp: interleaved 1F1B, pp..2pp-1: F-then-B) and each asserts its own
rule on it, so a count that changes per step is not theirs to run. Communication-overlap
buffers (`_chunk_2_comm_buffers`, dp/sharding overlap under pp) hold the count too; they
are refused (llmtrain.parallel.overlap refuses those knobs already).
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


def set_pipeline_micro_batches(pipe, n: int) -> None:
    """Make fleet's 1F1B `PipelineParallel` `pipe` run `n` micro-batches per `train_batch`/`eval_batch` from now on."""
    require_tested_paddle()
    from paddle.distributed.fleet.meta_parallel import PipelineParallel, PipelineParallelWithInterleave

    if not isinstance(pipe, PipelineParallel):
        raise TypeError(f"set_pipeline_micro_batches: {type(pipe).__name__} is not fleet's PipelineParallel")
    n = int(n)
    if n == pipe.accumulate_steps:
        return
    if n < 1:
        raise ValueError(f"set_pipeline_micro_batches: {n} micro-batches; needs >= 1")
    if isinstance(pipe, PipelineParallelWithInterleave):  # also its F-then-B subclasses
        raise ValueError(f"{type(pipe).__name__} was chosen for accumulate_steps={pipe.accumulate_steps} at start-up "
                         f"and asserts its rule on that count; {n} micro-batches per step are not supported")
    if pipe._chunk_2_comm_buffers:
        raise ValueError(f"pipeline communication-overlap buffers were built for accumulate_steps="
                         f"{pipe.accumulate_steps}; {n} micro-batches per step are not supported with them")
    pipe.accumulate_steps = n
    for hooks in (pipe.forward_hooks, pipe.backward_hooks):  # capacity = virtual stages (1 here) x micro-batches
        if hooks is not None:
            hooks.set_hooks_capacity(n)


def pipeline_step_loss(pipe):
    """The step's mean loss held by fleet's `PipelineParallel` on its last stage, read between the schedule and the
    optimizer step (inside `train_batch`); None on the other stages. Fleet keeps each micro-batch's loss, already
    divided by accumulate_steps, in `total_loss[0]` (a list, or one tensor once `_broadcast_final_loss` ran)."""
    require_tested_paddle()
    import paddle

    from llmtrain.paddle_compat.dualpipe import is_dualpipev

    if is_dualpipev(pipe):  # DualPipeV: the loss is on stage 0, the V's last chunk (llmtrain.paddle_compat.dualpipe)
        return None if pipe.step_loss is None else pipe.step_loss.astype("float32")
    held = getattr(pipe, "total_loss", None)
    if not held or not pipe.is_pipeline_last_stage(ignore_virtual=True):
        return None
    losses = held[0]
    t = losses if isinstance(losses, paddle.Tensor) else paddle.stack([x.reshape([]) for x in losses])
    return t.astype("float32").sum().reshape([])


def live_strategy():
    """The strategy fleet was initialised with, as fleet's optimizers read it when they are built
    (`fleet.fleet._user_defined_strategy`: DygraphShardingOptimizer(V2) and HybridParallelOptimizer read their
    sharding options there at construction, so a later run of the same process sets its own there)."""
    require_tested_paddle()
    from paddle.distributed import fleet

    return fleet.fleet._user_defined_strategy
