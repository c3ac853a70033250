"""Two "nodes" on 127.0.0.1 (issue 3, item 10): dp2 as 2 x 1 process equals 1 x 2 processes.

Run: pytest tests/paddle_compat/test_cpu_multinode.py   (~15 s on 2 cores)

Node 0 and node 1 are started with scripts/launch_multinode.sh (--master 127.0.0.1:PORT
--nnodes 2 --rank {0,1} --nproc-per-node 1); the same worker
(tests/paddle_compat/cpu_scripts/hybrid_worker.py dp2) then runs once as one node with
two processes. Global ranks, per-rank losses and final parameters must agree, and match
the single-process reference.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "cpu_scripts"))
import common  # noqa: E402
from launching import REPO_ROOT, SCRIPTS_DIR, check_finished, free_port, load_results, run_workers, worker_env  # noqa: E402

ATOL = 1e-5


def run_two_nodes(workdir: Path) -> dict[int, dict[str, np.ndarray]]:
    out_dir = workdir / "out"
    out_dir.mkdir(parents=True)
    master = f"127.0.0.1:{free_port()}"
    procs = []
    for node in (0, 1):
        log_dir = workdir / f"node{node}"
        cmd = [
            "bash", str(REPO_ROOT / "scripts" / "launch_multinode.sh"),
            "--master", master, "--nnodes", "2", "--rank", str(node), "--nproc-per-node", "1",
            "--log-dir", str(log_dir), str(SCRIPTS_DIR / "hybrid_worker.py"), "dp2", str(out_dir),
        ]
        env = {**worker_env(), "PYTHON": sys.executable}  # each node's launcher its own worker ports
        procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), log_dir))
    check_finished(procs, "two-node dp2")
    return load_results(out_dir)


@pytest.mark.slow
def test_two_nodes_match_one_node(tmp_path):
    two_nodes = run_two_nodes(tmp_path / "two_nodes")
    one_node = run_workers("hybrid_worker.py", ["dp2"], 2, tmp_path / "one_node")
    assert sorted(two_nodes) == [0, 1]
    ids, labels = common.tp_batch()
    ref = common.tp_reference_run(common.tp_full_weights(), ids, labels, 2, "adam")
    for rank in (0, 1):
        # node r runs global rank r, which takes data shard r, exactly as on one node
        np.testing.assert_array_equal(two_nodes[rank]["coord/dp_mp_sharding_shard"], [rank, 0, 0, rank])
        for key, value in one_node[rank].items():
            np.testing.assert_allclose(two_nodes[rank][key], value, rtol=0, atol=ATOL, err_msg=f"rank {rank} {key}")
    for step in range(common.TP_STEPS):
        mean = np.mean([float(two_nodes[r][f"loss/{step}"]) for r in (0, 1)])
        assert abs(mean - float(ref[f"loss/{step}"])) <= ATOL
    for name in common.TP_SPLIT_AXIS:
        np.testing.assert_allclose(two_nodes[0][f"param/{name}"], ref[f"param/{name}"], rtol=0, atol=ATOL)
