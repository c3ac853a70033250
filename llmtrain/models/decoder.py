"""GPT-2 / Llama style decoder-only language model, single-device code.

    python -m pytest tests/models -q
    model = build_model(cfg.model)          # llmtrain.models; logits = model(input_ids)

The model is written for one device; a parallel plan acts only through the
`Roles` factory it passes in. The model also describes itself as an ordered
list of stages (`decoder_stages`): embedding, L blocks, final norm, and the LM
head (an `LMHead`, or the embedding again when the table is tied). The
single-device `DecoderLM` runs the same layers in the same order; the pipeline
plan (`llmtrain/parallel/pipeline.py`) cuts the list between entries. Each
stage has a canonical name prefix, so a parameter has the same name
(`layers.3.attn.q_proj.weight`) under every layout.
"""
from __future__ import annotations

from typing import Optional

import paddle
import paddle.nn as nn

from llmtrain.contracts import tags
from llmtrain.models.config import ModelConfig
from llmtrain.models.layers import Attention, FeedForward, build_norm
from llmtrain.models.loss import LMLoss
from llmtrain.models.recompute import as_recompute, checkpointed
from llmtrain.models.roles import Roles
from llmtrain.models.stages import Stage, stage


class Embedding(nn.Layer):
    """ids [b, s] -> hidden [b, s, h]: word table (+ learned positions for GPT-2).

    With tied embeddings the word table (`word`, exposed as `shared_weight`) is
    also the output projection: logits = roles.tied_logits(hidden, shared_weight)."""

    def __init__(self, cfg: ModelConfig, roles: Roles, prefix: str = "embed"):
        super().__init__()
        tags.set_prefix(self, prefix)
        self.roles = roles
        self.word = roles.vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        tags.mark_tied_table(self.word, cfg.tie_embeddings)  # read outside its own forward by the tied output projection
        self.pos = None
        if cfg.position == "learned":
            self.pos = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)

    def forward(self, input_ids, position_ids=None):  # [b, s] int64; position_ids [b, s] (packed) or None
        x = self.word(input_ids)  # [b, s, h]
        if self.pos is not None:
            if position_ids is None:
                positions = paddle.arange(input_ids.shape[1], dtype="int64")  # [s]
                x = x + self.pos(positions)[None]
            else:
                x = x + self.pos(position_ids)  # [b, s, h]
        return self.roles.sequence_scatter(x)  # [b, s, h] (a sequence-parallel plan: this rank's positions)

    @property
    def shared_weight(self):
        """The word table [V/tp, h], shared with the output projection when embeddings are tied."""
        return self.word.weight


class Block(nn.Layer):
    """Transformer block. Pre-norm: x + attn(norm(x)), then + mlp(norm(x)); post-norm
    (BERT/ERNIE): norm(x + attn(x)), then norm(x + mlp(x)). Causal for the decoder family."""

    def __init__(self, cfg: ModelConfig, roles: Roles, recompute=False, prefix: str = "layers.0"):
        """`recompute`: a `llmtrain.models.recompute.Recompute` (what each block re-runs in the backward) or a bool
        (true: the whole block)."""
        super().__init__()
        tags.set_prefix(self, prefix)
        index = int(prefix.rsplit(".", 1)[-1]) if prefix.startswith("layers.") else 0
        self.attn_norm = build_norm(cfg, cfg.hidden_size)
        if cfg.is_mla():  # DeepSeek's multi-head latent attention (llmtrain/models/mla.py)
            from llmtrain.models.mla import MLAttention

            self.attn = MLAttention(cfg, roles)
        else:
            self.attn = Attention(cfg, roles, index)
        self.mlp_norm = build_norm(cfg, cfg.hidden_size)
        if cfg.family == "decoder" and cfg.is_moe_layer(index):
            from llmtrain.models.moe import MoEFeedForward

            self.mlp = MoEFeedForward(cfg, roles, index)
        else:
            self.mlp = FeedForward(cfg, roles)
        rc = as_recompute(recompute)
        self.parts = rc.at(index)  # what this block re-runs in its backward (models/recompute.py)
        self.offload = rc.offload and "block" in self.parts
        if self.offload and cfg.moe_num_experts > 0:
            raise ValueError("train.offload_activations with an MoE model: the offloaded block's first forward runs "
                             "without autograd, which the routers' balancing losses need; not supported")
        self.recompute = "block" in self.parts
        if "core_attn" in self.parts:
            self.attn.recompute_core = True
        if "moe_act" in self.parts and hasattr(self.mlp, "experts"):
            self.mlp.experts.recompute_act = True
        if "shared_experts" in self.parts and getattr(self.mlp, "shared", None) is not None:
            self.mlp.recompute_shared = True
        if cfg.norm_position not in ("pre", "post"):
            raise ValueError(f"model.norm_position={cfg.norm_position!r}: expected 'pre' or 'post'")
        self.pre_norm = cfg.norm_position == "pre"

    def _part(self, name: str, fn):
        """`fn`, recomputed in the backward when this block recomputes part `name` (training only)."""
        if name in self.parts and self.training:
            return checkpointed(self._replayable(fn) if name == "moe" else fn)
        return fn

    def _mlp(self):
        """The feed-forward as this block runs it: a dense one recomputed under `mlp`, an MoE one under `moe`."""
        return self._part("moe" if hasattr(self.mlp, "experts") else "mlp", self.mlp)

    def _forward(self, x, mask=None, positions=None, segments=None, cache=None):  # x [b, s, h]
        attn_norm, mlp_norm = self._part("norm", self.attn_norm), self._part("norm", self.mlp_norm)
        if self.pre_norm:
            x = x + self._part("attn", self._attention)(attn_norm(x), mask, positions, segments, cache)
            return x + self._mlp()(mlp_norm(x))
        x = attn_norm(x + self._part("attn", self._attention)(x, mask, positions, segments, cache))
        return mlp_norm(x + self._mlp()(x))

    def _attention(self, x, mask=None, positions=None, segments=None, cache=None):
        return self.attn(x, mask, positions, segments, cache)

    def forward(self, x, mask=None, positions=None, segments=None, cache=None):
        if cache is not None:  # generation (no gradient): the keys/values of earlier positions are kept
            return self._forward(x, mask, positions, segments, cache)
        if self.offload and self.training:  # the kept input in host memory (GPU: pinned, prefetched)
            from llmtrain.paddle_compat.offload import offloaded_checkpoint

            if x.stop_gradient:  # a frozen embedding (LoRA): the block's parameters still need the backward
                x = x.detach()
                x.stop_gradient = False
            return offloaded_checkpoint(self._forward, x, mask, positions, segments)
        if self.recompute and self.training:
            # use_reentrant=False (`checkpointed`): with Paddle's default reentrant form, a block whose inputs all
            # have stop_gradient=True returns an output with stop_gradient=True, so its parameters
            # silently get no gradient (and the 1F1B pipeline schedule deadlocked).
            return checkpointed(self._replayable(self._forward))(x, mask, positions, segments)
        return self._forward(x, mask, positions, segments)

    def _replayable(self, fn):
        """`fn` for recompute: its first call is this forward; a later one is recompute re-running it in the
        backward, when an MoE feed-forward routes as it did the first time (the kept top-k choice) and records
        nothing (its losses and loads once)."""
        calls, kept = [], {}

        def run(*args):
            if not hasattr(self.mlp, "replay"):
                return fn(*args)
            if calls:
                with self.mlp.replay(kept):
                    return fn(*args)
            calls.append(1)
            with self.mlp.keep_routing(kept):
                return fn(*args)

        return run


