"""Pipeline plan: cut the model's ordered stage list into fleet `PipelineLayer` stages.

    pipe = build_pipeline(cfg.model, layout, roles, topo, recompute)
    model = fleet.distributed_model(pipe)          # -> PipelineParallel
    loss = model.train_batch([input_ids, (labels, loss_mask)], optimizer, lr_scheduler)

Each `StageSpec` becomes a `LayerDesc`, or a `SharedLayerDesc` for the tied
embedding (first stage: the `Embedding`; last stage: a `TiedHead` holding the
same word table). Blocks are divided evenly (`seg_method="layer:Block"`), the
embedding joins the first stage and the final norm + head the last. The
pipeline's micro-batches are the gradient-accumulation micro-batches
(`pipeline_configs.accumulate_steps` = train grad_accum).
"""
from __future__ import annotations

import paddle.distributed as dist

from llmtrain.models import model_stages
from llmtrain.models.decoder import LMLoss
from llmtrain.parallel.layout import Layout


def build_pipeline(model_cfg, layout: Layout, roles, topo, recompute: bool = False):
    """A `PipelineLayer` holding this rank's stage(s) of the model."""
    from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, SharedLayerDesc

    descs = []
    for spec in model_stages(model_cfg, roles, recompute):
        if spec.shared_key is not None:
            descs.append(
                SharedLayerDesc(
                    spec.shared_key, spec.layer_cls, forward_func=spec.forward_func,
                    shared_weight_attr="shared_weight", **spec.kwargs,
                )
            )
        else:
            descs.append(LayerDesc(spec.layer_cls, **spec.kwargs))
    extra = {}
    if layout.virtual_pp > 1:
        extra["num_virtual_pipeline_stages"] = layout.virtual_pp
    pipe = PipelineLayer(
        layers=descs,
        num_stages=layout.pp,
        topology=topo.hcg.topology(),
        loss_fn=LMLoss(roles),
        seg_method="layer:Block",
        **extra,
    )
    _mark_secondary_shared_copies(pipe)
    return pipe


def _mark_secondary_shared_copies(pipe) -> None:
    """Count a tied table once in the global gradient norm.

    fleet's `HybridParallelClipGrad` skips parameters with
    `is_firstly_shared=False`, but Paddle 3.3.1's `_synchronize_shared_weights`
    compares `param.name` with attribute names and so never sets it; the copy
    on every stage but the first of each shared group is marked here.
    """
    rank = dist.get_rank()
    for comm in getattr(pipe, "shared_comm", {}).values():
        if rank != min(comm["ranks"]):
            for attr in comm["weight_attr"]:
                getattr(comm["layer"], attr).is_firstly_shared = False
