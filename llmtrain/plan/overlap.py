"""How much of each gradient synchronisation a step waits for: the communication options switched on, priced.

    python -m llmtrain.plan model=llama-7b plan.devices=64 +parallel=tp2sharding2 parallel.tp=1 parallel.sharding=64 \
        parallel.sharding_split_param=true parallel.sharding_comm_overlap=true
    syncs = gradient_syncs(layout, gpu=True)      # {axis: SyncPlan}: who buckets, how big, overlapped or not
    exposed_s = exposed(comm_s, window_s, sync)   # the part of comm_s the step waits for

A gradient synchronisation is overlapped only where the run asks for it and the device runs collectives beside
compute (a GPU's communication stream; `DeviceProfile.async_launch`; on CPU gloo runs in the training thread, so
nothing overlaps). What each layout does, read in Paddle 3.3.1:

- dp, pp = 1, sharding = 1: `paddle.DataParallel`'s reducer all-reduces 25 MiB buckets (`comm_buffer_size`) from
  gradient hooks during the last micro-batch's backward (the others run under `no_sync`): always overlapped.
- dp with pp > 1 or sharding > 1: fleet's HybridParallelOptimizer all-reduces every gradient after the backward
  (`fused_allreduce_gradients`): exposed, unless `parallel.dp_comm_overlap` (pp > 1), whose 128 MiB buckets
  (`PipelineParallel.register_allreduce_overlap_hook`'s group size) are issued from the last backward.
- sharding stage 1, V1: each gradient reduced to its owner after the backward (exposed); with `tensor_fusion` or
  `comm_overlap` one reduce per fused bucket of an owner's parameters (`comm_buffer_size_MB`), issued from the last
  backward with `parallel.sharding_comm_overlap` (pp = 1; under pp tensor fusion's buckets are reduced after the
  pipeline's backward); `split_param` (V2):
  one reduce-scatter per 256 MiB bucket (`sharding_configs.comm_buffer_size_MB`), after the backward unless
  `parallel.sharding_comm_overlap` (pp = 1) or `parallel.pp_sharding_comm_overlap` (pp > 1, 128 MiB buckets)
  issues them from the last backward. The updated parameters' broadcast (V1) / all-gather (V2) follows the update,
  never overlapped (V2's all-gather-in-the-next-forward is not switched on by llmtrain).
- ZeRO-2: GroupShardedStage2 reduces each gradient storage (`parallel.zero2_buffer_size` elements) from hooks in
  every micro-batch's backward: overlapped per micro-batch. ZeRO-3: a layer's parameters gathered before its
  forward and backward, its gradients reduce-scattered after: one bucket per layer, overlapped with the
  micro-batch's compute.

The overlap model: a sync of `comm_s` in n equal buckets whose gradients become ready evenly through a backward
window of `window_s`, issued in order on one communication stream. Bucket i is ready at window·(i + 1)/n and
starts when ready and the stream is free, so the last one ends at max over i of window·(i + 1)/n + (n - i)·comm/n;
that is linear in i, so the maximum is at an end: the step waits

    exposed = max(comm / n, comm - window·(n - 1)/n)

(the last bucket always; all of it beyond what the window hides). Not overlapped: exposed = comm. The gradients
move in fp32 under main-gradient training (the fused-buffer knobs switch it on: `llmtrain.train.main_grad`),
otherwise in the parameters' dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MIB = 2**20
DATA_PARALLEL_BUCKET = 25 * MIB
"""paddle.DataParallel's `comm_buffer_size` default (MB)."""
PIPELINE_BUCKET = 128 * MIB
"""fleet PipelineParallel's fused-gradient group size for dp_comm_overlap / sharding_comm_overlap."""
SHARDING_BUCKET = 256 * MIB
"""fleet's `sharding_configs.comm_buffer_size_MB` default (`parallel.sharding_comm_buffer_mb` sets it)."""


