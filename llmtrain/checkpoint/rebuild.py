"""Rebuild a checkpoint's damaged manifest.json from the files the checkpoint keeps beside it.

    python -m llmtrain.checkpoint.rebuild outputs/run/checkpoints/step_10           # verify, then write manifest
    python -m llmtrain.checkpoint.rebuild outputs/run/checkpoints/step_10 --check   # only say whether it can

Besides its manifest a checkpoint holds rank 0's `state.json` (the manifest without its file listing) and each
rank's `rank_<r>.files` (size and sha256 of that rank's files). When the manifest is missing, unreadable or
disagrees with the files while every file matches its rank's listing, the tensors are intact and only the
manifest is damaged: the rebuild hashes every file against its listing, keeps the damaged manifest as
`manifest.json.damaged-<k>` (nothing is deleted) and writes a new one atomically. Checkpoints written before
the listings were kept have neither file and cannot be rebuilt (the command says so). Exit status: 0 when every
named checkpoint is intact or rebuilt (with --check: could be), 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from llmtrain.checkpoint.listing import FORMAT, STATE_FILE, fsync_dir, write_json
from llmtrain.checkpoint.verify import verify_files
from llmtrain.utils.files import sha256_file


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def rebuild_problems(ckpt_dir: str, checksums: bool = False) -> list[str]:
    """What stops the manifest from being rebuilt (empty: every file matches its rank's listing; without
    `checksums` only the sizes are compared, the cheap check made before a run starts)."""
    state = _read_json(os.path.join(ckpt_dir, STATE_FILE))
    if state is None or state.get("format") != FORMAT or "world" not in state:
        return [f"{ckpt_dir}: no readable {STATE_FILE} (a checkpoint written before manifests could be rebuilt, or "
                "its rank 0 files are damaged)"]
    problems = []
    for rank in range(int(state["world"])):
        name = f"rank_{rank:05d}.files"
        listing = _read_json(os.path.join(ckpt_dir, name))
        if listing is None:
            problems.append(f"{os.path.join(ckpt_dir, name)}: missing or unreadable")
            continue
        for file, info in sorted(listing.items()):
            path = os.path.join(ckpt_dir, file)
            if not os.path.exists(path):
                problems.append(f"{path}: missing")
            elif os.path.getsize(path) != info["size"]:
                problems.append(f"{path}: {os.path.getsize(path)} bytes, its listing {name} says {info['size']}")
            elif checksums and sha256_file(path) != info["sha256"]:
                problems.append(f"{path}: sha256 differs from its listing {name}")
    return problems


def manifest_only_damage(ckpt_dir: str, problems: list[str]) -> bool:
    """True when a checkpoint with these `problems` (from `verify_files`) has intact files by its rank listings
    (sizes compared): only its manifest is damaged, and `rebuild` can restore it."""
    return bool(problems) and not rebuild_problems(ckpt_dir)


def rebuild_command(ckpt_dir: str) -> str:
    return f"python -m llmtrain.checkpoint.rebuild {ckpt_dir}"


def rebuild(ckpt_dir: str) -> str:
    """Verify every file against its rank's listing (sha256) and write a new manifest.json (the damaged one kept
    as `manifest.json.damaged-<k>`); returns a one-line account. Raises ValueError naming what stops it."""
    problems = rebuild_problems(ckpt_dir, checksums=True)
    if problems:
        raise ValueError(f"{ckpt_dir}: the manifest cannot be rebuilt: " + "; ".join(problems))
    state = _read_json(os.path.join(ckpt_dir, STATE_FILE))
    files = {}
    for rank in range(int(state["world"])):
        listing = os.path.join(ckpt_dir, f"rank_{rank:05d}.files")
        files.update(_read_json(listing))
        files[os.path.basename(listing)] = {"size": os.path.getsize(listing), "sha256": sha256_file(listing)}
    manifest = os.path.join(ckpt_dir, "manifest.json")
    kept = None
    if os.path.exists(manifest):
        k = 1
        while os.path.exists(f"{manifest}.damaged-{k}"):
            k += 1
        kept = f"{manifest}.damaged-{k}"
        os.rename(manifest, kept)
    write_json(manifest + ".part", dict(state, files=files))
    os.replace(manifest + ".part", manifest)
    fsync_dir(ckpt_dir)
    left = verify_files(ckpt_dir, checksums=False)
    if left:
        raise ValueError(f"{ckpt_dir}: the rebuilt manifest still fails: " + "; ".join(left))
    return (f"{ckpt_dir}: manifest rebuilt (step {state['step']}, {len(files)} files verified)"
            + (f"; the damaged one is kept as {os.path.basename(kept)}" if kept else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmtrain.checkpoint.rebuild", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", help="step_<N> directories")
    p.add_argument("--check", action="store_true", help="say whether each can be rebuilt; write nothing")
    args = p.parse_args(argv)
    failed = 0
    for ckpt in args.checkpoints:
        damage = verify_files(ckpt)
        if not damage:
            print(f"{ckpt}: intact (manifest and every file verified); nothing to do")
            continue
        if args.check:
            problems = rebuild_problems(ckpt, checksums=True)
            print(f"{ckpt}: " + ("the manifest can be rebuilt: every file matches its rank's listing" if not problems
                                 else "cannot be rebuilt: " + "; ".join(problems)))
            failed += bool(problems)
            continue
        try:
            print(rebuild(ckpt))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
