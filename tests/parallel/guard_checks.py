"""The divergence guard under a pipeline, folded into tests/parallel/test_parity.py's launches (no launch of its own).

    runs += guard_runs(corpus, out, layout)      # entries of that layout's run_many launch
    check_guard(reference_dir, layout_dir, layout)

Faults come from tests/train/faults.py, installed by `call` entries in the launched processes. One run per
layout, `guard_faults` (a 4-layer GPT, 4 steps, checkpoint.interval=2, default settings), meets two faults:
- step 2: rank 1's gradients become NaN once (its loss stays finite). The guard rejects the step on every rank,
  re-runs it from the same state, finds it finite (a transient fault, transient_faults_total 1) and continues;
- step 3: the batch of samples 16..23 has its logits scaled by 300 on every rank: a loss spike. The default
  policy rewinds to step 2 (the checkpoint written after the re-run) and skips those samples.
Every record then equals the one-process `guard_skipped` run, which has no fault and never sees samples 16..23
(the data jumps over them): the re-run left no trace, the rewind undid the spike.

Only pp2 runs it: there the loss lives on the last stage alone and fleet's schedule steps the optimizer (the
guard's check runs inside `train_batch`), the one structure the guard meets nowhere else. Its logic (verdicts
from the job-wide numbers, re-run, skip, rewind with skip_batches / rewind_back_steps, rank 0's target, the
fallback, fp16 overflows, refused non-finite saves) is tested in one process by tests/train/test_guard_fast.py;
the norm each layout reduces by tests/parallel/test_parity.py; dp2 with fp16 by tests/gpu_paths/test_amp_fp16.py.
"""
from __future__ import annotations

import json

import pytest

from launch import metrics
from llmtest import tiny_overrides

FAULTS = "tests/train/faults.py"
LAYOUTS = ("pp2",)
TOL = 1e-5
STEPS = 4
SPIKE_STEP = 3
SPIKE = (8 * (SPIKE_STEP - 1), 8 * SPIKE_STEP)  # samples of the spiking step (global batch 8)


def _run(corpus, out, name: str, layout, extra=()) -> list[str]:
    return (tiny_overrides(corpus, str(out / name), "gpt", steps=STEPS) + [*extra]
            + ([f"+parallel={layout}"] if layout else []))


def guard_runs(corpus, out, layout=None) -> list:
    """run_many entries: the guard's runs of one layout (None: the one-process reference's)."""
    runs = [{"call": f"{FAULTS}:poison_grads", "args": [2, 1 if layout else 0]},
            {"call": f"{FAULTS}:spike", "args": [SPIKE[0], 300.0]},
            _run(corpus, out, "guard_faults", layout, ["checkpoint.interval=2"])]
    if layout is None:
        runs += [{"call": f"{FAULTS}:clear"}, {"call": f"{FAULTS}:skip_samples", "args": list(SPIKE)},
                 _run(corpus, out, "guard_skipped", None)]
    return runs + [{"call": f"{FAULTS}:clear"}]


def _same(ref: list[dict], got: list[dict], what: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1)), what
    for r, g in zip(ref, got):
        for k in ("loss", "grad_norm"):
            assert abs(g[k] - r[k]) <= TOL, (what, r["step"], k, g[k], r[k])
        for k in ("tokens", "tokens_total", "consumed_samples"):
            assert g[k] == r[k], (what, r["step"], k, g[k], r[k])


def check_guard(ref_dir, got_dir, layout: str) -> None:
    recs = lambda d, n: [r for r in metrics(d / n) if "loss" in r]  # noqa: E731
    got = recs(got_dir, "guard_faults")
    # a transient fault at step 2 (rejected everywhere, re-run, continued) and a rewind over the spike of step 3:
    # equal to the clean run that never saw samples 16..23
    _same(recs(ref_dir, "guard_skipped"), got, f"{layout} guard_faults")
    assert [r["transient_faults_total"] for r in got] == [0] + [1] * (STEPS - 1), got
    assert [r["rewinds_total"] for r in got] == [0] * (SPIKE_STEP - 1) + [1] * (STEPS - SPIKE_STEP + 1), got
    assert not any("anomaly" in r for r in got)  # the rejected spiking record was redone
    events = [r for r in metrics(got_dir / "guard_faults") if r.get("event") == "rewind"]
    assert len(events) == 1 and events[0]["step"] == SPIKE_STEP and events[0]["to_step"] == SPIKE_STEP - 1, events
    assert events[0]["anomaly"] == ["loss_spike"] and events[0]["skip_samples"] == list(SPIKE), events
    with open(got_dir / "guard_faults" / "checkpoints" / f"step_{STEPS}" / "manifest.json") as f:
        health = json.load(f)["health"]  # the step's own loss and grad norm, recorded with its verdict
    assert health["status"] == "healthy" and (health["loss"], health["grad_norm"]) == pytest.approx(
        (got[-1]["loss"], got[-1]["grad_norm"]), rel=1e-6), (health, got[-1])
