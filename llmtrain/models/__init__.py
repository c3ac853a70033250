"""Model families. `build_model(cfg, roles)` returns the single-device model.

    from llmtrain.models import build_model
"""
from __future__ import annotations

from typing import Optional

from llmtrain.models.config import ModelConfig
from llmtrain.models.roles import Roles


def build_model(cfg: ModelConfig, roles: Optional[Roles] = None, recompute: bool = False):
    """The model of `cfg.family`, built with `roles` (single device when None)."""
    if cfg.family == "decoder":
        from llmtrain.models.decoder import DecoderLM

        return DecoderLM(cfg, roles, recompute)
    if cfg.family == "encoder":
        from llmtrain.models.encoder import EncoderMLM

        return EncoderMLM(cfg, roles, recompute)
    raise ValueError(f"model.family={cfg.family!r}: expected 'decoder' or 'encoder'")


def model_stages(cfg: ModelConfig, roles: Roles, recompute: bool = False):
    """The model of `cfg.family` as an ordered stage list (for the pipeline plan)."""
    if cfg.family == "decoder":
        from llmtrain.models.decoder import decoder_stages

        return decoder_stages(cfg, roles, recompute)
    if cfg.family == "encoder":
        from llmtrain.models.encoder import encoder_stages

        return encoder_stages(cfg, roles, recompute)
    raise ValueError(f"model.family={cfg.family!r}: expected 'decoder' or 'encoder'")
