"""A model as an ordered list of stages, and the canonical parameter names the stages give.

    python -m pytest tests/models/test_stages.py -q
    stages = model_stages(cfg, roles)              # llmtrain.models: [Stage(prefix, layer_cls, kwargs, shared_key)]
    named = canonical_parameters(model)           # [("layers.3.attn.q_proj.weight", param), ...]

Every model family describes itself as `Stage` entries (the pipeline plan cuts the
list between entries) and every stage layer carries its canonical name prefix, so a
parameter has the same name under every layout: what checkpoints, the optimizer and
PaddleNLP interop key on.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import paddle
import paddle.nn as nn

from llmtrain.contracts import tags
from llmtrain.models.config import ModelConfig
from llmtrain.models.roles import Roles


class Stage(NamedTuple):
    """One entry of a model's ordered stage list: `layer_cls(**kwargs)` applied to the previous entry's output.

    Entries with the same `shared_key` are one layer (a tied word table): the
    first is that layer in its place (the embedding); a later entry with the key
    is the same table used as the output projection, hidden [b, s, h] ->
    `roles.tied_logits(hidden, layer.shared_weight)` [b, s, V/tp]. A layer with a
    shared key holds its table as `word` (a `roles.vocab_embedding`) and exposes
    it as `shared_weight`."""

    prefix: str
    """Canonical name prefix of this stage's parameters (`embed`, `layers.3`, `final_norm`, `lm_head`)."""
    layer_cls: type
    kwargs: dict
    """Constructor arguments: `cfg`, `roles`, `prefix`, and layer-specific ones (`recompute`)."""
    shared_key: Optional[str] = None


def canonical_parameters(model: nn.Layer) -> list[tuple[str, paddle.Tensor]]:
    """(canonical name, parameter) for every parameter of a model or pipeline stage.

    Each stage layer carries its prefix (`tags.prefix_of`); a parameter's canonical name is that
    prefix plus its name inside the stage, whatever wraps the stage (a plain
    model, a `PipelineLayer`, a virtual-stage chunk). Shared layers seen twice
    are listed once.
    """
    out, seen = [], set()
    for layer in [model, *model.sublayers()]:
        prefix = tags.prefix_of(layer)
        if prefix is None:
            continue
        for name, param in layer.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                out.append((f"{prefix}.{name}", param))
    return out


def stage(cfg: ModelConfig, roles: Roles, prefix: str, layer_cls: type, shared_key=None, **extra) -> Stage:
    """A `Stage` whose layer is built as `layer_cls(cfg=cfg, roles=roles, prefix=prefix, **extra)`."""
    return Stage(prefix, layer_cls, dict(cfg=cfg, roles=roles, prefix=prefix, **extra), shared_key)
