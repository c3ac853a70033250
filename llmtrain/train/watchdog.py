"""Failure detection: a watchdog thread on every rank ends the job when a step stops completing or a peer is gone.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py train.hang_timeout_s=600

    wd = Watchdog(run_dir, topo, hang_timeout_s, peer_timeout_s).start()   # every rank, after resume
    wd.progress(step)            # after each step
    with wd.paused(): ckpt.save(...)   # a save has its own timeout (checkpoint.timeout_minutes)
    wd.stop("done")              # the rank finished normally

Why: a rank that dies (SIGKILL, OOM) leaves its peers blocked in a collective; Paddle's
launcher stops only its own node's ranks, and the other nodes wait for gloo's timeout or
forever. Collectives release the GIL, so a thread keeps running while the training
thread is blocked in one, and checks once per second:

- **hang**: no step completed for `train.hang_timeout_s` seconds;
- **dead peer**: through heartbeat files in the shared run directory,
  `<run.dir>/heartbeat/rank_<r>.json` = {job, rank, host, pid, beat, step, state}, rewritten
  every second by each rank's watchdog. A peer is gone when its file says `failed`, when it
  is on this host and its pid no longer runs, or when its `beat` counter has not changed
  for `train.peer_timeout_s` seconds of this rank's clock (no clock agreement needed across
  nodes; a stopped or wedged process stops beating too). `job` is a number rank 0 draws and
  broadcasts at start, so the files of an earlier run in the same directory are not read
  as live peers.

Then the watchdog prints the reason naming the rank, dumps the Python stack of every
thread of this process (`faulthandler`, to stderr, i.e. the worker log), marks its own
heartbeat `failed` (so peers on other nodes stop at once rather than after the
timeout) and exits the process with status 3 (peer gone) or 4 (hang). A rank that ends
with an exception marks itself `failed` too. All ranks must see one filesystem (as for checkpoints).
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import random
import socket
import sys
import threading
import time

EXIT_PEER = 3
EXIT_HANG = 4


def _pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


class Watchdog:
    def __init__(self, run_dir: str, topo, hang_timeout_s: float, peer_timeout_s: float, interval_s: float = 1.0):
        self.dir = os.path.join(run_dir, "heartbeat")
        self.topo = topo
        self.hang_timeout_s = hang_timeout_s
        self.peer_timeout_s = peer_timeout_s
        self.interval_s = interval_s
        self.host = socket.gethostname()
        self.job = 0
        self.beat = 0
        self.step = None
        self.state = "running"
        self._last_progress = time.monotonic()
        self._paused = 0
        self._stop = threading.Event()
        self._seen: dict[int, tuple] = {}  # rank -> (beat, monotonic time it changed)
        self._thread = None

    # ---- training thread ----
    def start(self) -> "Watchdog":
        self.job = _agree_on_job_id(self.topo)
        os.makedirs(self.dir, exist_ok=True)
        self._started = time.monotonic()
        self._write()
        self._last_progress = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="llmtrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def progress(self, step: int) -> None:
        self.step = step
        self._last_progress = time.monotonic()

    @contextlib.contextmanager
    def paused(self):
        """The hang clock stops inside (a long synchronous save); peers are still watched."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last_progress = time.monotonic()

    def stop(self, state: str = "done") -> None:
        self.state = state
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._write()

    # ---- watchdog thread ----
    def _path(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank_{rank:05d}.json")

    def _write(self) -> None:
        self.beat += 1
        tmp = self._path(self.topo.rank) + f".{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"job": self.job, "rank": self.topo.rank, "host": self.host, "pid": os.getpid(),
                       "beat": self.beat, "step": self.step, "state": self.state, "time": time.time()}, f)
        os.replace(tmp, self._path(self.topo.rank))

    def _read(self, rank: int):
        try:
            with open(self._path(rank)) as f:
                info = json.load(f)
        except (OSError, ValueError):
            return None
        return info if info.get("job") == self.job else None

    def _peer_problem(self, rank: int, now: float):
        info = self._read(rank)
        if info is None:  # not started yet (or still an earlier run's file)
            if now - self._started > self.peer_timeout_s:
                return f"rank {rank} never wrote a heartbeat in {self.peer_timeout_s:.0f} s (train.peer_timeout_s)"
            return None
        where = f"rank {rank} (host {info['host']}, pid {info['pid']}, last completed step {info['step']})"
        if info["state"] == "failed":
            return f"{where} failed"
        if info["state"] == "done":
            return None
        if info["host"] == self.host and not _pid_running(info["pid"]):
            # a peer that finished writes "done" and exits at once: it may have done both between our read and
            # the pid check, so its file is read again before it counts as gone
            last = self._read(rank)
            if last is not None and last["state"] == "done":
                return None
            return f"{where} is gone: its process no longer runs"
        beat, since = self._seen.get(rank, (None, now))
        if beat != info["beat"]:
            self._seen[rank] = (info["beat"], now)
        elif now - since > self.peer_timeout_s:
            return f"{where} stopped responding: no heartbeat for {now - since:.0f} s (train.peer_timeout_s={self.peer_timeout_s:g})"
        return None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write()
            except OSError as e:
                print(f"[llmtrain watchdog] rank {self.topo.rank}: cannot write heartbeat: {e}", file=sys.stderr, flush=True)
            now = time.monotonic()
            for rank in range(self.topo.world):
                if rank != self.topo.rank:
                    problem = self._peer_problem(rank, now)
                    if problem:
                        return self._fire(EXIT_PEER, f"{problem}; stopping rank {self.topo.rank}")
            idle = now - self._last_progress
            if not self._paused and idle > self.hang_timeout_s:
                return self._fire(EXIT_HANG, f"rank {self.topo.rank}: no step completed for {idle:.0f} s "
                                             f"(train.hang_timeout_s={self.hang_timeout_s:g}; last completed step {self.step})")

    def _fire(self, code: int, reason: str) -> None:
        if self._stop.is_set():
            return
        msg = f"[llmtrain watchdog] {reason}; Python stacks of every thread of rank {self.topo.rank} follow"
        print(msg, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.state = "failed"
        with contextlib.suppress(OSError):
            self._write()
        print(f"[llmtrain watchdog] rank {self.topo.rank} exits with status {code}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(code)


def _agree_on_job_id(topo) -> int:
    """A number every rank of this job agrees on (one broadcast), different for every launch."""
    import paddle
    import paddle.distributed as dist

    t = paddle.to_tensor([random.SystemRandom().randrange(1, 2**62) if topo.rank == 0 else 0], dtype="int64")
    if topo.world > 1:
        dist.broadcast(t, src=0)
    return int(t.numpy()[0])
