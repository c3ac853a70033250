"""Failure detection: two launchers on 127.0.0.1 as two nodes (one rank each); rank 1 is SIGKILLed or SIGSTOPped.

    python -m pytest tests/train/test_watchdog.py -q

Paddle's launcher of node 0 is never told that node 1 failed: without the watchdog,
rank 0 waits in a collective for gloo's timeout or longer. With it, rank 0 names the
failed rank and exits non-zero within seconds (dead peer: its heartbeat; stopped peer:
no step completes for train.hang_timeout_s, then the Python stacks are dumped), and
the newest complete checkpoint is intact. In the SIGKILL test rank 0 is held after a step
outside any collective (tests/train/watchdog_hold.py, injected by the test), so nothing
but the watchdog can end it: no gloo reset or timeout can stand in for it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launch import REPO, child_pids, env, free_port, launch_cmd
from llmtest import tiny_overrides
from llmtrain.checkpoint.listing import list_checkpoints
from llmtrain.checkpoint.verify import verify_files

HANG_S = 6



def _steps_done(run_dir: Path) -> int:
    try:
        return sum(1 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line)
    except OSError:
        return 0


PEER_S = 12
"""The SIGSTOP test's peer timeout: above the hang timeout (HANG_S), well below gloo's ~30 s collective timeout."""


def _two_nodes(corpus, tmp_path: Path, hold_after: int | None = None, extra: tuple = ()):
    """Two launchers ("nodes", one rank each) training; returns once step 5 and a checkpoint are done. `hold_after`:
    rank 0 is held after that step outside any collective (tests/train/watchdog_hold.py), the hang rule off."""
    run_dir = tmp_path / "run"
    overrides = [*tiny_overrides(corpus, str(run_dir), "gpt", steps=500), "+parallel=dp2", "checkpoint.interval=3",
                 "checkpoint.keep_last=2", f"train.hang_timeout_s={HANG_S if hold_after is None else 3600}", *extra]
    if hold_after is None:
        args = ["llmtrain/pretrain.py", *overrides]
    else:
        spec = tmp_path / "runs.json"
        spec.write_text(json.dumps([{"call": "tests/train/watchdog_hold.py:install",
                                     "args": [hold_after, str(tmp_path / "held")]}, {"overrides": overrides}]))
        args = [str(REPO / "tests/e2e/multirun_worker.py"), str(spec)]
    master = f"127.0.0.1:{free_port()}"
    procs = []
    for node in (0, 1):
        cmd = launch_cmd(args, 1, tmp_path / f"log{node}", master=master, nnodes=2, rank=node)
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    deadline = time.time() + 180
    while not (list_checkpoints(str(run_dir / "checkpoints")) and _steps_done(run_dir) >= 5
               and (hold_after is None or (tmp_path / "held").exists())):
        assert time.time() < deadline and all(p.poll() is None for p in procs), "the job did not start training"
        time.sleep(0.05)
    workers = child_pids(procs[1].pid)
    assert len(workers) == 1, workers
    return run_dir, procs, workers[0]


def _cleanup(procs, worker1: int) -> None:
    for pid in (worker1, *(p.pid for p in procs)):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()


def _newest_intact(run_dir: Path) -> None:
    found = list_checkpoints(str(run_dir / "checkpoints"))
    assert found and verify_files(found[0][1]) == [], found


def _signal_rank1(corpus, tmp_path, sig, hold_after=None, extra=()):
    """Two nodes training; `sig` to rank 1; (run_dir, procs, node 0's output, seconds until node 0 ended, rank 1's
    pid). Node 0 not ending within 60 s fails the test."""
    run_dir, procs, worker1 = _two_nodes(corpus, tmp_path, hold_after, extra)
    try:
        os.kill(worker1, sig)
        t0 = time.time()
        try:
            out0, _ = procs[0].communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("node 0 still runs 60 s after rank 1 was signalled: nothing ended rank 0")
        took = time.time() - t0
    finally:
        _cleanup(procs, worker1)
    return run_dir, procs, out0, took, worker1


@pytest.mark.slow
def test_sigkill_of_rank1_ends_the_other_node_naming_it(tiny_corpus, tmp_path):
    """Rank 0 is held after step 5 outside any collective (sleeping in its training thread: no gloo call can fail
    there); rank 1 is SIGKILLed. Only the watchdog can end rank 0: its own line names rank 1 with the killed pid,
    rank 0 exits with status 3 (EXIT_PEER) and node 0's launcher reports that status and exits with it."""
    run_dir, procs, out0, took, killed = _signal_rank1(tiny_corpus, tmp_path, signal.SIGKILL, hold_after=5)
    log0 = (tmp_path / "log0" / "workerlog.0").read_text(errors="replace")
    assert (tmp_path / "held").read_text() == "5"
    assert re.search(rf"\[llmtrain watchdog\] rank 1 \(host \S+, pid {killed}, last completed step \w+\) is gone: "
                     r"its process no longer runs; stopping rank 0", log0), log0[-3000:]
    assert "[llmtrain watchdog] rank 0 exits with status 3" in log0, log0[-3000:]
    assert re.search(r"Container rank 0 status failed .* code 3 ", out0) and procs[0].returncode == 3, \
        (procs[0].returncode, out0[-3000:])
    print(f"node 0 ended {took:.1f} s after rank 1 was killed, by the watchdog, status {procs[0].returncode}")
    assert took < 30
    _newest_intact(run_dir)


