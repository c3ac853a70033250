"""Attention on blocks of a sequence, with the log-sum-exp that lets partial results merge: context parallelism's math.

    python -m pytest tests/parallel/test_context.py -q
    out, lse = block_forward(q, k, v, keep)             # one (query block, key block) pair, fp32 log-sum-exp
    out, lse = merge(out_a, lse_a, out_b, lse_b)        # as if the two key blocks had been one
    dq, dk, dv = block_backward(q, k, v, out, lse, dout, keep)   # with the MERGED out and lse: exact gradients

Shapes: q [b, sq, nh, d], k [b, sk, nkv, d], v [b, sk, nkv, dv] (grouped-query heads: nh a multiple of nkv);
keep [b or 1, sq, sk] bool (True: the query may attend to the key) or None (all); out [b, sq, nh, dv];
lse [b, nh, sq] fp32, -inf for a query that kept no key of the block (its out is 0 there).

A query row's attention over keys split into blocks is the lse-weighted sum of the blocks' rows:
out = sum_i exp(lse_i - lse) out_i with lse = log sum_i exp(lse_i) (`merge`). The backward of one block, given
the final out and lse of the whole row, is the block's share of the exact gradient (p = exp(s - lse) are then the
global probabilities, and D = rowsum(dout * out) the global correction) — the flash-attention backward, used by the
ring so that no block's probabilities are kept between forward and backward.

These are the CPU kernels (paddle ops in fp32, no saved probabilities beyond one block at a time); the GPU ring runs
flash attention's own kernels instead (llmtrain/parallel/context_exchange.py). `keep_mask` builds `keep` from the
blocks' sequence indices (causal: key index <= query index) and document ids (`data.document_mask`: same document).
"""
from __future__ import annotations

import math

import paddle

NEG_INF = float("-inf")


def keep_mask(q_index, k_index, causal: bool, q_seg=None, k_seg=None):
    """[1 or b, sq, sk] bool: may query i see key j. q_index [sq], k_index [sk] int64 sequence indices;
    q_seg [b, sq], k_seg [b, sk] document ids or None. None when every pair is kept."""
    keep = None
    if causal:
        keep = (k_index.unsqueeze(0) <= q_index.unsqueeze(1)).unsqueeze(0)  # [1, sq, sk]
    if q_seg is not None:
        same = q_seg.unsqueeze(-1) == k_seg.unsqueeze(-2)  # [b, sq, sk]
        keep = same if keep is None else paddle.logical_and(keep, same)
    return keep


def _heads_first(x, nh: int):
    """[b, s, n, d] -> [b, nh, s, d] fp32, kv heads repeated for grouped-query attention."""
    if x.shape[2] != nh:
        x = paddle.repeat_interleave(x, nh // x.shape[2], axis=2)
    return x.transpose([0, 2, 1, 3]).astype("float32")


def _scores(q, k, keep, scale):
    """[b, nh, sq, sk] fp32 scores, -inf where not kept."""
    s = paddle.matmul(_heads_first(q, q.shape[2]), _heads_first(k, q.shape[2]), transpose_y=True) * scale
    if keep is not None:
        s = paddle.where(keep.unsqueeze(1), s, paddle.full([], NEG_INF, "float32"))
    return s


def block_forward(q, k, v, keep=None, scale=None):
    """(out [b, sq, nh, dv] in q's dtype, lse [b, nh, sq] fp32) of q over one key block. Differentiable."""
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    s = _scores(q, k, keep, scale)  # [b, nh, sq, sk]
    m = s.max(-1, keepdim=True)  # [b, nh, sq, 1]
    m = paddle.where(paddle.isinf(m), paddle.zeros_like(m), m).detach()  # a fully masked row: no shift
    p = paddle.exp(s - m)  # masked keys: exp(-inf) = 0
    l = p.sum(-1, keepdim=True)  # [b, nh, sq, 1]
    out = paddle.matmul(p, _heads_first(v, q.shape[2])) / paddle.where(l > 0, l, paddle.ones_like(l))
    lse = (m + paddle.log(l)).squeeze(-1)  # [b, nh, sq]; -inf where no key was kept
    return out.transpose([0, 2, 1, 3]).astype(q.dtype), lse


def merge(out_a, lse_a, out_b, lse_b):
    """Two partial results of the same queries over disjoint key blocks -> the result over both.
    out [b, sq, nh, dv], lse [b, nh, sq]; either may be None (nothing yet)."""
    if out_a is None:
        return out_b, lse_b
    lse = paddle.logaddexp(lse_a, lse_b)  # [b, nh, sq]; -inf only where both are
    safe = paddle.where(paddle.isinf(lse), paddle.zeros_like(lse), lse)
    wa = paddle.exp(lse_a - safe).transpose([0, 2, 1]).unsqueeze(-1)  # [b, sq, nh, 1]
    wb = paddle.exp(lse_b - safe).transpose([0, 2, 1]).unsqueeze(-1)
    out = out_a.astype("float32") * wa + out_b.astype("float32") * wb
    return out.astype(out_a.dtype), lse


def _sum_groups(g, nkv: int):
    """[b, nh, s, d] gradient of repeated kv heads -> [b, s, nkv, d] (each kv head's query group summed)."""
    b, nh, s, d = g.shape
    g = g.transpose([0, 2, 1, 3])  # [b, s, nh, d]
    if nkv != nh:
        g = g.reshape([b, s, nkv, nh // nkv, d]).sum(3)
    return g


def block_backward(q, k, v, out, lse, dout, keep=None, scale=None):
    """(dq, dk, dv) of one key block's share, given the row's final `out` [b, sq, nh, dv] and `lse` [b, nh, sq]
    (over all blocks) and dout [b, sq, nh, dv]. dq [b, sq, nh, d], dk [b, sk, nkv, d], dv [b, sk, nkv, dv], fp32."""
    nh, nkv = q.shape[2], k.shape[2]
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    s = _scores(q, k, keep, scale)  # [b, nh, sq, sk]
    p = paddle.exp(s - lse.unsqueeze(-1))  # the global probabilities of this block's keys
    do = _heads_first(dout, nh)  # [b, nh, sq, dv]
    dv = paddle.matmul(p, do, transpose_x=True)  # [b, nh, sk, dv]
    dp = paddle.matmul(do, _heads_first(v, nh), transpose_y=True)  # [b, nh, sq, sk]
    delta = (do * _heads_first(out, nh)).sum(-1, keepdim=True)  # [b, nh, sq, 1]
    ds = p * (dp - delta) * scale
    dq = paddle.matmul(ds, _heads_first(k, nh)).transpose([0, 2, 1, 3])  # [b, sq, nh, d]
    dk = paddle.matmul(ds, _heads_first(q, nh), transpose_x=True)  # [b, nh, sk, d]
    return dq, _sum_groups(dk, nkv), _sum_groups(dv, nkv)
