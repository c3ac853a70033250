"""When each fused bucket's gradient collective was issued, relative to the backward: `<run.dir>/overlap/rank_N.jsonl`.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py +parallel=sharding2 \
        parallel.sharding_split_param=true parallel.sharding_comm_overlap=true    # then read run.dir/overlap/
    hooks = timeline_hooks(model, optimizer, run_dir, rank)    # [] when the layout has no fused buffers

Written for every run whose layout keeps gradients in fleet's fused communication buffers
(`llmtrain.parallel.overlap.FUSED`: sharding V2, the sharding and dp comm overlaps), one JSON line per step:

    {"step": 3, "update_s": 0.41, "buckets": [{"bucket": 0, "elements": 53248, "issued_s": 0.37, "returned_s": 0.38,
     "before_update": true}, ...]}

Times are seconds since the step began (its first forward). `update_s` is when the backward was over and the
optimizer step began (the first of: the step hooks' `before_update`, the optimizer's `step` call; under pp the
pipeline's schedule calls the optimizer, so its last backward ends there). A bucket issued before `update_s` was
issued from a gradient hook inside the backward: that is the overlap (on a GPU the collective then runs on the
communication stream while the backward goes on; over gloo on CPU the call is synchronous, so `returned_s` is its
end, and the issue order is what the CPU shows). Without a comm overlap every bucket is issued after `update_s`, by
the optimizer's `reduce_gradients`. Layouts without fused buffers (DataParallel's own buckets, V1 sharding's
per-tensor reduce, ZeRO-2/3) record nothing here: their collectives are issued inside Paddle's C++ reducer or
wrappers, out of reach of this hook.
"""
from __future__ import annotations

import json
import os
import time

from llmtrain.contracts.steps import StepHook


class OverlapTimeline(StepHook):
    """A step hook that records every fused bucket's collective of the step and writes one line per step."""

    def __init__(self, buffers: list, optimizer, path: str):
        from llmtrain.paddle_compat.sharding_v2 import buffer_numel, on_gradient_collective

        self.path = path
        self.ids = {id(b): i for i, b in enumerate(buffers)}
        self.sizes = {id(b): buffer_numel(b) for b in buffers}
        self.t0, self.update, self.events, self.step = None, None, [], 0
        for buf in buffers:
            on_gradient_collective(buf, self._record)
        inner = optimizer.step

        def step(*args, **kwargs):
            self._mark_update()
            return inner(*args, **kwargs)

        optimizer.step = step  # the instance's own attribute: the pipeline's schedule calls it too
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._file = open(path, "a")

    def _record(self, buf, start: float, end: float) -> None:
        self.events.append((self.ids.get(id(buf), -1), self.sizes.get(id(buf), 0), start, end))

    def _mark_update(self) -> None:
        if self.update is None:
            self.update = time.perf_counter()

    def before_step(self, micro_batches: int) -> None:
        self.t0, self.update, self.events = time.perf_counter(), None, []

    def before_update(self, check) -> None:
        self._mark_update()

    def after_step(self, record) -> None:
        if self.t0 is None:
            return
        update = self.update if self.update is not None else time.perf_counter()
        line = {"step": record.step, "update_s": round(update - self.t0, 6), "buckets": [
            {"bucket": b, "elements": n, "issued_s": round(s - self.t0, 6), "returned_s": round(e - self.t0, 6),
             "before_update": s < update} for b, n, s, e in self.events]}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        self.t0 = None


def timeline_hooks(model, optimizer, run_dir: str, rank: int) -> list:
    """[OverlapTimeline] when `model` (the pipeline) or `optimizer` (sharding V2) holds fused gradient buffers; []."""
    from llmtrain.paddle_compat.sharding_v2 import fused_buffers, pipeline_buffers

    buffers = pipeline_buffers(model)
    seen = {id(b) for b in buffers}
    buffers += [b for b in fused_buffers(optimizer) if id(b) not in seen]
    if not buffers:
        return []
    return [OverlapTimeline(buffers, optimizer, os.path.join(run_dir, "overlap", f"rank_{rank:05d}.jsonl"))]


def read_timeline(run_dir: str, rank: int = 0) -> list[dict]:
    """The records a run wrote for `rank` (one per step)."""
    with open(os.path.join(run_dir, "overlap", f"rank_{rank:05d}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
