"""Run an entry script (`llmtrain/finetune.py ARGS...`) as `python SCRIPT ARGS...` would, inside a launched process.

    {"call": "tests/e2e/run_script.py:run", "args": ["llmtrain/finetune.py", "+parallel=dp2", ...]}

A `run_many` entry (tests/e2e/multirun_worker.py): the script's own `main` runs (Hydra's command line, `run_entry`)
in the process group the earlier entries of the launch initialised. The script ends the process
(`exit_process`), so this entry must be the launch's last.
"""
from __future__ import annotations

import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(script: str, *args: str) -> None:
    path = os.path.join(REPO, script)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))  # as `python SCRIPT` puts the script's folder first
    runpy.run_path(path, run_name="__main__")
    raise AssertionError(f"{script} returned instead of ending the process")
