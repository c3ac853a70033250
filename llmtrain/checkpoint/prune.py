"""Pruning: which checkpoints a completed save deletes (rank 0, after the new one is complete).

    python -m pytest -q tests/checkpoint/test_integrity.py -k keep_last
    after_complete(root, step, keep_last)   # stale temporaries and replaced copies go, then keep_last applies

Old checkpoints are deleted only after a newer one is complete. `checkpoint.keep_last` counts complete
checkpoints at or before the new step (0 keeps all); the newest healthy one survives any keep_last (the
divergence guard's rewind and stop need it; `health.py`).
"""
from __future__ import annotations

import glob
import os
import shutil

from llmtrain.checkpoint.health import newest_healthy
from llmtrain.checkpoint.listing import REPLACED_DIR, list_checkpoints, set_aside
from llmtrain.checkpoint.verify import verify_files
from llmtrain.utils.log import log0


def remove_superseded(root: str) -> None:
    """Interrupted saves (`.tmp-step_*`: a newer save is complete now) are deleted; replaced copies
    (`.replaced-step_<N>-*`) are renamed back to step_<N> when a crash left it missing, else moved to
    `<run.dir>/superseded/<k>/` (`listing.set_aside`)."""
    for stale in glob.glob(os.path.join(root, ".tmp-step_*")):
        shutil.rmtree(stale, ignore_errors=True)
    for aside in glob.glob(os.path.join(root, ".replaced-step_*")):
        m = REPLACED_DIR.match(os.path.basename(aside))
        final = os.path.join(root, f"step_{m.group(1)}") if m else None
        if final is not None and not os.path.exists(final):
            os.rename(aside, final)
        else:
            where = set_aside([aside], os.path.dirname(root), f"a replaced copy of {os.path.basename(final or aside)}"
                              " found after an interrupted replacement")
            log0(f"{aside}: a replaced copy of a redone step, moved to {where}")


def prune(root: str, newest: int, keep_last: int) -> None:
    """Keep the `keep_last` newest complete checkpoints at or before `newest`, and the newest healthy one."""
    if keep_last <= 0:
        return
    complete = [(s, p) for s, p in list_checkpoints(root) if s <= newest and not verify_files(p, names=[])]
    protect = newest_healthy(complete)
    for s, path in complete[keep_last:]:
        if (s, path) == protect:
            log0(f"checkpoint kept beyond keep_last={keep_last}: {path} is the newest healthy one")
            continue
        shutil.rmtree(path, ignore_errors=True)
        log0(f"checkpoint deleted (keep_last={keep_last}): {path}")


def after_complete(root: str, step: int, keep_last: int) -> None:
    """Rank 0, once step_<step> is complete: superseded directories removed, older checkpoints pruned."""
    remove_superseded(root)
    prune(root, step, keep_last)
