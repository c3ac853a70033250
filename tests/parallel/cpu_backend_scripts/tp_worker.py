"""tp2 worker: fleet's tensor-parallel layers on CPU through the llmtrain CPU backend.

Run (the test does this):
    PYTHONPATH=<repo> python -m paddle.distributed.launch --nproc_per_node 2 \
        tests/parallel/cpu_backend_scripts/tp_worker.py OUT_DIR

Builds common.TPReference's network from VocabParallelEmbedding, ColumnParallelLinear
(gather_output False and True), RowParallelLinear (input_is_parallel True and False)
and ParallelCrossEntropy(ignore_index), wraps it with fleet.distributed_model (so
TensorParallel broadcasts the inputs: rank 1 is fed zeros and must receive rank 0's
batch), trains TP_STEPS SGD steps and writes OUT_DIR/rank<r>.npz with losses,
per-token losses, step-0 gradients and final parameters (this rank's shards).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import paddle
from paddle import nn
from paddle.distributed import fleet

import common
from llmtrain.parallel import cpu_backend


class TPParallel(nn.Layer):
    def __init__(self, weights, rank, nranks):
        super().__init__()
        mp = fleet.meta_parallel
        self.emb = mp.VocabParallelEmbedding(common.VOCAB, common.HIDDEN)
        self.up = mp.ColumnParallelLinear(common.HIDDEN, common.FFN, has_bias=True, gather_output=False)
        self.down = mp.RowParallelLinear(common.FFN, common.HIDDEN, has_bias=True, input_is_parallel=True)
        self.gather = mp.ColumnParallelLinear(common.HIDDEN, common.FFN, has_bias=True, gather_output=True)
        self.split = mp.RowParallelLinear(common.FFN, common.HIDDEN, has_bias=True, input_is_parallel=False)
        self.head = mp.ColumnParallelLinear(common.HIDDEN, common.VOCAB, has_bias=False, gather_output=False)
        self.ce = mp.ParallelCrossEntropy(ignore_index=common.IGNORE_INDEX)
        for name, p in self.named_parameters():
            p.set_value(common.shard(weights[name], common.TP_SPLIT_AXIS[name], rank, nranks))

    def forward(self, ids, labels):
        return common.tp_forward(self, ids, labels, self.ce)


def main(out_dir: str) -> None:
    assert cpu_backend.install(), "CPU backend must install on a CPU device"
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 2, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    rank, nranks = hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size()

    model = fleet.distributed_model(TPParallel(common.tp_full_weights(), rank, nranks))
    opt = fleet.distributed_optimizer(
        paddle.optimizer.SGD(learning_rate=common.TP_LR, parameters=model.parameters())
    )
    ids, labels = common.tp_batch()
    if rank != 0:  # TensorParallel must overwrite these with rank 0's batch
        ids, labels = np.zeros_like(ids), np.zeros_like(labels)

    out: dict[str, np.ndarray] = {}
    for step in range(common.TP_STEPS):
        ids_t, lab_t = paddle.to_tensor(ids), paddle.to_tensor(labels)
        per_token, loss = model(ids_t, lab_t)
        loss.backward()
        out[f"loss/{step}"] = loss.numpy()
        out[f"per_token/{step}"] = per_token.numpy()
        out[f"labels_seen/{step}"] = lab_t.numpy()
        if step == 0:
            for name, p in model._layers.named_parameters():
                out[f"grad/{name}"] = p.grad.numpy()
        opt.step()
        opt.clear_grad()
    for name, p in model._layers.named_parameters():
        out[f"param/{name}"] = p.numpy()
    np.savez(os.path.join(out_dir, f"rank{paddle.distributed.get_rank()}.npz"), **out)


if __name__ == "__main__":
    main(sys.argv[1])
