"""File helpers shared by data preparation, tokenizers and checkpoints.

    from llmtrain.utils.files import sha256_file
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
