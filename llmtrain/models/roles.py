"""Layers requested by role, so model code stays single-device code.

A model never builds an `nn.Linear` whose shape depends on the parallel plan.
It asks a `Roles` factory for a *column* linear (output features split across
tensor-parallel ranks), a *row* linear (input features split, output summed), a
*vocab embedding*, an *output projection*, and the *token loss*. `Roles` here
is the single-device plan; `llmtrain.parallel.tensor.TensorParallelRoles`
returns fleet's `ColumnParallelLinear`, `RowParallelLinear`,
`VocabParallelEmbedding` and `ParallelCrossEntropy` instead (Megatron's
`ModuleSpec` idea, acting at construction time as Paddle's manual hybrid mode
requires).

Every parameter a factory creates is tagged with `llm_split_axis` (the axis
that is split across tensor-parallel ranks, or None) so that initialisation
and checkpoints can work on the full logical tensor whatever the layout.
"""
from __future__ import annotations

import paddle
import paddle.nn as nn
import paddle.nn.functional as F


def tag_split(layer: nn.Layer, weight_axis, bias_axis=None) -> nn.Layer:
    """Record which axis of `layer.weight` / `layer.bias` is split across tp ranks."""
    for pname, axis in (("weight", weight_axis), ("bias", bias_axis)):
        p = getattr(layer, pname, None)
        if p is not None:
            p.llm_split_axis = axis
    return layer


class Roles:
    """Single-device plan: plain Paddle layers, nothing split."""

    tp_degree: int = 1
    """Tensor-parallel degree; models divide heads and widths by it."""

    tp_rank: int = 0
    """This process's rank inside its tensor-parallel group."""

    def column_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Layer:
        """x [.., in] -> y [.., out / tp]: output features split across tp ranks."""
        return tag_split(nn.Linear(in_features, out_features, bias_attr=None if bias else False), None)

    def row_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Layer:
        """x [.., in / tp] -> y [.., out]: input features split, partial outputs summed."""
        return tag_split(nn.Linear(in_features, out_features, bias_attr=None if bias else False), None)

    def vocab_embedding(self, vocab_size: int, hidden_size: int) -> nn.Layer:
        """ids [b, s] -> [b, s, h]; the table's rows are split across tp ranks."""
        return tag_split(nn.Embedding(vocab_size, hidden_size), None)

    def output_linear(self, hidden_size: int, vocab_size: int) -> nn.Layer:
        """Untied LM head: [b, s, h] -> logits [b, s, V / tp] (vocab split, not gathered)."""
        return tag_split(nn.Linear(hidden_size, vocab_size, bias_attr=False), None)

    def vocab_parallel_bias(self, layer: nn.Layer, vocab_size: int) -> paddle.Tensor:
        """An output bias over the vocabulary, split like the logits: [V / tp], zeros."""
        bias = layer.create_parameter([vocab_size // self.tp_degree], is_bias=True)
        bias.llm_split_axis = 0 if self.tp_degree > 1 else None
        if self.tp_degree > 1:
            bias.is_distributed = True  # fleet: a split tensor (norm counted per rank, never broadcast over mp)
        return bias

    def tied_logits(self, hidden: paddle.Tensor, embedding_weight: paddle.Tensor) -> paddle.Tensor:
        """Tied LM head: hidden [b, s, h] x table [V / tp, h]^T -> logits [b, s, V / tp]."""
        return paddle.matmul(hidden, embedding_weight, transpose_y=True)

    def token_loss(self, logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
        """Per-token cross entropy: logits [b, s, V / tp], labels [b, s] -> loss [b, s] (fp32)."""
        loss = F.cross_entropy(logits.astype("float32"), labels.unsqueeze(-1), reduction="none")
        return loss.squeeze(-1)
