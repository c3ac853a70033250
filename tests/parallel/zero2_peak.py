"""Test-side measurement for tests/parallel/test_parity.py: gradient bytes a ZeRO-2 rank holds at its backward's peak.

    [{"call": "tests/parallel/zero2_peak.py:record_into", "args": [DIR]}, {"overrides": [... +parallel=zero2]}, ...]
    check(DIR, memory_json)    # in the test

`record_into(DIR)` (called in the launched process before a run) wraps the gradient-reduce hook that Paddle's
`GroupShardedStage2` puts on every trainable parameter (`_get_reduce_fn`, read in Paddle 3.3.1): each time a
parameter's gradient is complete, before it is reduced to its owner and freed on the other ranks, the distinct
bytes of every allocated gradient of the wrapped model (parameter gradients and the gradient storages,
overlapping views counted once, as `llmtrain.train.memory` counts them) are measured; the largest value over
the run is the backward's peak, written to DIR/zero2_peak.<rank>.json with the sharding rank.
"""
from __future__ import annotations

import json
import os


def _grad_bytes(stage2) -> int:
    from llmtrain.paddle_compat.optim import is_allocated
    from llmtrain.train.memory import _span, _union_bytes

    spans = []
    for p in stage2._trainable_params:
        for g in (getattr(p, "grad", None), getattr(p, "main_grad", None)):
            if is_allocated(g):
                spans.append(_span(g))
    for per_rank in stage2._grad_storages.values():
        for storage in per_rank.values():
            if storage.buffer is not None and is_allocated(storage.buffer):
                spans.append(_span(storage.buffer))
    return _union_bytes(spans)


def record_into(out_dir: str) -> None:
    import paddle.distributed as dist
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage2 import GroupShardedStage2

    os.makedirs(out_dir, exist_ok=True)
    GroupShardedStage2._llmtest_peak_dir = out_dir  # the runs after this call write here (until the next call)
    if getattr(GroupShardedStage2, "_llmtest_wrapped", False):
        return
    original = GroupShardedStage2._get_reduce_fn

    def get_reduce_fn(self, index, param, dst_rank):
        reduce = original(self, index, param, dst_rank)
        out = GroupShardedStage2._llmtest_peak_dir

        def measured(*args):
            if out is None:  # recording stopped (`stop_recording`): a later run of the launch
                return reduce(*args)
            held = _grad_bytes(self)
            path = os.path.join(out, f"zero2_peak.{dist.get_rank()}.json")
            if held > getattr(self, "_llmtest_peak", -1):
                self._llmtest_peak = held
                with open(path, "w") as f:
                    json.dump({"rank": dist.get_rank(), "sharding_rank": self._rank, "peak_grad_bytes": held}, f)
            return reduce(*args)

        return measured

    GroupShardedStage2._get_reduce_fn = get_reduce_fn
    GroupShardedStage2._llmtest_wrapped = True


def stop_recording() -> None:
    """The runs after this call are not measured (later runs of the same launch would overwrite the last file)."""
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage2 import GroupShardedStage2

    GroupShardedStage2._llmtest_peak_dir = None


PLAN_RTOL = 0.03
"""|measured peak - plan| / plan where the plan's storages are small (it ignores Paddle's 4096-byte alignment of each
gradient inside a storage; measured 1.5-1.6% here)."""
SHARDED_AT_MOST = 0.7
"""Largest peak / parameter bytes of a rank when gradients are sharded (measured 0.64 on both ranks of llama_wide)."""


def check(run_dir, sharded: bool) -> list[tuple[int, int, int, int]]:
    """A ZeRO-2 run's measured backward peaks against memory.json (what each rank holds, the planner's prediction).

    sharded: the storages are small (`parallel.zero2_buffer_size`): each rank's peak is within PLAN_RTOL of the
    plan's `grad_bytes`, holds at least the gradients of the parameters it owns (its optimizer-state share) and at
    most SHARDED_AT_MOST of all parameter bytes. Not sharded (Paddle's default 2**23-element storages hold a tiny
    model whole, one per owning rank): every rank holds every gradient, the plan (alignment ignored) a lower bound.
    Returns (rank, peak, plan, parameter bytes) per rank."""
    from pathlib import Path

    run_dir = Path(run_dir)
    mem = json.loads((run_dir / "memory.json").read_text())
    plan = {(p["dp_rank"], p["tp_rank"], p["pp_rank"], p["sharding_rank"]): p for p in mem["predicted"]["ranks"]}
    out = []
    for e in mem["ranks"]:
        peak = json.loads((run_dir / f"zero2_peak.{e['rank']}.json").read_text())
        assert peak["sharding_rank"] == e["sharding_rank"], (peak, e["sharding_rank"])
        held = peak["peak_grad_bytes"]
        want = plan[(e["dp_rank"], e["tp_rank"], e["pp_rank"], e["sharding_rank"])]["grad_bytes"]
        owned = sum(e["params"][n]["bytes"] for n in e["optimizer_params"])
        what = f"{run_dir.name} rank {e['rank']}: gradient bytes at the backward's peak {held}, plan {want}, " \
               f"owned {owned}, parameters {e['param_bytes']}"
        if sharded:
            assert abs(held - want) <= PLAN_RTOL * want, what
            assert owned <= held <= SHARDED_AT_MOST * e["param_bytes"], what
        else:
            assert held >= want and held >= e["param_bytes"], what
        out.append((e["rank"], held, want, e["param_bytes"]))
    return out
