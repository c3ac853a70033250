"""Resuming from a checkpoint older than the run's newest: the later results are set aside, never overwritten.

    python llmtrain/pretrain.py run.dir=outputs/a checkpoint.resume=outputs/a/checkpoints/step_16 ...
    branch = plan_branch(run_dir, "outputs/a/checkpoints/step_16", step=16)   # llmtrain.train.rundir, every rank
    where = set_branch_aside(run_dir, branch)                                 # rank 0, before any process group

A run directory holds one line of steps. A resume from step S while the directory holds checkpoints after S
(an explicit older `checkpoint.resume`, or `auto` passing over damaged or anomalous newer ones) would redo those
steps and replace their checkpoints and metrics. Instead, before any work, rank 0 moves the later checkpoints
to `<run.dir>/superseded/<k>/checkpoints/`, the metrics records of steps after S to
`<run.dir>/superseded/<k>/metrics.jsonl`, copies the old `config.yaml` and `loss_curve.png` beside them, and
writes `why.txt`; the log says so. Nothing is deleted, and nothing there is read again by training.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Optional

from llmtrain.checkpoint.listing import list_checkpoints, set_aside
from llmtrain.utils.log import log0


@dataclass
class Branch:
    """A resume from `step` with later checkpoints in the run directory (identical on every rank)."""

    step: int
    """The step of the checkpoint the run continues."""
    checkpoint: str
    """That checkpoint's directory."""
    later: list = field(default_factory=list)
    """The run directory's checkpoint directories after `step`, newest first (moved aside at the start)."""
    damaged: dict = field(default_factory=dict)
    """{path: what is wrong} for those of `later` that are damaged (said in the log; kept like the others)."""


def plan_branch(run_dir: str, checkpoint: str, step: int, damaged: Optional[dict] = None) -> Optional[Branch]:
    """The Branch of resuming `checkpoint` (step `step`) in `run_dir`, or None when no checkpoint there is later."""
    later = [p for s, p in list_checkpoints(os.path.join(run_dir, "checkpoints")) if s > step]
    if not later:
        return None
    return Branch(step, checkpoint, later, {p: v for p, v in (damaged or {}).items() if p in later})


def _split_metrics(path: str, step: int) -> list[str]:
    """Remove the records of steps after `step` from `path` (rewritten atomically) and return them as lines."""
    if not os.path.exists(path):
        return []
    keep, later = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec_step = json.loads(line).get("step", 0)
            except ValueError:
                rec_step = 0  # an unreadable line stays where it is
            (later if isinstance(rec_step, int) and rec_step > step else keep).append(line)
    if later:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)
    return later


def set_branch_aside(run_dir: str, branch: Branch) -> str:
    """Rank 0: move `branch.later` and the metrics after `branch.step` to a new `<run_dir>/superseded/<k>/`;
    returns that directory."""
    present = [p for p in branch.later if os.path.isdir(p)]
    why = (f"A run resumed from step {branch.step} ({branch.checkpoint}) while this run directory held later "
           f"checkpoints. These are the results of the line of steps it left: its checkpoints after step "
           f"{branch.step}, the metrics.jsonl records of those steps, and its config.yaml and loss_curve.png.")
    for path, what in branch.damaged.items():
        why += f"\n{os.path.basename(path)} was damaged when it was set aside: {what}"
    aside = set_aside(present, run_dir, why)
    records = _split_metrics(os.path.join(run_dir, "metrics.jsonl"), branch.step)
    if records:
        with open(os.path.join(aside, "metrics.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(records)
    for name in ("config.yaml", "loss_curve.png"):
        if os.path.exists(os.path.join(run_dir, name)):
            shutil.copy2(os.path.join(run_dir, name), os.path.join(aside, name))
    steps = [json.loads(r).get("step") for r in records]
    log0(f"resuming from step {branch.step}: the later checkpoints ("
         + ", ".join(os.path.basename(p) + (" (damaged)" if p in branch.damaged else "") for p in present) + ")"
         + (f" and the metrics of steps {min(steps)}-{max(steps)}" if steps else "")
         + f" are now in {aside}/ (nothing deleted)")
    return aside
