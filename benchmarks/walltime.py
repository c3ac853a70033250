"""Both sides of a trainer-vs-bare-loop benchmark timed the same way: wall clock around whole steps.

    from walltime import StepClock, trainer_window
    clock = StepClock(); ...; clock.mark(tokens, positions)   # bare loop: once per step, after the step's sync
    trainer_window(run_dir, warmup)                            # ours: from metrics.jsonl's per-record `time`

A window starts at the end of the last warm-up step and ends at the end of the last
step, so it holds the same whole steps on both sides: data wait (each side with the
data class's own prefetch), forward, backward, optimizer, and for the trainer its
logging (metrics.jsonl, VisualDL, progress bar) as configured. The trainer stamps
each record (`time`) after the step's loss sync; the bare loop marks the same point.
"""
from __future__ import annotations

import json
import os
import time


def _window(stamps: list[tuple[int, float, int, int]], warmup: int) -> dict:
    """stamps: (step, unix time at the end of the step, tokens, positions), one per step, in order."""
    if len(stamps) <= warmup + 1:
        raise ValueError(f"{len(stamps)} steps: need more than warm-up ({warmup}) + 1")
    start = next(t for s, t, _, _ in stamps if s == warmup)
    timed = [x for x in stamps if x[0] > warmup]
    seconds = timed[-1][1] - start
    return {"seconds": seconds, "steps": len(timed), "tokens_per_s": sum(x[2] for x in timed) / seconds,
            "positions_per_s": sum(x[3] for x in timed) / seconds, "step_s": seconds / len(timed)}


def trainer_window(run_dir: str, warmup: int, positions_per_step: int) -> dict:
    """Rates of our trainer from `<run_dir>/metrics.jsonl` (needs train.log_interval=1)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    recs = [r for r in recs if "loss" in r]
    if [r["step"] for r in recs] != list(range(1, len(recs) + 1)):
        raise ValueError("trainer_window needs one metrics record per step (train.log_interval=1)")
    return _window([(r["step"], r["time"], r["tokens"], positions_per_step) for r in recs], warmup)


class StepClock:
    """Per-step end times of a hand-written loop."""

    def __init__(self):
        self.stamps: list[tuple[int, float, int, int]] = []

    def mark(self, tokens: int, positions: int) -> None:
        self.stamps.append((len(self.stamps) + 1, time.time(), int(tokens), int(positions)))

    def window(self, warmup: int) -> dict:
        return _window(self.stamps, warmup)
