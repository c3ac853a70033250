"""install() contract of llmtrain.paddle_compat.cpu_backend: device gate, version pin, idempotence.

Run: pytest tests/paddle_compat/test_cpu_install.py   (~10 s)

The stand-ins are only installed in child processes here, so this test session's Paddle
stays untouched.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import paddle
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
from llmtrain.paddle_compat import cpu_backend  # noqa: E402
from llmtrain.paddle_compat.version import TESTED_PADDLE_VERSION, check_paddle_version  # noqa: E402


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT)},
    )


def test_install_is_a_noop_off_cpu(monkeypatch):
    before = (cpu_backend.is_installed(), list(cpu_backend.installed_patches()))
    monkeypatch.setattr(paddle, "get_device", lambda: "gpu:0")
    assert cpu_backend.install() is False
    assert (cpu_backend.is_installed(), list(cpu_backend.installed_patches())) == before


def test_version_check_names_both_versions():
    check_paddle_version(TESTED_PADDLE_VERSION)
    with pytest.raises(RuntimeError, match=r"3\.3\.1.*'3\.0\.0'"):
        check_paddle_version("3.0.0")


@pytest.fixture(scope="module")
def fresh_process():
    """(refusal part, install part, process) of one fresh process (one Paddle import for both tests below): first
    install() under a fake Paddle version (refused, nothing patched), then, the real version back, install() twice."""
    proc = run_python(
        "import paddle; real = paddle.__version__; paddle.__version__ = '3.0.0'\n"
        "from llmtrain.paddle_compat import cpu_backend\n"
        "try:\n    cpu_backend.install()\nexcept RuntimeError as e:\n"
        "    print('REFUSED', len(cpu_backend.installed_patches()), str(e).splitlines()[0])\n"
        "paddle.__version__ = real\n"
        "print('INSTALL', flush=True)\n"
        "assert cpu_backend.install() is True and cpu_backend.install() is True\n"
        "print('\\n'.join(cpu_backend.installed_patches()))\n"
    )
    refusal, _, install = proc.stdout.partition("INSTALL\n")
    return refusal, install, proc


def test_install_refuses_other_paddle_versions_before_patching(fresh_process):
    refusal, _, proc = fresh_process
    assert "REFUSED 0" in refusal, proc.stdout + proc.stderr
    assert TESTED_PADDLE_VERSION in refusal


def test_install_on_cpu_is_idempotent_and_lists_every_patch(fresh_process):
    _, install, proc = fresh_process
    assert proc.returncode == 0 and "INSTALL" in proc.stdout, proc.stdout + proc.stderr
    patched = install.split()
    assert len(patched) == len(set(patched))
    for expected in [
        "paddle.distributed.collective._new_process_group_impl",
        "paddle.distributed.fleet.layers.mpu.mp_ops._c_identity",
        "paddle.distributed.fleet.layers.mpu.mp_ops._c_concat",
        "paddle.distributed.fleet.layers.mpu.mp_ops._c_split",
        "paddle.distributed.fleet.layers.mpu.mp_ops._mp_allreduce",
        "paddle.distributed.fleet.layers.mpu.mp_ops._c_softmax_with_cross_entropy",
        "paddle.distributed.fleet.meta_parallel.tensor_parallel.broadcast_input_data",
        "paddle.distributed.parallel.ParallelEnv.device_id",
        "paddle.distributed.fleet.meta_parallel.pp_utils.p2p_communication._batched_p2p_ops",
        "paddle.distributed.fleet.meta_parallel.pp_utils.p2p_communication.SendRecvMeta.recv_meta",
        "paddle.distributed.fleet.meta_parallel.dualpipev.DualPipeVParallel._commit_and_wait_comm",
        "paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage3.GroupShardedStage3.__init__",
        "paddle.distributed.sharding.group_sharded_parallel",
    ]:
        assert expected in patched, f"{expected} not in {patched}"


def test_check_strategy_rejects_gpu_only_mp_async_allreduce():
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"mp_degree": 2, "mp_configs": {"mp_async_allreduce": True}}
    with pytest.raises(ValueError, match="mp_async_allreduce"):
        cpu_backend.check_strategy(strategy)
    strategy.hybrid_configs = {"mp_degree": 2, "mp_configs": {"mp_async_allreduce": False}}
    cpu_backend.check_strategy(strategy)


def test_check_strategy_accepts_dualpipev():
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"pp_degree": 2, "pp_configs": {"use_dualpipev": True}}
    cpu_backend.check_strategy(strategy)  # its p2p goes through the channels (cpu_backend.dualpipe_p2p)
