"""Run llmtrain/pretrain.py's real entry (Hydra main, exit statuses) with a test fault installed first.

    python tests/train/run_with_faults.py lr_from 5 50 -- model=gpt-tiny train.max_steps=8 ...

The fault is one of tests/train/faults.py's functions with its arguments; everything after `--` is
the pretrain command line.
"""
from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "llmtrain"))  # pretrain.py run as a file imports its _bootstrap

if __name__ == "__main__":
    split = sys.argv.index("--")
    name, args = sys.argv[1], [float(a) if "." in a else int(a) for a in sys.argv[2:split]]
    import faults

    getattr(faults, name)(*args)
    script = os.path.join(REPO, "llmtrain", "pretrain.py")
    sys.argv = [script, *sys.argv[split + 1:]]
    import runpy

    runpy.run_path(script, run_name="__main__")  # as `python llmtrain/pretrain.py` (Hydra finds conf/ beside it)