@pytest.mark.slow
def test_sigstop_of_rank1_fires_the_hang_watchdog_with_stacks(tiny_corpus, tmp_path):
    # the peer rule's timeout well under gloo's own ~30 s: when rank 0 waits inside a save (the hang clock paused),
    # the watchdog's peer rule, not gloo's TIMEOUT, must end it (seen in CI with the default 30 s: gloo won)
    run_dir, procs, out0, took, _ = _signal_rank1(tiny_corpus, tmp_path, signal.SIGSTOP,
                                                  extra=(f"train.peer_timeout_s={PEER_S}",))
    assert procs[0].returncode != 0, out0[-3000:]
    log0 = (tmp_path / "log0" / "workerlog.0").read_text(errors="replace")
    # the hang watchdog fires (status 4) — or, when rank 0 was itself waiting for rank 1's shard inside a
    # checkpoint save (the hang clock is paused there), the dead-peer rule does (status 3): seen under load
    hang = "rank 0: no step completed for" in log0 and f"train.hang_timeout_s={HANG_S}" in log0
    # (inside the save: Checkpointer.save, or the trainer's _save before it, e.g. the exact token count's all-reduce)
    peer = "rank 1 (host" in log0 and "stopped responding: no heartbeat for" in log0 and \
        re.search(r"line \d+ in _?save\b", log0) is not None
    assert hang or peer, log0[-3000:]
    assert "Current thread" in log0 or "Thread 0x" in log0, log0[-3000:]  # faulthandler's stack dump
    assert "in _loop" in log0 and f"exits with status {4 if hang else 3}" in log0, log0[-3000:]
    print(f"node 0 ended {took:.1f} s after rank 1 was stopped, status {procs[0].returncode}")
    assert HANG_S - 2 < took < 60
    _newest_intact(run_dir)


def test_peer_checks_from_heartbeat_files(tmp_path, monkeypatch):
    """The dead-peer rules, in-process: a gone pid on this host, a failed state, a beat that stops changing,
    an earlier run's file (another job id) ignored until the peer timeout."""
    import json
    import socket
    from types import SimpleNamespace

    from llmtrain.train.watchdog import Watchdog

    wd = Watchdog(str(tmp_path), SimpleNamespace(rank=0, world=2), hang_timeout_s=100, peer_timeout_s=5)
    wd.job, wd._started = 7, 0.0
    (tmp_path / "heartbeat").mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()

    def peer(**kw):
        info = {"job": 7, "rank": 1, "host": socket.gethostname(), "pid": os.getpid(), "beat": 1, "step": 4,
                "state": "running"} | kw
        (tmp_path / "heartbeat" / "rank_00001.json").write_text(json.dumps(info))

    peer(job=6)  # an earlier run's file: not a live peer, and only an error after the peer timeout
    assert wd._peer_problem(1, now=1.0) is None
    assert "never wrote a heartbeat" in wd._peer_problem(1, now=6.0)
    peer()
    assert wd._peer_problem(1, now=10.0) is None
    assert wd._peer_problem(1, now=14.0) is None
    assert "rank 1 (host" in wd._peer_problem(1, now=16.0) and "no heartbeat for 6 s" in wd._peer_problem(1, now=16.0)
    peer(beat=2)
    assert wd._peer_problem(1, now=17.0) is None
    peer(pid=gone.pid)
    assert "last completed step 4) is gone: its process no longer runs" in wd._peer_problem(1, now=18.0)
    # a peer that wrote "done" and exited between our read of its file and the pid check finished: no problem
    # (seen in a 2-process run whose rank 1 ended while rank 0 was still drawing the loss curve)
    from llmtrain.train import watchdog

    real_running = watchdog._pid_running

    def finished_meanwhile(pid):
        peer(pid=gone.pid, state="done", step=5, beat=3)
        return real_running(pid)

    monkeypatch.setattr(watchdog, "_pid_running", finished_meanwhile)
    assert wd._peer_problem(1, now=19.0) is None
    monkeypatch.undo()
    peer(state="failed", host="elsewhere")
    assert wd._peer_problem(1, now=18.0).endswith("failed")
    peer(state="done", host="elsewhere", beat=2)
    assert wd._peer_problem(1, now=100.0) is None
