"""Sequence parallelism under tp (Megatron-style, Korthikanti et al. 2022): norms on sequence shards.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py model=llama-tiny +parallel=tp2 \
        parallel.sequence_parallel=true

Between the tensor-parallel blocks the residual stream lives as this rank's 1/tp of the
sequence, [s/tp, b, h]: the norms (and their saved activations) work on s/tp positions.
Each column linear all-gathers the sequence before its matmul (fleet's
`ColumnSequenceParallelLinear`: all-gather forward, reduce-scatter of d(x) backward), each
row linear reduce-scatters its partial sums instead of all-reducing them
(`RowSequenceParallelLinear`), the embedding output is cut into shards (`ScatterOp`) and the
LM head gathers them back (`GatherOp`). Norm weights see only their shard's positions, so
they are marked with fleet's `mark_as_sequence_parallel_parameter` and their gradients
all-reduced over the tp group after the last micro-batch
(`register_sequence_parallel_allreduce_hooks`), as PaddleNLP does. All of these are fleet's
public `paddle.distributed.fleet.utils.sequence_parallel_utils`; on CPU its two collectives
are served by `llmtrain/paddle_compat/cpu_backend/sequence_parallel.py`. LoRA adapters follow
their base (`lora_down`): a column linear's x A is all-gathered like its input, a row linear's
partial x A reduce-scattered like its output, both on r columns instead of h; the factors whole
on every tp rank (column A, row B) get gradients from this rank's positions only and are
all-reduced like the norms.

The model code stays single-device ([b, s, ...] inside attention and MLP): these roles
transpose at the edges of the sequence-parallel region (the shards are [s/tp, b, h] on axis
0, fleet's convention). Parameters are fleet's tp layers with the same shapes and canonical
names as plain tp, so checkpoints move freely between tp and tp+sp.

What it saves: the norms' inputs and outputs (no dropout here) are 1/tp per rank. Fleet's
plain column linear keeps the all-gathered [s, b, h] input for its weight gradient (it does
not re-gather in backward unless mp_configs.sp_async_reduce_scatter + recompute_allgather),
so the linear inputs stay whole; and without model.fuse_qkv / fuse_ffn every projection
gathers (and keeps) its own copy: turn those on with sequence parallelism.
"""
from __future__ import annotations

import paddle
import paddle.nn as nn
from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear
from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

from llmtrain.contracts import tags
from llmtrain.models.roles import concat_linear, tag_linear
from llmtrain.parallel.tensor import TensorParallelRoles, tag_split


def _swap01(x):  # [a, b, ...] -> [b, a, ...]
    return x.transpose([1, 0, *range(2, x.ndim)])


class _SeqColumn(spu.ColumnSequenceParallelLinear):
    """x [s/tp, b, in] -> all-gather -> [s, b, out/tp] -> [b, s, out/tp]."""

    def forward(self, x):
        return _swap01(super().forward(x))


class _SeqRow(spu.RowSequenceParallelLinear):
    """x [b, s, in/tp] -> [s, b, in/tp] -> matmul, reduce-scatter -> [s/tp, b, out]."""

    def forward(self, x):
        return super().forward(_swap01(x))


class _GatheredColumn(ColumnParallelLinear):
    """The LM head: x [s/tp, b, h] -> gathered [b, s, h] -> [b, s, V/tp]."""

    def forward(self, x):
        return super().forward(_swap01(spu.GatherOp.apply(x)))


