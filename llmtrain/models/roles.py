"""Layers requested by role, so model code stays single-device code.

    python -m pytest tests/models -q

A model never builds a layer whose shape depends on the parallel plan. It asks
a `Roles` factory for a *column linear* (a plan may split its output features),
a *row linear* (a plan may split its input features and sum the outputs), a
*replicated linear* (never split) and the hand-over of a replicated tensor to split heads, a
*vocab embedding*, an *output linear* and *output bias* over the vocabulary,
*tied logits* through the word table, and the *token loss*. The plan passes the
factory in at construction (Paddle's manual hybrid mode builds parallel layers
there, not afterwards).

`Roles` here is the single-device factory: plain Paddle layers, nothing split.
A parallel plan subclasses it and overrides what differs (the tensor-parallel
one is `llmtrain.parallel.tensor.TensorParallelRoles`). Whatever a plan does,
a model must not read shapes back from its own configuration where a plan may
have cut them: the local width of a layer is what the layer returns (e.g. a
head count from `reshape([0, 0, -1, head_dim])`).
"""
from __future__ import annotations

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from llmtrain.contracts import tags
from llmtrain.models.fused_linear import concat_linear
from llmtrain.models.lora import add_fused_adapters


def tag_linear(layer: nn.Layer, kind: str, in_features: int, out_features: int) -> nn.Layer:
    """Record that `layer` is a `kind` ("column" / "row") linear of full size in x out (LoRA adapters read it)."""
    tags.set_linear(layer, kind, in_features, out_features)
    return layer


class RoleLinear(nn.Linear):
    """`nn.Linear` whose GEMM is its `linear(x, weight, bias)` attribute (`F.linear`), as in fleet's parallel
    linears: a compute recipe (`llmtrain.fp8`) replaces that attribute, the parameters stay the same."""

    def __init__(self, in_features: int, out_features: int, bias_attr=None):
        super().__init__(in_features, out_features, bias_attr=bias_attr)
        self.linear = F.linear

    def forward(self, x):  # x [.., in] -> [.., out]
        return self.linear(x, self.weight, self.bias, name=self.name)


