"""The divergence guard under a layout, folded into tests/parallel/test_parity.py's launches (no launch of its own).

    runs += guard_runs(corpus, out, layout)      # entries of that layout's run_many launch
    check_guard(reference_dir, layout_dir, layout)

Faults come from tests/train/faults.py, installed by `call` entries in the launched processes. One run per
layout, `guard_faults` (6 steps, checkpoint.interval=2, default settings), meets two faults:
- step 2: rank 1's gradients become NaN once (its loss stays finite). The guard rejects the step on every rank,
  re-runs it from the same state, finds it finite (a transient fault, transient_faults_total 1) and continues;
- step 5: the batch of samples 32..39 has its logits scaled by 300 on every rank: a loss spike. The default
  policy rewinds to step 4 and skips those samples.
Every record then equals the one-process `guard_skipped` run, which has no fault and never sees samples 32..39
(the data jumps over them): the re-run left no trace, the rewind undid the spike. One process only:
- `guard_skip` (train.anomaly.policy=skip, the same spike, a checkpoint every step): the checkpoint of step 5
  (the skipped step) holds exactly the tensors of step 4 and is marked anomalous;
- `guard_nan`: a NaN written into the word-embedding table at step 5 (corrupted memory): the save of step 6 is
  refused, steps 2 and 4 stay (keep_last=2).
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
STEPS = 6
SPIKE = (32, 40)  # samples of step 5 (global batch 8)


def _run(corpus, out, name: str, layout, extra=()) -> list[str]:
    return (tiny_overrides(corpus, str(out / name), "gpt", steps=STEPS) + ["model.num_layers=8", *extra]
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
                 {"call": f"{FAULTS}:nan_weights", "args": [5]},
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
    # a transient fault at step 2 (rejected everywhere, re-run, continued) and a rewind over the spike of step 5:
    # equal to the clean run that never saw samples 32..39
    _same(recs(ref_dir, "guard_skipped"), got, f"{layout} guard_faults")
    assert [r["transient_faults_total"] for r in got] == [0] + [1] * (STEPS - 1), got
    assert [r["rewinds_total"] for r in got] == [0] * 4 + [1] * (STEPS - 4), got
    assert not any("anomaly" in r for r in got)  # the rejected step-5 record was redone
    events = [r for r in metrics(got_dir / "guard_faults") if r.get("event") == "rewind"]
    assert len(events) == 1 and events[0]["step"] == 5 and events[0]["to_step"] == 4, events
    assert events[0]["anomaly"] == ["loss_spike"] and events[0]["skip_samples"] == list(SPIKE), events
    with open(got_dir / "guard_faults" / "checkpoints" / f"step_{STEPS}" / "manifest.json") as f:
        health = json.load(f)["health"]  # the step's own loss and grad norm, recorded with its verdict
    assert health["status"] == "healthy" and (health["loss"], health["grad_norm"]) == pytest.approx(
        (got[-1]["loss"], got[-1]["grad_norm"]), rel=1e-6), (health, got[-1])
    if layout == "single":
        check_skip(ref_dir / "guard_skip")
        steps = sorted(int(p.name[5:]) for p in (ref_dir / "guard_nan" / "checkpoints").glob("step_*"))
        assert steps == [2, 4], steps  # never written from a non-finite state (else 4, 6)
        assert [r["step"] for r in recs(ref_dir, "guard_nan")] == list(range(1, STEPS + 1))


def check_skip(run_dir) -> None:
    """policy=skip: the skipped step's update is dropped (parameters and optimizer state untouched)."""
    from safetensors.numpy import load_file

    recs = [r for r in metrics(run_dir) if "loss" in r]
    assert [r.get("anomaly") for r in recs][4] == ["loss_spike"] and recs[-1]["skipped_steps_total"] == 1, recs
    assert recs[4]["consumed_samples"] == SPIKE[1]  # the data was consumed
    step = {s: load_file(str(run_dir / "checkpoints" / f"step_{s}" / "rank_00000.safetensors")) for s in (4, 5, 6)}
    assert set(step[4]) == set(step[5]) and any(k.startswith("optim/") for k in step[4])
    for k in step[4]:
        assert np.array_equal(step[4][k], step[5][k]), k
    assert any(not np.array_equal(step[5][k], step[6][k]) for k in step[5])  # step 6 trained again
    with open(run_dir / "checkpoints" / "step_5" / "manifest.json") as f:
        assert json.load(f)["health"]["status"] == "anomalous"
