"""The ordered stage list describes the same model the single-device classes build."""
from __future__ import annotations

import numpy as np
import paddle
import pytest

from llmtrain.models import build_model, model_stages
from llmtrain.models.config import ModelConfig
from llmtrain.models.stages import canonical_parameters
from llmtrain.models.init import init_parameters
from llmtrain.models.roles import Roles


def tiny_ernie() -> ModelConfig:
    return ModelConfig(
        name="t-ernie", family="encoder", hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
        vocab_size=256, max_position_embeddings=64, position="learned", norm="layernorm", activation="gelu",
        bias=True, norm_position="post", type_vocab_size=2, task_type_vocab_size=3, tie_embeddings=True,
    )


def run_stages(cfg: ModelConfig, seed: int, ids):
    """Build each stage's layer (one per shared key) and run the list in order, as the Stage doc says."""
    roles = Roles()
    layers, shared, named = [], {}, []
    for st in model_stages(cfg, roles):
        if st.shared_key in shared:
            layers.append(lambda x, table=shared[st.shared_key].shared_weight: roles.tied_logits(x, table))
            continue
        layer = st.layer_cls(**st.kwargs)
        if st.shared_key is not None:
            shared[st.shared_key] = layer
        layers.append(layer)
        named += canonical_parameters(layer)
    init_parameters(named, cfg, seed)
    x = ids
    for layer in layers:
        x = layer(x)
    return [n for n, _ in named], x.numpy()


@pytest.mark.parametrize("name", ["tiny_gpt", "tiny_llama", "ernie"])
def test_stage_list_is_the_model(name, request):
    cfg = tiny_ernie() if name == "ernie" else request.getfixturevalue(name)
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 12)))
    model = build_model(cfg)
    init_parameters(canonical_parameters(model), cfg, 3)
    model.eval()
    names, logits = run_stages(cfg, 3, ids)
    assert names == [n for n, _ in canonical_parameters(model)]
    np.testing.assert_allclose(logits, model(ids).numpy(), rtol=0, atol=1e-6)
