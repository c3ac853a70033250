"""Rank-0 logging: `log0("message")` prints once per job, not once per process; `run_log` also writes rank 0's lines
to `<run.dir>/llmtrain.log`.

    from llmtrain.utils.log import log0
"""
from __future__ import annotations

import contextlib
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


class RunLog(logging.Handler):
    """Rank 0's log lines, also in `<run.dir>/llmtrain.log` (appended: a restart adds to it). Lines logged before the
    run directory is known (resolve's notes) are kept and written when `open` names it."""

    FILE = "llmtrain.log"

    def __init__(self):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("[llmtrain %(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
        self.pending: list[str] = []
        self.stream = None

    def open(self, run_dir: str) -> None:
        """Start writing `<run.dir>/llmtrain.log` (rank 0), the lines so far first."""
        if global_rank() != 0 or self.stream is not None:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.stream = open(os.path.join(run_dir, self.FILE), "a", encoding="utf-8")
        self.stream.write(f"== {' '.join(sys.argv)}\n" + "".join(self.pending))
        self.stream.flush()
        self.pending = []

    def emit(self, record) -> None:
        line = self.format(record) + "\n"
        if self.stream is None:
            self.pending.append(line)
        else:
            self.stream.write(line)
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        super().close()


@contextlib.contextmanager
def run_log():
    """`with run_log() as log: ...; log.open(run_dir)`: the recipe's log lines in the run directory's llmtrain.log; an
    error that ends the recipe is its last line."""
    handler = RunLog()
    _logger.addHandler(handler)
    try:
        yield handler
    except BaseException as e:
        if handler.stream is not None:
            handler.stream.write(f"error: {type(e).__name__}: {e}\n")
        raise
    finally:
        _logger.removeHandler(handler)
        handler.close()
