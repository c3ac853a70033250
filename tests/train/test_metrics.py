"""The metrics line's arithmetic on one process: tokens, rates, a CPU peak measured too low; the per-interval log line.

    python -m pytest tests/train/test_metrics.py -q
"""
from __future__ import annotations

import io
import json
import logging
import sys

import paddle
import pytest

from llmtrain.parallel.strategy import Topology
from llmtrain.train.logline import interval_line
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


class _Lines(logging.Handler):
    """Collects the rank-0 logger's messages."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    handler = _Lines()
    logger = logging.getLogger("llmtrain")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_one_log_line_per_interval_with_the_fields_and_no_bar_off_a_terminal(tmp_path, log_lines, monkeypatch):
    """train.progress_bar=true off a terminal (a workerlog file) draws no bar; every log_interval (and the last step)
    is one plain line with step/total, loss, lr, grad norm, tokens/s, TFLOP/s, MFU, data wait, the fp16 loss scale
    and the guard's counters; `train.progress_bar=false` the same lines."""
    for bar in (True, False):
        monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file: no terminal
        log_lines.clear()
        (tmp_path / str(bar)).mkdir()
        meter = Meter(str(tmp_path / str(bar)), Topology(), flops_per_token=1e6, peak=1e18, log_interval=2, max_steps=5,
                      progress_bar=bar, visualdl=False)
        assert meter._bar is None
        for step in range(1, 6):
            extra = {"loss_scale": 32768.0, "anomalies_total": int(step >= 4), "skipped_steps_total": int(step >= 4)}
            if step == 4:
                extra |= {"anomaly": ["loss_spike"], "loss_scale_overflow": True}
            meter.update(step, _out(100, 128), lr=3e-4, data_wait=0.002, extra=extra)
        meter.close()
        steps = [line for line in log_lines if line.startswith("step ")]
        assert [s.split("|")[0].strip() for s in steps] == ["step 2/5", "step 4/5", "step 5/5"], log_lines
        for line in steps:
            assert "\r" not in line and "\n" not in line
            for field in ("loss 2.0000", "lr 3.00e-04", "grad norm 1.000", " tok/s", " TFLOP/s/device", "MFU ",
                          "loss scale 32768", "data wait 2.0 ms/step"):
                assert field in line, (field, line)
        assert "anomalies" not in steps[0]
        assert "loss scale 32768 overflow" in steps[1] and "anomalies 1, skipped 1, this step: loss_spike" in steps[1]
        assert sys.stderr.getvalue() == ""  # no bar was drawn


def test_the_progress_bar_on_a_terminal_keeps_the_log_lines(tmp_path, log_lines, monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    meter = Meter(str(tmp_path), Topology(), flops_per_token=1e6, peak=None, log_interval=1, max_steps=2,
                  progress_bar=True, visualdl=False)
    assert meter._bar is not None
    for step in (1, 2):
        meter.update(step, _out(100, 128), lr=1e-3, data_wait=0.0)
    meter.close()
    steps = [line for line in log_lines if line.startswith("step ")]
    assert len(steps) == 2 and "MFU -" in steps[0]  # peak unknown: no MFU
    assert "2/2" in sys.stderr.getvalue()  # the bar drew itself on the terminal


def test_the_log_line_shows_gpu_memory_when_the_record_has_it():
    rec = {"step": 3, "loss": 1.5, "lr": 1e-4, "grad_norm": None, "tokens_per_sec": 12345.6, "tflops_per_device": 0.5,
           "mfu": 0.25, "data_wait_time": 0.0, "max_memory_allocated": 3 * 2**30}
    line = interval_line(rec, 100)
    assert line.startswith("step   3/100 | loss 1.5000 | lr 1.00e-04 | grad norm - | 12,346 tok/s | 0.5 TFLOP/s")
    assert "MFU 25.0% | mem 3.00 GiB | data wait 0.0 ms/step" in line


def test_the_cpu_peak_is_measured_once_per_machine_and_raised_only_upwards(tmp_path, monkeypatch):
    """MFU on CPU divides by a peak measured once and cached (measured at every start it moved 46-73% for the same
    work); a re-measurement (MFU above 1) replaces it only when higher; another thread setting is another entry."""
    from llmtrain.train import peak

    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    calls = []

    def measure(value):
        return lambda: calls.append(value) or value

    first, source = peak.cached_cpu_peak(measure(5e9))
    assert first == 5e9 and calls == [5e9] and "measured now, cached in" in source
    again, source = peak.cached_cpu_peak(measure(9e9))  # a later start: read, not measured
    assert again == 5e9 and calls == [5e9] and "delete it to measure again" in source
    assert peak.remeasure_cpu_peak(measure(4e9)) == 4e9 and peak.cached_cpu_peak(measure(1.0))[0] == 5e9  # lower: kept
    assert peak.remeasure_cpu_peak(measure(7e9)) == 7e9 and peak.cached_cpu_peak(measure(1.0))[0] == 7e9  # higher: cached
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert peak.cached_cpu_peak(measure(3e9))[0] == 3e9  # another thread count: its own measurement
    assert json.loads((tmp_path / "cpu-matmul-peak.json").read_text()).__len__() == 2


@pytest.mark.parametrize("name", ["прогон-single", "中文运行-single"])
def test_the_loss_curve_title_never_draws_a_run_name_as_boxes(name, tmp_path):
    """A Chinese run name showed as boxes in loss_curve.png's title (matplotlib's default font has no CJK glyphs):
    now it is drawn with an installed font that has them or, with none installed, shown with `?` and a line naming
    the font to install; matplotlib warns of no missing glyph either way."""
    import warnings

    from llmtrain.train.plot import _draws, drawable_title, plot_metrics

    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0 - s, "tokens_per_sec": 100.0}) + "\n"
                                               for s in (1, 2)), encoding="utf-8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        png = plot_metrics(str(run / "metrics.jsonl"))
    assert not [w for w in caught if "missing from font" in str(w.message)], [str(w.message) for w in caught]
    assert png == str(run / "loss_curve.png") and (run / "loss_curve.png").stat().st_size > 0
    title, font = drawable_title(name)
    if font is not None:  # a machine with a CJK font
        assert title == name and _draws(font.get_file(), name) and "LastResort" not in font.get_file()
    elif title != name:  # none installed (this repository's CI): the characters no font draws become `?`
        assert title.startswith("????-single\n(run name in characters no installed font draws: install a CJK font")
