"""What every entry script does around its recipe.

    @hydra.main(version_base="1.3", config_path="../conf", config_name="config")
    def main(dcfg): run_entry(pretrain, dcfg)

A `ConfigError` (a configuration that cannot run) is printed once, by rank 0,
as the list of problems, and the process exits with status 2 without a Python
traceback (set HYDRA_FULL_ERROR=1 to get the traceback); so does an unknown override, checked before Hydra
composes (`llmtrain.config.refuse_unknown_keys`). A run already finished (`RunFinished`: its checkpoint is at
train.max_steps) says so and exits 0 before any work. A run the divergence guard stopped
(`llmtrain.train.anomaly.Diverged`) prints its message and exits with status 5; a checkpoint that could not be
written (`CheckpointSaveError`: a full disk, a permission) stops the run with status 6, the newest complete
checkpoint intact and named. A finished CPU job
exits without the interpreter teardown that can crash in gloo after the work is
done (`llmtrain.paddle_compat.process.exit_process`).
"""
from __future__ import annotations

import os
import sys

from llmtrain.errors import CheckpointSaveError, ConfigError, RunFinished
from llmtrain.utils.log import global_rank

EXIT_CONFIG_ERROR = 2
EXIT_SAVE_FAILED = 6
"""A checkpoint could not be written (`llmtrain.errors.CheckpointSaveError`): the run stopped at that save."""
RANK0_FIRST_S = 3.0
"""On a ConfigError every rank fails at once; the other ranks wait this long before exiting so rank 0's status
reaches Paddle's launcher first. The launcher stops the remaining ranks (SIGTERM) when one fails and reports the
first non-zero status in rank order: when rank 1 exited first, rank 0's -15 was reported (241) instead of 2."""


def exit_config_error(e: ConfigError) -> None:
    """Print the problems once (rank 0) and exit with status 2; the other ranks wait `RANK0_FIRST_S` first."""
    if global_rank() == 0:
        print(f"error: {e}", file=sys.stderr, flush=True)
    else:
        import time

        time.sleep(RANK0_FIRST_S)  # rank 0 exits first: the launcher reports status 2, not its SIGTERM of rank 0
    sys.exit(EXIT_CONFIG_ERROR)


def run_entry(recipe, dcfg) -> None:
    from llmtrain.train.anomaly import EXIT_DIVERGED, Diverged

    try:
        recipe(dcfg)
    except Diverged as e:  # the divergence guard stopped the run: its message, status EXIT_DIVERGED
        if global_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        from llmtrain.paddle_compat.process import exit_process

        exit_process(EXIT_DIVERGED)  # CPU: without the gloo teardown
        sys.exit(EXIT_DIVERGED)
    except ConfigError as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        exit_config_error(e)
    except CheckpointSaveError as e:  # a save failed: the message (every rank: its own cause), status 6
        print(f"error: [rank {global_rank()}] {e}", file=sys.stderr, flush=True)
        from llmtrain.paddle_compat.process import exit_process

        exit_process(EXIT_SAVE_FAILED)
        sys.exit(EXIT_SAVE_FAILED)
    except RunFinished as e:  # resolve found the run already at train.max_steps: nothing to do, said once
        if global_rank() == 0:
            print(str(e), file=sys.stderr, flush=True)
        sys.exit(0)
    from llmtrain.paddle_compat.process import exit_process

    exit_process(0)
