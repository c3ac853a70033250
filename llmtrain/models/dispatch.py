"""Tokens into the expert-major buffer [E, C, h] and back: the MoE dispatch, from tensor ops only.

    python -m pytest tests/models/test_dispatch.py -q
    slots = expert_slots(index, num_experts, capacity)    # where every (token, choice) goes
    buffer = dispatch(x, slots)                            # [T, h] -> [E, C, h]
    y = combine(expert_out, slots, weight)                 # [E, C, h] -> [T, h]

The op sequence is written out in `llmtrain.models.experts` (steps 1-5 and 7 are here). No step reads a value on
the host except the dropless capacity (`capacity=None`): C = the largest expert load of the micro-batch,
`int(counts.max())`, the one host read of an MoE layer, taken through `agree` (an expert-parallel dispatcher
takes the maximum over its group first, so every rank's buffer has the same C).

On a GPU the combine runs as Paddle's fused `moe_combine` kernel when the installed Paddle is the tested one
(`llmtrain.paddle_compat.moe_kernels`); the tensor ops below are the CPU path and the fallback.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import paddle
import paddle.nn.functional as F

from llmtrain.paddle_compat import amp, moe_kernels


@dataclass
class Slots:
    """Where each of the k T choices of a micro-batch sits in the expert-major buffer, in slot-major order (every
    token's first choice, then every second, ...: GShard's queue order, as `llmtrain.models.router.route` counts the
    capacity)."""

    slot: paddle.Tensor
    """[k T] int64: row of the choice in the flat buffer [E C + 1, h]; E C (the trash row) for a dropped choice."""
    row: paddle.Tensor
    """[T, k] int64: the same rows in token-major order for the combine, 0 for a dropped choice (weighted by 0)."""
    kept: paddle.Tensor
    """[T, k] bool: the choice is computed (index >= 0 and, with a capacity, its place in the queue < C)."""
    source: paddle.Tensor
    """[E C] int64: the token in each buffer row, T for an empty row (the zero row appended to x by `dispatch`)."""
    num_experts: int
    capacity: int
    """C, rows per expert."""


def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Tokens one expert takes from a micro-batch: ceil(factor * tokens * top_k / experts)."""
    return int(math.ceil(factor * tokens * top_k / num_experts))


def host_int(t: paddle.Tensor) -> int:
    """The one host read of a dropless MoE layer (one device, or a dispatcher's group maximum already taken)."""
    return int(t.reshape([]))


def expert_slots(index: paddle.Tensor, num_experts: int, capacity: Optional[int],
                 agree: Callable[[paddle.Tensor], int] = host_int) -> Slots:
    """Steps 1-4: index [T, k] int64 (-1: dropped) -> the buffer row of every choice.

    `capacity`: C (capacity mode: static, no host read) or None (dropless: C = the largest expert load,
    `agree(counts.max())`). With a capacity, a choice past its expert's C-th place is dropped here too (route()
    has already dropped them: this only keeps a caller's index from writing into the next expert's rows)."""
    num_tokens, top_k = index.shape
    idx = index.transpose([1, 0]).reshape([top_k * num_tokens])  # [k T] slot-major
    keep = idx >= 0  # [k T]
    onehot = F.one_hot(paddle.clip(idx, min=0), num_experts).astype("int64") * keep.astype("int64")[:, None]
    pos = (paddle.cumsum(onehot, axis=0) * onehot).sum(-1) - 1  # [k T] place in its expert's queue
    if capacity is None:
        capacity = max(agree(onehot.sum(0).max()), 1)  # dropless: the one host read of the layer
    else:
        keep = keep & (pos < capacity)
    rows = num_experts * capacity
    slot = paddle.where(keep, idx * capacity + pos, paddle.full_like(idx, rows))  # [k T]
    row = paddle.where(keep, slot, paddle.zeros_like(slot)).reshape([top_k, num_tokens]).transpose([1, 0])  # [T, k]
    kept = keep.reshape([top_k, num_tokens]).transpose([1, 0])  # [T, k]
    token = paddle.tile(paddle.arange(num_tokens, dtype="int64"), [top_k])  # [k T] token of each choice
    source = paddle.scatter(paddle.full([rows + 1], num_tokens, "int64"), slot, token)[:rows]  # [E C]
    return Slots(slot, row, kept, source, num_experts, capacity)


def dispatch(x: paddle.Tensor, slots: Slots) -> paddle.Tensor:
    """Step 5: x [T, h] -> [E, C, h]: each buffer row gathers its token (`slots.source`), an empty row the zero row
    appended to x. (A gather, whose backward is one index_add into [T + 1, h]; measured on CPU 6x faster forward +
    backward than an index_add of the k T choices into the buffer, whose backward Paddle runs slowly.)"""
    hidden = x.shape[1]
    padded = paddle.concat([x, paddle.zeros([1, hidden], dtype=x.dtype)])  # [T + 1, h]
    return paddle.gather(padded, slots.source).reshape([slots.num_experts, slots.capacity, hidden])  # [E, C, h]


def combine(y: paddle.Tensor, slots: Slots, weight: paddle.Tensor, fp32: bool = True) -> paddle.Tensor:
    """Step 7: expert outputs y [E, C, h] -> [T, h] = sum over a token's k choices of weight * its row (weight
    [T, k] fp32, set to 0 where dropped). `fp32` (`model.moe_router_dtype=fp32`): the products and their sum in
    fp32 whatever AMP does, the result cast once to y's dtype (Megatron, torchtitan); else the weight is cast to y's
    dtype and the sum runs in it (bf16 under AMP: k roundings)."""
    flat = y.reshape([-1, y.shape[-1]])  # [E C, h]
    weight = weight * slots.kept.astype(weight.dtype)  # [T, k] fp32; a dropped choice adds nothing
    if not fp32:
        return _weighted_sum(flat, slots, weight.astype(y.dtype))
    with amp.fp32_region():
        out = _weighted_sum(flat, slots, weight)  # [T, h] fp32
    return out if y.dtype == paddle.float32 else out.astype(y.dtype)


def _as(t: paddle.Tensor, dtype) -> paddle.Tensor:
    return t if t.dtype == dtype else t.astype(dtype)


def _weighted_sum(flat: paddle.Tensor, slots: Slots, weight: paddle.Tensor) -> paddle.Tensor:
    """flat [E C, h], weight [T, k] -> [T, h] computed in the weight's dtype: the fused kernel on a GPU (flat cast to
    it), else the rows gathered, cast, weighted and summed."""
    if moe_kernels.fused_combine_available():
        return moe_kernels.fused_combine(_as(flat, weight.dtype), weight, slots.row)  # GPU-ONLY(moe-combine)
    num_tokens, top_k = weight.shape
    rows = _as(paddle.gather(flat, slots.row.reshape([-1])), weight.dtype)  # [T k, h] token-major
    return (rows.reshape([num_tokens, top_k, -1]) * weight.unsqueeze(-1)).sum(1)  # [T, h]
