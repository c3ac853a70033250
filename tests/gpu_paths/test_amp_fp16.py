"""GPU-only branch `amp-fp16`: fp16 AMP O2 + Paddle's GradScaler under dp2, rehearsed on CPU (the scaler forced on).

    python -m pytest -q tests/gpu_paths/test_amp_fp16.py

One `paddle.distributed.launch` of two CPU processes (gloo), three runs of the tiny GPT through the real entry
function, faults from tests/train/faults.py, the scaler from tests/gpu_paths/amp_fp16_rehearsal.py:
- `overflow`: train.amp=fp16; at step 3 rank 1's gradients become NaN (its loss stays finite): the scaler finds
  the overflow on both ranks (DataParallel all-reduced the gradients), skips the update, halves the scale
  32768 -> 16384, and the run goes on, nothing rejected;
- `reference`: fp32, no scaler, step 3's optimizer update not applied (the LR schedule advances as usual):
  every record of `overflow` equals it (loss and grad_norm within 1e-5, tokens exact), step 3's norm aside;
- `persistent`: fp16, NaN gradients from step 3 on, train.anomaly.max_consecutive_overflows=3,
  train.anomaly.policy=stop: the third overflow in a row (step 5, scale 4096) is an anomaly; the run stops with
  the message docs/divergence.md shows and status 5 (`EXIT_DIVERGED`), through the entry's own handling.
The `overflow` and `persistent` runs also pass and fail `check_fp16_overflow`, the check of the GPU acceptance step
`fp16_overflow` (scripts/gpu_acceptance.py). In-process (`test_amp_plan_builds_the_scaler_the_runs_use`): the marked line of `AmpPlan.scaler` runs under
`reaches("amp-fp16")` (tests/gpu_paths' convention, once its gpu_rehearsal.py is on the branch) and the scaler it
builds halves its scale at one overflowing step of a tiny model. The guard's fp16 logic in one process:
tests/train/test_guard_fast.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import REPO, metrics, run_launch
from llmtest import tiny_overrides
from llmtrain.train.anomaly import EXIT_DIVERGED

sys.path.insert(0, str(REPO / "scripts"))
import gpu_acceptance  # noqa: E402

TOL = 1e-5
STEPS = 6
FAULTS = "tests/train/faults.py"
REHEARSAL = "tests/gpu_paths/amp_fp16_rehearsal.py"


def test_amp_plan_builds_the_scaler_the_runs_use(tiny_gpt, tmp_path, monkeypatch):
    """`AmpPlan.scaler()` for train.amp=fp16 (its GPU-only line), Paddle's place check answered as a GPU's: an enabled
    dynamic scaler at 2^15 that halves at every overflow; one overflowing step of a tiny model under the guard is
    skipped and halves it (tests/train/fake_job.py)."""
    from paddle.amp import grad_scaler

    from amp_fp16_rehearsal import gpu_tracer
    from llmtrain.paddle_compat.amp import LossScaler, loss_scale
    from llmtrain.train.amp import AmpPlan
    from train.fake_job import GuardRig  # tests/train (no package: a namespace import)

    gpu_rehearsal = pytest.importorskip("gpu_rehearsal", reason="tests/gpu_paths/gpu_rehearsal.py (gpupaths) absent")
    monkeypatch.setattr(grad_scaler, "_dygraph_tracer", gpu_tracer)
    with gpu_rehearsal.reaches("amp-fp16"):
        scaler = AmpPlan.from_config("fp16").scaler()
    monkeypatch.undo()
    assert isinstance(scaler, LossScaler) and scaler.is_enable() and scaler.is_use_dynamic_loss_scaling()
    assert (loss_scale(scaler), scaler.get_decr_every_n_nan_or_inf(), scaler.get_incr_every_n_steps()) == (
        2.0**15, 1, 1000)
    rig = GuardRig(tmp_path, tiny_gpt, scaler=scaler)
    rig.fault = lambda start: "inf" if start == 8 else None
    rig.step()
    rig.step()
    assert rig.records[-1]["loss_scale_overflow"] is True and loss_scale(scaler) == 2.0**14


def _run(corpus, out, name, *extra):
    return tiny_overrides(corpus, str(out / name), "gpt", steps=STEPS) + ["+parallel=dp2", *extra]


def test_fp16_overflow_under_dp2_is_skipped_and_a_persistent_one_stops(tiny_corpus, tmp_path):
    fp16 = ["train.amp=fp16"]
    runs = [{"call": f"{REHEARSAL}:force_scaler"},
            {"call": f"{FAULTS}:poison_grads", "args": [3, 1]},
            {"overrides": _run(tiny_corpus, tmp_path, "overflow", *fp16)},
            {"call": f"{FAULTS}:clear"}, {"call": f"{FAULTS}:drop_update", "args": [3]},
            {"overrides": _run(tiny_corpus, tmp_path, "reference")},
            {"call": f"{FAULTS}:clear"}, {"call": f"{FAULTS}:poison_grads_from", "args": [3, 1]},
            {"call": f"{REHEARSAL}:stop_run", "args": [_run(tiny_corpus, tmp_path, "persistent", *fp16,
                                                             "train.anomaly.max_consecutive_overflows=3",
                                                             "train.anomaly.policy=stop")]}]
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    proc = run_launch([str(REPO / "tests/e2e/multirun_worker.py"), str(spec)], 2, tmp_path / "log", expect_ok=False)
    log0 = (tmp_path / "log" / "workerlog.0").read_text(errors="replace")
    got = [r for r in metrics(tmp_path / "overflow") if "loss" in r]
    ref = [r for r in metrics(tmp_path / "reference") if "loss" in r]
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1)), log0[-3000:]
    assert [r.get("loss_scale_overflow", False) for r in got] == [False, False, True, False, False, False]
    assert [r["loss_scale"] for r in got] == [32768.0] * 2 + [16384.0] * 4
    assert got[-1]["loss_scale_overflows_total"] == 1 and got[-1]["anomalies_total"] == 0 and "anomaly" not in got[2]
    assert ref[2]["grad_norm"] is None and "loss_scale" not in ref[0]  # the reference's step 3 never reached the clip
    for g, r in zip(got, ref):
        assert abs(g["loss"] - r["loss"]) <= TOL, (g["step"], g["loss"], r["loss"])
        if g["step"] != 3:
            assert abs(g["grad_norm"] - r["grad_norm"]) <= TOL, (g["step"], g["grad_norm"], r["grad_norm"])
        assert (g["tokens"], g["tokens_total"], g["consumed_samples"]) == (r["tokens"], r["tokens_total"],
                                                                           r["consumed_samples"])
    # the persistent overflow: the documented message on rank 0, status 5 from every rank
    (msg,) = [line for line in log0.splitlines() if line.startswith("error: training stopped")]
    assert msg.startswith("error: training stopped at step 5: persistent fp16 loss-scale overflow (loss scale now "
                          "4096) (loss "), msg
    assert "train.anomaly.policy=stop; newest healthy checkpoint: none." in msg, msg
    assert proc.returncode == EXIT_DIVERGED, (proc.returncode, proc.stderr[-2000:])
    stopped = [r for r in metrics(tmp_path / "persistent") if r.get("event") == "stopped"]
    assert stopped and stopped[0]["anomaly"] == ["loss_scale_overflow"]
    persistent = [r for r in metrics(tmp_path / "persistent") if "loss" in r]
    assert [r["loss_scale"] for r in persistent] == [32768.0, 32768.0, 16384.0, 8192.0, 4096.0]
    assert Path(tmp_path / "overflow" / "metrics.jsonl").exists()
    # the GPU acceptance step fp16_overflow judges its run with this check: it passes this run, refuses the stopped one
    assert STEPS == gpu_acceptance.FP16_STEPS and gpu_acceptance.check_fp16_overflow(tmp_path / "overflow") == []
    assert any("stopped" in p for p in gpu_acceptance.check_fp16_overflow(tmp_path / "persistent"))
