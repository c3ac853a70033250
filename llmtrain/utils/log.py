"""Rank-0 logging: `log0("message")` prints once per job, not once per process.

    from llmtrain.utils.log import log0
"""
from __future__ import annotations

import logging
import os
import sys

_logger = logging.getLogger("llmtrain")
if not _logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[llmtrain %(asctime)s] %(message)s", "%H:%M:%S"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False


def global_rank() -> int:
    """This process's rank in the job, from the launcher's environment (0 when run directly)."""
    return int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def log0(msg: str, *args) -> None:
    """Log on global rank 0 only."""
    if global_rank() == 0:
        _logger.info(msg, *args)


def log_all(msg: str, *args) -> None:
    """Log on every rank, prefixed with the rank."""
    _logger.info(f"[rank {global_rank()}] " + msg, *args)
