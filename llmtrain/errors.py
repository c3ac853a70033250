"""Errors every layer may raise: the bottom of the import graph (it imports nothing of llmtrain).

    from llmtrain.errors import ConfigError
    raise ConfigError(["train.global_batch_size=10 is not a multiple of micro 4 x data-parallel 2"])

A rule that refuses a configuration lives with the module that owns the feature
(`llmtrain.parallel.layout`, `llmtrain.data.rampup`, `llmtrain.models.moe`, ...) and
returns or raises its problems through these types; `llmtrain.resolve` gathers them.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message lists every problem found (field names and numbers).

    The entry scripts print the message and exit with status 2 (a traceback only with HYDRA_FULL_ERROR=1)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(self.problems))


class RunFinished(Exception):
    """The run directory's checkpoint is already at train.max_steps: nothing to train (resolve raises it before any
    work; the entry script prints the message, which says how to train on, and exits 0)."""


class FrozenConfigError(AttributeError):
    """Raised on an assignment to a resolved (frozen) configuration."""


class CheckpointReadError(ValueError):
    """A checkpoint that cannot be read as a model; the message names the directory (or file) and the reason."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a permission, another rank's failed part): the run stops with
    status 6; the message names the step, the cause and the newest complete checkpoint, which is intact."""
