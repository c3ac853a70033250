"""Shared pytest fixtures: tiny model configs composed from the real conf/ tree."""
from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

os.environ.setdefault("FLAGS_cudnn_deterministic", "1")


def compose(overrides=()):
    """The root config composed with Hydra's compose API, as llmtrain/pretrain.py would see it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from llmtrain.config import register_configs

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=os.path.join(REPO, "conf")):
        return hydra_compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def tiny_gpt():
    from llmtrain.models.config import ModelConfig

    return ModelConfig(
        name="t-gpt", hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, vocab_size=256,
        max_position_embeddings=64, position="learned", norm="layernorm", activation="gelu_tanh", bias=True,
        tie_embeddings=True,
    )


@pytest.fixture
def tiny_llama():
    from llmtrain.models.config import ModelConfig

    return ModelConfig(
        name="t-llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
        vocab_size=256, max_position_embeddings=64, position="rope", norm="rmsnorm", norm_eps=1e-6,
        activation="swiglu", bias=False, tie_embeddings=False,
    )
