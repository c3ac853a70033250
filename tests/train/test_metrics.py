"""The metrics line's arithmetic on one process: tokens, rates, and a CPU peak measured too low.

    python -m pytest tests/train/test_metrics.py -q
"""
from __future__ import annotations

import json

import paddle

from llmtrain.parallel.strategy import Topology
from llmtrain.train.metrics import Meter
from llmtrain.train.step import StepOutput


def _out(tokens: int, positions: int) -> StepOutput:
    return StepOutput(loss=paddle.to_tensor(2.0), tokens=tokens, positions=positions, grad_norm=paddle.to_tensor([1.0]))


def _meter(tmp_path, peak, remeasure):
    return Meter(str(tmp_path), Topology(), flops_per_token=1e6, peak=peak, log_interval=1, max_steps=3,
                 progress_bar=False, visualdl=False, remeasure_peak=remeasure)


def test_tokens_and_rates_per_window(tmp_path):
    meter = _meter(tmp_path, peak=1e18, remeasure=None)
    recs = [meter.update(step, _out(100 * step, 128), lr=1e-3, data_wait=0.0) for step in (1, 2, 3)]
    assert [r["tokens"] for r in recs] == [100, 200, 300] and [r["tokens_total"] for r in recs] == [100, 300, 600]
    for r in recs:
        assert abs(r["tokens_per_sec"] * r["step_time"] - r["tokens"]) <= 1e-6 * r["tokens"]
        assert abs(r["tflops_per_device"] * 1e12 - 128 / r["step_time"] * 1e6) <= 1e-6 * r["tflops_per_device"] * 1e12
        assert r["mfu"] == r["tflops_per_device"] * 1e12 / 1e18
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]


def test_a_peak_measured_too_low_is_measured_again_once(tmp_path):
    """A start-up peak below the achieved model FLOP/s (a loaded machine) gives MFU > 1: the meter re-measures
    the peak once, keeps the higher value, and never calls the measurement again."""
    calls = []

    def remeasure():
        calls.append(1)
        return 1e18

    meter = _meter(tmp_path, peak=1.0, remeasure=remeasure)  # 1 FLOP/s: any step exceeds it
    first = meter.update(1, _out(10, 128), lr=1e-3, data_wait=0.0)
    assert calls == [1] and meter.peak == 1e18 and first["mfu"] < 1
    meter.update(2, _out(10, 128), lr=1e-3, data_wait=0.0)
    assert calls == [1]


def test_a_remeasured_peak_lower_than_the_first_is_not_taken(tmp_path):
    meter = _meter(tmp_path, peak=10.0, remeasure=lambda: 5.0)
    rec = meter.update(1, _out(10, 128), lr=1e-3, data_wait=0.0)
    assert meter.peak == 10.0 and rec["mfu"] > 1  # still above 1: logged as it is, never clipped
