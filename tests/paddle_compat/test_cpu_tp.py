"""Tensor parallel, data parallel and sharding stage 1 on CPU vs. one process.

Run: pytest tests/paddle_compat/test_cpu_tp.py   (~20 s on 2 cores)

Each case launches tests/paddle_compat/cpu_scripts/hybrid_worker.py under
`paddle.distributed.launch` (gloo, llmtrain.paddle_compat.cpu_backend installed) and compares
every rank's losses, per-token losses (ParallelCrossEntropy with ignore_index), step-0
gradients (tp2), parameter shards after training and optimizer-state bytes with a
single-process run of the same network, weights and data (fp32, atol 1e-5). sharding2, dp2tp2 and
sharding2tp2 (defined in cpu_scripts/common.py) run through the real trainer in tests/parallel/test_parity.py
(sharding2, dp2tp2, tp2sharding2) and are not launched a second time here.
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


def assert_close(what: str, got: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=0, atol=ATOL, err_msg=what)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, nproc",
    [("tp2", 2), ("sharding2dp2", 4)],
)
def test_layout_matches_single_process(layout, nproc, tmp_path):
    spec = common.HYBRID_LAYOUTS[layout]
    shards = spec["dp"] * spec["sharding"]
    ids, labels = common.tp_batch()
    ref = common.tp_reference_run(common.tp_full_weights(), ids, labels, shards, spec["opt"])
    results = run_workers("hybrid_worker.py", [layout], nproc, tmp_path)

    shard_losses: dict[int, dict[int, float]] = {}
    state_bytes: dict[tuple[int, int], int] = {}  # (dp, mp) -> summed over sharding ranks
    for rank, got in results.items():
        dp_rank, mp_rank, sharding_rank, shard = (int(v) for v in got["coord/dp_mp_sharding_shard"])
        where = f"{layout} rank {rank} (dp {dp_rank}, mp {mp_rank}, sharding {sharding_rank})"
        for step in range(common.TP_STEPS):
            # mp rank 1 was fed zeros: TensorParallel must have broadcast the real batch
            np.testing.assert_array_equal(got[f"labels_seen/{step}"], common.dp_slice(labels, shard, shards))
            assert_close(f"{where} per-token loss step {step}", got[f"per_token/{step}"],
                         common.dp_slice(ref[f"per_token/{step}"], shard, shards))
            previous = shard_losses.setdefault(step, {}).setdefault(shard, float(got[f"loss/{step}"]))
            assert abs(previous - float(got[f"loss/{step}"])) <= ATOL, f"{where}: ranks of one shard disagree"
        for name, axis in common.TP_SPLIT_AXIS.items():
            expected = common.shard(ref[f"param/{name}"], axis, mp_rank, spec["mp"])
            assert_close(f"{where} param {name}", got[f"param/{name}"], expected)
            if shards == 1:  # gradients before any data-parallel reduction are comparable
                assert_close(f"{where} grad {name}", got[f"grad/{name}"],
                             common.shard(ref[f"grad/{name}"], axis, mp_rank, spec["mp"]))
        if spec["sharding"] > 1:
            # stage 1 keeps optimizer state only for this rank's share of its tp shard
            mine = int(got["optimizer_state_bytes"])
            assert 0 < mine <= 0.6 * int(ref["optimizer_state_bytes"]) / spec["mp"], where
            state_bytes[dp_rank, mp_rank] = state_bytes.get((dp_rank, mp_rank), 0) + mine
    if spec["sharding"] > 1 and spec["mp"] == 1:
        # the sharding ranks' states are a partition of the single-process state
        assert set(state_bytes.values()) == {int(ref["optimizer_state_bytes"])}, state_bytes
    for step in range(common.TP_STEPS):
        mean = np.mean(list(shard_losses[step].values()))
        assert abs(mean - float(ref[f"loss/{step}"])) <= ATOL, f"{layout} step {step}: {mean} vs {ref[f'loss/{step}']}"
