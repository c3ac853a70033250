"""The divergence guard under a layout, folded into tests/parallel/test_parity.py's launches (no launch of its own).

    runs += guard_runs(corpus, out, layout)      # entries of that layout's run_many launch
    check_guard(reference_dir, layout_dir, layout)

Faults come from tests/train/faults.py, installed by `call` entries in the launched processes:
- `guard_poison`: rank 1's gradients of step 3 become NaN once (its loss stays finite). The guard rejects the
  step on every rank, re-runs it from the same state, finds it finite (a transient fault) and continues: every
  record equals the one-process `gpt` run of the parity reference, and transient_faults_total is 1.
- `guard_spike`: the batch of step 5 (samples 32..39) has its logits scaled by 300 on every rank: a loss spike.
  The default policy rewinds to step 4 (checkpoint.interval=2) and skips those samples; the run then equals
  the one-process `guard_skipped` run, which never saw samples 32..39 (the data jumps over them).
- one process only, `guard_skip` (train.anomaly.policy=skip, the same spike, a checkpoint every step): the
  checkpoint of step 5 (the skipped step) holds exactly the tensors of step 4 and is marked anomalous.
- one process only, `guard_nan`: a NaN written into the word-embedding table at step 5 (corrupted memory that the
  loss need not show): the saves of steps 6 and 8 are refused, steps 2 and 4 stay (keep_last=2).
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
SPIKE = (32, 40)  # samples of step 5 (global batch 8)


def _run(corpus, out, name: str, layout, extra=()) -> list[str]:
    return (tiny_overrides(corpus, str(out / name), "gpt", steps=8) + ["model.num_layers=8", *extra]
            + ([f"+parallel={layout}"] if layout else []))


def guard_runs(corpus, out, layout=None) -> list:
    """run_many entries: the guard's runs of one layout (None: the one-process reference's)."""
    runs = [{"call": f"{FAULTS}:poison_grads", "args": [3, 1 if layout else 0]}, _run(corpus, out, "guard_poison", layout),
            {"call": f"{FAULTS}:spike", "args": [SPIKE[0], 300.0]},
            _run(corpus, out, "guard_spike", layout, ["checkpoint.interval=2"])]
    if layout is None:
        runs += [_run(corpus, out, "guard_skip", None, ["checkpoint.interval=1", "checkpoint.keep_last=0",
                                                        "train.anomaly.policy=skip"]),
                 {"call": f"{FAULTS}:clear"}, {"call": f"{FAULTS}:skip_samples", "args": list(SPIKE)},
                 _run(corpus, out, "guard_skipped", None), {"call": f"{FAULTS}:clear"},
                 {"call": f"{FAULTS}:nan_weights", "args": [5]},
                 _run(corpus, out, "guard_nan", None, ["checkpoint.interval=2", "train.anomaly.policy=skip"])]
    return runs + [{"call": f"{FAULTS}:clear"}]


def _same(ref: list[dict], got: list[dict], what: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, 9)), what
    for r, g in zip(ref, got):
        for k in ("loss", "grad_norm"):
            assert abs(g[k] - r[k]) <= TOL, (what, r["step"], k, g[k], r[k])
        for k in ("tokens", "tokens_total", "consumed_samples"):
            assert g[k] == r[k], (what, r["step"], k, g[k], r[k])


def check_guard(ref_dir, got_dir, layout: str) -> None:
    recs = lambda d, n: [r for r in metrics(d / n) if "loss" in r]  # noqa: E731
    # transient fault: rejected everywhere, re-run, continued with the re-run's (clean) result
    poison = recs(got_dir, "guard_poison")
    _same(recs(ref_dir, "gpt"), poison, f"{layout} guard_poison")
    assert [r["transient_faults_total"] for r in poison] == [0, 0] + [1] * 6, poison
    assert all(r["anomalies_total"] == 0 and "anomaly" not in r for r in poison)
    # loss spike: rewound to step 4, samples 32..39 skipped: equal to the run that never saw them
    spike = metrics(got_dir / "guard_spike")
    events = [r for r in spike if r.get("event") == "rewind"]
    assert len(events) == 1 and events[0]["step"] == 5 and events[0]["to_step"] == 4, events
    assert events[0]["anomaly"] == ["loss_spike"] and events[0]["skip_samples"] == list(SPIKE), events
    _same(recs(ref_dir, "guard_skipped"), recs(got_dir, "guard_spike"), f"{layout} guard_spike")
    assert recs(got_dir, "guard_spike")[-1]["rewinds_total"] == 1
    with open(got_dir / "guard_spike" / "checkpoints" / "step_8" / "manifest.json") as f:
        health = json.load(f)["health"]  # the step's own loss and grad norm, recorded with its verdict
    last = recs(got_dir, "guard_spike")[-1]
    assert health["status"] == "healthy" and (health["loss"], health["grad_norm"]) == pytest.approx(
        (last["loss"], last["grad_norm"]), rel=1e-6), (health, last)
    if layout == "single":
        check_skip(ref_dir / "guard_skip")
        steps = sorted(int(p.name[5:]) for p in (ref_dir / "guard_nan" / "checkpoints").glob("step_*"))
        assert steps == [2, 4], steps  # never written from a non-finite state (else 4, 6, 8)
        assert [r["step"] for r in recs(ref_dir, "guard_nan")] == list(range(1, 9))


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
