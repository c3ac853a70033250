"""The pipeline plan's reading of a model's stage list: LayerDesc per stage, TiedHead for a repeated table."""
from __future__ import annotations

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.meta_parallel import SharedLayerDesc

from llmtrain.models import build_model, model_stages
from llmtrain.models.config import ModelConfig
from llmtrain.models.stages import canonical_parameters
from llmtrain.models.init import init_parameters
from llmtrain.models.roles import Roles
from llmtrain.parallel.pipeline import TiedHead, stage_descs


def tiny_ernie() -> ModelConfig:
    return ModelConfig(
        name="t-ernie", family="encoder", hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
        vocab_size=256, max_position_embeddings=64, position="learned", norm="layernorm", activation="gelu",
        bias=True, norm_position="post", type_vocab_size=2, task_type_vocab_size=3, tie_embeddings=True,
    )


@pytest.mark.parametrize("name", ["tiny_gpt", "tiny_llama", "ernie"])
def test_descs_run_as_the_model(name, request):
    """Each desc built on its own (as if every stage sat on another rank) computes the model's logits,
    once the TiedHead's table holds the embedding's values (fleet broadcasts them at start)."""
    cfg = tiny_ernie() if name == "ernie" else request.getfixturevalue(name)
    roles = Roles()
    descs = stage_descs(model_stages(cfg, roles), roles)
    layers = [d.build_layer() for d in descs]
    funcs = [d.forward_func if isinstance(d, SharedLayerDesc) else None for d in descs]
    heads = [layer for layer in layers if isinstance(layer, TiedHead)]
    assert len(heads) == (1 if cfg.tie_embeddings else 0)
    assert all(f is None for f, layer in zip(funcs, layers) if not isinstance(layer, TiedHead))

    named = [pair for layer in layers if not isinstance(layer, TiedHead) for pair in canonical_parameters(layer)]
    init_parameters(named, cfg, 3)
    for head in heads:
        assert [n for n, _ in canonical_parameters(head)] == ["embed.word.weight"]
        head.shared_weight.set_value(dict(named)["embed.word.weight"])

    model = build_model(cfg)
    init_parameters(canonical_parameters(model), cfg, 3)
    assert [n for n, _ in named] == [n for n, _ in canonical_parameters(model)]

    ids = paddle.to_tensor(np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 12)))
    x = ids
    for layer, func in zip(layers, funcs):
        x = func(layer, x) if func is not None else layer(x)
    np.testing.assert_allclose(x.numpy(), model(ids).numpy(), rtol=0, atol=1e-6)
