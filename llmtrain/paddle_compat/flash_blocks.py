"""Flash attention's forward and backward kernels on one (query block, key block) pair, for the context-parallel ring.

    out, lse = flash_block(q, k, v, causal)                         # q [b, sq, nh, d] fp16/bf16, lse [b, nh, sq] fp32
    dq, dk, dv = flash_block_grad(q, k, v, out, lse, dout, causal)  # with the ring's MERGED out and lse

GPU only. The ring merges blocks by their log-sum-exp and back-propagates each block with the merged output and
log-sum-exp (llmtrain/parallel/context_attention.py explains why that gives exact gradients), which needs the
kernels themselves: Paddle 3.3 exposes them as `paddle._C_ops.flash_attn` / `flash_attn_grad`, the calls its own
`paddle.distributed.auto_parallel.ring_attention` makes (the public `flash_attention` returns no log-sum-exp
and takes none back). `causal=True` with sq != sk is flash attention's bottom-right alignment: query t of the block
sees keys up to sk - sq + t. Dropout is not supported (the ring refuses it: our models have none). Values narrower
than q and k (multi-head latent attention's d_v) are zero-padded to their width for the kernels, which take one
head width, and the results cut back (the padding columns' outputs and gradients are zero, the rest unchanged).
"""
from __future__ import annotations

import paddle

from llmtrain.paddle_compat.version import require_tested_paddle


def widened(x, width: int):
    """[b, s, n, dv] -> [b, s, n, width], zero columns appended (unchanged when dv == width)."""
    if x.shape[-1] == width:
        return x
    return paddle.concat([x, paddle.zeros([*x.shape[:-1], width - x.shape[-1]], dtype=x.dtype)], axis=-1)


def flash_block(q, k, v, causal: bool):
    """(out [b, sq, nh, dv], lse [b, nh, sq] fp32) of q over one key block (grouped-query heads native). The kernel
    pads the log-sum-exp's rows (to a multiple of 128): cut to sq."""
    require_tested_paddle()
    dv, width = v.shape[-1], q.shape[-1]
    out, _, lse, _ = paddle._C_ops.flash_attn(q, k, widened(v, width), None, None, 0.0, causal, False, False, "")  # GPU-ONLY(cp-ring-flash)
    return out[..., :dv], lse[:, :, : q.shape[1]]


def flash_block_grad(q, k, v, out, lse, dout, causal: bool):
    """(dq, dk, dv) of one block's share of the exact gradient, given the row's merged `out` and `lse`."""
    seed = paddle.to_tensor([0, 0], place=paddle.CPUPlace(), dtype="int64")
    dv, width = v.shape[-1], q.shape[-1]
    v, out, dout = (widened(x, width) for x in (v, out, dout))
    dq, dk, dvw = paddle._C_ops.flash_attn_grad(q, k, v, out, lse, seed, None, dout, 0.0, causal)  # GPU-ONLY(cp-ring-flash)
    return dq, dk, dvw[..., :dv]
