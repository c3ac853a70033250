"""Relaunch a training job a bounded number of times, resuming from the newest complete checkpoint.

    python scripts/supervise.py --max-restarts 3 -- \\
        python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py +parallel=dp2 checkpoint.interval=100

Run one supervisor per node, each around that node's launcher (same command, same fixed
`--master HOST:PORT` for several nodes). When the launcher exits non-zero (a rank died:
Paddle's launcher stops the node's other ranks and exits with the first failure; on the
other nodes llmtrain's watchdog ends the ranks within train.peer_timeout_s), the supervisor
waits `--delay` seconds and starts the same command again with `checkpoint.resume=auto`
appended (unless the command already says so), so the job continues from the newest complete
checkpoint (`<run.dir>/checkpoints`; an interrupted save is ignored); a `run.overwrite=true` of the command applies to
the first attempt only (a relaunch must not move the run it continues aside). Status 5 (the divergence guard stopped the run,
docs/divergence.md) is not relaunched: a resume would start from the same newest healthy checkpoint; nor is status 2
(a configuration error, found before any work: the same command fails the same way). It stops after
`--max-restarts` relaunches and exits with the last status; exit 0 ends it at once.
SIGTERM / SIGINT to the supervisor go to the launcher (which forwards them: the ranks finish
their step, save and exit 0) and no relaunch follows. Each attempt sees LLMTRAIN_ATTEMPT=<n>.

Paddle's own restart (`paddle.distributed.launch --master etcd://HOST:PORT --max_restart N
--elastic_level 1`, docs/long-runs.md) needs an etcd server and the etcd3 client; this script
is the path without them: it needs nothing but the launcher and a shared filesystem.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


EXIT_DIVERGED = 5
"""The status of a run the divergence guard stopped (`llmtrain.train.anomaly.EXIT_DIVERGED`): never relaunched."""
EXIT_CONFIG = 2
"""The status of a refused configuration (`llmtrain.errors.ConfigError`, also argparse's usage errors): never
relaunched."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="supervise.py [--max-restarts N] [--delay S] -- COMMAND ...")
    ap.add_argument("--max-restarts", type=int, default=3, help="relaunches after the first attempt (default 3)")
    ap.add_argument("--delay", type=float, default=5.0, help="seconds between a failure and the relaunch (default 5)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the launch command, after --")
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command given: supervise.py [options] -- python -m paddle.distributed.launch ...")
    if args.max_restarts < 0:
        ap.error(f"--max-restarts={args.max_restarts}: must be >= 0")
    resume = [a for a in cmd if a.startswith("checkpoint.resume=")]
    if resume and resume[-1] != "checkpoint.resume=auto":
        ap.error(f"{resume[-1]}: a relaunch must resume from the newest checkpoint (checkpoint.resume=auto)")
    if not resume:
        cmd = cmd + ["checkpoint.resume=auto"]

    child: list[subprocess.Popen] = []
    stopping: list[int] = []

    def forward(signum, frame):
        stopping.append(signum)
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = 1
    for attempt in range(args.max_restarts + 1):
        print(f"[supervise] attempt {attempt + 1} of {args.max_restarts + 1}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        child[:] = [subprocess.Popen(cmd, env=dict(os.environ, LLMTRAIN_ATTEMPT=str(attempt)))]
        code = child[0].wait()
        if code == 0:
            print(f"[supervise] the job finished (attempt {attempt + 1})", file=sys.stderr, flush=True)
            return 0
        if code == EXIT_DIVERGED:
            print(f"[supervise] the divergence guard stopped the job (status {code}): no relaunch (it would resume "
                  f"from the newest healthy checkpoint and diverge again); fix the cause first", file=sys.stderr, flush=True)
            return code
        if code == EXIT_CONFIG:
            print(f"[supervise] the job refused its configuration (status {code}, the message above): no relaunch "
                  "(the same command fails the same way); fix the command first", file=sys.stderr, flush=True)
            return code
        if stopping:
            print(f"[supervise] stopped by {signal.Signals(stopping[0]).name}; status {code}; no relaunch",
                  file=sys.stderr, flush=True)
            return code if code > 0 else 128 - code
        print(f"[supervise] attempt {attempt + 1} failed with status {code}", file=sys.stderr, flush=True)
        if attempt < args.max_restarts:
            time.sleep(args.delay)
            if stopping:
                return 128 + stopping[0]
            # a relaunch continues the run the first attempt started: run.overwrite=true would move it aside
            cmd = [a for a in cmd if not a.startswith(("run.overwrite=", "+run.overwrite="))]
    print(f"[supervise] giving up after {args.max_restarts} relaunches; last status {code}", file=sys.stderr, flush=True)
    return code if code > 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
