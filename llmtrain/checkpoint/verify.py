"""Checkpoint verification: is a checkpoint complete and intact, checked by one rank or shared by all.

    python -m pytest -q tests/checkpoint/test_integrity.py
    verify_files(path)                      # problems (empty: complete and intact), one process
    verify_shared(path, topo, comm)         # every rank checks a share of the files; all agree (a collective)

A checkpoint is complete when its manifest exists, parses and has our format, and every file it lists exists with
the recorded size and sha256; a `rank_*` file the manifest does not list is a problem too (a shard of another
save). Problems are logged by the rank that found them, naming the file.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Optional

from llmtrain.checkpoint.listing import FORMAT
from llmtrain.checkpoint.rendezvous import all_ok
from llmtrain.utils.files import sha256_file
from llmtrain.utils.log import log_all


def verify_files(ckpt_dir: str, names: Optional[list[str]] = None, checksums: bool = True) -> list[str]:
    """Problems with a checkpoint directory (empty list: complete and intact).

    Checks the manifest exists and parses, and for each listed file (all, or
    `names`) that it exists, has the recorded size and (unless `checksums` is False: the cheap check
    `llmtrain.resolve` makes up front) sha256."""
    manifest_path = os.path.join(ckpt_dir, "manifest.json")
    if not os.path.exists(manifest_path):
        return [f"{ckpt_dir}: no manifest.json (save did not finish)"]
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return [f"{manifest_path}: unreadable ({e})"]
    if manifest.get("format") != FORMAT:
        return [f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT!r}"]
    problems = []
    for name, info in manifest["files"].items():
        if names is not None and name not in names:
            continue
        path = os.path.join(ckpt_dir, name)
        if not os.path.exists(path):
            problems.append(f"{path}: missing")
        elif os.path.getsize(path) != info["size"]:
            problems.append(f"{path}: {os.path.getsize(path)} bytes, manifest says {info['size']} (truncated?)")
        elif checksums and sha256_file(path) != info["sha256"]:
            problems.append(f"{path}: sha256 mismatch")
    return problems


def verify_shared(path: str, topo, comm) -> bool:
    """Every rank checks a share of the files (rank r: every world-th name from r); all agree on the verdict."""
    problems = verify_files(path, names=[])  # the manifest only
    if not problems:
        with open(os.path.join(path, "manifest.json")) as f:
            names = sorted(json.load(f)["files"])
        problems = verify_files(path, names=names[topo.rank :: topo.world])
        if not problems and topo.rank == 0:
            unlisted = {os.path.basename(p) for p in glob.glob(os.path.join(path, "rank_*"))} - set(names)
            if unlisted:
                problems.append(f"{path}: files not in the manifest: {sorted(unlisted)}")
    for p in problems:
        log_all(f"checkpoint problem: {p}")
    return all_ok(comm, not problems)
