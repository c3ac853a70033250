"""Pipeline worker: fleet PipelineParallel / PipelineParallelWithInterleave on CPU.

Run (the tests do this; LAYOUT is a key of common.PP_LAYOUTS):
    PYTHONPATH=<repo> python -m paddle.distributed.launch --nproc_per_node N \
        tests/paddle_compat/cpu_scripts/pp_worker.py LAYOUT OUT_DIR

Builds a PipelineLayer of common.Block (Column/RowParallelLinear inside when mp > 1),
trains `steps` train_batch calls with SGD and writes OUT_DIR/rank<r>.npz: the loss
train_batch returned at every step, the parameters of the blocks this rank holds, and
for "pp2" also the eval_batch loss and a SharedLayerDesc-tied embedding model's losses
and both stages' copies of the tied table. Layouts with `also_1f1b` first train the same
blocks with the plain 1F1B schedule (keys prefixed "1f1b/", with eval_batch) and then
with the interleaved one, in one job.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import paddle
from paddle import nn
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, SharedLayerDesc

import common
from llmtrain.paddle_compat import cpu_backend


def init_fleet(layout: dict):
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": layout["dp"],
        "mp_degree": layout["mp"],
        "pp_degree": layout["pp"],
    }
    strategy.pipeline_configs = {"accumulate_steps": layout["acc"], "micro_batch_size": layout["mb"]}
    if layout.get("overlap"):
        strategy.hybrid_configs["pp_configs"].overlap_p2p_comm = True
    fleet.init(is_collective=True, strategy=strategy)
    return fleet.get_hybrid_communicate_group()


def block_descs(layout: dict, hcg) -> list:
    mp, mp_rank = hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank()
    return [LayerDesc(common.Block, i, mp, mp_rank) for i in range(layout["blocks"])]


def train(model, opt, batches, dp_rank, dp) -> list[np.ndarray]:
    losses = []
    for x, y in batches:
        data = [paddle.to_tensor(common.dp_slice(a, dp_rank, dp)) for a in (x, y)]
        losses.append(model.train_batch(data, optimizer=opt).numpy())
    return losses


def run_blocks(layout: dict, hcg, out: dict, virtual: int, prefix: str = "", evaluate: bool = False) -> None:
    """Train the Block pipeline; keys of `out` get `prefix` (several models in one job)."""
    kwargs = {}
    if virtual > 1:
        kwargs = dict(seg_method="layer:Block", num_virtual_pipeline_stages=virtual)
    pipe = PipelineLayer(
        layers=block_descs(layout, hcg), loss_fn=nn.MSELoss(), topology=hcg.topology(), **kwargs
    )
    model = fleet.distributed_model(pipe)
    opt = fleet.distributed_optimizer(paddle.optimizer.SGD(common.PP_LR, parameters=model.parameters()))
    dp_rank, dp = hcg.get_data_parallel_rank(), layout["dp"]
    for step, loss in enumerate(train(model, opt, common.pp_global_batches(layout), dp_rank, dp)):
        out[f"{prefix}loss/{step}"] = loss
    if evaluate:
        x, y = common.pp_eval_batch(layout)
        data = [paddle.to_tensor(common.dp_slice(a, dp_rank, dp)) for a in (x, y)]
        out[f"{prefix}eval/loss"] = model.eval_batch(data, compute_loss=True).numpy()
    out.update({prefix + k: v for k, v in common.block_params(pipe).items()})


def run_tied(layout: dict, hcg, out: dict) -> None:
    layers = [
        SharedLayerDesc("embed", common.TiedEmbedding, shared_weight_attr="weight"),
        *block_descs(layout, hcg),
        SharedLayerDesc(
            "embed", common.TiedEmbedding, forward_func=common.tied_logits, shared_weight_attr="weight"
        ),
    ]
    pipe = PipelineLayer(layers=layers, loss_fn=common.tied_ce, topology=hcg.topology())
    model = fleet.distributed_model(pipe)
    opt = fleet.distributed_optimizer(paddle.optimizer.SGD(common.PP_LR, parameters=model.parameters()))
    batches = common.tied_global_batches(layout)
    for step, loss in enumerate(train(model, opt, batches, hcg.get_data_parallel_rank(), layout["dp"])):
        out[f"tied/loss/{step}"] = loss
    tables = [p for name, p in pipe.named_parameters() if name.endswith("weight") and p.shape == [common.TIED_VOCAB, common.PP_HIDDEN]]
    assert len(tables) == 1, f"each stage holds exactly one copy of the tied table, got {len(tables)}"
    out["tied/embedding"] = tables[0].numpy()


def main(layout_name: str, out_dir: str) -> None:
    assert cpu_backend.install(), "CPU backend must install on a CPU device"
    layout = common.PP_LAYOUTS[layout_name]
    hcg = init_fleet(layout)
    out: dict[str, np.ndarray] = {
        "coord/dp_mp_stage": np.array(
            [hcg.get_data_parallel_rank(), hcg.get_model_parallel_rank(), hcg.get_stage_id()]
        )
    }
    if layout["virtual"] > 1 and layout.get("also_1f1b"):
        run_blocks(layout, hcg, out, virtual=1, prefix="1f1b/", evaluate=True)
    run_blocks(layout, hcg, out, virtual=layout["virtual"], evaluate=layout["tied"])
    if layout["tied"]:
        run_tied(layout, hcg, out)
    np.savez(os.path.join(out_dir, f"rank{paddle.distributed.get_rank()}.npz"), **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
