"""Test helper: run `llmtrain/pretrain.py` (or the multi-run worker) on N CPU processes.

    run_launch(["llmtrain/pretrain.py", "+parallel=dp2", ...], nproc=2, log_dir=tmp)

One free master port per launch, one OpenMP thread per worker, the repository on
PYTHONPATH; on failure the AssertionError carries the tail of every worker log.
`etcd_server(tmp)` runs a real etcd for Paddle's restarting launcher (`--master etcd://`).
`require_binary("promtool", "prometheus")`: the path of a system tool a test needs; missing, the test skips
saying which Debian package provides it, or under CI (CI=true) fails naming it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ports import free_port, launcher_port_range  # noqa: F401  (free_port is re-exported to the tests)

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 400


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), e.get("PYTHONPATH", "")) if p)
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("MKL_NUM_THREADS", "1")
    e.pop("PADDLE_TRAINERS_NUM", None)
    e["PORT_RANGE"] = launcher_port_range()  # this launch's workers bind ports no other job draws (tests/ports.py)
    return e


def path_without_ccache() -> str:
    """$PATH without any directory that holds a ccache binary (so Paddle's import would warn about it)."""
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in dirs if d and not os.path.exists(os.path.join(d, "ccache")))


def fault_env(**faults: str) -> dict:
    """`env()` with checkpoint faults injected into every process of the job (tests/faults/sitecustomize.py)."""
    e = env()
    e["PYTHONPATH"] = os.pathsep.join((str(REPO / "tests" / "faults"), e["PYTHONPATH"]))
    return e | faults


def logs(log_dir: Path, tail: int = 60) -> str:
    parts = []
    for p in sorted(Path(log_dir).glob("workerlog.*")):
        lines = p.read_text(errors="replace").splitlines()[-tail:]
        parts.append(f"----- {p}\n" + "\n".join(lines))
    return "\n".join(parts)


def launch_cmd(script_and_args: list[str], nproc: int, log_dir: Path, master: str | None = None,
               nnodes: int = 1, rank: int = 0) -> list[str]:
    if nproc == 0:  # plain single process, no launcher
        return [sys.executable, *script_and_args]
    return [
        sys.executable, "-m", "paddle.distributed.launch", "--master", master or f"127.0.0.1:{free_port()}",
        "--nnodes", str(nnodes), "--rank", str(rank), "--nproc_per_node", str(nproc), "--log_dir", str(log_dir),
        *script_and_args,
    ]


def run_launch(script_and_args: list[str], nproc: int, log_dir: Path, timeout: int = TIMEOUT_S,
               expect_ok: bool = True) -> subprocess.CompletedProcess:
    """Run to completion; nproc=0 runs the script directly (one process, no launcher)."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = launch_cmd(script_and_args, nproc, log_dir)
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs(log_dir)}"
        )
    return proc


def run_many(runs: list[list[str]], nproc: int, workdir: Path, entry: str = "pretrain") -> None:
    """Several override lists through tests/e2e/multirun_worker.py in one launch (entry: pretrain or finetune; a
    dict entry is passed as is, e.g. {"call": "tests/parallel/sp_activations.py:measure", "args": [dir]})."""
    spec = Path(workdir) / "runs.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps([r if isinstance(r, dict) else {"overrides": r, "entry": entry} for r in runs]))
    run_launch([str(REPO / "tests/e2e/multirun_worker.py"), str(spec)], nproc, Path(workdir) / "log")


def metrics(run_dir) -> list[dict]:
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc): the workers of a `paddle.distributed.launch`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def require_binary(name: str, package: str) -> str:
    """The path of `name` (a system tool from Debian's `package`). Missing: under CI (`CI=true`, set by .ci/run)
    the test fails naming the package, so CI never goes green with these tests unrun; locally it skips, saying so."""
    import pytest

    path = shutil.which(name)
    if path is not None:
        return path
    why = (f"the `{name}` binary is not on PATH: install Debian's `{package}` package (`apt-get install {package}`; "
           f"scripts/install_system_deps.sh, run by scripts/test.sh, does it when it can and printed why not)")
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true: {why}", pytrace=False)
    pytest.skip(f"{why}; skipped locally (with CI=true this fails)")


@contextlib.contextmanager
def etcd_server(tmp_path: Path):
    """A real etcd server (Debian's etcd-server) on free 127.0.0.1 ports with its data in tmp_path; yields HOST:PORT."""
    binary = require_binary("etcd", "etcd-server")
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    log = open(tmp_path / "etcd.log", "w")
    proc = subprocess.Popen([binary, "--name", "llmtrain-test", "--data-dir", str(tmp_path / "etcd-data"),
                             "--listen-client-urls", client, "--advertise-client-urls", client,
                             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                             "--initial-cluster", f"llmtrain-test={peer}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 30
        while True:
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "etcd.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        break
            except OSError:
                pass
            time.sleep(0.1)
        yield client.removeprefix("http://")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
