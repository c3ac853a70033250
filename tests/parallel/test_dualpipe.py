"""DualPipeV in one process: what the layout accepts and refuses, the V placement of chunks, fleet's segmentation of
the marked stage list into 2 x pp chunks, the split-weight-gradient linears, and the planner's bubble (the
launches that train it against one process are in tests/parallel/test_parity.py: pp2dpv, pp4dpv).

    python -m pytest tests/parallel/test_dualpipe.py -q
"""
from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import pytest

from llmtest import compose
from llmtrain.config import to_config
from llmtrain.models import model_stages
from llmtrain.models.config import ModelConfig
from llmtrain.parallel.config import ParallelConfig, layout_tag
from llmtrain.parallel.dualpipe import SplitWeightGradRoles
from llmtrain.parallel.layout import layout_problems, model_fit_problems
from llmtrain.parallel.pipeline import CHUNK_END, stage_descs
from llmtrain.parallel.pp_split import chunk_stage, describe_split, stage_blocks
from llmtrain.train.config import TrainConfig

MODEL = ModelConfig(name="m", hidden_size=64, num_layers=8, num_heads=4, ffn_hidden_size=128, vocab_size=256)


def _layout(micro=1, global_batch=16, **parallel):
    p = ParallelConfig(**parallel)
    layout, problems = layout_problems(p, TrainConfig(global_batch_size=global_batch, micro_batch_size=micro), p.world())
    return layout, problems + model_fit_problems(p, MODEL)


def test_dualpipev_layout_holds_two_chunks_per_stage():
    layout, problems = _layout(pp=4, pp_schedule="dualpipev")
    assert problems == [] and layout.virtual_pp == 2 and layout.v_shape
    assert layout_tag(ParallelConfig(pp=4, pp_schedule="dualpipev")) == "pp4dpv"
    _, problems = _layout(pp=2, pp_schedule="dualpipev", pp_layers=[3, 1, 2, 2])  # 2 x pp entries
    assert problems == []
    _, problems = _layout(pp=2, pp_schedule="dualpipev", pp_layers=[4, 4])
    assert any("2 entries" in p and "4 pipeline chunks" in p for p in problems), problems


@pytest.mark.parametrize("parallel,needle", [
    (dict(pp=1, pp_schedule="dualpipev"), "parallel.pp=1"),
    (dict(pp=2, pp_schedule="dualpipev", virtual_pp=3), "parallel.virtual_pp=3"),
    (dict(pp=2, tp=2, pp_schedule="dualpipev"), "parallel.tp=2"),
    (dict(pp=2, cp=2, pp_schedule="dualpipev"), "parallel.cp=2"),
    (dict(pp=2, dp=2, pp_schedule="dualpipev", dp_comm_overlap=True), "parallel.dp_comm_overlap=true"),
    (dict(pp=2, sharding=2, pp_schedule="dualpipev", sharding_split_param=True), "parallel.sharding_split_param=true"),
    (dict(pp=2, pp_schedule="zb"), "parallel.pp_schedule='zb'"),
])
def test_dualpipev_refusals_name_the_fields(parallel, needle):
    _, problems = _layout(**parallel)
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize("parallel", [dict(dp=2), dict(sharding=2), dict(dp=2, ep=2), dict(sharding=2, ep=2)],
                         ids=["dp2", "sharding2", "dp2ep2", "sharding2ep2"])
def test_dualpipev_composes_with_data_sharding_and_expert_axes(parallel):
    """dp, stage-1 sharding and ep beside the V (launched against one process: dp2pp2dpv, sharding2pp2dpv)."""
    p = ParallelConfig(pp=2, pp_schedule="dualpipev", **parallel)
    moe = dataclasses.replace(MODEL, moe_num_experts=4)
    layout, problems = layout_problems(p, TrainConfig(global_batch_size=16, micro_batch_size=1), p.world())
    assert problems == [] and layout.v_shape and model_fit_problems(p, moe) == [], problems


def test_dualpipev_needs_twice_pp_micro_batches_and_blocks():
    _, problems = _layout(micro=2, pp=4, pp_schedule="dualpipev")  # 16 / 2 = 8 micro-batches: enough
    assert problems == []
    _, problems = _layout(micro=4, pp=4, pp_schedule="dualpipev")  # 4 < 8
    assert any("train.grad_accum=4" in p and ">= 8" in p for p in problems), problems
    p = ParallelConfig(pp=8, pp_schedule="dualpipev")
    assert any("16 pipeline chunks" in x for x in model_fit_problems(p, MODEL))  # 8 blocks < 2 x 8 chunks


