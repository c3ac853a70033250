"""The checkpoint directory: which checkpoints exist, their manifests, and the file-level primitives of a save.

    python -m pytest -q tests/checkpoint/test_write_edges.py
    list_checkpoints(root)              # [(step, path)], newest first
    read_manifest(path)                 # the parsed manifest.json, or None when missing or unreadable
    amend_manifest(path, {"k": v})      # rank 0: merge entries into a complete checkpoint's manifest, atomically

Layout of `<run.dir>/checkpoints/`:
    step_<N>/                       a complete checkpoint (manifest.json written last, then the directory renamed)
    .tmp-step_<N>-<nonce>/          a save in progress or interrupted (never loaded; removed by the next save)
    .replaced-step_<N>-<nonce>/     the previous step_<N> while a save of the same step replaces it: the old
                                    one is renamed aside, the new one renamed in, then the old one moved to
                                    `<run.dir>/superseded/<k>/checkpoints/`, so at every moment one of the two is
                                    complete on disk. If a crash falls between the two renames,
                                    `list_checkpoints` offers the aside copy as step <N>.

`<run.dir>/superseded/<k>/` (k = 1, 2, ...): what a run set aside instead of deleting it: the checkpoints of a
branch a resume from an older checkpoint left (`llmtrain.train.branch`), a replaced copy of a redone step, each
with `why.txt`. Nothing there is ever read by training or deleted automatically.
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Optional

FORMAT = "llmtrain-checkpoint-1"
STATE_FILE = "state.json"
"""Rank 0's copy of the manifest without its file listing (`rebuild.py` restores a damaged manifest from it)."""
SUPERSEDED = "superseded"
STEP_DIR = re.compile(r"^step_(\d+)$")
REPLACED_DIR = re.compile(r"^\.replaced-step_(\d+)-\d+$")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every step_<N> directory under root, newest first; a `.replaced-step_<N>-*` directory stands
    in for a step_<N> that is missing (a replacement interrupted between its renames)."""
    found: dict[int, str] = {}
    aside: dict[int, str] = {}
    for path in glob.glob(os.path.join(root, "step_*")) + glob.glob(os.path.join(root, ".replaced-step_*")):
        if not os.path.isdir(path):
            continue
        name = os.path.basename(path)
        m = STEP_DIR.match(name)
        if m:
            found[int(m.group(1))] = path
        elif REPLACED_DIR.match(name):
            aside[int(REPLACED_DIR.match(name).group(1))] = path
    for step, path in aside.items():
        found.setdefault(step, path)
    return sorted(found.items(), reverse=True)


def init_label(path: str) -> str:
    """The model name a run started from `model.init_from=path` carries (and its default run name): one of our
    checkpoints -> `<its model>-step<N>` (`gpt-tiny-step200`), another directory -> its name (`Qwen3-0.6B`)."""
    manifest = read_manifest(path)
    model = (manifest or {}).get("model")
    if isinstance(model, dict) and model.get("name") and "step" in manifest:
        return f"{model['name']}-step{manifest['step']}"
    return os.path.basename(os.path.normpath(path))


def read_manifest(path: str) -> Optional[dict]:
    """A checkpoint's manifest.json, parsed; None when it is missing or unreadable."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj) -> None:
    """`obj` as JSON in `path`, flushed and fsynced."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def amend_manifest(path: str, entries: dict) -> None:
    """Merge `entries` into the manifest of the complete checkpoint `path` (a new file renamed over the old one:
    a reader sees the old manifest or the new, never a part). Its file listing and checksums are unchanged."""
    manifest = read_manifest(path)
    if manifest is None:
        raise FileNotFoundError(f"{path}: no readable manifest.json to amend")
    part = os.path.join(path, "manifest.json.part")
    write_json(part, manifest | entries)
    os.replace(part, os.path.join(path, "manifest.json"))
    fsync_dir(path)


def set_aside(paths: list[str], run_dir: str, why: str) -> str:
    """Move checkpoint directories into a new `<run_dir>/superseded/<k>/checkpoints/` (a `.replaced-step_<N>-*`
    copy under the name `step_<N>`) and write `why.txt` there; returns that `superseded/<k>` directory."""
    base = os.path.join(run_dir, SUPERSEDED)
    os.makedirs(base, exist_ok=True)
    k = 1
    while True:
        aside = os.path.join(base, str(k))
        try:
            os.mkdir(aside)  # atomic: two callers never share a number
            break
        except FileExistsError:
            k += 1
    os.makedirs(os.path.join(aside, "checkpoints"))
    with open(os.path.join(aside, "why.txt"), "w", encoding="utf-8") as f:
        f.write(why.rstrip("\n") + "\n")
    for path in paths:
        name = os.path.basename(path.rstrip("/"))
        m = REPLACED_DIR.match(name)
        os.rename(path, os.path.join(aside, "checkpoints", f"step_{m.group(1)}" if m else name))
    return aside
