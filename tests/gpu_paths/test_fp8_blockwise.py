"""GPU-only branch `fp8-blockwise`: `train.fp8=blockwise` on Paddle's FP8 kernels (`fp8_quant_blockwise`,
`fp8_gemm_blockwise`), against the CPU emulation of the same recipe.

    python -m pytest tests/gpu_paths/test_fp8_blockwise.py -q

`llmtrain.paddle_compat.fp8_kernels` runs the recipe's three GEMMs through the two kernels on a CUDA device. On CPU
the rehearsal makes llmtrain believe it runs on a GPU and replaces both kernels by stand-ins bound to the installed
functions' signatures (`checked`), whose references are written from the kernels' documented contracts with the
numpy FP8 reference (tests/fp8_reference.py), not from llmtrain's recipe code:

- quant: x [R, C] (or xᵀ when input_transpose with return_transpose_only) -> e4m3 values and fp32 decode scales,
  1x128 scales [R, C/128] ([C/128, R] with output_scale_transpose), 128x128 scales [R/128, C/128]; pow2 scales;
- gemm: a [M, K] @ b [N, K]ᵀ with a 1-D scaled (its scales [K/128, M]) and b 1-D scaled ([K/128, N]) or 2-D scaled
  ([N/128, K/128]); fp32 accumulation, out_dtype result.

A linear's y, dx and dW and the stacked experts' through the kernels must equal the CPU emulation (the same tiles,
scales and FP8 values; the fp32 sums in another order: 1e-5 of the output's scale). That holds only if the GPU path
hands the kernels the right operand (x or xᵀ, W or Wᵀ), the right scale layout and pads the tokens with zero rows.
On a GPU the real kernels run against the same emulation (`GPU_TOL`, not yet measured: the kernels accumulate in
fp32 with their own split-K order and produce bf16).
"""
from __future__ import annotations

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF
import pytest

from fp8_reference import ref_quantize, values_of
from gpu_rehearsal import ON_GPU, checked, reaches
from llmtrain.fp8.health import FP8Health
from llmtrain.fp8.linear import FP8Gemm
from llmtrain.fp8.recipe import RECIPES
from llmtrain.paddle_compat import kernels

GPU_TOL = 2e-2
"""|kernels - emulation| relative to the output's scale on a GPU (bf16 outputs): not yet measured."""

QUANT_ARGS = ("x", "quant_method", "input_transpose", "return_transpose_only", "output_scale_transpose",
              "using_pow2_scale")
GEMM_ARGS = ("a", "a_decode_scale", "b", "b_decode_scale", "out_dtype", "is_a_1d_scaled", "is_b_1d_scaled")


def reference_fp8_quant_blockwise(x, quant_method, input_transpose, return_transpose_only, output_scale_transpose,
                                  using_pow2_scale, **_defaults):
    """The kernel's contract (Paddle 3.3.1 docstring), e4m3 only, as the recipe calls it."""
    assert x.ndim == 2, f"fp8_quant_blockwise: 2-D input, got {x.shape}"
    assert quant_method in ("1x128", "128x128")
    assert not input_transpose or return_transpose_only, "only the transposed copy is modelled"
    a = x.astype("float32").numpy()
    if input_transpose:
        a = a.T
        assert quant_method == "1x128" or True
    if quant_method == "1x128" and input_transpose:
        assert x.shape[0] % 128 == 0, f"the transposed 1x128 copy takes whole 128-token groups, got {x.shape[0]}"
    assert quant_method == "1x128" or not output_scale_transpose, "128x128 scales are modelled untransposed"
    codes, decodes, _ = ref_quantize(a, (1, 128) if quant_method == "1x128" else (128, 128), "e4m3",
                                     using_pow2_scale)
    data = paddle.to_tensor(values_of(codes, "e4m3")).astype("float8_e4m3fn")  # on the grid: the cast is exact
    scale = decodes.T if output_scale_transpose else decodes
    return data, paddle.to_tensor(np.ascontiguousarray(scale))


