"""How the ranks of one save meet: through the shared filesystem, not collectives.

    python -m pytest -q tests/checkpoint/test_write_edges.py
    nonce = save_nonce(comm, rank)                       # one quick broadcast at a step boundary
    wait_for("manifest of step_4", ready, tmp, minutes)  # poll until ready(); stop at once on a failure marker
    mark_failed(tmp, rank, error)                         # what a failing rank leaves for the others

gloo's collectives time out after ~30 s and a big save takes longer, so a save's steps are ordered by files
(each rank's `rank_<r>.files` listing, then rank 0's manifest carrying the save's nonce). A rank whose part of
the save fails, rank 0 included (its wait for the listings, the manifest, the rename), writes
`rank_<r>.failed` into the save's temporary directory; every rank waiting on that save sees it at its next
poll (every 0.05 s) and raises naming the rank and its error, instead of waiting `checkpoint.timeout_minutes`.
"""
from __future__ import annotations

import glob
import os
import random
import time

import paddle

from llmtrain.checkpoint.listing import read_manifest

POLL_S = 0.05


def save_nonce(comm, rank: int) -> int:
    """A number every rank agrees on, naming one save (rank 0 draws it; one broadcast)."""
    mine = [random.SystemRandom().randrange(1, 2**62)] if rank == 0 else None
    return comm.broadcast_ints(mine)[0]


def manifest_nonce(final: str):
    """The nonce in `final`'s manifest (None while there is none)."""
    m = read_manifest(final)
    return None if m is None else m.get("save_nonce")


def mark_failed(tmp: str, rank: int, error: BaseException) -> None:
    """Leave `rank_<r>.failed` (the error) in the save's temporary directory; best effort."""
    try:
        os.makedirs(tmp, exist_ok=True)
        with open(os.path.join(tmp, f"rank_{rank:05d}.failed"), "w") as f:
            f.write(f"{type(error).__name__}: {error}\n")
    except OSError:
        pass


def failures(tmp: str) -> list[str]:
    """`rank_<r> (<error>)` for every failure marker in the save's temporary directory."""
    out = []
    for p in sorted(glob.glob(os.path.join(tmp, "rank_*.failed"))):
        try:
            with open(p) as f:
                why = f.read().strip()
        except OSError:
            why = "unreadable marker"
        out.append(f"{os.path.basename(p)[:-len('.failed')]} ({why})")
    return out


def wait_for(what: str, ready, tmp: str, timeout_minutes: float) -> None:
    """Poll the shared filesystem until `ready()`; raises at once when a rank left a failure marker in `tmp`, or
    after `timeout_minutes`."""
    deadline = time.time() + 60 * timeout_minutes
    while not ready():
        failed = failures(tmp)
        if failed:
            raise RuntimeError(f"checkpoint save: {what}: the write failed on " + ", ".join(failed))
        if time.time() > deadline:
            raise TimeoutError(f"checkpoint save: {what} not ready after checkpoint.timeout_minutes={timeout_minutes}")
        time.sleep(POLL_S)


def all_ok(comm, ok: bool) -> bool:
    """True on every rank when `ok` is True on every rank (one all-reduce of the failure count)."""
    t = comm.all_reduce_sum(paddle.to_tensor([0 if ok else 1], dtype="int32"))
    return int(t.numpy()[0]) == 0
