"""Qwen3 presets (`conf/model/qwen3-*.yaml`): the published shapes and parameter counts, the model's own parameters,
the planner.

    python -m pytest tests/models/test_qwen3_presets.py -q
"""
from __future__ import annotations

import numpy as np
import pytest

from llmtest import compose
from llmtrain.config import to_config
from llmtrain.models.size import flops_parameters, parameter_count

PUBLISHED = {"qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360, "qwen3-32b": 32_762_123_264,
             "qwen3-30b-a3b": 30_532_122_624}
"""Parameters of the released checkpoints: 8B, 32B, 30B-A3B: their model.safetensors.index.json total_size / 2 (bf16:
16381470720, 65524246528, 61064245248 bytes); 0.6B (one file, tied): the sum of its config's shapes, published as
"0.6B, 0.44B non-embedding" (440,467,456 without the 155,582,464 embedding)."""
ACTIVE_30B = 3_353_032_704
"""Qwen3-30B-A3B parameters a token passes through, embedding included ("3.3B activated")."""
SHAPES = {  # config.json of Qwen/Qwen3-*: hidden, layers, heads, kv heads, head_dim, intermediate, tied
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, True), "qwen3-8b": (4096, 36, 32, 8, 128, 12288, False),
    "qwen3-32b": (5120, 64, 64, 8, 128, 25600, False), "qwen3-30b-a3b": (2048, 48, 32, 4, 128, 6144, False)}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_qwen3_preset_has_the_published_shape_and_size(preset):
    from llmtrain.plan.memory import param_specs

    cfg = to_config(compose([f"model={preset}"])).model
    h, L, nh, nkv, d, f, tied = SHAPES[preset]
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.kv_heads(), cfg.attn_head_dim(), cfg.ffn_hidden_size,
            cfg.tie_embeddings) == (h, L, nh, nkv, d, f, tied)
    assert cfg.qk_norm and not cfg.bias and not cfg.has_qkv_bias() and cfg.rope_theta == 1e6
    assert cfg.vocab_size == 151936 and cfg.max_position_embeddings == 40960
    bias = cfg.moe_num_experts * cfg.num_layers  # our expert_bias (aux-loss-free balancing) has no HF tensor
    assert parameter_count(cfg) == PUBLISHED[preset] + bias
    assert sum(s.numel for s in param_specs(cfg)) == PUBLISHED[preset] + bias  # the planner's parameter list
    if preset == "qwen3-30b-a3b":
        assert (cfg.moe_num_experts, cfg.moe_top_k, cfg.expert_ffn_size(), cfg.moe_norm_topk) == (128, 8, 768, True)
        assert flops_parameters(cfg) + cfg.vocab_size * cfg.hidden_size == ACTIVE_30B


def test_qwen3_preset_model_holds_the_counted_parameters():
    """The built model (no memory: LazyGuard) has QK-norm weights [128], q [1024, 2048] (16 x 128 > 1024), no bias."""
    from llmtrain.interop.keys import model_shapes

    shapes = model_shapes(to_config(compose(["model=qwen3-0.6b"])).model)
    assert shapes["layers.0.attn.q_norm.weight"] == [128] == shapes["layers.0.attn.k_norm.weight"]
    assert shapes["layers.0.attn.q_proj.weight"] == [1024, 2048] and shapes["layers.0.attn.o_proj.weight"] == [2048, 1024]
    assert not any(n.endswith(".bias") for n in shapes) and "lm_head.proj.weight" not in shapes
    assert sum(int(np.prod(s)) for s in shapes.values()) == PUBLISHED["qwen3-0.6b"]


def test_planner_explains_qwen3_30b_a3b_under_expert_parallelism():
    """The planner on dp8 x ep8 (bf16 weights): each rank holds the dense parameters and 1/8 of the experts, exactly."""
    from llmtrain.plan.__main__ import plan

    cfg = to_config(compose(["model=qwen3-30b-a3b", "data.seq_len=4096", "train.global_batch_size=64",
                             "plan.devices=8", "+parallel=dp8", "parallel.ep=8", "train.micro_batch_size=1",
                             "train.recompute=true"]))
    (row,) = plan(cfg)
    m = cfg.model
    experts = m.num_layers * m.moe_num_experts * 3 * m.hidden_size * m.expert_ffn_size()
    bias = m.num_layers * m.moe_num_experts
    assert row["runnable"] and row["memory_bytes"]["params"] == 2 * (parameter_count(m) - experts + experts // 8)
    assert row["memory_bytes"]["grads"] == 2 * (parameter_count(m) - bias - experts + experts // 8)  # no bias grad
