"""Batch-size ramp-up (Megatron's `--rampup-batch-size START INCREMENT SAMPLES`): the global batch of a step
as a function of the samples consumed before it.

    python llmtrain/pretrain.py train.global_batch_size=32 train.batch_rampup=[8,8,3000]
    ramp = BatchRampup(start=8, increment=8, samples=3000, final=32); ramp.batch_at(consumed_samples)

The batch starts at START and grows by INCREMENT every SAMPLES / ((final - START) / INCREMENT)
consumed samples until it reaches the final `train.global_batch_size` (from SAMPLES consumed
samples on it stays there). Since it depends on consumed samples only, it is the same on every
layout and a resume in the middle of the ramp continues it exactly. Under pipeline parallelism
(1F1B) the trainer sets the pipeline's micro-batch count before each step
(`llmtrain.paddle_compat.fleet.set_pipeline_micro_batches`); interleaved pipelines are refused.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRampup:
    start: int
    """Global batch of the first step."""
    increment: int
    """Samples added to the global batch at each increase."""
    samples: int
    """Consumed samples over which the batch grows from start to final."""
    final: int
    """train.global_batch_size: the batch after the ramp."""

    def batch_at(self, consumed_samples: int) -> int:
        """Global batch of the step that starts after `consumed_samples` samples."""
        n_increments = (self.final - self.start) // self.increment
        if n_increments == 0 or consumed_samples >= self.samples:
            return self.final
        per_increment = self.samples / n_increments
        return min(self.final, self.start + int(consumed_samples / per_increment) * self.increment)


def rampup_problems(triple, final: int, micro_batch: int, data_parallel: int, virtual_pp: int = 1) -> list[str]:
    """Config checks of train.batch_rampup=[START, INCREMENT, SAMPLES], with the numbers."""
    name = f"train.batch_rampup={list(triple)}"
    if len(triple) != 3 or not all(isinstance(v, int) for v in triple):
        return [f"{name}: expected three integers [START, INCREMENT, SAMPLES]"]
    start, inc, samples = triple
    unit = micro_batch * data_parallel
    problems = []
    if start <= 0 or inc <= 0 or samples <= 0:
        problems.append(f"{name}: START, INCREMENT and SAMPLES must be > 0")
        return problems
    if start > final:
        problems.append(f"{name}: START {start} > train.global_batch_size={final}")
    elif (final - start) % inc:
        problems.append(f"{name}: train.global_batch_size={final} - START {start} = {final - start} is not a "
                        f"multiple of INCREMENT {inc}")
    for what, v in (("START", start), ("INCREMENT", inc)):
        if v % unit:
            problems.append(f"{name}: {what} {v} is not a multiple of micro batch x data-parallel ranks = "
                            f"{micro_batch} x {data_parallel} = {unit} (every step's batch must split evenly)")
    if virtual_pp > 1:
        problems.append(f"{name} with parallel.virtual_pp={virtual_pp}: absent for the interleaved schedule. fleet "
                        "picks its class from the start-up micro-batch count (>= 2 x pp: interleaved 1F1B; pp..2pp-1: "
                        "F-then-B, which also needs a multiple of pp), so the small steps of a ramp can need another "
                        "class than the one built, and a per-step count is untested there (a 4-process launch); "
                        "parallel.virtual_pp=1 (1F1B) ramps")
    return problems


def rampup_config_problems(rampup, data_cfg, layout) -> list[str]:
    """Problems of `train.batch_rampup` for this run (empty when off): pretraining only (fine-tuning runs a constant
    global batch), then `rampup_problems` against the layout's batch sizes (None: the layout itself is invalid)."""
    if rampup is None:
        return []
    if not hasattr(data_cfg, "prefixes"):
        return ["train.batch_rampup is for pretraining; fine-tuning runs a constant global batch"]
    if layout is None:
        return []
    if getattr(layout, "pp_schedule", "1f1b") == "dualpipev":
        return [f"train.batch_rampup={list(rampup)} with parallel.pp_schedule=dualpipev: absent. DualPipeV asserts "
                f">= 2 x pp = {2 * layout.pp} micro-batches in every step, which the small steps of a ramp may not "
                "have, and a per-step count is untested there; parallel.pp_schedule=1f1b ramps"]
    return rampup_problems(list(rampup), layout.global_batch, layout.micro_batch, layout.data_parallel,
                           layout.virtual_pp)

