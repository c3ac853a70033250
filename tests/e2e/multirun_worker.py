"""Run several pretraining configs, one after another, in one (possibly launched) process group.

    python -m paddle.distributed.launch --nproc_per_node 2 tests/e2e/multirun_worker.py RUNS.json
    python tests/e2e/multirun_worker.py RUNS.json           # one process

RUNS.json: [{"overrides": ["model=gpt-tiny", "+parallel=dp2", ...]}, ...]. Each entry goes
through the real entry function `llmtrain.pretrain.pretrain` (`"entry": "finetune"`:
`llmtrain.finetune.finetune` on `conf/finetune.yaml`) with a config composed by Hydra's
compose API; fleet is initialised once (all entries must share one layout). Starting the
process group once per launch instead of once per model halves the parity suite's time. An entry
{"call": "FILE.py:FUNCTION", "args": [...]} calls that function in the launched process instead
(after earlier entries initialised fleet), e.g. tests/parallel/sp_activations.py.
"""
from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from llmtrain.config import compose_config  # noqa: E402
from llmtrain.pretrain import pretrain  # noqa: E402


def main(path: str) -> None:
    with open(path) as f:
        runs = json.load(f)
    for run in runs:
        if "call" in run:  # {"call": "path/to/file.py:function", "args": [...]}: in this (launched) process
            import runpy

            file, func = run["call"].split(":")
            runpy.run_path(os.path.join(REPO, file))[func](*run.get("args", []))
            continue
        if run.get("entry") == "finetune":
            from llmtrain.finetune import finetune

            finetune(compose_config(run["overrides"], config_name="finetune"))
        else:
            pretrain(compose_config(run["overrides"]))
    from llmtrain.paddle_compat.process import exit_process

    exit_process(0)  # as llmtrain/pretrain.py's main does


if __name__ == "__main__":
    main(sys.argv[1])
