"""Checkpoint health: what a manifest says about its step, and which checkpoints pruning and resuming prefer.

    health_of(ckpt_dir)                  # {"status": "healthy"|"anomalous", "loss", "grad_norm", "anomaly"}
    newest_healthy(list_checkpoints(root), before=step)   # (step, path) or None
    nonfinite_arrays(tensors)            # names of a snapshot's arrays holding NaN/inf (empty: all finite)

Each manifest carries `health`: the divergence guard's verdict of the step it was written
after (`llmtrain.train.anomaly_guard`: `anomalous` when that step was rejected, e.g. a skipped
update), with that step's loss and gradient norm. A checkpoint is never written from a state
holding a non-finite parameter or optimizer value (the save is refused on every rank).
`keep_last` never deletes the newest healthy checkpoint, and `checkpoint.resume=auto` takes
the newest healthy one (naming the newer ones it passes over). Manifests written before
health was recorded count as healthy.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np


def health_of(ckpt_dir: str) -> dict:
    """The manifest's `health` entry ({"status": "healthy"} for manifests that predate it); {} if unreadable."""
    try:
        with open(os.path.join(ckpt_dir, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return {}
    return manifest.get("health") or {"status": "healthy"}


def is_healthy(ckpt_dir: str) -> bool:
    return health_of(ckpt_dir).get("status") == "healthy"


def newest_healthy(checkpoints: list[tuple[int, str]], before: Optional[int] = None) -> Optional[tuple[int, str]]:
    """The newest (step, path) of `checkpoints` (newest first, as `list_checkpoints` gives them) whose manifest
    says healthy, at a step <= `before` when given."""
    for step, path in checkpoints:
        if (before is None or step <= before) and is_healthy(path):
            return step, path
    return None


def resume_order(paths: list[str]) -> tuple[list[str], list[str]]:
    """(paths with the ones whose manifest says anomalous moved last, each group newest first; what to log).

    Incomplete or unreadable checkpoints keep their place: resuming verifies them and reports them."""
    anomalous = [p for p in paths if health_of(p).get("status") == "anomalous"]
    rest = [p for p in paths if p not in anomalous]
    notes = []
    if anomalous and rest and paths.index(rest[0]) > 0:
        passed = paths[: paths.index(rest[0])]
        notes.append(f"checkpoint.resume=auto: newest healthy checkpoint {rest[0]}; passing over newer "
                     + ", ".join(f"{os.path.basename(p)} ({_status(p)})" for p in passed))
    elif anomalous and not rest:
        notes.append(f"checkpoint.resume=auto: no healthy checkpoint; the newest is {anomalous[0]} "
                     f"({_status(anomalous[0])})")
    return rest + anomalous, notes


def _status(path: str) -> str:
    h = health_of(path)
    what = ", ".join(h.get("anomaly") or []) or h.get("status", "unreadable")
    return f"{what} at loss {h.get('loss')}, grad_norm {h.get('grad_norm')}"


def nonfinite_arrays(tensors: dict) -> list[str]:
    """Names of the floating-point arrays of a snapshot holding NaN or inf (empty: all finite)."""
    bad = []
    for name, arr in tensors.items():
        a = np.asarray(arr)
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            bad.append(name)
    return bad
