"""ERNIE 3.0 / BERT style bidirectional encoder with a tied masked-LM head, single-device code.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py model=ernie-tiny +parallel=tp2

Same construction rules as the decoder (`decoder.py`): layers a plan may split
come from the `Roles` factory, and the model is an ordered stage list the
pipeline can cut: embedding, L blocks (post-norm for ERNIE), [final norm when
pre-norm], MLM transform (dense, GeLU, LayerNorm), the tied word table as
output projection, and the output bias over the vocabulary.

Attention is bidirectional. Padding is masked only when an `attention_mask`
is passed (single-device and tp use); pretraining feeds packed sequences
without padding, so every layout computes the same thing. The word embedding
is zero at `pad_token_id` (Paddle's `nn.Embedding(padding_idx=...)` lookup, as
PaddleNLP's ERNIE builds its table; see `llmtrain/interop/ernie.py`); the row
itself is still the tied output projection of that id.
"""
from __future__ import annotations

from typing import Optional

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from llmtrain.contracts import tags
from llmtrain.models.config import ModelConfig
from llmtrain.models.decoder import Block, FinalNorm, LMHead
from llmtrain.models.loss import LMLoss
from llmtrain.models.stages import Stage, stage
from llmtrain.models.layers import build_norm
from llmtrain.models.roles import Roles


class EncoderEmbedding(nn.Layer):
    """ids [b, s] -> norm(word + position + token type + task type) [b, s, h]; word is 0 at pad_token_id.

    The word table (`word`, exposed as `shared_weight`) is also the tied output projection."""

    def __init__(self, cfg: ModelConfig, roles: Roles, prefix: str = "embed"):
        super().__init__()
        tags.set_prefix(self, prefix)
        self.task_id = cfg.task_id
        self.pad_token_id = cfg.pad_token_id
        self.word = roles.vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        tags.mark_tied_table(self.word, cfg.tie_embeddings)  # read outside its own forward by the tied output projection
        self.pos = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = None
        if cfg.type_vocab_size > 0:
            self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.task_type = None
        if cfg.task_type_vocab_size > 0:
            self.task_type = nn.Embedding(cfg.task_type_vocab_size, cfg.hidden_size)
        self.norm = build_norm(cfg, cfg.hidden_size)

    @property
    def shared_weight(self):
        """The word table [V/tp, h]."""
        return self.word.weight

    def forward(self, input_ids, token_type_ids=None):  # [b, s] int64
        word = self.word(input_ids)  # [b, s, h]
        # padding_idx semantics (PaddleNLP ERNIE): the lookup gives zeros at the padding id and no gradient
        # reaches that row through the lookup; the tied output projection still uses the row.
        word = word * (input_ids != self.pad_token_id).astype(word.dtype).unsqueeze(-1)  # [b, s, h]
        x = word + self.pos(paddle.arange(input_ids.shape[1], dtype="int64"))[None]
        if self.token_type is not None:
            if token_type_ids is None:
                token_type_ids = paddle.zeros_like(input_ids)
            x = x + self.token_type(token_type_ids)
        if self.task_type is not None:
            x = x + self.task_type(paddle.full_like(input_ids, self.task_id))
        return self.norm(x)


class MLMTransform(nn.Layer):
    """The MLM head's transform: [b, s, h] -> norm(gelu(dense(x))) [b, s, h] (a plain h x h linear: small)."""

    def __init__(self, cfg: ModelConfig, roles: Roles, prefix: str = "mlm_head"):
        super().__init__()
        tags.set_prefix(self, prefix)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.approximate = cfg.activation == "gelu_tanh"
        self.norm = build_norm(cfg, cfg.hidden_size)

    def forward(self, x):
        return self.norm(F.gelu(self.dense(x), approximate=self.approximate))


class MLMBias(nn.Layer):
    """Adds the output bias to the logits: [b, s, V/tp] + [V/tp]."""

    def __init__(self, cfg: ModelConfig, roles: Roles, prefix: str = "mlm_bias"):
        super().__init__()
        tags.set_prefix(self, prefix)
        self.bias = roles.output_bias(self, cfg.vocab_size)

    def forward(self, logits):
        return logits + self.bias


def encoder_stages(cfg: ModelConfig, roles: Roles, recompute=False) -> list[Stage]:
    """The encoder as an ordered stage list (see `stages.Stage`), in the order `EncoderMLM.forward` runs them."""
    tied = "embed" if cfg.tie_embeddings else None
    stages = [stage(cfg, roles, "embed", EncoderEmbedding, tied)]
    stages += [stage(cfg, roles, f"layers.{i}", Block, recompute=recompute) for i in range(cfg.num_layers)]
    if cfg.norm_position == "pre":
        stages.append(stage(cfg, roles, "final_norm", FinalNorm))
    stages.append(stage(cfg, roles, "mlm_head", MLMTransform))
    stages.append(stage(cfg, roles, "embed", EncoderEmbedding, tied) if tied else stage(cfg, roles, "lm_head", LMHead))
    stages.append(stage(cfg, roles, "mlm_bias", MLMBias))
    return stages


class EncoderMLM(nn.Layer):
    """Encoder + masked-LM head, built with the layers `roles` hands out (plain ones when None).

    forward(input_ids [b, s], token_type_ids=None, attention_mask=None) -> logits [b, s, V/tp];
    attention_mask: [b, s] with 1 keep / 0 pad, or an additive [b, 1, 1, s].
    Loss: `self.loss_fn(logits, (labels, loss_mask))`, loss_mask 1 at masked positions.
    """

    def __init__(self, cfg: ModelConfig, roles: Optional[Roles] = None, recompute=False):
        super().__init__()
        roles = roles or Roles()
        self.cfg = cfg
        self.roles = roles
        self.embed = EncoderEmbedding(cfg, roles)
        self.layers = nn.LayerList([Block(cfg, roles, recompute, prefix=f"layers.{i}") for i in range(cfg.num_layers)])
        self.final_norm = FinalNorm(cfg, roles) if cfg.norm_position == "pre" else None
        self.mlm_head = MLMTransform(cfg, roles)
        self.lm_head = None if cfg.tie_embeddings else LMHead(cfg, roles)
        self.mlm_bias = MLMBias(cfg, roles)
        self.loss_fn = LMLoss(roles)

    def step_hooks(self) -> list:
        """The model's `StepHook`s for the training loop: none (`llmtrain.contracts.steps`)."""
        return []

    def forward(self, input_ids, token_type_ids=None, attention_mask=None):
        mask = None
        if attention_mask is not None:
            mask = attention_mask
            if mask.ndim == 2:  # [b, s] 1 keep / 0 pad -> additive [b, 1, 1, s]
                mask = ((1.0 - mask.astype("float32")) * -1e4)[:, None, None, :]
        x = self.embed(input_ids, token_type_ids)  # [b, s, h]
        for block in self.layers:
            x = block(x, mask)
        if self.final_norm is not None:
            x = self.final_norm(x)
        x = self.mlm_head(x)
        if self.lm_head is None:
            logits = self.roles.tied_logits(x, self.embed.shared_weight)  # [b, s, V/tp]
        else:
            logits = self.lm_head(x)
        return self.mlm_bias(logits)
