"""The persistent background checkpoint writer behind `checkpoint.async_save=true`.

    python llmtrain/pretrain.py checkpoint.interval=100 checkpoint.async_save=true

    writer = BackgroundWriter(checkpointer.write)   # one thread for the whole run
    writer.submit(snapshot)                          # returns at once; at most one write in flight
    writer.wait()                                    # the write is complete, or its failure raises here

One daemon thread lives as long as the run (no process forked or spawned per save, no
pickling of the state): the training thread copies its tensors into numpy arrays that
own their memory (`Checkpointer.snapshot`), hands them over, and goes on training while
this thread writes the same atomic, checksummed directory as a synchronous save
(`Checkpointer.write`: files, fsync, listing, manifest, rename, pruning). The write
uses no collectives (ranks meet through the filesystem), so it cannot interleave with
the training thread's gloo/NCCL calls. safetensors' serialisation, sha256 and file I/O
release the GIL for their bulk work.

Guarantees: `submit` first waits for the previous write (never two in flight, so host
memory holds at most one extra copy of this rank's shard); a failed write is logged on
every rank at once and raised again, with its traceback, by the next `submit`, `wait`
or `close` on the training thread, which stops the run with a non-zero status; a failed
or interrupted write leaves only `.tmp-step_*`, which `resume=auto` ignores.
"""
from __future__ import annotations

import threading
import traceback
from typing import Callable, Optional

from llmtrain.utils.log import log_all


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed; the message carries the writer's traceback."""


class BackgroundWriter:
    """One persistent thread that runs `write(snapshot)` for each submitted save, one at a time; its failure is raised
    on the training thread at the next `wait`, `submit` or `close`."""

    def __init__(self, write: Callable[[object], str]):
        self._write = write
        self._cond = threading.Condition()
        self._job = None  # the snapshot waiting to be written (at most one)
        self._busy = False
        self._error: Optional[str] = None
        self._cause: Optional[BaseException] = None
        self._closed = False
        self.last_path: Optional[str] = None
        self._thread = threading.Thread(target=self._loop, name="llmtrain-checkpoint-writer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                if self._job is None:
                    return
                job, self._job = self._job, None
            try:
                path = self._write(job)
                error = cause = None
            except BaseException as e:  # reported loudly here and raised on the training thread
                path, cause = None, e
                error = f"checkpoint write of step {getattr(job, 'step', '?')} failed:\n{traceback.format_exc()}"
                log_all(f"ERROR: {error}")
            with self._cond:
                self._busy = False
                if error is not None and self._error is None:
                    self._error, self._cause = error, cause
                if path is not None:
                    self.last_path = path
                self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise CheckpointWriteError(self._error) from self._cause

    def wait(self) -> None:
        """Block until no write is queued or running; raise if any write failed."""
        with self._cond:
            while self._busy:
                self._cond.wait()
        self._raise_if_failed()

    def submit(self, snapshot) -> None:
        """Queue `snapshot` for writing (after the previous write completes)."""
        self.wait()
        with self._cond:
            if self._closed:
                raise RuntimeError("BackgroundWriter.submit after close")
            self._job, self._busy = snapshot, True
            self._cond.notify_all()

    def close(self) -> None:
        """Wait for the last write, stop the thread; raise if a write failed."""
        try:
            self.wait()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join()
