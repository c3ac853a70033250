"""Test-side helper: start worker scripts under `paddle.distributed.launch` and collect results.

Use (from tests/parallel/test_cpu_*.py):

    from launching import run_workers
    results = run_workers("pp_worker.py", ["pp2"], nproc=2, workdir=tmp_path)
    # -> {global_rank: {key: np.ndarray}} read from the workers' rank<r>.npz files

Every launch gets its own free master port (so concurrent test runs on one machine do
not collide), its own log directory, PYTHONPATH with the repository root, and one
OpenMP thread per worker (2-core CI machines run 4 workers). On a non-zero exit or a
timeout the AssertionError carries the tail of every worker's log.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from ports import free_port, launcher_port_range  # noqa: F401  (tests/ is on sys.path: tests/conftest.py)

SCRIPTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = SCRIPTS_DIR.parents[2]
LAUNCH_TIMEOUT_S = 240
LOG_TAIL_LINES = 60


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env["PORT_RANGE"] = launcher_port_range()  # this launch's workers bind ports no other job draws (tests/ports.py)
    return env


def worker_logs(log_dir: Path) -> str:
    """The last LOG_TAIL_LINES lines of every file the launcher wrote to `log_dir`."""
    parts = []
    for path in sorted(Path(log_dir).glob("*")):
        if path.is_file() and (path.name.startswith("workerlog") or path.suffix == ".log"):
            lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            parts.append(f"----- {path} (last {len(lines)} lines)\n" + "\n".join(lines))
    return "\n".join(parts) or f"(no logs in {log_dir})"


def launch_command(script: str, args: list[str], nproc: int, log_dir: Path, master: str,
                   nnodes: int = 1, node_rank: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "paddle.distributed.launch",
        "--master", master, "--nnodes", str(nnodes), "--rank", str(node_rank),
        "--nproc_per_node", str(nproc), "--log_dir", str(log_dir),
        str(SCRIPTS_DIR / script), *args,
    ]


def check_finished(procs: list[tuple[subprocess.Popen, Path]], what: str) -> None:
    """Wait for every launcher; raise AssertionError with worker logs if one failed."""
    failures = []
    for proc, log_dir in procs:
        try:
            out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            failures.append(f"timed out after {LAUNCH_TIMEOUT_S}s\n{out[-3000:]}\n{worker_logs(log_dir)}")
            continue
        if proc.returncode != 0:
            failures.append(f"exit code {proc.returncode}\n{out[-3000:]}\n{worker_logs(log_dir)}")
    if failures:
        raise AssertionError(f"{what} failed:\n" + "\n\n".join(failures))


def load_results(out_dir: Path) -> dict[int, dict[str, np.ndarray]]:
    results = {}
    for path in sorted(out_dir.glob("rank*.npz")):
        with np.load(path) as data:
            results[int(path.stem[4:])] = {k: data[k] for k in data.files}
    return results


def run_workers(script: str, args: list[str], nproc: int, workdir: Path) -> dict[int, dict[str, np.ndarray]]:
    """One single-node launch of `script args OUT_DIR` on `nproc` CPU processes."""
    out_dir, log_dir = workdir / "out", workdir / "log"
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = launch_command(script, [*args, str(out_dir)], nproc, log_dir, f"127.0.0.1:{free_port()}")
    proc = subprocess.Popen(cmd, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    check_finished([(proc, log_dir)], f"{script} {' '.join(args)} on {nproc} processes")
    results = load_results(out_dir)
    assert sorted(results) == list(range(nproc)), f"missing rank outputs in {out_dir}: {sorted(results)}"
    return results
