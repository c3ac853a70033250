"""Model families: `build_model(cfg, roles)` builds the model, `model_stages(cfg, roles)` lists its stages.

    python -m pytest tests/models -q
    from llmtrain.models import build_model; model = build_model(cfg.model)

Both are single-device descriptions; a parallel plan takes part only through
the `Roles` it passes in (`llmtrain/parallel/build.py`) and by cutting the stage
list (`llmtrain/parallel/pipeline.py`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from llmtrain.models.config import ModelConfig

if TYPE_CHECKING:  # paddle is imported by roles: `llmtrain.models.config` (the planner's path) stays paddle-free
    from llmtrain.models.roles import Roles


def build_model(cfg: ModelConfig, roles: Optional[Roles] = None, recompute=False):
    """The model of `cfg.family`, built with the layers `roles` hands out (plain ones when None)."""
    if cfg.family == "decoder":
        from llmtrain.models.decoder import DecoderLM

        return DecoderLM(cfg, roles, recompute)
    if cfg.family == "encoder":
        from llmtrain.models.encoder import EncoderMLM

        return EncoderMLM(cfg, roles, recompute)
    raise ValueError(f"model.family={cfg.family!r}: expected 'decoder' or 'encoder'")


def model_stages(cfg: ModelConfig, roles: Roles, recompute=False):
    """The model of `cfg.family` as an ordered list of `stages.Stage` entries (the pipeline plan cuts it)."""
    if cfg.family == "decoder":
        from llmtrain.models.decoder import decoder_stages

        return decoder_stages(cfg, roles, recompute)
    if cfg.family == "encoder":
        from llmtrain.models.encoder import encoder_stages

        return encoder_stages(cfg, roles, recompute)
    raise ValueError(f"model.family={cfg.family!r}: expected 'decoder' or 'encoder'")
