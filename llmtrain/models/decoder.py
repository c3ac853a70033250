"""GPT-2 / Llama style decoder-only language model, single-device code.

    python -c "from llmtrain.models import build_model; ..."   # see tests/models/test_decoder.py

The model describes itself as an ordered list of stages (`decoder_stages`):
embedding, L blocks, final norm, LM head (or the embedding again, tied). The
single-device `DecoderLM` runs them in order; the pipeline plan
(`llmtrain/parallel/pipeline.py`) cuts the same list into `LayerDesc` /
`SharedLayerDesc` entries. Each stage has a canonical name prefix, so a
parameter has the same name (`layers.3.attn.q_proj.weight`) under every layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import paddle
import paddle.nn as nn

from llmtrain.models.config import ModelConfig
from llmtrain.models.layers import Attention, FeedForward, build_norm
from llmtrain.models.roles import Roles, tag_split


def tied_logits(layer: nn.Layer, hidden):  # hidden [b, s, h] -> logits [b, s, V/tp]
    """Output projection through the shared word table (`layer.word`) of an `Embedding` or `TiedHead`."""
    return layer.roles.tied_logits(hidden, layer.word.weight)


class Embedding(nn.Layer):
    """ids [b, s] -> hidden [b, s, h]: word table (+ learned positions for GPT-2)."""

    def __init__(self, cfg: ModelConfig, roles: Roles, prefix: str = "embed"):
        super().__init__()
        self.llm_prefix = prefix
        self.roles = roles
        self.word = roles.vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.word.llm_tied_table = cfg.tie_embeddings  # read outside its own forward by the tied output projection
        self.pos = None
        if cfg.position == "learned":
            self.pos = tag_split(nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size), None)

    def forward(self, input_ids):  # [b, s] int64
        x = self.word(input_ids)  # [b, s, h]
        if self.pos is not None:
            positions = paddle.arange(input_ids.shape[1], dtype="int64")  # [s]
            x = x + self.pos(positions)[None]
        return x

    @property
    def shared_weight(self):
        """The word table, shared with the output projection when embeddings are tied."""
        return self.word.weight


class TiedHead(nn.Layer):
    """The last pipeline stage's copy of the tied word table: [b, s, h] -> logits [b, s, V/tp].

    Built only when the output projection lives on another pipeline stage than
    the embedding; the pipeline keeps both copies equal (broadcast at start,
    gradients all-reduced)."""

    def __init__(self, cfg: ModelConfig, roles: Roles, prefix: str = "embed"):
        super().__init__()
        self.llm_prefix = prefix
        self.roles = roles
        self.word = roles.vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.word.llm_tied_table = cfg.tie_embeddings  # read outside its own forward by the tied output projection

    @property
    def shared_weight(self):
        return self.word.weight

    def forward(self, hidden):
        return tied_logits(self, hidden)


class Block(nn.Layer):
    """Transformer block. Pre-norm: x + attn(norm(x)), then + mlp(norm(x)); post-norm
    (BERT/ERNIE): norm(x + attn(x)), then norm(x + mlp(x)). Causal for the decoder family."""

    def __init__(self, cfg: ModelConfig, roles: Roles, recompute: bool = False, prefix: str = "layers.0"):
        super().__init__()
        self.llm_prefix = prefix
        self.attn_norm = build_norm(cfg, cfg.hidden_size)
        self.attn = Attention(cfg, roles)
        self.mlp_norm = build_norm(cfg, cfg.hidden_size)
        self.mlp = FeedForward(cfg, roles)
        self.recompute = recompute
        if cfg.norm_position not in ("pre", "post"):
            raise ValueError(f"model.norm_position={cfg.norm_position!r}: expected 'pre' or 'post'")
        self.pre_norm = cfg.norm_position == "pre"

    def _forward(self, x, mask=None):  # x [b, s, h]
        if self.pre_norm:
            x = x + self.attn(self.attn_norm(x), mask)
            return x + self.mlp(self.mlp_norm(x))
        x = self.attn_norm(x + self.attn(x, mask))
        return self.mlp_norm(x + self.mlp(x))

    def forward(self, x, mask=None):
        if self.recompute and self.training:
            from paddle.distributed.fleet.utils import recompute

            # use_reentrant=False: the reentrant form drops parameter grads when
            # every input has stop_gradient=True (DESIGN.md §1).
            return recompute(self._forward, x, mask, use_reentrant=False)
        return self._forward(x, mask)


class FinalNorm(nn.Layer):
    """Norm after the last block: [b, s, h] -> [b, s, h]."""

    def __init__(self, cfg: ModelConfig, roles: Roles, prefix: str = "final_norm"):
        super().__init__()
        self.llm_prefix = prefix
        self.norm = build_norm(cfg, cfg.hidden_size)

    def forward(self, x):
        return self.norm(x)


class LMHead(nn.Layer):
    """Untied output projection: [b, s, h] -> logits [b, s, V/tp]."""

    def __init__(self, cfg: ModelConfig, roles: Roles, prefix: str = "lm_head"):
        super().__init__()
        self.llm_prefix = prefix
        self.proj = roles.output_linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, x):
        return self.proj(x)


class LMLoss(nn.Layer):
    """Mean next-token cross entropy over loss-bearing positions.

    logits [b, s, V/tp]; labels = (target ids [b, s] int64, loss_mask [b, s] fp32).
    Returns sum(ce * mask) / sum(mask) for this micro-batch (fp32 scalar).
    """

    def __init__(self, roles: Roles):
        super().__init__()
        self.roles = roles

    def forward(self, logits, labels):
        target, mask = labels
        ce = self.roles.token_loss(logits, target)  # [b, s]
        mask = mask.astype("float32")
        return (ce * mask).sum() / paddle.clip(mask.sum(), min=1.0)


@dataclass
class StageSpec:
    """One entry of the model's ordered stage list."""

    prefix: str
    """Canonical name prefix of this stage's parameters (`embed`, `layers.3`, `final_norm`, `lm_head`)."""
    layer_cls: type
    kwargs: dict = field(default_factory=dict)
    shared_key: Optional[str] = None
    """Stages with the same key share one layer (tied embeddings)."""
    forward_func: Optional[Callable] = None
    """For a repeated shared stage: how to call the shared layer, f(layer, x)."""