def test_packed_documents_and_moe_are_accepted_under_dualpipev():
    """Models and data are not restricted under DualPipeV: MoE and packed documents (position and document ids carried
    beside the hidden states: trained against one process in tests/parallel/test_parity.py, pp4dpv's `llama_docs`)."""
    cfg = to_config(compose(["model=llama-tiny", "+parallel=pp2dpv", "data.document_mask=true",
                             "data.reset_position_ids=true", "train.global_batch_size=8", "train.micro_batch_size=1"]))
    layout, problems = layout_problems(cfg.parallel, cfg.train, 2)
    from llmtrain.data.loader import document_problems

    assert problems + document_problems(cfg.data, cfg.model) + model_fit_problems(cfg.parallel, cfg.model) == []
    assert layout.v_shape


def test_carried_ids_travel_whole_and_only_the_hidden_states_get_a_gradient():
    """`CarriedCommHelper` (llmtrain/paddle_compat/dualpipe.py) from a stage message of (hidden [2, 8, 16] fp32 needing
    a gradient, position ids [2, 8] int64, document ids [2, 8] int64): activations are received as three buffers with
    the ids' stop_gradient kept, gradients as the hidden states' one buffer, and a gradient send of anything else is
    refused. fleet's own helper posts three gradient buffers for the one gradient a stage sends (the hang it fixes)."""
    from paddle.distributed.fleet.meta_parallel.pp_utils.batch_comm_helper import BatchCommHelper
    from paddle.distributed.fleet.meta_parallel.pp_utils.utils import paddle_2_number

    from llmtrain.paddle_compat.dualpipe import _carried_comm_helper_class

    def with_message(helper):
        meta = helper._send_recv_meta  # as SendRecvMeta.recv_meta leaves it on a receiving stage
        meta.recv_shape_message = ([2, 8, 16], [2, 8], [2, 8])
        meta.recv_dtype_message = tuple(paddle_2_number(d) for d in (paddle.float32, paddle.int64, paddle.int64))
        meta.recv_stop_gradient = (False, True, True)
        return helper

    helper = with_message(_carried_comm_helper_class()())
    acts = helper._build_from_meta()
    assert [(t.shape, t.dtype, t.stop_gradient) for t in acts] == [
        ([2, 8, 16], paddle.float32, False), ([2, 8], paddle.int64, True), ([2, 8], paddle.int64, True)]
    helper._check_valid(acts)
    with helper.gradients():
        grads = helper._build_from_meta()
        assert [(t.shape, t.dtype) for t in grads] == [([2, 8, 16], paddle.float32)]
        helper._check_valid(grads)
        with pytest.raises(ValueError, match="gradient send"):
            helper._check_valid(acts)
    assert not helper.grads and len(helper._build_from_meta()) == 3
    assert len(with_message(BatchCommHelper())._build_from_meta()) == 3  # fleet's: gradients sized as activations


