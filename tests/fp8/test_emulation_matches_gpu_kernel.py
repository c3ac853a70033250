"""The CPU emulation's blockwise quantisation equals, bit for bit, a fused GPU kernel of Paddle's class run on an H100.

    python -m pytest tests/fp8/test_emulation_matches_gpu_kernel.py -q

benchmarks/data/h100/fp8_quant_sample.npz was written on the H100 by benchmarks/fp8_quant_triton.py (`sample`):
an input x [256, 384] bf16 with planted edge tiles (a zero 128x128 block, rows of bf16 subnormals, amax exactly
1.75 * 2^-3, 448 and 450, large values, -0) and the e4m3 bytes and fp32 decode scales of every variant of
`fp8_quant_blockwise` (1x128, 1x128 transposed, 128x128, 128x128 transposed, 1x128 with both outputs) from the
Triton kernels, which matched a PyTorch reference of Paddle's CUDA rule bit for bit on that machine. Here
`llmtrain.fp8.recipe.quantize` (the emulation: Paddle's CPU casts) must give the same bytes and scales.
"""
from __future__ import annotations

import os

import numpy as np
import paddle
import pytest

from llmtest import REPO
from llmtrain.fp8.recipe import RECIPES, quantize

SAMPLE = os.path.join(REPO, "benchmarks", "data", "h100", "fp8_quant_sample.npz")
BLOCKWISE = RECIPES["blockwise"]


@pytest.fixture(scope="module")
def sample():
    data = np.load(SAMPLE)
    x = paddle.to_tensor(data["x_bf16_bits"]).view(paddle.bfloat16)  # [256, 384]
    return x, data


def _emulated(x, tile):
    q = quantize(x, tile, "e4m3", BLOCKWISE.pow2)
    return q.data.numpy().view(np.uint8), q.decode.numpy()


def test_the_sample_holds_the_edge_tiles(sample):
    x, data = sample
    dec = data["1x128.s"]
    assert (dec == 1.0).any()  # zero tiles: m = 1
    assert (dec == np.float32(2.0 ** -127)).any()  # bf16 subnormal tiles: m = 2^127, decode an fp32 subnormal
    assert (dec == np.float32(2.0 ** -11)).any()  # amax 1.75 * 2^-3: 448 / amax is exactly 2^11
    assert (data["1x128.q"] == 0x80).any()  # -0 kept


def test_1x128_tiles_equal_the_gpu_kernel(sample):
    x, data = sample
    q, dec = _emulated(x, BLOCKWISE.activation)  # [256, 384], [256, 3]
    for variant in ("1x128", "1x128+T"):
        np.testing.assert_array_equal(q, data[f"{variant}.q"])
        np.testing.assert_array_equal(dec.T, data[f"{variant}.s"])  # the kernel writes [C/128, R]


def test_128x1_tiles_equal_the_gpu_kernels_transposed_copy(sample):
    x, data = sample
    q, dec = _emulated(x, BLOCKWISE.wgrad)  # tiles of 128 tokens: [256, 384], [2, 384]
    for variant in ("1x128T", "1x128+T"):
        np.testing.assert_array_equal(q.T, data[f"{variant}.qt"])  # the kernel writes xᵀ [384, 256]
        np.testing.assert_array_equal(dec, data[f"{variant}.st"])  # and its scales [R/128, C]


def test_128x128_blocks_equal_the_gpu_kernel_and_its_transposed_copy(sample):
    x, data = sample
    q, dec = _emulated(x, BLOCKWISE.weight)  # [256, 384], [2, 3]
    np.testing.assert_array_equal(q, data["128x128.q"])
    np.testing.assert_array_equal(dec, data["128x128.s"])
    np.testing.assert_array_equal(q.T, data["128x128T.qt"])
    np.testing.assert_array_equal(dec.T, data["128x128T.st"])