class Roles:
    """Single-device factory: plain Paddle layers, every parameter whole."""

    def column_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Layer:
        """x [.., in] -> y [.., out]; a plan may split `out` (y stays split, not gathered)."""
        return tag_linear(RoleLinear(in_features, out_features, bias_attr=None if bias else False), "column",
                          in_features, out_features)

    def column_linears(self, x: paddle.Tensor, layers: list) -> list:
        """Several column linears of the same input as ONE matmul: x [.., in] -> [y_i [.., out_i]].

        The weights (and biases) are concatenated along the output axis at each call and the concatenation is not
        kept for the backward (`llmtrain.models.fused_linear`), so the parameters stay the layers' own (canonical
        names, unchanged checkpoints) and no weight copy outlives the layer's forward; outputs equal
        `[layer(x) for layer in layers]`, LoRA adapters included (`llmtrain.models.lora.add_fused_adapters`:
        their x A as one block too). A plan overrides `concat_columns`, not this."""
        return add_fused_adapters(self, x, layers, self.concat_columns(x, layers))

    def concat_columns(self, x: paddle.Tensor, layers: list) -> list:
        """The base layers of `column_linears` (no adapters): x [.., in] -> [y_i [.., out_i]], one matmul."""
        return concat_linear(x, layers)

    def row_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Layer:
        """x [.., in] -> y [.., out]; a plan may split `in` (x arrives split, y is summed over the split)."""
        return tag_linear(RoleLinear(in_features, out_features, bias_attr=None if bias else False), "row",
                          in_features, out_features)

    def replicated_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Layer:
        """x [.., in] -> y [.., out], whole on every rank: a plan never splits it (multi-head latent attention's
        down-projections to the compressed q and kv, which a norm reads whole). Under tensor parallelism every rank
        computes the same y and gets the same weight gradient, provided whatever reads y hands its gradient back
        whole: a column linear (its input gradient is summed over the ranks) or `head_shared`."""
        return tag_linear(RoleLinear(in_features, out_features, bias_attr=None if bias else False), "replicated",
                          in_features, out_features)

    def lora_shapes(self, kind: str, in_features: int, out_features: int, rank: int):
        """((A shape, A split axis), (B shape, B split axis)) of a LoRA adapter on a `kind` linear; axes None: whole."""
        return ([in_features, rank], None), ([rank, out_features], None)

    def lora_down(self, kind: str, x: paddle.Tensor, a: paddle.Tensor) -> paddle.Tensor:
        """The first half of an adapter branch on a `kind` linear, x A: x [.., in] -> [.., r], whole and laid out
        like the linear's output rows, so that (x A) B is the branch (unscaled). Several adapters' A may come
        concatenated ([in, n r] -> [.., n r])."""
        return paddle.matmul(x, a)

    def head_shared(self, param: paddle.Tensor) -> paddle.Tensor:
        """A parameter every attention head applies (QK-norm's weight [head_dim]), or a tensor computed whole on every
        rank that every head reads (MLA's rotary key, one per position), as the layer should use it. A plan that
        splits the heads sums its gradient over the split (each rank's heads give a partial sum); single device: the
        tensor itself."""
        return param

    def attention_core(self, core):
        """The attention core a layer calls, `core(q, k, v, causal, mask=None, segments=None)` on this rank's
        positions (`llmtrain.models.layers.choose_attention`); a plan that splits the sequence (context
        parallelism) wraps it with its key/value exchange. Single device: the core itself."""
        return core

    def vocab_embedding(self, vocab_size: int, hidden_size: int) -> nn.Layer:
        """ids [b, s] -> [b, s, h] through a [V, h] table; a plan may split the table's rows."""
        layer = nn.Embedding(vocab_size, hidden_size)
        tags.set_role(layer, "vocab_embedding")  # the planner reads roles to know what a plan splits (llmtrain/plan/params.py)
        return layer

    def output_linear(self, hidden_size: int, vocab_size: int) -> nn.Layer:
        """Untied LM head, no bias: [b, s, h] -> logits [b, s, V]; a plan may split V (logits stay split)."""
        layer = nn.Linear(hidden_size, vocab_size, bias_attr=False)
        tags.set_role(layer, "output_linear")
        return layer

    def output_bias(self, layer: nn.Layer, vocab_size: int) -> paddle.Tensor:
        """A parameter of `layer` added to the logits: [V], zeros; a plan splits it like the logits."""
        bias = layer.create_parameter([vocab_size], is_bias=True)
        tags.set_role(bias, "output_bias")
        return bias

    def tied_logits(self, hidden: paddle.Tensor, table: paddle.Tensor) -> paddle.Tensor:
        """Tied LM head: hidden [b, s, h] x table [V, h]^T -> logits [b, s, V]."""
        return paddle.matmul(hidden, table, transpose_y=True)

    def sequence_scatter(self, x: paddle.Tensor) -> paddle.Tensor:
        """Embedding output [b, s, h] -> the residual stream between blocks; here unchanged.
        A sequence-parallel plan keeps only this rank's positions (in its own layout)."""
        return x

    def sequence_gather(self, x: paddle.Tensor) -> paddle.Tensor:
        """The inverse of `sequence_scatter`, back to [b, s, h]; here unchanged."""
        return x

    def experts(self, cfg) -> nn.Layer:
        """The routed experts of one MoE layer (`llmtrain.models.experts.Experts`); a plan may hold a block of them
        and bring tokens to them through a dispatcher (expert parallelism)."""
        from llmtrain.models.experts import Experts

        return Experts(cfg, cfg.moe_num_experts)

    def token_loss(self, logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
        """Per-token cross entropy: logits [b, s, V], labels [b, s] -> loss [b, s] (fp32)."""
        loss = F.cross_entropy(logits.astype("float32"), labels.unsqueeze(-1), reduction="none")
        return loss.squeeze(-1)
