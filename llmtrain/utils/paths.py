"""Where relative data and tokenizer paths point.

    from llmtrain.utils.paths import resolve_path
    resolve_path("work/pd1998/pd1998_text_document")   # -> an absolute path

A relative path is tried against the directory the run was launched from (Hydra's
original working directory when Hydra runs, else the current directory), then
against the repository root, so ``conf/data/*.yaml`` can name files relative to the
repository and still work when a run is launched from elsewhere. The first candidate
that exists (for a data prefix: whose ``.idx`` exists) wins; when none exists the
launch-directory candidate is returned, so error messages name the path the user
expects.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if os.path.isabs(path):
        return path
    bases = []
    if "hydra" in sys.modules:  # a Hydra run has imported it; never import it here (slow, optional)
        from hydra.core.hydra_config import HydraConfig
        from hydra.utils import get_original_cwd

        if HydraConfig.initialized():
            bases.append(get_original_cwd())
    bases += [os.getcwd(), str(REPO_ROOT)]
    for b in bases:
        cand = os.path.join(b, path)
        if os.path.exists(cand) or os.path.exists(cand + ".idx"):
            return cand
    return os.path.join(bases[0], path)
