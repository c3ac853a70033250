"""Pipeline parallel on CPU (1F1B with tied embeddings, interleaved with overlapped p2p) vs. one process.

Run: pytest tests/paddle_compat/test_cpu_pp.py   (~20 s on 2 cores)

Each case launches tests/paddle_compat/cpu_scripts/pp_worker.py (fleet PipelineLayer +
PipelineParallel / PipelineParallelWithInterleave, llmtrain.paddle_compat.cpu_backend
installed) and compares the losses train_batch returns and every block's parameters
after training with common.Block run in sequence on one process (fp32, atol 1e-5).
"pp2" also checks eval_batch and a SharedLayerDesc-tied embedding (grads of the two
copies are summed across stages, so both copies must equal the single table);
"pp4_vpp_overlap" runs the interleaved schedule with overlap_p2p_comm (unbatched p2p) on 4 processes.
The stand-ins under dp2pp2, tp2pp2 and pp4 x 2 virtual stages (and pp4_vpp, dp2pp2, tp2pp2 of
cpu_scripts/common.py without overlap) are exercised through the real trainer by
tests/parallel/test_parity.py, so they are not launched a second time here.
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


def scalar(value) -> float:
    return float(np.asarray(value).reshape(-1)[0])  # train_batch returns shape [1]


def assert_close(what: str, got, expected) -> None:
    np.testing.assert_allclose(np.asarray(got).reshape(np.shape(expected)), expected, rtol=0, atol=ATOL, err_msg=what)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, nproc", [("pp2", 2), ("pp4_vpp_overlap", 4)]
)
def test_pipeline_matches_single_process(layout, nproc, tmp_path):
    spec = common.PP_LAYOUTS[layout]
    eval_batch = common.pp_eval_batch(spec) if spec["tied"] else None
    ref = common.pp_reference_run(spec["blocks"], common.pp_global_batches(spec), common.PP_LR, eval_batch)
    results = run_workers("pp_worker.py", [layout], nproc, tmp_path)

    dp_losses: dict[int, dict[str, float]] = {}
    blocks_held: dict[tuple[int, int], list[int]] = {}  # (dp, mp) -> block indices over stages
    for rank, got in results.items():
        dp_rank, mp_rank, stage = (int(v) for v in got["coord/dp_mp_stage"])
        where = f"{layout} rank {rank} (dp {dp_rank}, mp {mp_rank}, stage {stage})"
        for step in range(spec["steps"]):
            loss = scalar(got[f"loss/{step}"])  # train_batch broadcasts it to every stage
            first = dp_losses.setdefault(dp_rank, {}).setdefault(f"loss/{step}", loss)
            assert abs(first - loss) <= ATOL, f"{where}: stages disagree on the loss"
        mine = sorted({int(k.split("/")[0][5:]) for k in got if k.startswith("block")})
        if spec["virtual"] > 1:  # chunk c of stage s holds segment c * pp + s
            assert mine == [stage + c * spec["pp"] for c in range(spec["virtual"])], (where, mine)
        blocks_held.setdefault((dp_rank, mp_rank), []).extend(mine)
        for key in (k for k in got if k.startswith("block")):
            axis = common.BLOCK_SPLIT_AXIS[key.split("/")[1]]
            assert_close(f"{where} {key}", got[key], common.shard(ref[key], axis, mp_rank, spec["mp"]))
        if spec["tied"]:
            assert_close(f"{where} eval loss", got["eval/loss"], ref["eval/loss"])
    for coord, held in blocks_held.items():
        assert sorted(held) == list(range(spec["blocks"])), f"blocks of (dp, mp) {coord}: {held}"
    for step in range(spec["steps"]):  # data parallel: the mean of the dp ranks' losses
        mean = np.mean([losses[f"loss/{step}"] for losses in dp_losses.values()])
        assert abs(mean - scalar(ref[f"loss/{step}"])) <= ATOL, f"{layout} step {step}"

    if spec.get("also_1f1b"):  # the same blocks through plain 1F1B first, with eval_batch
        ref_eval = common.pp_reference_run(
            spec["blocks"], common.pp_global_batches(spec), common.PP_LR, common.pp_eval_batch(spec)
        )
        for rank, got in results.items():
            stage = int(got["coord/dp_mp_stage"][2])
            held = sorted(int(k.split("/")[1][5:]) for k in got if k.startswith("1f1b/block") and k.endswith("up.weight"))
            per_stage = spec["blocks"] // spec["pp"]
            assert held == list(range(stage * per_stage, (stage + 1) * per_stage)), (rank, held)
            for key in (k for k in got if k.startswith("1f1b/")):
                assert_close(f"1F1B rank {rank} {key}", got[key], ref_eval[key[len("1f1b/"):]])

    if spec["tied"]:
        tied = common.tied_reference_run(spec["blocks"], common.tied_global_batches(spec), common.PP_LR)
        for rank, got in results.items():
            for step in range(spec["steps"]):
                assert_close(f"tied rank {rank} loss {step}", got[f"tied/loss/{step}"], tied[f"loss/{step}"])
            assert_close(f"tied rank {rank} table", got["tied/embedding"], tied["embedding"])