def canonical_parameters(model: nn.Layer) -> list[tuple[str, paddle.Tensor]]:
    """(canonical name, parameter) for every parameter of a model or pipeline stage.

    Each stage layer carries `llm_prefix`; a parameter's canonical name is that
    prefix plus its name inside the stage, whatever wraps the stage (a plain
    model, a `PipelineLayer`, a virtual-stage chunk). Shared layers seen twice
    are listed once.
    """
    out, seen = [], set()
    for layer in [model, *model.sublayers()]:
        prefix = getattr(layer, "llm_prefix", None)
        if prefix is None:
            continue
        for name, param in layer.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                out.append((f"{prefix}.{name}", param))
    return out


def decoder_stages(cfg: ModelConfig, roles: Roles, recompute: bool = False) -> list[StageSpec]:
    """The decoder as an ordered list of stages; the pipeline cuts it between entries."""
    def spec(prefix, cls, **kw):
        return StageSpec(prefix, cls, dict(cfg=cfg, roles=roles, prefix=prefix, **kw.pop("extra", {})), **kw)

    tied = cfg.tie_embeddings
    stages = [spec("embed", Embedding, shared_key="embed" if tied else None)]
    stages += [spec(f"layers.{i}", Block, extra=dict(recompute=recompute)) for i in range(cfg.num_layers)]
    stages.append(spec("final_norm", FinalNorm))
    if tied:
        stages.append(spec("embed", TiedHead, shared_key="embed", forward_func=tied_logits))
    else:
        stages.append(spec("lm_head", LMHead))
    return stages


class DecoderLM(nn.Layer):
    """The decoder on one device (or under tensor parallelism, via `roles`).

    forward(input_ids [b, s]) -> logits [b, s, V/tp]; `self.loss_fn(logits, (labels, mask))`.
    """

    def __init__(self, cfg: ModelConfig, roles: Optional[Roles] = None, recompute: bool = False):
        super().__init__()
        roles = roles or Roles()
        self.cfg = cfg
        self.embed = Embedding(cfg, roles)
        self.layers = nn.LayerList([Block(cfg, roles, recompute, prefix=f"layers.{i}") for i in range(cfg.num_layers)])
        self.final_norm = FinalNorm(cfg, roles)
        self.lm_head = None if cfg.tie_embeddings else LMHead(cfg, roles)
        self.loss_fn = LMLoss(roles)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.layers:
            x = block(x)
        x = self.final_norm(x)
        return tied_logits(self.embed, x) if self.lm_head is None else self.lm_head(x)
