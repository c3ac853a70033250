"""The divergence guard under a layout, folded into tests/parallel/test_parity.py's launches (no launch of its own).

    runs += guard_runs(corpus, out, layout)      # entries of that layout's run_many launch
    check_guard(reference_dir, layout_dir, layout)

Faults come from tests/train/faults.py, installed by `call` entries in the launched processes. One run per
layout, `guard_faults` (a 4-layer GPT, 4 steps, checkpoint.interval=2, default settings), meets two faults:
- step 2: rank 1's gradients become NaN once (its loss stays finite). The guard rejects the step on every rank,
  re-runs it from the same state, finds it finite (a transient fault, transient_faults_total 1) and continues;
- step 3: the batch of samples 16..23 has its logits scaled by 300 on every rank: a loss spike. The default
  policy rewinds to step 2 (the checkpoint written after the re-run) and skips those samples.
Every record then equals the one-process `guard_skipped` run, which has no fault and never sees samples 16..23
(the data jumps over them): the re-run left no trace, the rewind undid the spike. One process only:
- `guard_skip` (train.anomaly.policy=skip, the same spike, a checkpoint every step): the checkpoint of step 3
  (the skipped step) holds exactly the tensors of step 2 and is marked anomalous, step 4 trains again;
- `guard_nan`: a NaN written into the word-embedding table at step 3 (corrupted memory): the save of step 4 is
  refused, steps 0 and 2 stay (keep_last=2).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from launch import metrics
from llmtest import tiny_overrides

FAULTS = "tests/train/faults.py"
LAYOUTS = ("dp2", "tp2", "pp2", "zero2")
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
        runs += [_run(corpus, out, "guard_skip", None, ["checkpoint.interval=1", "checkpoint.keep_last=0",
                                                        "train.anomaly.policy=skip"]),
                 {"call": f"{FAULTS}:clear"}, {"call": f"{FAULTS}:skip_samples", "args": list(SPIKE)},
                 _run(corpus, out, "guard_skipped", None), {"call": f"{FAULTS}:clear"},
                 {"call": f"{FAULTS}:nan_weights", "args": [SPIKE_STEP]},
                 _run(corpus, out, "guard_nan", None, ["checkpoint.interval=2", "train.anomaly.policy=skip"])]
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
    if layout == "single":
        check_skip(ref_dir / "guard_skip")
        steps = sorted(int(p.name[5:]) for p in (ref_dir / "guard_nan" / "checkpoints").glob("step_*"))
        assert steps == [0, 2], steps  # never written from a non-finite state (else 2, 4; step 0 is the start)
        assert [r["step"] for r in recs(ref_dir, "guard_nan")] == list(range(1, STEPS + 1))


def check_skip(run_dir) -> None:
    """policy=skip: the skipped step's update is dropped (parameters and optimizer state untouched)."""
    from safetensors.numpy import load_file

    recs = [r for r in metrics(run_dir) if "loss" in r]
    s = SPIKE_STEP
    assert [r.get("anomaly") for r in recs][s - 1] == ["loss_spike"] and recs[-1]["skipped_steps_total"] == 1, recs
    assert recs[s - 1]["consumed_samples"] == SPIKE[1]  # the data was consumed
    step = {i: load_file(str(run_dir / "checkpoints" / f"step_{i}" / "rank_00000.safetensors")) for i in (s - 1, s, s + 1)}
    assert set(step[s - 1]) == set(step[s]) and any(k.startswith("optim/") for k in step[s - 1])
    for k in step[s - 1]:
        assert np.array_equal(step[s - 1][k], step[s][k]), k
    assert any(not np.array_equal(step[s][k], step[s + 1][k]) for k in step[s])  # the next step trained again
    with open(run_dir / "checkpoints" / f"step_{s}" / "manifest.json") as f:
        assert json.load(f)["health"]["status"] == "anomalous"
