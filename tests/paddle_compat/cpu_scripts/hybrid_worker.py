"""Worker for the non-pipeline layouts: tp2, dp2 x tp2, sharding stage 1 (alone, x dp2, x tp2).

Run (the tests do this; LAYOUT is a key of common.HYBRID_LAYOUTS):
    PYTHONPATH=<repo> python -m paddle.distributed.launch --nproc_per_node N \
        tests/paddle_compat/cpu_scripts/hybrid_worker.py LAYOUT OUT_DIR

Builds common.TPParallel (fleet's VocabParallelEmbedding, Column/RowParallelLinear with
and without gather/split, ParallelCrossEntropy with ignore_index), wraps it with
fleet.distributed_model and fleet.distributed_optimizer, trains common.TP_STEPS steps and
writes OUT_DIR/rank<r>.npz: this rank's losses and per-token losses, step-0 gradients,
final parameter shards, optimizer-state bytes and its (dp, mp, sharding) coordinates.
With mp > 1, tensor-parallel rank 1 is fed zeros: TensorParallel must broadcast rank 0's
batch to it (recorded as labels_seen).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import paddle
from paddle.distributed import fleet

import common
from llmtrain.paddle_compat import cpu_backend


def main(layout_name: str, out_dir: str) -> None:
    assert cpu_backend.install(), "CPU backend must install on a CPU device"
    layout = common.HYBRID_LAYOUTS[layout_name]
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": layout["dp"],
        "mp_degree": layout["mp"],
        "pp_degree": 1,
        "sharding_degree": layout["sharding"],
    }
    cpu_backend.check_strategy(strategy)
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    mp_rank = hcg.get_model_parallel_rank()
    dp_rank, sharding_rank = hcg.get_data_parallel_rank(), hcg.get_sharding_parallel_rank()

    model = fleet.distributed_model(common.TPParallel(common.tp_full_weights(), mp_rank, layout["mp"]))
    opt = fleet.distributed_optimizer(common.make_optimizer(layout["opt"], model.parameters()))

    shards = layout["dp"] * layout["sharding"]
    shard_index = dp_rank * layout["sharding"] + sharding_rank
    ids, labels = (common.dp_slice(a, shard_index, shards) for a in common.tp_batch())
    if mp_rank != 0:  # TensorParallel must overwrite these with mp rank 0's batch
        ids, labels = np.zeros_like(ids), np.zeros_like(labels)

    inner = model._layers if hasattr(model, "_layers") else model
    out: dict[str, np.ndarray] = {
        "coord/dp_mp_sharding_shard": np.array([dp_rank, mp_rank, sharding_rank, shard_index])
    }
    for step in range(common.TP_STEPS):
        ids_t, lab_t = paddle.to_tensor(ids), paddle.to_tensor(labels)
        per_token, loss = model(ids_t, lab_t)
        loss.backward()
        out[f"loss/{step}"] = loss.numpy()
        out[f"per_token/{step}"] = per_token.numpy()
        out[f"labels_seen/{step}"] = lab_t.numpy()
        if step == 0:
            for name, p in inner.named_parameters():
                out[f"grad/{name}"] = p.grad.numpy()
        opt.step()
        opt.clear_grad()
    for name, p in inner.named_parameters():
        out[f"param/{name}"] = p.numpy()
    out["optimizer_state_bytes"] = np.array(common.optimizer_state_bytes(opt))
    np.savez(os.path.join(out_dir, f"rank{paddle.distributed.get_rank()}.npz"), **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
