"""Run one worker command and record how it ended (the status its parent would see).

    python -m paddle.distributed.launch --nproc_per_node 2 tests/e2e/exit_status.py OUT_DIR tests/e2e/multirun_worker.py RUNS.json

Starts `python ARGS...` as a child with this process's environment (the launcher's
PADDLE_* variables) and process group, waits for it, writes its return code to
OUT_DIR/exit.<rank> (negative: killed by that signal, as `subprocess` reports it) and
exits with the same status. Paddle's launcher signals a worker's whole process group;
a SIGTERM or SIGINT that reaches this process is passed on to the child and has no
other effect here. Used by tests that must know each worker's exit status, which the
launcher does not report when it is itself stopped by a signal.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys


def main(out_dir: str, args: list[str]) -> int:
    child = subprocess.Popen([sys.executable, *args])

    def forward(signum, frame):
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = child.wait()
    rank = os.environ.get("PADDLE_TRAINER_ID", "0")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"exit.{rank}.part"), "w") as f:
        f.write(f"{code}\n")
    os.replace(os.path.join(out_dir, f"exit.{rank}.part"), os.path.join(out_dir, f"exit.{rank}"))
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