class SequenceParallelRoles(TensorParallelRoles):
    """TensorParallelRoles with the residual stream on sequence shards (see the module docstring)."""

    def column_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Layer:
        layer = tag_linear(_SeqColumn(in_features, out_features, has_bias=bias, gather_output=False), "column",
                           in_features, out_features)
        return tag_split(layer, weight_axis=1, bias_axis=0)  # weight [in, out/tp], bias [out/tp]

    def row_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Layer:
        layer = tag_linear(_SeqRow(in_features, out_features, has_bias=bias, input_is_parallel=True), "row",
                           in_features, out_features)
        return tag_split(layer, weight_axis=0, bias_axis=None)  # weight [in/tp, out], bias [out] (sp-marked)

    def concat_columns(self, x, layers: list) -> list:
        full = spu.AllGatherOp.apply(x)  # [s/tp, b, h] -> [s, b, h], once for all the projections
        return [_swap01(y) for y in concat_linear(full, layers)]  # [b, s, out_i/tp]

    def lora_down(self, kind: str, x, a):
        """x A in the layout of the sequence-parallel linear's output: a column linear (x [s/tp, b, in]) gathers
        the [s/tp, b, r] shards to [b, s, r] (backward: reduce-scatter of the partial d(xA) of each rank's B
        columns); a row linear (x [b, s, in/tp]) reduce-scatters its partial sums to [s/tp, b, r]."""
        xa = paddle.matmul(x, a)
        if kind == "column":
            return _swap01(spu.AllGatherOp.apply(xa))  # [b, s, r], then @ B [r, out/tp]
        return spu.ReduceScatterOp.apply(_swap01(xa))  # [s/tp, b, r], then @ B [r, out]

    def output_linear(self, hidden_size: int, vocab_size: int) -> nn.Layer:
        layer = _GatheredColumn(hidden_size, vocab_size, has_bias=False, gather_output=False)
        return tag_split(layer, weight_axis=1)  # weight [h, V/tp]

    def tied_logits(self, hidden, table):
        return super().tied_logits(self.sequence_gather(hidden), table)  # [b, s, V/tp]

    def sequence_scatter(self, x):  # [b, s, h] -> this rank's [s/tp, b, h]
        return spu.ScatterOp.apply(_swap01(x))

    def sequence_gather(self, x):  # [s/tp, b, h] -> [b, s, h]
        return _swap01(spu.GatherOp.apply(x))


def mark_sequence_parallel_norms(model: nn.Layer) -> int:
    """Mark every parameter whose gradient each tp rank computes from its own positions only: the norms, and the
    LoRA factors whole on every tp rank (a column linear's A sees this rank's x shard, a row linear's B its
    reduce-scattered x A shard). Returns how many were marked."""
    from llmtrain.models.layers import RMSNorm

    marked = 0
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, (nn.LayerNorm, RMSNorm)):
            for p in layer.parameters(include_sublayers=False):
                spu.mark_as_sequence_parallel_parameter(p)
                marked += 1
    for p in model.parameters():
        if tags.is_lora(p) and tags.split_axis(p) is None:
            spu.mark_as_sequence_parallel_parameter(p)
            marked += 1
    return marked


def install_grad_allreduce(model: nn.Layer, grad_accum: int) -> int:
    """Norm weights marked, and fleet's hooks that all-reduce sequence-parallel gradients over tp after
    `grad_accum` micro-batches. Returns the number of sequence-parallel parameters."""
    mark_sequence_parallel_norms(model)
    spu.register_sequence_parallel_allreduce_hooks(model, grad_accum, fuse_sequence_parallel_allreduce=False)
    return sum(1 for p in model.parameters() if spu.is_sequence_parallel_parameter(p) and not p.stop_gradient)


def sequence_parallel_problems(parallel, model, seq_len: int) -> list[str]:
    """parallel.sequence_parallel needs a decoder and a sequence length divisible by tp."""
    if parallel is None or not getattr(parallel, "sequence_parallel", False):
        return []
    problems = []  # tp > 1 is checked with the layout (llmtrain/parallel/layout.py)
    if parallel.tp > 1 and seq_len % parallel.tp:
        problems.append(f"parallel.sequence_parallel=true: data.seq_len={seq_len} is not divisible by "
                        f"parallel.tp={parallel.tp}")
    if model.family != "decoder":
        problems.append(f"parallel.sequence_parallel=true with model.family={model.family}: implemented for the "
                        "decoder only")
    return problems
