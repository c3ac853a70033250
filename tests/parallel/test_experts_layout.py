"""Expert parallelism: degrees checked up front with their numbers; the expert slices of init and checkpoints.

    python -m pytest tests/parallel/test_experts_layout.py -q
"""
from __future__ import annotations

import numpy as np
import paddle
import pytest

from llmtrain.models.config import ModelConfig
from llmtrain.models.experts import Experts
from llmtrain.parallel.config import ParallelConfig
from llmtrain.parallel.layout import ConfigError, check_model_fits, layout_problems, resolve_layout
from llmtrain.parallel.slicing import TensorSlices
from llmtrain.train.config import TrainConfig

MOE = ModelConfig(name="m", hidden_size=16, num_layers=2, num_heads=2, ffn_hidden_size=24, vocab_size=64,
                  activation="swiglu", bias=False, moe_num_experts=6, moe_top_k=2, moe_ffn_hidden_size=8)


def problems(parallel: ParallelConfig, world: int, model=MOE) -> str:
    layout, probs = layout_problems(parallel, TrainConfig(global_batch_size=8, micro_batch_size=None, grad_accum=None), world)
    from llmtrain.parallel.layout import model_fit_problems

    return "\n".join(probs + model_fit_problems(parallel, model))


def test_ep_is_carved_out_of_dp():
    lay = resolve_layout(ParallelConfig(dp=4, ep=2), TrainConfig(global_batch_size=8, micro_batch_size=None,
                                                                 grad_accum=None), 4)
    assert (lay.world, lay.ep, lay.data_parallel) == (4, 2, 4)  # no extra processes
    lay = resolve_layout(ParallelConfig(dp=2, tp=2, ep=2), TrainConfig(global_batch_size=8, micro_batch_size=None,
                                                                       grad_accum=None), 4)
    assert (lay.world, lay.ep, lay.tp) == (4, 2, 2)  # experts whole over tp, shared out over ep
    check_model_fits(lay, ModelConfig(**{**MOE.__dict__, "moe_num_experts": 8}))


@pytest.mark.parametrize("parallel,world,message", [
    (ParallelConfig(dp=3, ep=2), 3, "parallel.ep=2 does not divide the data-parallel ranks parallel.dp=3 x "
                                    "parallel.sharding=1 = 3: the routed experts are spread over ep of the data-parallel "
                                    "ranks of each (pp, cp, tp) coordinate; use parallel.ep in [3]"),
    (ParallelConfig(dp=1, pp=2, ep=2), 2, "parallel.dp=1 x parallel.sharding=1 = 1: the routed experts are spread over "
                                          "ep of the data-parallel ranks of each (pp, cp, tp) coordinate; add "
                                          "data-parallel ranks"),
    (ParallelConfig(sharding=4, ep=2), 4, "parallel.ep=2 with parallel.sharding=4: under sharding the experts' "
                                          "optimizer states"),
    (ParallelConfig(sharding=2, sharding_stage=2, ep=2), 2, "parallel.ep=2 with parallel.sharding_stage=2"),
    (ParallelConfig(dp=4, ep=4), 4, "model.moe_num_experts=6 is not divisible by parallel.ep=4"),
    (ParallelConfig(dp=2, ep=0), 2, "parallel.ep=0: must be >= 1"),
    (ParallelConfig(dp=2, ep=2, ep_dispatcher="nccl"), 2, "parallel.ep_dispatcher='nccl'"),
])
def test_bad_expert_layouts_name_their_numbers(parallel, world, message):
    assert message in problems(parallel, world)


def test_ep_composes_with_pp_and_zero1():
    """ep carved out of each stage's dp ranks, or equal to a ZeRO-1 sharding group; a pooled aux loss is refused
    under pp (each stage feeds its own layers' losses to the backward)."""
    train = TrainConfig(global_batch_size=8, micro_batch_size=None, grad_accum=None)
    for parallel in (ParallelConfig(dp=2, pp=2, ep=2), ParallelConfig(sharding=2, ep=2),
                     ParallelConfig(dp=2, sharding=2, ep=2), ParallelConfig(pp=2)):
        check_model_fits(resolve_layout(parallel, train, parallel.world()), MOE)
    pooled = ModelConfig(**{**MOE.__dict__, "moe_aux_loss_scope": "model"})
    assert "model.moe_aux_loss_scope='model' with parallel.pp=2" in problems(ParallelConfig(pp=2), 2, pooled)
    assert not problems(ParallelConfig(dp=2), 2, pooled)


def test_ep_needs_an_moe_model():
    dense = ModelConfig(**{**MOE.__dict__, "moe_num_experts": 0})
    assert "parallel.ep=2 with model.moe_num_experts=0" in problems(ParallelConfig(dp=2, ep=2), 2, dense)
    with pytest.raises(ConfigError, match="moe_top_k=7 > model.moe_num_experts=6"):
        check_model_fits(resolve_layout(None, TrainConfig(), 1), ModelConfig(**{**MOE.__dict__, "moe_top_k": 7}))


def test_expert_slices_cut_the_expert_axis_by_ep_rank():
    full = np.arange(6 * 16 * 8, dtype=np.float32).reshape(6, 16, 8)
    for rank in range(3):
        layer = Experts(MOE, num_local=2, first=2 * rank)
        s = TensorSlices(0, 1, rank, 3)
        assert s.full_shape(layer.w_up) == [6, 16, 8]
        np.testing.assert_array_equal(s.local(full, layer.w_up), full[2 * rank:2 * rank + 2])
    dense = paddle.create_parameter([16, 8], "float32")
    np.testing.assert_array_equal(TensorSlices(0, 1, 1, 3).local(full[0], dense), full[0])  # not an expert: whole
