"""The divergence guard through the real entry script (`llmtrain/pretrain.py`'s main: messages, exit statuses).

    python -m pytest -q tests/train/test_anomaly.py

- The issue's run: gpt-tiny, one process, optim.lr=50, no warmup, checkpoint.interval=4, keep_last=2, 16 steps,
  default settings: the loss spikes at step 2; three rewinds to the step-0 checkpoint do not help (the LR is the
  cause), so the run stops with status 5 naming the step, the anomaly, the values, step_0, which is kept, and the
  samples a resume would skip; its learning-rate advice, followed as written, trains on those samples.
- A learning rate that diverges from step 5 (tests/train/faults.py's `lr_from`, installed by
  tests/train/run_with_faults.py): with policy=skip every later step is rejected, its update dropped, and after
  max_consecutive_skips the run stops; keep_last=1 still keeps step_4, the newest healthy checkpoint, beside the
  anomalous step_10. Resumed with checkpoint.resume=auto (policy=stop, the same LR fault) it starts from step_4,
  saying that it passes over step_10 (set aside under superseded/1/), and stops at the first anomaly, step_4 kept.
The guard under dp2, tp2, pp2 and zero2 (transient fault and rewind) is in tests/parallel/guard_checks.py.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from launch import run_launch
from llmtest import compose, tiny_overrides
from llmtrain.checkpoint.listing import list_checkpoints
from llmtrain.config import ConfigError, check_config
from llmtrain.train.anomaly import EXIT_DIVERGED
from llmtrain.train.contract import rule_of


def _health(run_dir: Path, step: int) -> dict:
    with open(run_dir / "checkpoints" / f"step_{step}" / "manifest.json") as f:
        return json.load(f)["health"]


def _steps(run_dir: Path) -> list[int]:
    return [s for s, _ in list_checkpoints(str(run_dir / "checkpoints"))]


def test_issue_run_stops_with_a_message_and_keeps_step_0(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    args = ["llmtrain/pretrain.py", "model=gpt-tiny", f"data.prefixes=[{tiny_corpus['prefix']}]",
            f"data.tokenizer={tiny_corpus['tokenizer']}", "data.seq_len=64", "data.num_workers=0",
            "train.max_steps=16", "optim.lr=50", "optim.warmup_steps=0", "checkpoint.interval=4",
            "checkpoint.keep_last=2", f"run.dir={run_dir}", "train.progress_bar=false", "train.visualdl=false"]
    proc = run_launch(args, nproc=0, log_dir=tmp_path / "log", expect_ok=False)
    err = proc.stderr
    assert proc.returncode == EXIT_DIVERGED == 5, err[-3000:]
    (msg,) = [line for line in err.splitlines() if line.startswith("error: training stopped")]
    assert "at step 2: loss spike: loss " in msg and "grad_norm " in msg and "train.anomaly.max_rewinds=3" in msg, msg
    assert f"newest healthy checkpoint: {run_dir / 'checkpoints' / 'step_0'} (step 0)" in msg, msg
    assert "If the data caused it, checkpoint.resume=auto continues from it and skips samples 8..31 (the windows the " \
           "rewinds recorded)" in msg, msg
    assert _steps(run_dir) == [0] and _health(run_dir, 0)["status"] == "healthy"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["to_step"] for r in records if r.get("event") == "rewind"] == [0, 0, 0]
    assert records[-1]["event"] == "stopped" and records[-1]["anomaly"] == ["loss_spike"]
    # the learning rate's advice, followed as written: the data of the rewinds' windows is trained on, not skipped
    from llmtrain.pretrain import pretrain

    advice = [a.replace("<lower>", "1e-3") for a in msg.split(": ")[-1].split()]
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("llmtrain").addHandler(handler)
    try:
        pretrain(compose([a for a in args[1:] if not a.startswith(("optim.lr=", "train.max_steps="))]
                         + advice + ["train.max_steps=3"]))
    finally:
        logging.getLogger("llmtrain").removeHandler(handler)
    assert any("samples 8..31, which the rewinds recorded to skip, are trained on" in line for line in said), said
    resumed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-3:]
    assert [(r["step"], r["consumed_samples"]) for r in resumed] == [(1, 8), (2, 16), (3, 24)], resumed


def _faulted(corpus, run_dir, policy, *extra):
    return ["tests/train/run_with_faults.py", "lr_from", "5", "50.0", "--",
            *tiny_overrides(corpus, str(run_dir), "gpt", steps=16), "checkpoint.interval=2", "checkpoint.keep_last=1",
            f"train.anomaly.policy={policy}", *extra]


def test_diverging_lr_skip_then_resume_auto_then_stop(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_launch(_faulted(tiny_corpus, run_dir, "skip"), nproc=0, log_dir=tmp_path / "log1", expect_ok=False)
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-3000:]
    (msg,) = [line for line in proc.stderr.splitlines() if line.startswith("error: training stopped")]
    assert "at step 11: " in msg and "6 anomalous steps in a row (train.anomaly.max_consecutive_skips=5)" in msg, msg
    assert f"{run_dir / 'checkpoints' / 'step_4'} (step 4, loss " in msg, msg
    assert _steps(run_dir) == [10, 4]  # keep_last=1, and the newest healthy one
    assert _health(run_dir, 4)["status"] == "healthy" and _health(run_dir, 10)["status"] == "anomalous"
    assert "checkpoint kept beyond keep_last=1" in proc.stderr
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["skipped_steps_total"] for r in records][4:11] == [0, 1, 2, 3, 4, 5, 5], records
    # resume=auto passes over the anomalous step_10; policy=stop ends at the first anomaly after it
    proc = run_launch(_faulted(tiny_corpus, run_dir, "stop", "checkpoint.resume=auto"), nproc=0,
                      log_dir=tmp_path / "log2", expect_ok=False)
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-3000:]
    assert (f"newest healthy checkpoint {run_dir / 'checkpoints' / 'step_4'}; passing over newer step_10 "
            f"(loss_spike at loss ") in proc.stderr, proc.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_4'}: step 4" in proc.stderr
    (msg,) = [line for line in proc.stderr.splitlines() if line.startswith("error: training stopped")]
    assert "at step 6: loss spike" in msg and "train.anomaly.policy=stop" in msg and "step_4 (step 4" in msg, msg
    assert _steps(run_dir) == [4]  # the passed-over step_10 was set aside before the resume, not replaced
    assert _health(run_dir / "superseded" / "1", 10)["status"] == "anomalous"


def test_config_values_checked_and_resume_rule():
    with pytest.raises(ConfigError) as e:
        check_config(compose(["train.anomaly.policy=ignore", "train.anomaly.loss_spike=1.0",
                              "train.anomaly.window=0"]))
    text = str(e.value)
    assert "train.anomaly.policy='ignore'" in text and "train.anomaly.loss_spike=1.0" in text
    assert "train.anomaly.window=0" in text
    assert rule_of("train.anomaly.policy")[0] == "honoured" and "divergence guard" in rule_of("train.anomaly.window")[1]


def test_supervisor_does_not_relaunch_a_diverged_run(tmp_path):
    """scripts/supervise.py relaunches failed jobs, but not status 5: the same healthy checkpoint would diverge again."""
    import subprocess
    import sys

    from llmtest import REPO

    proc = subprocess.run([sys.executable, f"{REPO}/scripts/supervise.py", "--max-restarts", "2", "--delay", "0", "--",
                           sys.executable, "-c", f"import sys; sys.exit({EXIT_DIVERGED})"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_DIVERGED and "attempt 2" not in proc.stderr, proc.stderr
    assert "divergence guard stopped the job" in proc.stderr
