"""Paddle's fused Mixture-of-Experts kernel on GPU (ERNIE-4.5's `moe_combine`), behind the version check.

    python -m pytest tests/gpu_paths/test_moe_combine.py -q      # the GPU branch rehearsed on CPU
    y = fused_combine(expert_rows, weight, row)                  # [N, h], [T, k], [T, k] int -> [T, h]

`paddle.incubate.nn.functional.moe_combine(x, combine_weights, scatter_index)` computes, in one kernel with its
own backward (`moe_combine_grad`), y[t] = sum_j combine_weights[t, j] * x[scatter_index[t, j]]: x [N, h] 2-D,
combine_weights [T, k] of x's dtype (the kernel reads both through one type and sums the k terms in it),
scatter_index [T, k] int32 (Paddle 3.3.1's GPU kernel indexes it row-major as [T, k]; its docstring's "[k, s]" is
what `moe_gate_dispatch` returns before ERNIE transposes it). That is step 7 of `llmtrain.models.experts`'
formulation, so the GPU path replaces the gather, the weighting and the sum over k (three kernels and a [T k, h]
intermediate) by one.

Chosen (`fused_combine_available`) on a CUDA device when the installed Paddle is the tested release
(`TESTED_PADDLE_VERSION`: its signature and semantics were read there) and has the function; otherwise the
tensor-op combine of `llmtrain.models.dispatch` runs (the CPU path and the fallback), with one warning when a GPU
run falls back.

Why not Paddle's dispatch kernels as well (read in 3.3.1): `moe_gate_dispatch` and `moe_gate_dispatch_permute`
choose the top-k experts themselves from the gate scores (route()'s expert bias, group-limited routing and
capacity order would be bypassed); `moe_gate_dispatch_partial_nosoftmaxtopk` takes the choices but copies expert
offsets to the host and synchronises the stream inside its forward; `moe_permute` needs the per-expert token
counts as a host list (a sync) and has no backward of its own. The dispatch stays one gather through the inverse
map (step 5), whose backward is one index_add.
"""
from __future__ import annotations

import warnings

import paddle

from llmtrain.paddle_compat import kernels
from llmtrain.paddle_compat.version import TESTED_PADDLE_VERSION

_WARNED = False


def fused_combine_available() -> bool:
    """True on a CUDA device with the tested Paddle release, which has `moe_combine` (warns once when a GPU falls
    back to the tensor ops)."""
    if not kernels.on_gpu():
        return False
    import paddle.incubate.nn.functional as incubate

    if paddle.__version__ == TESTED_PADDLE_VERSION and hasattr(incubate, "moe_combine"):
        return True
    global _WARNED
    if not _WARNED:
        _WARNED = True
        warnings.warn(f"paddle {paddle.__version__}: the fused moe_combine kernel was read in paddle "
                      f"{TESTED_PADDLE_VERSION} only; the MoE combine runs as tensor ops")
    return False


def fused_combine(x: paddle.Tensor, weight: paddle.Tensor, row: paddle.Tensor) -> paddle.Tensor:
    """x [N, h] expert output rows, weight [T, k] (x's dtype), row [T, k] integer rows of x -> [T, h]."""
    from paddle.incubate.nn.functional import moe_combine

    return moe_combine(x, weight, row.astype("int32"))  # GPU-ONLY(moe-combine)
