"""Multi-head latent attention and DeepSeek's MoE routing, in one process; the DeepSeek presets' published sizes.

    python -m pytest tests/models/test_mla.py -q

The logits of whole DeepSeek-V2/V3 models against a numpy forward of the published architecture are in
tests/interop/test_deepseek.py; the layouts (tp2, pp2, ep2) in tests/e2e/family_deepseek.py (run by test_families_e2e.py).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import pytest

from llmtest import compose
from llmtrain.config import to_config
from llmtrain.models.config import ModelConfig
from llmtrain.models.size import flops_parameters, parameter_count

PUBLISHED = {"deepseek-v2-lite": 15_706_484_224, "deepseek-v3": 671_026_419_200}
"""Parameters of the released checkpoints' tensors (DeepSeek-V3: without its multi-token prediction module, with
the routers' e_score_correction_bias), recomputed below from the published tensor list (tests/hf_deepseek.py)."""
ACTIVE = {"deepseek-v2-lite": 2.4e9, "deepseek-v3": 36.6e9}
"""Published active parameters besides the input table (DeepSeek-V3's README_WEIGHTS: 36.6B with the output head;
DeepSeek-V2-Lite: 2.4B), to the published precision."""
_YARN = dict(type="yarn", factor=40, beta_fast=32, beta_slow=1, original_max_position_embeddings=4096)
_SHARED = dict(max_position_embeddings=163840, rope_theta=10000, rms_norm_eps=1e-6, tie_word_embeddings=False,
               kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
PUBLISHED_CONFIG = {  # the architecture fields of the published config.json files
    "deepseek-v2-lite": ("deepseek_v2", dict(_SHARED, vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                                             moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                                             num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
                                             num_experts_per_tok=6, first_k_dense_replace=1, q_lora_rank=None,
                                             n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax",
                                             norm_topk_prob=False, routed_scaling_factor=1.0,
                                             rope_scaling=dict(_YARN, mscale=0.707, mscale_all_dim=0.707))),
    "deepseek-v3": ("deepseek_v3", dict(_SHARED, vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                                        num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
                                        num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536, n_group=8,
                                        topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
                                        norm_topk_prob=True, routed_scaling_factor=2.5,
                                        rope_scaling=dict(_YARN, mscale=1.0, mscale_all_dim=1.0))),
}
TRAINING_ONLY = ("name", "moe_aux_loss_coef", "moe_bias_update_rate", "vocab_size", "init_from")
"""ModelConfig fields a preset may set apart from an import (the import's training choices; vocab: the preset's own)."""


def tiny_mla(**kw) -> ModelConfig:
    base = dict(name="t-mla", hidden_size=32, num_layers=3, num_heads=4, ffn_hidden_size=48, vocab_size=64,
                max_position_embeddings=64, position="rope", norm="rmsnorm", norm_eps=1e-6, activation="swiglu",
                bias=False, tie_embeddings=False, mla_kv_lora_rank=16, mla_q_lora_rank=12, mla_qk_nope_head_dim=8,
                mla_qk_rope_head_dim=4, mla_v_head_dim=6, moe_num_experts=8, moe_top_k=2, moe_ffn_hidden_size=16,
                moe_num_shared_experts=1, moe_first_dense_layers=1, moe_router="sigmoid", moe_n_group=4,
                moe_topk_group=2, moe_routed_scale=2.5)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_deepseek_preset_has_the_published_size(preset):
    from hf_deepseek import deepseek_config, deepseek_shapes

    from llmtrain.plan.memory import param_specs

    cfg = to_config(compose([f"model={preset}"])).model
    model_type, fields = PUBLISHED_CONFIG[preset]
    published = sum(int(np.prod(s)) for s in deepseek_shapes(deepseek_config(model_type, **fields), mtp=False).values())
    assert published == PUBLISHED[preset]
    ours_only = 0 if model_type == "deepseek_v3" else cfg.moe_num_experts * (cfg.num_layers - 1)  # V2: no gate bias
    assert parameter_count(cfg) == PUBLISHED[preset] + ours_only
    assert sum(s.numel for s in param_specs(cfg)) == PUBLISHED[preset] + ours_only  # the planner's parameter list
    assert abs(flops_parameters(cfg) - ACTIVE[preset]) < 0.05e9 + 0.01 * ACTIVE[preset]


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_deepseek_preset_is_what_the_published_config_imports_as(preset):
    from hf_deepseek import deepseek_config

    from llmtrain.interop.deepseek import config_from_hf

    model_type, fields = PUBLISHED_CONFIG[preset]
    imported, _ = config_from_hf(deepseek_config(model_type, **fields), model_type, preset, "config.json")
    cfg = to_config(compose([f"model={preset}"])).model
    differ = {f.name: (getattr(cfg, f.name), getattr(imported, f.name)) for f in dataclasses.fields(cfg)
              if f.name not in TRAINING_ONLY and getattr(cfg, f.name) != getattr(imported, f.name)}
    assert not differ, differ
    assert cfg.vocab_size == fields["vocab_size"]


def test_group_limited_routing_keeps_the_best_groups_only():
    from hf_deepseek import route as reference_route

    from llmtrain.models.router import GroupLimit, limit_to_groups, route

    rng = np.random.default_rng(0)
    logits, bias = rng.standard_normal([40, 8]), 0.4 * rng.standard_normal(8)
    bias[3] = -1.5  # a selection score below zero: still chosen over the experts outside the groups
    c = dict(num_experts_per_tok=2, n_routed_experts=8, n_group=4, topk_group=2, scoring_func="sigmoid",
             topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.0, model_type="deepseek_v3")
    r = route(paddle.to_tensor(logits, "float32"), 2, "sigmoid", True, paddle.to_tensor(bias, "float32"),
              groups=GroupLimit(4, 2, "top2"))
    want_index, want_weight = reference_route(c, logits, bias)
    np.testing.assert_array_equal(np.sort(r.index.numpy(), -1), np.sort(want_index, -1))
    order = np.argsort(r.index.numpy(), -1)
    np.testing.assert_allclose(np.take_along_axis(r.weight.numpy(), order, -1),
                               np.take_along_axis(want_weight, np.argsort(want_index, -1), -1), atol=1e-6)
    grouped = r.index.numpy() // 2  # both choices inside the token's 2 best groups
    limited = limit_to_groups(paddle.to_tensor(logits, "float32"), GroupLimit(4, 1, "max")).numpy()
    assert ((limited > -np.inf).sum(-1) == 2).all() and (np.unique(grouped).size > 1)
    np.testing.assert_array_equal(limit_to_groups(paddle.to_tensor(logits), None).numpy(), logits)


def test_mla_and_group_problems_name_the_fields():
    from llmtrain.models.mla import mla_problems
    from llmtrain.models.router import group_problems

    assert not mla_problems(tiny_mla()) and not group_problems(tiny_mla())
    assert any("mla_qk_rope_head_dim=5" in p for p in mla_problems(tiny_mla(mla_qk_rope_head_dim=5)))
    assert any("num_kv_heads=2" in p for p in mla_problems(tiny_mla(num_kv_heads=2)))
    assert any("sequence_parallel" in p for p in mla_problems(tiny_mla(), sequence_parallel=True))
    assert any("moe_n_group=3" in p for p in group_problems(tiny_mla(moe_n_group=3)))
    assert any("moe_topk_group=5" in p for p in group_problems(tiny_mla(moe_topk_group=5)))
    assert any("moe_top_k=6" in p for p in group_problems(tiny_mla(moe_top_k=6, moe_topk_group=2)))
    assert any("moe_group_score='sum'" in p for p in group_problems(tiny_mla(moe_group_score="sum")))


def test_value_padding_for_flash_kernels_changes_nothing():
    """The GPU-only wrapper (`padded_value_core`, GPU-ONLY(mla-value-pad)) around the math core, on CPU."""
    from llmtrain.models.layers import math_attention
    from llmtrain.models.mla import padded_value_core

    rng = np.random.default_rng(0)
    q, k = (paddle.to_tensor(rng.standard_normal([2, 7, 4, 12]), "float32") for _ in range(2))
    v = paddle.to_tensor(rng.standard_normal([2, 7, 4, 6]), "float32")
    got = padded_value_core(math_attention, 12)(q, k, v, True)
    assert got.shape == [2, 7, 4, 6]
    np.testing.assert_allclose(got.numpy(), math_attention(q, k, v, True).numpy(), atol=1e-6)


def test_mla_decoding_with_a_cache_equals_the_full_forward():
    from llmtrain.models import build_model

    paddle.seed(0)
    cfg = tiny_mla(moe_num_experts=0)
    model = build_model(cfg)
    model.eval()
    ids = paddle.to_tensor(np.random.default_rng(1).integers(0, 64, (1, 9)))
    with paddle.no_grad():
        full = model(ids).numpy()
        cache = [{} for _ in range(cfg.num_layers)]
        steps = [model(ids[:, :5], cache=cache).numpy()[:, -1]]
        for t in range(5, 9):
            steps.append(model(ids[:, t:t + 1], position_ids=paddle.to_tensor([[t]]), cache=cache).numpy()[:, -1])
    np.testing.assert_allclose(np.stack(steps, 1), full[:, 4:], atol=1e-5)


def test_mla_flops_count_the_attention_widths():
    from llmtrain.models.size import flops_per_token

    cfg = tiny_mla(moe_num_experts=0)
    dense = dataclasses.replace(cfg, mla_kv_lora_rank=0)
    qk, dv = 12, 6
    attention = flops_per_token(cfg, 32) - 6 * flops_parameters(cfg)
    assert attention == 6 * cfg.num_layers * cfg.num_heads * (qk + dv) * 32
    assert flops_per_token(dense, 32) - 6 * flops_parameters(dense) == 12 * cfg.num_layers * cfg.hidden_size * 32
