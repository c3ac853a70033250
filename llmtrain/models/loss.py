"""The language-model loss every model family ends in: next-token (or masked-token) cross entropy.

    python -m pytest tests/models -q
    loss_sum, tokens = LMLoss(roles)(logits, (labels, loss_mask))

The per-token loss comes from `roles.token_loss` (a tensor-parallel plan computes it
over vocabulary shards), so this layer is the same under every layout.
"""
from __future__ import annotations

import paddle.nn as nn

from llmtrain.models.roles import Roles


class LMLoss(nn.Layer):
    """Next-token (or masked-token) cross entropy over loss-bearing positions, as a sum and a count.

    logits [b, s, V/tp]; labels = (target ids [b, s] int64, loss_mask [b, s] fp32).
    Returns (sum(ce * mask), sum(mask)) for this micro-batch (fp32 scalars): the caller divides
    (`llmtrain.contracts.steps.mean_loss`, a training step) or sums over batches first (evaluation:
    exact token-weighted means over any batching).
    """

    def __init__(self, roles: Roles):
        super().__init__()
        self.roles = roles

    def forward(self, logits, labels):
        target, mask = labels
        ce = self.roles.token_loss(logits, target)  # [b, s]
        mask = mask.astype("float32")
        return (ce * mask).sum(), mask.sum()
