"""ZeRO stages 2 and 3 (Paddle's group-sharded classes) on 2 CPU processes vs. one process.

Run: pytest tests/paddle_compat/test_cpu_zero.py   (~15 s on 2 cores)

tests/paddle_compat/cpu_scripts/zero_worker.py wraps common.WideMLP and Adam with
global-norm clipping (active: clip 0.3 < grad norm) in GroupShardedOptimizerStage2 +
GroupShardedStage2 built without a device argument (stage 2), or with
paddle.distributed.sharding.group_sharded_parallel(level="p_g_os", segment_size=0)
(stage 3, every parameter sliced). Losses and full parameters after training
must equal the single-process run (fp32, atol 1e-5), and each rank must hold about half
of the single-process optimizer state (stage 2 exactly partitions it). Both stages run in one
launch (the worker trains them one after another in the same two processes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "cpu_scripts"))
import common  # noqa: E402
from launching import run_workers  # noqa: E402

ATOL = 1e-5


LAYOUTS = ("zero2", "zero3")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every rank's results of both stages, from one launch on 2 processes."""
    assert {common.ZERO_LAYOUTS[name]["sharding"] for name in LAYOUTS} == {2}
    return run_workers("zero_worker.py", [",".join(LAYOUTS)], 2, tmp_path_factory.mktemp("zero"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_group_sharded_matches_single_process(layout, launched):
    spec = common.ZERO_LAYOUTS[layout]
    ref = common.zero_reference_run(spec["sharding"])
    prefix = f"{layout}/"
    results = {rank: {k[len(prefix):]: v for k, v in got.items() if k.startswith(prefix)}
               for rank, got in launched.items()}
    assert all(results.values()), f"{layout}: no results in the launch"

    for step in range(common.ZERO_STEPS):
        mean = np.mean([float(got[f"loss/{step}"]) for got in results.values()])
        assert abs(mean - float(ref[f"loss/{step}"])) <= ATOL, f"{layout} step {step}"
    total = int(ref["optimizer_state_bytes"])
    per_rank = []
    for rank, got in results.items():
        for key in (k for k in got if k.startswith("param/")):
            np.testing.assert_allclose(got[key], ref[key], rtol=0, atol=ATOL, err_msg=f"{layout} rank {rank} {key}")
        per_rank.append(int(got["optimizer_state_bytes"]))
        # stage 3 pads each slice to a 4096-byte boundary, hence not exactly 1/2
        assert 0.45 * total <= per_rank[-1] <= 0.55 * total, (layout, rank, per_rank[-1], total)
    if layout == "zero2":
        assert sum(per_rank) == total
