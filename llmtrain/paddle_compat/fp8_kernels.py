"""Paddle 3.3.1's blockwise FP8 kernels (GPU-only): the `blockwise` recipe's quantisations and GEMMs on a GPU.

    python -m pytest tests/gpu_paths/test_fp8_blockwise.py -q     # the GPU branch rehearsed on CPU
    y = blockwise_gemm(x, w, health, name)      # x [M, K] @ w [K, N] -> [M, N], or x [E, N, K] @ w [E, K, F]

The kernels (public `paddle.incubate.nn.functional`, read in Paddle 3.3.1's `incubate/nn/functional/fp8.py`):

    fp8_quant_blockwise(x [R, C] bf16, quant_method="1x128" | "128x128", input_transpose, return_transpose_only,
                        output_scale_transpose, using_pow2_scale=True)
        -> (e4m3 [R, C] (or [C, R] when transposed), fp32 decode scales: 1x128 [R, ceil(C/128)] (transposed
            [ceil(C/128), R] with output_scale_transpose), 128x128 [ceil(R/128), ceil(C/128)])
    fp8_gemm_blockwise(a [M, K] e4m3, a_decode_scale, b [N, K] e4m3, b_decode_scale, out_dtype,
                       is_a_1d_scaled, is_b_1d_scaled) -> a bᵀ [M, N]      (cuBLAS >= 12.8.5, CUDA >= 12.8)

How the recipe's three GEMMs call them (the layout PaddleFormers' `fp8_utils` uses; W is Paddle's [in, out]):

    forward  y  [M, N] = gemm(Q1x128(x) [M, K], Q128x128(Wᵀ) [N, K])            a 1-D scaled, b 2-D scaled
    backward dx [M, K] = gemm(Q1x128(dy) [M, N], Q128x128(W) [K, N])            a 1-D scaled, b 2-D scaled
             dW [K, N] = gemm(Q1x128(xᵀ) [K, M], Q1x128(dyᵀ) [N, M]) in fp32    both 1-D scaled (128 tokens)

The tokens M are padded with zero rows to a multiple of 128 for the transposed quantisations (zeros add nothing to
dW). The forward keeps Q1x128(xᵀ) (FP8, one byte per element) and the weight; the weight is quantised again in the
backward, or, with a `WeightCache` (`train.fp8_weight_cache`, the default), both weight copies are made at a
step's first micro-batch and reused by the others. Non-finite decode scales (an inf or NaN in a tile) are counted by `FP8Health`. The stacked experts
[E, N, K] run one GEMM per expert (Paddle 3.3.1 has no grouped FP8 GEMM with these scales).
"""
from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

MIN_CUDA = (12, 8)
"""`fp8_gemm_blockwise` needs CUDA >= 12.8 (and cuBLAS >= 12.8.5)."""


def gpu_problems() -> list[str]:
    """Why this process cannot run the blockwise FP8 kernels (empty: it can)."""
    from llmtrain.paddle_compat.version import TESTED_PADDLE_VERSION

    import paddle.incubate.nn.functional as incubate

    problems = []
    if paddle.__version__ != TESTED_PADDLE_VERSION:
        problems.append(f"train.fp8=blockwise: the FP8 kernels were read in paddle {TESTED_PADDLE_VERSION}, this is "
                        f"{paddle.__version__}")
    missing = [n for n in ("fp8_quant_blockwise", "fp8_gemm_blockwise") if not hasattr(incubate, n)]
    if missing:
        problems.append(f"train.fp8=blockwise: this Paddle has no {', '.join(missing)}")
    cuda = paddle.version.cuda()
    try:
        found = tuple(int(p) for p in str(cuda).split(".")[:2])
    except ValueError:
        found = (0, 0)
    if found < MIN_CUDA:
        problems.append(f"train.fp8=blockwise needs a Paddle built with CUDA >= {MIN_CUDA[0]}.{MIN_CUDA[1]} "
                        f"(fp8_gemm_blockwise), this one has {cuda}")
    major, minor = paddle.device.cuda.get_device_capability()
    if (major, minor) < (9, 0):
        problems.append(f"train.fp8=blockwise needs a Hopper or newer GPU (sm_90+), this is sm_{major}{minor}")
    return problems


