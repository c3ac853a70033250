"""File helpers shared by data preparation, tokenizers and checkpoints.

    from llmtrain.utils.files import sha256_file, chmod_as_created
"""
from __future__ import annotations

import hashlib
import os


def sha256_file(path: str | os.PathLike, block: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in blocks (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            h.update(chunk)
    return h.hexdigest()


def current_umask() -> int:
    """This process's umask: from /proc/self/status on Linux (no change to the process state, safe beside the
    background checkpoint writer), else by setting it and putting it back at once."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def chmod_as_created(path: str | os.PathLike) -> None:
    """Give `path` the mode a plain `open()` / `mkdir()` would: 0o666 (files) or 0o777 (directories) less the
    umask. For files written by libraries that create them 0600 (`safetensors.numpy.save_file`, `mkdtemp`)."""
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, base & ~current_umask())
