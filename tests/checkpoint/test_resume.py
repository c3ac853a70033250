"""Checkpoints: crash and resume continue the loss curve; corrupt checkpoints are skipped; any layout resumes any other.

    python -m pytest tests/checkpoint -q
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from llmtest import tiny_overrides
from launch import REPO, env, launch_cmd, metrics, run_launch, run_many

STEPS = 12


def _losses(run_dir):
    return [r["loss"] for r in metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def uninterrupted(tiny_corpus, tmp_path_factory):
    """Reference: one process, 12 steps, no interruption (both models)."""
    out = tmp_path_factory.mktemp("ckpt_ref")
    run_many([tiny_overrides(tiny_corpus, str(out / m), m, steps=STEPS) for m in ("gpt", "llama")], nproc=0, workdir=out)
    return {m: _losses(out / m) for m in ("gpt", "llama")}


def _dp2_args(corpus, run_dir):
    return ["llmtrain/pretrain.py", *tiny_overrides(corpus, str(run_dir), "gpt", steps=STEPS),
            "+parallel=dp2", "checkpoint.interval=2", "checkpoint.resume=auto", "checkpoint.keep_last=3"]


def _dp2_cmd(corpus, run_dir, log_dir):
    return launch_cmd(_dp2_args(corpus, run_dir), 2, Path(log_dir))


@pytest.mark.slow
def test_sigkill_mid_training_and_during_save_then_resume(tiny_corpus, uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    # 1. killed while saving step 4: shards written, no manifest
    env1 = env() | {"LLMTRAIN_FAULT_KILL_IN_SAVE": "4"}
    proc = subprocess.run(_dp2_cmd(tiny_corpus, run_dir, tmp_path / "log1"), cwd=REPO, env=env1,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    ckpts = run_dir / "checkpoints"
    assert len(list(ckpts.glob(".tmp-step_4-*"))) == 1 and not (ckpts / "step_4").exists() and (ckpts / "step_2").is_dir()
    # 2. resumed from step 2 (the interrupted save is ignored), then SIGKILLed between checkpoints
    p = subprocess.Popen(_dp2_cmd(tiny_corpus, run_dir, tmp_path / "log2"), cwd=REPO, env=env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        if (ckpts / "step_6").is_dir() and any(r.get("step", 0) >= 7 for r in _safe_metrics(run_dir)):
            break
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    logs = "".join(f.read_text(errors="replace") for f in (tmp_path / "log2").glob("workerlog.*"))
    assert "resumed from" in logs and "step_2" in logs and "ignoring incomplete checkpoint" in logs
    # 3. resume to the end
    run_launch(_dp2_args(tiny_corpus, run_dir), 2, tmp_path / "log3")
    got = _losses(run_dir)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, uninterrupted["gpt"]), 1):
        assert abs(a - b) <= 1e-5, (step, a, b)
    kept = sorted(p.name for p in ckpts.iterdir())
    assert kept == ["step_10", "step_12", "step_8"]  # keep_last=3, the interrupted .tmp cleaned by later saves


def _safe_metrics(run_dir):
    try:
        return metrics(run_dir)
    except (OSError, json.JSONDecodeError):
        return []


@pytest.mark.slow
def test_any_layout_resumes_any_other(tiny_corpus, uninterrupted, tmp_path):
    """dp2 writes step 6; tp2, pp2, sharding2 (ZeRO-1), zero2, zero3 and one process continue from it with the uninterrupted losses."""
    src = tmp_path / "dp2"
    runs = [tiny_overrides(tiny_corpus, str(src / m), m, steps=STEPS) + ["+parallel=dp2", "checkpoint.interval=6"]
            for m in ("gpt", "llama")]
    run_many(runs, nproc=2, workdir=src)
    for layout, nproc in (("tp2", 2), ("pp2", 2), ("sharding2", 2), ("zero2", 2), ("zero3", 2), (None, 0)):
        out = tmp_path / (layout or "single")
        runs = [tiny_overrides(tiny_corpus, str(out / m), m, steps=STEPS)
                + [f"checkpoint.resume={src / m / 'checkpoints' / 'step_6'}"] + ([f"+parallel={layout}"] if layout else [])
                + (["parallel.zero3_segment_size=1024"] if layout == "zero3" else [])  # really slice the tiny params
                for m in ("gpt", "llama")]
        run_many(runs, nproc=nproc, workdir=out)
        for m in ("gpt", "llama"):
            recs = [r for r in metrics(out / m) if "loss" in r]
            assert [r["step"] for r in recs] == list(range(7, STEPS + 1)), (layout, m)
            for r in recs:
                ref = uninterrupted[m][r["step"] - 1]
                assert abs(r["loss"] - ref) <= 1e-4, (layout, m, r["step"], r["loss"], ref)


@pytest.mark.slow
def test_tp_split_checkpoint_resumes_on_one_process(tiny_corpus, uninterrupted, tmp_path):
    """The other direction: tensors written as tp slices (and pp stages) are reassembled for one process."""
    for layout in ("tp2", "pp2", "zero3"):
        src = tmp_path / layout
        run_many([tiny_overrides(tiny_corpus, str(src / "llama"), "llama", steps=STEPS)
                  + [f"+parallel={layout}", "checkpoint.interval=6"]
                  + (["parallel.zero3_segment_size=1024"] if layout == "zero3" else [])], nproc=2, workdir=src)
        out = tmp_path / f"{layout}_to_single"
        run_many([tiny_overrides(tiny_corpus, str(out), "llama", steps=STEPS)
                  + [f"checkpoint.resume={src / 'llama' / 'checkpoints' / 'step_6'}"]], nproc=0, workdir=out / "w")
        recs = [r for r in metrics(out) if "loss" in r]
        assert [r["step"] for r in recs] == list(range(7, STEPS + 1))
        for r in recs:
            assert abs(r["loss"] - uninterrupted["llama"][r["step"] - 1]) <= 1e-4, (layout, r)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_step_saves_and_exits_0(tiny_corpus, tmp_path, sig):
    run_dir = tmp_path / "run"
    cmd = launch_cmd(["llmtrain/pretrain.py", *tiny_overrides(tiny_corpus, str(run_dir), "gpt", steps=100000)], 0, tmp_path)
    p = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(_safe_metrics(run_dir)) < 3:
        time.sleep(0.2)
    p.send_signal(sig)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-2000:]
    steps = [r["step"] for r in _safe_metrics(run_dir)]
    saved = [c.name for c in (run_dir / "checkpoints").iterdir()]
    assert saved == [f"step_{steps[-1]}"] and f"stopped by {signal.Signals(sig).name}" in out
