"""Tensor-parallel plan: the `Roles` factory backed by fleet's Megatron-style layers.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py model=llama-tiny +parallel=tp2

    roles = TensorParallelRoles(topo)     # after init_distributed with tp > 1
    model = build_model(cfg.model, roles)

q/k/v and gate/up are `ColumnParallelLinear` (outputs split, not gathered), o and
down are `RowParallelLinear` (inputs split, outputs all-reduced), a replicated linear
(MLA's down-projections) stays a plain whole `nn.Linear` on every rank, the word table
is a `VocabParallelEmbedding`, and the loss is `ParallelCrossEntropy` on
vocabulary-split logits, so the full [b, s, V] logits never exist on one rank.
On CPU the collectives inside these layers are served by
`llmtrain.paddle_compat.cpu_backend`; on GPU they are fleet's own kernels.

Every split parameter is tagged with its split axis (`llmtrain.contracts.tags.set_split_axis`) (the axis cut across the
tp ranks, each rank holding one contiguous chunk in rank order); an untagged
parameter is whole on every rank. `llmtrain.parallel.slicing` and the
checkpoint read the tag to go between the full logical tensor and this rank's
chunk.
"""
from __future__ import annotations

import paddle
import paddle.nn as nn

from llmtrain.contracts import tags
from llmtrain.models.roles import Roles, tag_linear
from llmtrain.paddle_compat.fleet import c_identity, mp_allreduce


def tag_split(layer: nn.Layer, weight_axis, bias_axis=None) -> nn.Layer:
    """Record which axis of `layer.weight` / `layer.bias` is split across tp ranks (None: whole)."""
    for pname, axis in (("weight", weight_axis), ("bias", bias_axis)):
        p = getattr(layer, pname, None)
        if p is not None:
            tags.set_split_axis(p, axis)
    return layer


class TensorParallelRoles(Roles):
    """Megatron-style tensor parallelism through `paddle.distributed.fleet.meta_parallel`.

    Shapes below are this rank's: V/tp rows of the vocabulary, out/tp or in/tp features."""

    def __init__(self, topo):
        from paddle.distributed.fleet import meta_parallel as mpu

        self._mpu = mpu
        self.group = topo.group("tp")
        self.tp_degree = topo.size("tp")
        self.tp_rank = topo.tp_rank
        self._ce = None

    def column_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Layer:
        layer = self._mpu.ColumnParallelLinear(in_features, out_features, has_bias=bias, gather_output=False)
        tag_linear(layer, "column", in_features, out_features)
        return tag_split(layer, weight_axis=1, bias_axis=0)  # weight [in, out/tp], bias [out/tp]

    def concat_columns(self, x: paddle.Tensor, layers: list) -> list:
        # ColumnParallelLinear's own forward, once for all: identity forward and ONE all-reduce of
        # d(x) backward, then this rank's concatenated output columns [.., sum out_i/tp]
        from llmtrain.models.roles import concat_linear

        return concat_linear(c_identity(x, self.group), layers)

    def row_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Layer:
        layer = self._mpu.RowParallelLinear(in_features, out_features, has_bias=bias, input_is_parallel=True)
        tag_linear(layer, "row", in_features, out_features)
        return tag_split(layer, weight_axis=0, bias_axis=None)  # weight [in/tp, out], bias [out]

    def lora_shapes(self, kind: str, in_features: int, out_features: int, rank: int):
        """Split with the base (PaddleNLP's ColumnParallelLoRALinear / RowParallelLoRALinear): a column linear's
        B [r, out/tp] (axis 1), a row linear's A [in/tp, r] (axis 0); the other factor whole on every tp rank.
        A replicated linear's adapter is whole on every rank, like its base."""
        if kind == "replicated":
            return super().lora_shapes(kind, in_features, out_features, rank)
        if kind == "column":
            return ([in_features, rank], None), ([rank, out_features // self.tp_degree], 1)
        return ([in_features // self.tp_degree, rank], 0), ([rank, out_features], None)

    def lora_down(self, kind: str, x: paddle.Tensor, a: paddle.Tensor) -> paddle.Tensor:
        xa = paddle.matmul(x, a)  # [.., r]: column: x whole; row: x [.., in/tp], a partial sum
        if kind == "replicated":  # x and the base's output whole on every rank: nothing to exchange
            return xa
        if kind == "column":
            # identity forward; backward all-reduces d(xA), whose parts come from each rank's out/tp columns of B
            return c_identity(xa, self.group)  # [.., r], then @ B [r, out/tp]
        return mp_allreduce(xa, self.group)  # sum over the in/tp slices -> [.., r], then @ B [r, out] (whole)

    def head_shared(self, param: paddle.Tensor) -> paddle.Tensor:
        # whole on every rank, applied to this rank's nh/tp heads: identity forward, the gradient's partial sums
        # all-reduced over tp backward (Megatron's and HF's "replicated with grad all-reduce" for QK-norm)
        return c_identity(param, self.group)

    def vocab_embedding(self, vocab_size: int, hidden_size: int) -> nn.Layer:
        return tag_split(self._mpu.VocabParallelEmbedding(vocab_size, hidden_size), weight_axis=0)  # [V/tp, h]

    def output_linear(self, hidden_size: int, vocab_size: int) -> nn.Layer:
        layer = self._mpu.ColumnParallelLinear(hidden_size, vocab_size, has_bias=False, gather_output=False)
        return tag_split(layer, weight_axis=1)  # weight [h, V/tp]

    def output_bias(self, layer: nn.Layer, vocab_size: int) -> paddle.Tensor:
        bias = layer.create_parameter([vocab_size // self.tp_degree], is_bias=True)  # [V/tp]
        tags.set_split_axis(bias, 0)
        bias.is_distributed = True  # fleet: a split tensor (norm counted per rank, never broadcast over mp)
        return bias

    def tied_logits(self, hidden: paddle.Tensor, table: paddle.Tensor) -> paddle.Tensor:
        # identity forward, all-reduce of d(hidden) backward: every rank's vocab slice contributes
        hidden = c_identity(hidden, self.group)  # [b, s, h]
        return paddle.matmul(hidden, table, transpose_y=True)  # [b, s, h] x [V/tp, h]^T -> [b, s, V/tp]

    def token_loss(self, logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
        if self._ce is None:
            self._ce = self._mpu.ParallelCrossEntropy()
        loss = self._ce(logits.astype("float32"), labels.unsqueeze(-1))  # [b, s, 1]
        return loss.squeeze(-1)