class FinalNorm(nn.Layer):
    """Norm after the last block: [b, s, h] -> [b, s, h]."""

    def __init__(self, cfg: ModelConfig, roles: Roles, prefix: str = "final_norm"):
        super().__init__()
        tags.set_prefix(self, prefix)
        self.norm = build_norm(cfg, cfg.hidden_size)

    def forward(self, x):
        return self.norm(x)


class LMHead(nn.Layer):
    """Untied output projection: [b, s, h] -> logits [b, s, V/tp]."""

    def __init__(self, cfg: ModelConfig, roles: Roles, prefix: str = "lm_head"):
        super().__init__()
        tags.set_prefix(self, prefix)
        self.proj = roles.output_linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, x):
        return self.proj(x)


def decoder_stages(cfg: ModelConfig, roles: Roles, recompute=False) -> list[Stage]:
    """The decoder as an ordered list of stages, in the order `DecoderLM.forward` runs them."""
    tied = "embed" if cfg.tie_embeddings else None
    stages = [stage(cfg, roles, "embed", Embedding, tied)]
    stages += [stage(cfg, roles, f"layers.{i}", Block, recompute=recompute) for i in range(cfg.num_layers)]
    stages.append(stage(cfg, roles, "final_norm", FinalNorm))
    stages.append(stage(cfg, roles, "embed", Embedding, tied) if tied else stage(cfg, roles, "lm_head", LMHead))
    return stages


class DecoderLM(nn.Layer):
    """The decoder, built with the layers `roles` hands out (plain ones when None).

    forward(input_ids [b, s]) -> logits [b, s, V/tp]; `self.loss_fn(logits, (labels, mask))` -> (loss_sum, tokens).
    """

    def __init__(self, cfg: ModelConfig, roles: Optional[Roles] = None, recompute=False):
        super().__init__()
        roles = roles or Roles()
        self.cfg = cfg
        self.roles = roles
        self.embed = Embedding(cfg, roles)
        self.layers = nn.LayerList([Block(cfg, roles, recompute, prefix=f"layers.{i}") for i in range(cfg.num_layers)])
        self.final_norm = FinalNorm(cfg, roles)
        self.lm_head = None if cfg.tie_embeddings else LMHead(cfg, roles)
        self.loss_fn = LMLoss(roles)
        self._step_hooks = []
        if cfg.moe_num_experts > 0:  # + the routers' balancing losses of the same forward
            from llmtrain.models.moe import MoELMLoss, moe_layers

            self.loss_fn = MoELMLoss(self.loss_fn, moe_layers(self), cfg)
            self._step_hooks.append(self.loss_fn.stats)

    def step_hooks(self) -> list:
        """The model's `StepHook`s for the training loop (`llmtrain.contracts.steps`): an MoE model's routing
        statistics and bias update (`MoEStats`); none for a dense model."""
        return list(self._step_hooks)

    def forward(self, input_ids, position_ids=None, segment_ids=None, cache=None):
        # input_ids [b, s] int64; packed sequences: position_ids [b, s] (restarting per example) and
        # segment_ids [b, s] (example ids, non-decreasing): attention stays inside each example.
        # Generation: `cache` a list of one dict per block (keys/values so far) and position_ids the
        # absolute positions of input_ids (`llmtrain.generate`)
        x = self.embed(input_ids, position_ids)  # [b, s, h]
        for i, block in enumerate(self.layers):
            x = block(x, None, position_ids, segment_ids, None if cache is None else cache[i])
        x = self.final_norm(x)
        if self.lm_head is None:
            return self.roles.tied_logits(x, self.embed.shared_weight)  # [b, s, V/tp]
        return self.lm_head(x)