def test_the_v_places_chunk_i_and_its_mirror_on_one_stage():
    assert [chunk_stage(i, 4, 8, v_shape=True) for i in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [chunk_stage(i, 4, 8) for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    split = (2, 1, 1, 1, 1, 2)  # 8 blocks, pp3
    assert [stage_blocks(split, 3, s, v_shape=True) for s in range(3)] == [[0, 1, 6, 7], [2, 5], [3, 4]]
    assert describe_split(split, 3, v_shape=True) == \
        "stage 0: embedding + blocks 0-1, blocks 6-7 + head | stage 1: block 2, block 5 | stage 2: block 3, block 4"


@pytest.mark.parametrize("pp,split", [(2, (2, 2, 3, 1)), (4, (1,) * 8), (3, (2, 1, 1, 1, 1, 2))])
def test_fleet_cuts_the_marked_stages_into_the_v(pp, split):
    """fleet's DualPipeV segmentation (`_segment_network_for_dualpipev`: SegmentLayers into 2 x pp parts, stage s
    taking parts s and 2 pp - 1 - s) of our marked list gives each stage the blocks `stage_blocks` says, the
    embedding and head on stage 0, and the tied head as fleet's LocalSharedLayerDesc."""
    from paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers import LocalSharedLayerDesc, SegmentLayers

    cfg = ModelConfig(name="m", hidden_size=16, num_layers=sum(split), num_heads=2, ffn_hidden_size=32,
                      vocab_size=64, family="decoder", tie_embeddings=True)
    roles = SplitWeightGradRoles()
    descs = stage_descs(model_stages(cfg, roles), roles, pp_layers=split, local_shared=True)
    parts = SegmentLayers(descs, num_parts=2 * pp, method=f"layer:^{CHUNK_END}", num_virtual_pipeline_stage=1).do_segment()
    prefix = [getattr(d, "kwargs", {}).get("prefix") for d in descs]  # None: the list-unwrapping functions
    for s in range(pp):
        held = [p for i in (s, 2 * pp - 1 - s) for p in prefix[parts[i]:parts[i + 1]] if p]
        assert sorted(int(p.split(".")[1]) for p in held if p.startswith("layers.")) == stage_blocks(split, pp, s, True)
        assert ("embed" in held) == ("final_norm" in held) == (s == 0)
    head = descs[-1]  # the tied output projection: the embedding's table again, same prefix
    assert isinstance(head, LocalSharedLayerDesc) and head.kwargs["prefix"] == "embed" and parts[-1] == len(descs)


def test_split_weight_gradient_linear_defers_and_matches_nn_linear():
    """fleet's SplitBWLinear (what SplitWeightGradRoles builds) gives nn.Linear's gradients, the weight's later when
    WeightGradStore is enabled."""
    from paddle.distributed.fleet.meta_parallel.zero_bubble_utils import WeightGradStore

    paddle.seed(0)
    split = SplitWeightGradRoles().column_linear(8, 4, True)
    plain = paddle.nn.Linear(8, 4)
    plain.weight.set_value(split.weight), plain.bias.set_value(split.bias)
    x = paddle.randn([2, 3, 8])
    xs, xp = x.clone(), x.clone()
    xs.stop_gradient = xp.stop_gradient = False
    plain(xp).square().sum().backward()
    WeightGradStore.enabled = True
    try:
        split(xs).square().sum().backward()
    finally:
        WeightGradStore.enabled = False
    assert split.weight.grad is None  # deferred: queued, not computed
    WeightGradStore.flush()
    WeightGradStore.pop()
    np.testing.assert_allclose(split.weight.grad.numpy(), plain.weight.grad.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(xs.grad.numpy(), xp.grad.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(split.bias.grad.numpy(), plain.bias.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_planner_prices_the_dualpipev_bubble_below_1f1b():
    """Same model, pp and micro-batches: DualPipeV's bubble is 1F1B's times (F + 2B - 3W) / 2(F + B), between 1/3
    (all linears) and 5/6 (no weight split), and the step time drops."""
    from llmtrain.config import to_config
    from llmtrain.parallel.layout import resolve_layout
    from llmtrain.plan.dualpipe_bubble import dualpipe_bubble_factor, weight_grad_share
    from llmtrain.plan.estimate import time_estimate
    from llmtrain.plan.profile import load_profile
    from llmtest import compose

    cfg = to_config(compose(["model=llama-7b", "data.seq_len=4096", "+parallel=custom", "parallel.pp=4",
                             "train.global_batch_size=16", "train.micro_batch_size=1"]))
    dev = load_profile("h200")
    est = {}
    for sched in ("1f1b", "dualpipev"):
        layout = resolve_layout(ParallelConfig(pp=4, pp_schedule=sched), cfg.train, 4)
        est[sched] = time_estimate(cfg.model, layout, 4096, False, dev, 8)
    factor = dualpipe_bubble_factor(cfg.model, 4096)
    w = weight_grad_share(cfg.model, 4096)
    assert 1 / 3 < factor < 5 / 6 and 0 < w < 1 / 3
    # the V's stages are not 1F1B's (stage 0 holds embedding and head, 8 chunks balanced): within 5% of the ratio
    assert est["dualpipev"]["bubble_s"] == pytest.approx(est["1f1b"]["bubble_s"] * factor, rel=0.05)
    assert est["dualpipev"]["step_time_s"] < est["1f1b"]["step_time_s"]
