"""Checkpoint configuration: the `checkpoint` section of the root config.

    python llmtrain/pretrain.py checkpoint.interval=100 checkpoint.keep_last=3 checkpoint.resume=auto
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    """`checkpoint`: when to save, what to keep, where to resume from (docs/checkpoints.md)."""

    interval: int = 0
    """Save every this many steps (0: only at the end and on SIGTERM/SIGINT)."""

    keep_last: int = 2
    """Keep this many complete checkpoints; older ones are deleted only after a newer one is complete (0 keeps all)."""

    resume: str = "auto"
    """`auto`: continue from the newest complete checkpoint under <run.dir>/checkpoints if any (a config that cannot
    continue it is refused up front); `none`: a new run (refused when <run.dir> holds checkpoints: use a new
    run.dir or run.overwrite=true); or a path: a step_<N> directory, or a run directory (its newest complete
    checkpoint). Checked before any work by `llmtrain.train.rundir`."""

    save_final: bool = True
    """Save a checkpoint after the last step."""

    async_save: bool = False
    """Save in the background: the step pays only for copying this rank's state into host memory, one persistent
    writer thread writes the same atomic checksummed directory while training continues (one write in flight;
    the next save, pruning, SIGTERM and the end of the run wait for it; a failed write stops the run)."""

    timeout_minutes: float = 60.0
    """How long ranks wait for each other's shards during a save (a slow disk, a big model) before giving up."""
