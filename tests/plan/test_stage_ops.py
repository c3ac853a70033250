"""A pipeline stage runs the planner's per-stage kernels: `python -m pytest tests/plan/test_stage_ops.py`.

The model's stage list is cut as the pipeline cuts it (`llmtrain.parallel.pipeline.stage_descs` with the chunk
markers of `pp_layers`, fleet's `SegmentLayers` with the same `seg_method` as `build_pipeline`), each stage's layers
are built from their `LayerDesc`s in this one process (the tied head as fleet builds it: `_tied_logits` over the
stage's own copy of the table) and one micro-batch runs through them: the first stage from the token ids, the others
from a hidden state [b, s, h]; the last ends in the pipeline's loss (`PipelineLoss`), the others' outputs get a
gradient. Per stage the forward GEMMs (shape), the backward GEMM count and the forward's memory-bound classes
(tests/plan/test_op_sequence.py's `CLASS_OF`) must be the planner's list for that stage: `MicroBatchSpec(first=,
last=, layers=, first_layer=)` with the blocks `llmtrain.parallel.pp_split.stage_blocks` gives it, what
`estimate.compute_estimate` prices every stage with. Splits: uneven, three stages (the MoE model's dense block alone with the embedding,
a middle stage of MoE blocks with neither end, one MoE block with the head), the tied GPT head on the last stage.
"""
from __future__ import annotations

import collections
import functools
import os
import sys

import paddle
import pytest

from llmtrain.config import compose_config, to_config
from llmtrain.models import model_stages
from llmtrain.models.roles import Roles
from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
from gemm_record import _Record  # noqa: E402
from test_op_sequence import FORWARD_GEMMS, GRAD_NODES, _classes, _operators, _planned_classes  # noqa: E402

CASES = {
    "moe-three": (["model=moe-tiny", "model.moe_capacity_factor=1.25"], [1, 2, 1]),
    "gpt-tied": (["model=gpt-tiny"], [3, 1]),
}
"""case -> (overrides, blocks per stage): 4-block models."""
B, S = 2, 16


def _stage_layers(cfg, pp_layers):
    """[[callable, ...] per stage]: the pipeline's cut of the model's stage list, each layer built from its desc."""
    from paddle.distributed.fleet.meta_parallel import SharedLayerDesc
    from paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers import SegmentLayers

    from llmtrain.parallel.pipeline import CHUNK_END, stage_descs

    roles = Roles()
    descs = stage_descs(model_stages(cfg, roles), roles, pp_layers=pp_layers)
    bounds = SegmentLayers(descs, len(pp_layers), f"layer:^{CHUNK_END}").do_segment()
    stages = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        run = []
        for d in descs[lo:hi]:
            layer = d.build_layer()
            fwd = getattr(d, "forward_func", None) if isinstance(d, SharedLayerDesc) else None
            run.append(functools.partial(fwd, layer) if fwd is not None else layer)
        stages.append(run)
    return stages


@pytest.mark.parametrize("case", list(CASES))
def test_a_stage_runs_its_planned_kernels(case, monkeypatch, tmp_path):
    from llmtrain.models.loss import LMLoss
    from llmtrain.parallel.pipeline import PipelineLoss
    from llmtrain.parallel.pp_split import stage_blocks

    monkeypatch.chdir(tmp_path)  # the profiler writes into the working directory
    overrides, pp_layers = CASES[case]
    cfg = to_config(compose_config(["model.vocab_size=256", "model.num_layers=4", *overrides])).model
    record = _Record(monkeypatch)
    paddle.seed(0)
    stages = _stage_layers(cfg, pp_layers)
    pp = len(pp_layers)
    assert len(stages) == pp
    loss_fn = PipelineLoss(LMLoss(Roles()))
    ids = paddle.randint(0, cfg.vocab_size, [B, S])
    for r, layers in enumerate(stages):
        first, last = r == 0, r == pp - 1
        x = ids if first else paddle.randn([B, S, cfg.hidden_size])
        if not first:
            x.stop_gradient = False

        def forward(x=x, layers=layers, last=last):
            for layer in layers:
                x = layer(x)
            return loss_fn(x, (ids, paddle.ones([B, S], "float32"))) if last else x

        record.shapes.clear()
        record.on = True
        out, fwd_ops = _operators(forward)
        executed_fwd = list(record.shapes)
        record.on = False
        grad = None if last else paddle.randn(out.shape)
        _, bwd_ops = _operators(lambda: out.backward(grad))

        blocks = stage_blocks(pp_layers, pp, r)
        planned = micro_batch_kernels(MicroBatchSpec(cfg, B, S, t=1, e=4, gpu=False, flash=False, math_core=False,
                                                     ce_core=False, layers=len(blocks), first=first, last=last,
                                                     first_layer=blocks[0]))
        where = f"{case}, stage {r} of {pp_layers}"
        ops = collections.Counter(fwd_ops)
        assert sum(ops[n] for n in FORWARD_GEMMS) == len(executed_fwd), where  # none unrecorded
        assert sorted(executed_fwd) == sorted(k.shape for k in planned.forward if k.kind == "gemm"), where
        bops = collections.Counter(bwd_ops)
        executed_bwd = 2 * sum(bops[n] for n in GRAD_NODES) + sum(bops[n] for n in FORWARD_GEMMS)
        assert executed_bwd == sum(k.kind == "gemm" for k in planned.backward), (where, bops)
        assert _classes(fwd_ops) == _planned_classes(planned.forward), where
