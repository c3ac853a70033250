"""CPU references of Paddle's GPU-only kernels, written from their documentation (Paddle 3.3.1 docstrings).

    from gpu_references import flash_attention, flashmask_attention, dense_attention
    stand_in = checked(real_flashmask, flashmask_attention, FLASHMASK_ARGS)

Each takes the arguments of the Paddle function by name (through `gpu_rehearsal.checked`), repeats the input
checks the Paddle wrapper or kernel makes (dtype, shapes, the number of mask columns for the causality), and
computes in fp32 with plain tensor ops, returning the kernel's dtype. They share no code with llmtrain's own
attention (`llmtrain/models/layers.py:math_attention`), which is what they are compared with.
"""
from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F

LOW_PRECISION = (paddle.float16, paddle.bfloat16)


def dense_attention(q, k, v, drop=None, bias=None, causal: bool = False, scale=None):
    """softmax(q k^T * scale + bias, dropping `drop` and, if causal, keys after the query) v, in fp32.

    q [b, sq, nh, d]; k [b, sk, nkv, d], v [b, sk, nkv, dv] with nh a multiple of nkv (query head h reads kv head
    h // (nh / nkv)); drop bool, bias float, both broadcastable to [b, nh, sq, sk]. Returns [b, sq, nh, dv] fp32."""
    b, sq, nh, d = q.shape
    sk, nkv = k.shape[1], k.shape[2]
    if nh % nkv:
        raise ValueError(f"{nh} query heads cannot share {nkv} key/value heads")
    group = nh // nkv
    qg = q.astype("float32").reshape([b, sq, nkv, group, d])  # query heads grouped by the kv head they read
    scores = paddle.einsum("bqgrd,bkgd->bgrqk", qg, k.astype("float32")).reshape([b, nh, sq, sk])
    scores = scores * (d ** -0.5 if scale is None else scale)
    if bias is not None:
        scores = scores + bias.astype("float32")
    rows = paddle.arange(sq).reshape([sq, 1])
    cols = paddle.arange(sk).reshape([1, sk])
    dropped = paddle.zeros([1, 1, sq, sk], dtype="bool")
    if causal:
        dropped = paddle.logical_or(dropped, (cols > rows).reshape([1, 1, sq, sk]))
    if drop is not None:
        dropped = paddle.logical_or(dropped, drop)
    scores = paddle.where(dropped, paddle.full_like(scores, float("-inf")), scores)
    probs = F.softmax(scores, axis=-1).reshape([b, nkv, group, sq, sk])
    out = paddle.einsum("bgrqk,bkgd->bqgrd", probs, v.astype("float32"))  # [b, sq, nkv, group, dv]
    return out.reshape([b, sq, nh, v.shape[-1]])


def _one_head_width(fn: str, query, key, value) -> None:
    """Paddle's flash kernels take q, k and v of one head width ("all these tensors share the same dimensions")."""
    widths = [query.shape[-1], key.shape[-1], value.shape[-1]]
    if len(set(widths)) != 1:
        raise ValueError(f"{fn}: head widths q {widths[0]}, k {widths[1]}, v {widths[2]}: the kernel takes one width")


def _low_precision(fn: str, **tensors) -> None:
    for name, t in tensors.items():
        if t.dtype not in LOW_PRECISION:
            raise TypeError(f"{fn}: {name} is {t.dtype}; the kernel takes float16 or bfloat16 only")
    if len({t.dtype for t in tensors.values()}) != 1:
        raise TypeError(f"{fn}: query, key and value must share one dtype, got {[str(t.dtype) for t in tensors.values()]}")


FLASH_ARGS = ("query", "key", "value", "causal")
"""The arguments of paddle.nn.functional.flash_attention.flash_attention the reference models (others: defaults)."""


def flash_attention(query, key, value, causal, **_defaults):
    """flash_attention(query [b, s, nh, d], key/value [b, s, nkv, d], causal) -> (out [b, s, nh, d], None)."""
    _low_precision("flash_attention", query=query, key=key, value=value)
    _one_head_width("flash_attention", query, key, value)
    return dense_attention(query, key, value, causal=causal).astype(query.dtype), None


FLASHMASK_ARGS = ("query", "key", "value", "startend_row_indices", "causal")
"""The arguments of flashmask_attention the reference models."""


