"""Which checkpoint to load, agreed by every rank: at resume, and for the divergence guard's rewind.

    python -m pytest -q tests/train/test_guard_fast.py -k target
    chooser = CheckpointChooser(root, topo, comm)
    chooser.first_verified(lambda: [(step, path), ...])   # rank 0's ordered candidates; the first that verifies

Rank 0 alone lists the directory and orders the candidates (`resume_order` for `checkpoint.resume=auto`: healthy
ones first, newest first; the healthy ones at or before a step for a rewind). It broadcasts its first untried
candidate; every rank verifies its share of that checkpoint's files and all agree (`verify.verify_shared`). A
candidate that fails is reported, and rank 0 offers the next one, until one verifies or none is left. Every rank
therefore loads the same checkpoint even when their own directory listings would differ (an asynchronous save
finishing, pruning by rank 0, a slow shared filesystem).
"""
from __future__ import annotations

import glob
import os
from typing import Callable, Optional

from llmtrain.checkpoint.health import newest_healthy, resume_order
from llmtrain.checkpoint.listing import list_checkpoints, read_manifest
from llmtrain.checkpoint.verify import verify_shared
from llmtrain.utils.log import log0


class CheckpointChooser:
    """Rank 0 proposes, all verify, the first verified candidate wins (the same on every rank)."""

    def __init__(self, root: str, topo, comm):
        self.root, self.topo, self.comm = root, topo, comm

    def _agree(self, path: Optional[str]) -> Optional[str]:
        """Rank 0's `path` (None: no candidate left) on every rank: its UTF-8 bytes in one broadcast of ints."""
        mine = list(path.encode()) if path is not None and self.topo.rank == 0 else None
        if self.topo.rank == 0 and path is None:
            mine = []
        got = self.comm.broadcast_ints(mine)
        return bytes(got).decode() if got else None

    def first_verified(self, candidates: Callable[[], list[tuple[int, str]]],
                       on_failure: Optional[Callable[[str], None]] = None) -> Optional[tuple[int, str]]:
        """(step, path) of the first of rank 0's `candidates()` that every rank verifies; None when none does.
        `on_failure(path)` is called on every rank for each candidate that failed."""
        ordered = list(candidates()) if self.topo.rank == 0 else []
        while True:
            proposal = ordered.pop(0)[1] if ordered else None
            path = self._agree(proposal)
            if path is None:
                return None
            if verify_shared(path, self.topo, self.comm):
                return _step_of(path), path
            if on_failure is not None:
                on_failure(path)

    def resume_candidates(self, how: str) -> Callable[[], list[tuple[int, str]]]:
        """The candidates of `checkpoint.resume` (`auto`: healthy first, each group newest first)."""

        def auto():
            for tmp in glob.glob(os.path.join(self.root, ".tmp-step_*")):
                log0(f"ignoring incomplete checkpoint {tmp} (a save was interrupted)")
            listed = list_checkpoints(self.root)
            ordered, notes = resume_order([p for _, p in listed])
            for note in notes:
                log0(note)
            step = {p: s for s, p in listed}
            return [(step[p], p) for p in ordered]

        return auto if how == "auto" else (lambda: [(_step_of(how), how)])

    def rewind_candidates(self, before: int) -> Callable[[], list[tuple[int, str]]]:
        """Healthy checkpoints at or before step `before`, newest first (the divergence guard's rewind)."""

        def healthy():
            listed = list_checkpoints(self.root)
            out = []
            while True:
                found = newest_healthy(listed, before=before)
                if found is None:
                    return out
                out.append(found)
                listed = [c for c in listed if c[0] < found[0]]

        return healthy


def _step_of(path: str) -> int:
    """The step of a checkpoint directory, read from its manifest (-1 when unreadable)."""
    m = read_manifest(path)
    return int(m["step"]) if m is not None and "step" in m else -1
