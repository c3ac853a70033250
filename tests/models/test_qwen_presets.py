"""Qwen presets (`conf/model/qwen*.yaml`): published parameter counts, the model's own parameters, the planner.

    python -m pytest tests/models/test_qwen_presets.py -q
"""
from __future__ import annotations

import numpy as np
import pytest

from llmtest import compose
from llmtrain.config import to_config
from llmtrain.models.size import parameter_count

# parameter counts published for the released checkpoints (sum of the tensors in their safetensors files)
PUBLISHED = {"qwen2-0.5b": 494_032_768, "qwen2-1.5b": 1_543_714_304, "qwen2-7b": 7_615_616_512,
             "qwen-1.8b": 1_836_828_672, "qwen-7b": 7_721_324_544}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_qwen_preset_has_the_published_size(preset):
    from llmtrain.plan.memory import param_specs

    cfg = to_config(compose([f"model={preset}"])).model
    assert cfg.has_qkv_bias() and not cfg.bias  # bias on q/k/v only
    assert parameter_count(cfg) == PUBLISHED[preset]
    assert sum(s.numel for s in param_specs(cfg)) == PUBLISHED[preset]  # the planner's parameter list


def test_qwen2_preset_model_holds_the_counted_parameters():
    """The built model (no memory: LazyGuard) has the q/k/v biases the count includes, and nothing else."""
    from llmtrain.interop.keys import model_shapes

    cfg = to_config(compose(["model=qwen2-0.5b"])).model
    shapes = model_shapes(cfg)
    assert shapes["layers.0.attn.k_proj.bias"] == [128] and "layers.0.attn.o_proj.bias" not in shapes
    assert "lm_head.proj.weight" not in shapes  # tied
    assert sum(int(np.prod(s)) for s in shapes.values()) == PUBLISHED["qwen2-0.5b"]


def test_planner_plans_qwen2_7b():
    from llmtrain.plan.__main__ import plan

    cfg = to_config(compose(["model=qwen2-7b", "data.seq_len=4096", "train.global_batch_size=64", "plan.devices=4"]))
    rows = plan(cfg)
    assert rows and any(r["fits"] for r in rows)


def test_qkv_bias_is_validated_and_changing_it_at_resume_is_refused():
    from llmtrain.config import config_problems
    from llmtrain.train.contract import rule_of

    cfg = to_config(compose(["model=ernie-tiny", "model.qkv_bias=true", "model.bias=false"]))
    assert any("model.qkv_bias=True with model.family=encoder" in p for p in config_problems(cfg))
    assert not any("qkv_bias" in p for p in config_problems(to_config(compose(["model=qwen2-0.5b"]))))
    rule, why = rule_of("model.qkv_bias")  # its own rule, not only the `model` prefix's
    assert rule == "refuse" and "q/k/v" in why
