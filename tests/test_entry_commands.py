"""What the entry commands leave behind and print besides their work: no empty `outputs/<name>/` directory from the
planner or a refused configuration, and no Paddle "No ccache found" warning.

    python -m pytest -q tests/test_entry_commands.py
"""
from __future__ import annotations

import os
import subprocess
import sys

from llmtest import REPO


def _env() -> dict:
    """The repository on PYTHONPATH; PATH without any directory that holds ccache (so Paddle would warn)."""
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not os.path.exists(os.path.join(d, "ccache"))]
    return dict(os.environ, PYTHONPATH=REPO, PATH=os.pathsep.join(path), OMP_NUM_THREADS="1")


def _run(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


def test_the_planner_and_a_refused_config_leave_no_directory_and_no_ccache_warning(tmp_path):
    plan = _run(["-m", "llmtrain.plan", "model=gpt-tiny", "model.vocab_size=1000", "plan.devices=2",
                 "plan.device=cpu-here", "plan.top=1"],
                tmp_path)
    assert plan.returncode == 0, plan.stderr[-3000:]
    refused = _run([os.path.join(REPO, "llmtrain", "pretrain.py"), "train.global_batch_size=10",
                    "train.micro_batch_size=4"], tmp_path)
    assert refused.returncode == 2 and "train.global_batch_size=10" in refused.stderr, refused.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)  # no outputs/gpt-tiny-single/
    for proc in (plan, refused):
        assert "ccache" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
