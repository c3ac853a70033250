"""End to end on 2 processes: the pretraining entry (`llmtrain.pretrain.pretrain`) under `+parallel=dp2`.

    python -m pytest tests/e2e/test_pretrain.py -q

The run goes through tests/e2e/multirun_worker.py in the dp2 launch it shares with tests/e2e/test_finetune.py when
both files are collected (tests/e2e/shared_launch.py); `llmtrain/pretrain.py`'s own main runs under the launcher in
tests/e2e/test_ernie_paddlenlp.py, tests/deploy, tests/checkpoint and tests/train.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from llmtest import compose, tiny_overrides
from launch import metrics
from shared_launch import join, shared

FIELDS = ("step", "loss", "lr", "grad_norm", "tokens", "tokens_total", "tokens_per_sec", "tokens_per_sec_per_device",
          "step_time", "data_wait_time", "tflops_per_device", "mfu")
STEPS = 16


def build(out, tiny_corpus):
    """(run_many entries, (run directory, overrides, the launch's log directory)): the dp2 pretraining run, with
    the progress bar and the loss curve on (the defaults) under the launcher."""
    overrides = tiny_overrides(tiny_corpus, str(out / "run"), "gpt", steps=STEPS) + [
        "+parallel=dp2", "optim.lr=3e-3", "data.eod_mask_loss=true", "train.eval_interval=8", "train.eval_batches=2",
        "checkpoint.save_final=true", "train.visualdl=true", "train.progress_bar=true", "train.loss_curve=true",
    ]
    return [{"overrides": overrides, "entry": "pretrain"}], (out / "run", overrides, out.parent / "log")


join("dp2", "pretrain", build)


@pytest.fixture(scope="module")
def dp2_run(tiny_corpus, tmp_path_factory):
    return shared("dp2", "pretrain", tiny_corpus, tmp_path_factory)


@pytest.mark.slow
def test_dp2_run_writes_metrics_curve_and_checkpoint(dp2_run):
    run_dir, _, _ = dp2_run
    recs = metrics(run_dir)
    train = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        for f in FIELDS:
            assert f in r, f
        assert r["mfu"] is not None and 0 < r["mfu"] < 1  # CPU: measured matmul peak
        assert r["tokens_per_sec_per_device"] == pytest.approx(r["tokens_per_sec"] / 2)
    assert np.mean([r["loss"] for r in train[-3:]]) < np.mean([r["loss"] for r in train[:3]]) - 0.3
    evals = [r for r in recs if "eval_loss" in r]
    assert [r["step"] for r in evals] == [8, 16]
    assert (run_dir / "loss_curve.png").stat().st_size > 10_000
    assert (run_dir / "config.yaml").exists() and (run_dir / "visualdl").is_dir()
    manifest = json.loads((run_dir / "checkpoints" / f"step_{STEPS}" / "manifest.json").read_text())
    assert manifest["step"] == STEPS and manifest["tokens_total"] == train[-1]["tokens_total"]


@pytest.mark.slow
def test_tokens_total_is_the_exact_count_of_loss_bearing_targets(dp2_run):
    """Recount the loss mask of every sample the run consumed (EOD targets excluded) on one process."""
    from llmtrain.config import to_config
    from llmtrain.data.loader import PretrainData

    run_dir, overrides, _ = dp2_run
    cfg = to_config(compose([o for o in overrides if not o.startswith("+parallel")]))
    data = PretrainData(cfg.data, seed=cfg.seed, global_batch_size=8, micro_batch_size=8, dp_rank=0, dp_world=1)
    expected, per_step = 0, []
    for _ in range(STEPS):
        (mb,) = data.next_step()
        per_step.append(int(mb["loss_mask"].sum()))
        expected += per_step[-1]
    assert expected < STEPS * 8 * 32  # EOD masking removed some targets: the count is not samples x seq_len
    train = [r for r in metrics(run_dir) if "loss" in r]
    assert [r["tokens"] for r in train] == per_step
    assert train[-1]["tokens_total"] == expected


@pytest.mark.slow
def test_workerlog_holds_one_plain_line_per_step_and_no_progress_bar(dp2_run):
    """Under the launcher (stderr is workerlog.0, not a terminal) train.progress_bar=true draws no bar: no `\r`, and
    rank 0 writes one line per log interval (log_interval=1 here) with the fields of the metrics record."""
    run_dir, _, log_dir = dp2_run
    text = (log_dir / "workerlog.0").read_text(errors="replace")
    assert "\r" not in text and not re.search(r"train: +\d+%\|", text)  # tqdm's bar (`train:  50%|...`) is absent
    lines = [line for line in text.splitlines() if re.search(rf"\] step +\d+/{STEPS} \|", line)]
    train = [r for r in metrics(run_dir) if "loss" in r]
    assert len(lines) == STEPS, text[-3000:]
    for line, rec in zip(lines, train):
        assert f"step {rec['step']:>2}/{STEPS} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | grad norm " in line
        for field in (" tok/s | ", " TFLOP/s/device | MFU ", "% | data wait ", " ms/step"):
            assert field in line, (field, line)
    assert not re.search(r"\] step +\d+/", (log_dir / "workerlog.1").read_text(errors="replace"))  # rank 0 only
