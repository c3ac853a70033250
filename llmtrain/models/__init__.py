"""Model families: `build_model(cfg, roles)` builds the model, `model_stages(cfg, roles)` lists its stages.

    python -m pytest tests/models -q
    from llmtrain.models import build_model; model = build_model(cfg.model)
    with shape_only(): model = build_model(cfg.model)     # shapes and tags only, for the planner and checks

Both are single-device descriptions; a parallel plan takes part only through
the `Roles` it passes in (`llmtrain/parallel/build.py`) and by cutting the stage
list (`llmtrain/parallel/pipeline.py`).
"""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def shape_only():
    """Build a throwaway model inside: no memory is allocated (`paddle.LazyGuard`) and Paddle's per-process naming
    counters are left as they were (`paddle.utils.unique_name.guard`: a private generator).

    Paddle names every layer and parameter from those counters ("layer_norm_51.w_0"). A throwaway copy built on some
    ranks only (the planner's on-disk cache answers the others) would otherwise shift the names of every model the
    process builds afterwards on those ranks, and ZeRO-3 orders the flat storage it all-reduces by names
    (llmtrain/parallel/zero.py)."""
    import paddle

    with paddle.utils.unique_name.guard(), paddle.LazyGuard():
        yield


def model_stages(cfg: ModelConfig, roles: Roles, recompute=False):
    """The model of `cfg.family` as an ordered list of `stages.Stage` entries (the pipeline plan cuts it)."""
    if cfg.family == "decoder":
        from llmtrain.models.decoder import decoder_stages

        return decoder_stages(cfg, roles, recompute)
    if cfg.family == "encoder":
        from llmtrain.models.encoder import encoder_stages

        return encoder_stages(cfg, roles, recompute)
    raise ValueError(f"model.family={cfg.family!r}: expected 'decoder' or 'encoder'")