def _scaled(q: np.ndarray, scale: np.ndarray, one_d: bool) -> np.ndarray:
    """Dequantise an operand [rows, K] from its scales (1-D: [K/128, rows]; 2-D: [rows/128, K/128])."""
    rows, k = q.shape
    r = np.arange(rows)[:, None]
    c = np.arange(k)[None, :] // 128
    return q.astype(np.float64) * (scale.T[r, c] if one_d else scale[r // 128, c])


def reference_fp8_gemm_blockwise(a, a_decode_scale, b, b_decode_scale, out_dtype, is_a_1d_scaled, is_b_1d_scaled,
                                 **_defaults):
    """a [M, K] @ b [N, K]ᵀ of the dequantised operands, accumulated exactly, returned in out_dtype."""
    assert a.dtype == b.dtype == paddle.float8_e4m3fn and a.ndim == b.ndim == 2 and a.shape[1] == b.shape[1]
    assert is_a_1d_scaled, "the recipe always passes a 1x128-scaled a"
    m, k = a.shape
    n = b.shape[0]
    assert list(a_decode_scale.shape) == [-(-k // 128), m], a_decode_scale.shape
    want_b = [-(-k // 128), n] if is_b_1d_scaled else [-(-n // 128), -(-k // 128)]
    assert list(b_decode_scale.shape) == want_b, (b_decode_scale.shape, want_b)
    av = _scaled(a.astype("float32").numpy(), a_decode_scale.numpy(), True)
    bv = _scaled(b.astype("float32").numpy(), b_decode_scale.numpy(), is_b_1d_scaled)
    return paddle.to_tensor((av @ bv.T).astype(np.float32)).astype(out_dtype)


def _install(monkeypatch):
    if ON_GPU:
        return None, None
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    quant = checked(IF.fp8_quant_blockwise, reference_fp8_quant_blockwise, QUANT_ARGS)
    gemm = checked(IF.fp8_gemm_blockwise, reference_fp8_gemm_blockwise, GEMM_ARGS)
    monkeypatch.setattr(IF, "fp8_quant_blockwise", quant)
    monkeypatch.setattr(IF, "fp8_gemm_blockwise", gemm)
    return quant, gemm


def _run(x, w, experts: bool):
    xt, wt = paddle.to_tensor(x, stop_gradient=False), paddle.to_tensor(w, stop_gradient=False)
    gemm = FP8Gemm(RECIPES["blockwise"], FP8Health(), "t")
    y = gemm.bmm(xt, wt) if experts else gemm(xt, wt)
    dy = paddle.to_tensor(np.cos(np.arange(y.size, dtype=np.float32)).reshape(y.shape) * 1e-2)
    y.backward(dy)
    return [y.numpy(), xt.grad.numpy(), wt.grad.numpy()], gemm.health


@pytest.mark.parametrize("experts", [False, True], ids=["linear", "experts"])
def test_the_gpu_kernels_equal_the_cpu_emulation(monkeypatch, experts):
    rng = np.random.default_rng(21)
    shape_x, shape_w = ([3, 70, 256], [3, 256, 200]) if experts else ([2, 100, 256], [256, 320])
    x = (rng.standard_normal(shape_x) * np.exp(rng.uniform(-2, 2, shape_x))).astype(np.float32)
    w = (rng.standard_normal(shape_w) * 0.05).astype(np.float32)
    want, _ = _run(x, w, experts)  # the CPU emulation
    quant, gemm = _install(monkeypatch)
    with reaches("fp8-blockwise"):
        got, health = _run(x, w, experts)
    if gemm is not None:
        per = 3 if experts else 1
        assert len(gemm.calls) == 3 * per  # forward, dx, dW per expert
        wgrad = [c for c in gemm.calls if c["is_b_1d_scaled"]]  # dW = xᵀ dy: both operands 1x128 over the tokens
        assert len(wgrad) == per and all(c["out_dtype"] == paddle.float32 for c in wgrad)  # accumulated in fp32
        assert any(c["input_transpose"] for c in quant.calls)
    assert float(health.count()) == 0
    tol = GPU_TOL if ON_GPU else 1e-5
    for name, a, b in zip(("y", "dx", "dW"), got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max(), err_msg=name)


def test_gpu_refusals_name_what_is_missing(monkeypatch):
    from llmtrain.paddle_compat import fp8_kernels

    monkeypatch.setattr(paddle.version, "cuda", lambda: "12.4")
    monkeypatch.setattr(paddle.device.cuda, "get_device_capability", lambda *a: (8, 0))
    problems = " ".join(fp8_kernels.gpu_problems())
    assert "CUDA >= 12.8" in problems and "sm_80" in problems
    monkeypatch.setattr(paddle, "__version__", "3.4.0")
    assert "read in paddle 3.3.1" in " ".join(fp8_kernels.gpu_problems())


def test_the_weight_cache_quantises_each_weight_copy_once_per_step(monkeypatch):
    """With a `WeightCache` (train.fp8_weight_cache) two micro-batches quantise W and Wᵀ once each (128x128 calls:
    2, not 4) and give the numbers of the uncached path."""
    from llmtrain.fp8.cache import WeightCache

    rng = np.random.default_rng(22)
    xs = [(rng.standard_normal([32, 128])).astype(np.float32) for _ in range(2)]
    w0 = (rng.standard_normal([128, 160]) * 0.05).astype(np.float32)

    def micro_batches(cache):
        w = paddle.create_parameter([128, 160], "float32")
        w.set_value(paddle.to_tensor(w0))
        gemm = FP8Gemm(RECIPES["blockwise"], FP8Health(), "t", cache=cache)
        ys = []
        for x in xs:
            y = gemm(paddle.to_tensor(x, stop_gradient=False), w)  # dx too: the backward reads W
            (y * y).sum().backward()
            ys.append(y.numpy())
        return ys, w.grad.numpy()

    quant, _ = _install(monkeypatch)
    with reaches("fp8-blockwise"):
        want = micro_batches(None)
        before = len(quant.calls) if quant is not None else 0
        got = micro_batches(WeightCache())
    if quant is not None:
        assert len([c for c in quant.calls[:before] if c["quant_method"] == "128x128"]) == 4
        blocks = [c for c in quant.calls[before:] if c["quant_method"] == "128x128"]
        assert len(blocks) == 2 and {c["input_transpose"] for c in blocks} == {True, False}, blocks
    for a, b in zip([*got[0], got[1]], [*want[0], want[1]]):
        np.testing.assert_array_equal(a, b)