def _quant(x, method: str, transpose: bool):
    """x [R, C] -> (e4m3, decode scales) of Q_method(x) ([R, C]) or of Q_method(xᵀ) ([C, R]) when `transpose`;
    1x128 scales in the GEMM's layout (transposed), 128x128 as [row blocks, col blocks]."""
    from paddle.incubate.nn.functional import fp8_quant_blockwise

    if transpose:
        return fp8_quant_blockwise(x, quant_method=method, input_transpose=True,  # GPU-ONLY(fp8-blockwise)
                                   return_transpose_only=True, output_scale_transpose=method == "1x128",
                                   using_pow2_scale=True)
    return fp8_quant_blockwise(x, quant_method=method, input_transpose=False,  # GPU-ONLY(fp8-blockwise)
                               output_scale_transpose=method == "1x128", using_pow2_scale=True)


def _gemm(a, a_scale, b, b_scale, out_dtype, b_blocks: bool):
    """a [M, K] @ b [N, K]ᵀ -> [M, N] (a 1x128-scaled; b 128x128-scaled when `b_blocks`, else 1x128)."""
    from paddle.incubate.nn.functional import fp8_gemm_blockwise

    return fp8_gemm_blockwise(a, a_scale, b, b_scale, out_dtype,  # GPU-ONLY(fp8-blockwise)
                              is_a_1d_scaled=True, is_b_1d_scaled=not b_blocks)


def _pad_rows(x, multiple: int = 128):
    """x [M, C] -> [ceil(M / multiple) multiple, C], zero rows appended."""
    extra = -int(x.shape[0]) % multiple
    return x if not extra else paddle.concat([x, paddle.zeros([extra, x.shape[1]], x.dtype)], axis=0)


class _BlockwiseGemm(PyLayer):
    """x [M, K], w [K, N] -> [M, N] in x's dtype through the FP8 kernels (module docstring)."""

    @staticmethod
    def forward(ctx, x, w, health, name: str, cache=None, ident=None):
        xq, xs = _quant(x, "1x128", transpose=False)  # [M, K], [K/128, M]
        wq, ws = _weight(w, cache, name, True, ident)  # Wᵀ [N, K], [N/128, K/128]
        xtq, xts = _quant(_pad_rows(x), "1x128", transpose=True)  # xᵀ [K, M'], its scales
        if health is not None:
            health.record(xs, f"{name}:x")
            health.record(ws, f"{name}:W")
        ctx.save_for_backward(xtq, xts, w)
        ctx.health, ctx.name, ctx.x_dtype, ctx.cache, ctx.ident = health, name, x.dtype, cache, ident
        ctx.needs = (not x.stop_gradient, not w.stop_gradient)
        return _gemm(xq, xs, wq, ws, x.dtype, b_blocks=True)  # [M, N]

    @staticmethod
    def backward(ctx, dy):  # dy [M, N]
        xtq, xts, w = ctx.saved_tensor()
        dx = dw = None
        if ctx.needs[0]:
            dyq, dys = _quant(dy, "1x128", transpose=False)  # [M, N]
            wq, ws = _weight(w, ctx.cache, ctx.name, False, ctx.ident)  # W [K, N]
            if ctx.health is not None:
                ctx.health.record(dys, f"{ctx.name}:dY")
            dx = _gemm(dyq, dys, wq, ws, ctx.x_dtype, b_blocks=True)  # [M, K]
        if ctx.needs[1]:
            dytq, dyts = _quant(_pad_rows(dy), "1x128", transpose=True)  # dyᵀ [N, M']
            dw = _gemm(xtq, xts, dytq, dyts, paddle.float32, b_blocks=False).astype(w.dtype)  # [K, N]
        return dx, dw


def _weight(w, cache, name: str, transpose: bool, ident=None):
    """Q128x128(Wᵀ) [N, K] (`transpose`) or Q128x128(W) [K, N] with their scales: from `cache`
    (`llmtrain.fp8.cache.WeightCache`, once per optimizer step) when given, else quantised now; `ident`: the
    parameter `w` is an expert's slice of."""
    if cache is None:
        return _quant(w, "128x128", transpose=transpose)
    return cache.get(name, w, "Wt" if transpose else "W", lambda: _quant(w, "128x128", transpose=transpose), ident)


def blockwise_gemm(x, w, health, name: str, cache=None):
    """x [M, K] @ w [K, N] -> [M, N], or per expert x [E, N, K] @ w [E, K, F] -> [E, N, F], on the FP8 kernels;
    `cache`: the weight's two FP8 copies made once per optimizer step."""
    if w.ndim == 2:
        return _BlockwiseGemm.apply(x, w, health, name, cache)
    ident = (id(w), bool(getattr(w, "persistable", False)))  # (`WeightCache` identity): each expert's slice w[e]
    # is cached as a part of the stacked parameter
    return paddle.stack([_BlockwiseGemm.apply(x[e], w[e], health, f"{name}[{e}]", cache, ident)
                         for e in range(int(w.shape[0]))])
