"""Paddle's fused kernels behind the `model.fuse_*` switches, and what Paddle 3.3.1's CPU build has of them.

    python -m pytest tests/models/test_fused.py -q
    y = fused_rms_norm(x, weight, eps)         # x [b, s, h] -> [b, s, h]
    q, k = fused_rope(q, k, cos, sin)          # q [b, s, nh, d], k [b, s, nkv, d]; cos/sin [1, s, 1, d]
    y = swiglu(gate, up)                       # silu(gate) * up, [b, s, f]

These are public `paddle.incubate.nn.functional` APIs, called the way PaddleNLP's
Llama calls them (`fused_rotary_position_embedding(..., use_neox_rotary_style=False)`
is the rotate-half form of `llmtrain.models.layers.Rotary`). They live here because
`paddle.incubate` signatures change between releases (`fused_rms_norm` became
`fused_rms_norm_quant` underneath in 3.x and returns (out, residual_out, inv_var)).

What Paddle 3.3.1's CPU build does with each, probed by calling it (forward and
backward) on an x86-64 CPU with AVX2 and no AVX-512:

  swiglu                            CPU kernel, forward and backward: fused == unfused is tested on CPU
  fused_rms_norm                    a CPU kernel is registered (RmsNormAvxKernel) but the process dies
                                    with SIGILL (illegal instruction) on that CPU: GPU-only here
  fused_rotary_position_embedding   no CPU kernel ("kernel not registered"); without sin/cos it refuses
                                    the rotate-half form: GPU-only
  fused_rms_norm_ext                no CPU kernel (not used)

`CPU_KERNELS` records this; `llmtrain.models.config.fusion_problems` refuses a forced
`true` for a kernel the CPU cannot run, so a CPU run never reaches a crash.
"""
from __future__ import annotations

CPU_KERNELS = {
    "fuse_rms_norm": False,  # registered, but SIGILL on an AVX2-only x86 CPU (Paddle 3.3.1)
    "fuse_rope": False,  # kernel not registered on CPU
    "fuse_swiglu": True,
    "fuse_qkv": True,  # plain matmul of concatenated weights
    "fuse_ffn": True,
}
"""Whether each `model.fuse_*` path runs on Paddle 3.3.1's CPU build."""


def fused_rms_norm(x, weight, eps: float):
    """x [.., h] normalised over the last axis times weight [h] (one kernel; fp32 statistics inside)."""
    from paddle.incubate.nn.functional import fused_rms_norm as _fused

    return _fused(x, weight, None, eps, x.ndim - 1)[0]  # GPU-ONLY(fused-rms-norm)


def fused_rope(q, k, cos, sin, position_ids=None):
    """Rotate-half rotary embedding of q [b, s, nh, d] and k [b, s, nkv, d] in one kernel; cos/sin [1, P, 1, d]
    (P = s when position_ids is None); position_ids [b, s] int64 rows of the table (packed or chunked sequences)."""
    from paddle.incubate.nn.functional import fused_rotary_position_embedding

    q, k, _ = fused_rotary_position_embedding(q, k, None, sin=sin, cos=cos, position_ids=position_ids,  # GPU-ONLY(fused-rope)
                                              use_neox_rotary_style=False)
    return q, k


def swiglu(gate, up):
    """silu(gate) * up in one kernel: [.., f], [.., f] -> [.., f]."""
    from paddle.incubate.nn.functional import swiglu as _swiglu

    return _swiglu(gate, up)


def on_gpu() -> bool:
    """True when this process computes on a CUDA device."""
    import paddle

    return paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu")