@dataclass(frozen=True)
class SyncPlan:
    """How one gradient synchronisation of a step runs."""

    kind: str
    """What moves: "all-reduce", "reduce" (V1, per tensor), "reduce-scatter" (V2, ZeRO-3), "storages" (ZeRO-2)."""
    overlapped: bool
    """Issued from gradient hooks during the backward (the option asked for it, or the wrapper always does)."""
    bucket_bytes: float
    """Bytes of one bucket (0: one collective per tensor, or per layer under ZeRO-3)."""
    option: str
    """The `parallel.*` knob that decides `overlapped` here ("" when none does)."""


def gradient_syncs(layout, gpu: bool = True, e: float = 2.0) -> dict:
    """{axis: SyncPlan} for the gradient syncs of `layout` ("dp", "sharding"); a CPU (`gpu` False) overlaps none;
    `e`: bytes per gradient element (ZeRO-2's storages hold `zero2_buffer_size` elements)."""
    out = {}
    sharding, pp = layout.sharding > 1, layout.pp > 1
    if layout.dp * getattr(layout, "cp", 1) > 1:
        if not pp and not sharding:
            out["dp"] = SyncPlan("all-reduce", gpu, DATA_PARALLEL_BUCKET, "")
        else:
            on = pp and layout.dp_comm_overlap
            out["dp"] = SyncPlan("all-reduce", gpu and on, PIPELINE_BUCKET if on else 0.0, "dp_comm_overlap" if pp else "")
    if sharding and layout.sharding_stage == 1:
        if pp:
            on = layout.pp_sharding_comm_overlap
            kind = "reduce-scatter" if layout.sharding_split_param else "reduce"
            fused = layout.sharding_split_param or layout.sharding_tensor_fusion  # V2's or V1's own buckets
            out["sharding"] = SyncPlan(kind, gpu and on, PIPELINE_BUCKET if on else
                                       (getattr(layout, "sharding_comm_buffer_mb", 256) * MIB if fused else 0.0),
                                       "pp_sharding_comm_overlap")
        elif layout.sharding_split_param:
            out["sharding"] = SyncPlan("reduce-scatter", gpu and layout.sharding_comm_overlap,
                                       getattr(layout, "sharding_comm_buffer_mb", 256) * MIB,
                                       "sharding_comm_overlap")
        elif layout.sharding_tensor_fusion or layout.sharding_comm_overlap:  # V1's fused buckets, to their owner
            out["sharding"] = SyncPlan("reduce", gpu and layout.sharding_comm_overlap,
                                       getattr(layout, "sharding_comm_buffer_mb", 256) * MIB, "sharding_comm_overlap")
        else:
            out["sharding"] = SyncPlan("reduce", False, 0.0, "sharding_split_param")
    elif sharding and layout.sharding_stage == 2:
        out["sharding"] = SyncPlan("storages", gpu, float(layout.zero2_buffer_size) * e, "")
    elif sharding:
        out["sharding"] = SyncPlan("reduce-scatter", gpu, 0.0, "")
    return out


def buckets(total_bytes: float, sync: SyncPlan, tensors: int = 1) -> int:
    """Collectives one sync issues: ceil(bytes / bucket) for bucketed syncs, `tensors` otherwise (V1: one per
    tensor; ZeRO-3: one per layer)."""
    if sync.bucket_bytes <= 0:
        return max(1, tensors)
    return max(1, math.ceil(total_bytes / sync.bucket_bytes))


def exposed(comm_s: float, window_s: float, sync: SyncPlan, n: int) -> float:
    """Seconds of a sync of `comm_s` in `n` buckets the step waits for, behind a backward of `window_s`."""
    if not sync.overlapped or comm_s <= 0:
        return comm_s
    return max(comm_s / n, comm_s - window_s * (n - 1) / n)


def gradient_bytes_per_element(layout, e: float) -> float:
    """Bytes per gradient element the sync moves: 4 under main-gradient training (the fused-buffer knobs), else the
    parameters' `e`."""
    from llmtrain.parallel.overlap import needs_main_grad

    return 4.0 if needs_main_grad(layout) else e