def flashmask_rows_dropped(startend_row_indices, causal: bool, sq: int, nh: int):
    """The column-wise mask of flashmask's docstring as a dense bool [b, nh, sq, sk] (True: dropped).

    startend_row_indices [b, h, sk, c] int32, h 1 or a divisor of nh; for key j: causal, c=1: rows >= LTS[j];
    causal, c=2: LTS[j] <= row < LTE[j]; bidirectional, c=2: rows >= LTS[j] or rows < UTE[j]; bidirectional, c=4:
    LTS <= row < LTE or UTS <= row < UTE."""
    idx = startend_row_indices.astype("int64").transpose([0, 1, 3, 2]).unsqueeze(3)  # [b, h, c, 1, sk]
    if idx.shape[1] not in (1, nh):
        idx = paddle.repeat_interleave(idx, nh // idx.shape[1], axis=1)
    row = paddle.arange(sq, dtype="int64").reshape([1, 1, sq, 1])
    cols = idx.shape[2]
    if causal and cols == 1:
        return row >= idx[:, :, 0]
    if causal and cols == 2:
        return paddle.logical_and(row >= idx[:, :, 0], row < idx[:, :, 1])
    if not causal and cols == 2:
        return paddle.logical_or(row >= idx[:, :, 0], row < idx[:, :, 1])
    lower = paddle.logical_and(row >= idx[:, :, 0], row < idx[:, :, 1])
    return paddle.logical_or(lower, paddle.logical_and(row >= idx[:, :, 2], row < idx[:, :, 3]))


def flashmask_attention(query, key, value, startend_row_indices, causal, **_defaults):
    """flashmask_attention with the checks of Paddle 3.3.1's wrapper (int32, rank 4, batch, key length, heads, and
    1 or 2 columns when causal, 2 or 4 when not) and the dense form of its mask; returns out [b, s, nh, d]."""
    _low_precision("flashmask_attention", query=query, key=key, value=value)
    _one_head_width("flashmask_attention", query, key, value)
    rows = startend_row_indices
    if rows is None:
        return dense_attention(query, key, value, causal=causal).astype(query.dtype)
    if rows.dtype != paddle.int32:
        raise AssertionError(f"startend_row_indices.dtype must be paddle.int32, but got {rows.dtype}")
    if len(rows.shape) != 4 or rows.shape[0] != key.shape[0] or rows.shape[2] != key.shape[1]:
        raise AssertionError(f"startend_row_indices {rows.shape}: expected [batch {key.shape[0]}, heads, "
                             f"seqlen_k {key.shape[1]}, columns]")
    if rows.shape[1] not in (1, query.shape[2], key.shape[2]):
        raise AssertionError(f"startend_row_indices head_num {rows.shape[1]}: 1, {query.shape[2]} or {key.shape[2]}")
    allowed = (1, 2) if causal else (2, 4)
    if rows.shape[-1] not in allowed:
        raise ValueError(f"Invalid shape of startend_row_indices, when causal is {causal}, the last dimension should "
                         f"be either {allowed[0]} or {allowed[1]} but got {rows.shape[-1]}")
    drop = flashmask_rows_dropped(rows, causal, query.shape[1], query.shape[2])
    return dense_attention(query, key, value, drop=drop, causal=causal).astype(query.dtype)


SDPA_ARGS = ("query", "key", "value", "attn_mask", "is_causal")
"""The arguments of paddle.nn.functional.scaled_dot_product_attention the reference models."""


def scaled_dot_product_attention(query, key, value, attn_mask, is_causal, **_defaults):
    """sdpa(query [b, s, nh, d], key/value [b, s, nkv, d], attn_mask bool (True: attend) or additive, is_causal)."""
    _low_precision("scaled_dot_product_attention", query=query, key=key, value=value)
    if attn_mask is None:
        out = dense_attention(query, key, value, causal=is_causal)
    elif attn_mask.dtype == paddle.bool:
        out = dense_attention(query, key, value, drop=paddle.logical_not(attn_mask), causal=is_causal)
    elif attn_mask.dtype != query.dtype:  # Paddle's docstring: "The dtype can be bool or same type of query"
        raise TypeError(f"scaled_dot_product_attention: attn_mask {attn_mask.dtype} with query {query.dtype}: the "
                        "mask is bool or of the query's dtype")
    else:
        out = dense_attention(query, key, value, bias=attn_mask, causal=is_causal)
    return out.astype(query.dtype)


RMS_NORM_ARGS = ("x", "norm_weight", "norm_bias", "epsilon", "begin_norm_axis")
"""The arguments of paddle.incubate.nn.functional.fused_rms_norm the reference models (no residual, no quant)."""


def fused_rms_norm(x, norm_weight, norm_bias, epsilon, begin_norm_axis, **_defaults):
    """x normalised over the axes from `begin_norm_axis` on, times norm_weight (+ norm_bias); fp32 statistics.

    Returns (out, residual_out, inv_var) as the dygraph op does (out in x's dtype; residual_out None here)."""
    rank = len(x.shape)
    axis = begin_norm_axis + rank if begin_norm_axis < 0 else begin_norm_axis
    if not 0 <= axis < rank:
        raise ValueError(f"begin_norm_axis must be in range [0, {rank}), but got {begin_norm_axis}")
    norm_shape = list(x.shape[axis:])
    if list(norm_weight.shape) not in (norm_shape, [math.prod(norm_shape)]):
        raise ValueError(f"fused_rms_norm: norm_weight {list(norm_weight.shape)} for normalised axes {norm_shape}")
    xf = x.astype("float32")
    inv = paddle.rsqrt((xf * xf).mean(axis=list(range(axis, rank)), keepdim=True) + epsilon)
    out = xf * inv * norm_weight.astype("float32").reshape(norm_shape)
    if norm_bias is not None:
        out = out + norm_bias.astype("float32").reshape(norm_shape)
    return out.astype(x.dtype), None, inv.reshape(x.shape[:axis])


ROPE_ARGS = ("q", "k", "v", "sin", "cos", "position_ids", "use_neox_rotary_style")
"""The arguments of paddle.incubate.nn.functional.fused_rotary_position_embedding the reference models."""


def fused_rotary_position_embedding(q, k, v, sin, cos, position_ids, use_neox_rotary_style, **_defaults):
    """Rotary embedding of q (and k, v) [b, s, h, d] with the checks of Paddle's GPU kernel (fused_rope_kernel.cu):
    sin/cos of equal dims, [S, d] or [1, S, 1, d], in q's dtype; without position_ids S == s, with them S >= s and
    position_ids [b, s] int64 picking the rows. use_neox_rotary_style=False rotates halves (x1, x2) -> (-x2, x1);
    True rotates adjacent pairs. Returns (out_q, out_k, out_v), None for an absent input."""
    b, s, _, d = q.shape
    if d % 2:
        raise ValueError("The head_dim of input must be a multiple of 2.")
    if sin is None or cos is None:  # the wrapper's own checks
        if position_ids is not None or not use_neox_rotary_style:
            raise AssertionError("position_ids or rotate_half without sin/cos is not correctly supported now.")
        raise NotImplementedError("the reference needs sin and cos")
    if sin.shape != cos.shape or len(sin.shape) not in (2, 4):
        raise ValueError(f"sin {sin.shape} and cos {cos.shape}: equal dims of rank 2 or 4 expected")
    if len(sin.shape) == 4 and (sin.shape[0] != 1 or sin.shape[2] != 1):
        raise ValueError("The batch_size and num_heads of sin and cos must be 1.")
    if sin.dtype != q.dtype or cos.dtype != q.dtype:
        raise TypeError(f"sin/cos {sin.dtype}/{cos.dtype} with q {q.dtype}: the kernel reads them as q's dtype")
    table = sin.shape[-2] if len(sin.shape) == 2 else sin.shape[1]
    if sin.shape[-1] != d:
        raise ValueError(f"head_dim of sin/cos {sin.shape[-1]} != {d}")
    sin2, cos2 = sin.reshape([table, d]).astype("float32"), cos.reshape([table, d]).astype("float32")
    if position_ids is None:
        if table != s:
            raise ValueError(f"The seq_len of sin and cos ({table}) must be the same as q's ({s})")
        sin_rows, cos_rows = sin2.reshape([1, s, 1, d]), cos2.reshape([1, s, 1, d])
    else:
        if table < s or position_ids.dtype != paddle.int64 or list(position_ids.shape) != [b, s]:
            raise ValueError(f"position_ids {position_ids.shape} {position_ids.dtype} with table {table}, q {q.shape}")
        if int(position_ids.max()) >= table or int(position_ids.min()) < 0:
            raise IndexError(f"position {int(position_ids.max())} outside the sin/cos table of {table} rows: the GPU "
                             "kernel reads past it without a check")
        flat = position_ids.reshape([-1])
        sin_rows = paddle.gather(sin2, flat).reshape([b, s, 1, d])
        cos_rows = paddle.gather(cos2, flat).reshape([b, s, 1, d])

    def rotate(x):
        if x is None:
            return None
        if x.shape[0] < b:
            raise ValueError(f"The batch_size of q ({b}) must be less than or equal to k's/v's ({x.shape[0]}).")
        xf = x.astype("float32")
        if use_neox_rotary_style:  # pairs (x0, x1) -> (-x1, x0)
            pairs = xf.reshape([*x.shape[:3], d // 2, 2])
            turned = paddle.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
        else:
            turned = paddle.concat([-xf[..., d // 2:], xf[..., : d // 2]], axis=-1)
        return (xf * cos_rows + turned * sin_rows).astype(x.dtype)

    return rotate(q), rotate(k), rotate(v)
