"""The FP8 emulation against an independent numpy reference of the recipes, bit for bit on the FP8 grid.

    python -m pytest tests/fp8/test_recipe.py -q

The reference (tests/fp8_reference.py) is written from the formats' definitions, not from Paddle. Compared: the
FP8 codes (raw bits), the decode scales and the dequantised values, exactly.
"""
from __future__ import annotations

import numpy as np
import paddle
import pytest

from fp8_reference import FMAX, decode, grid, ref_cast, ref_quantize
from llmtrain.fp8.recipe import RECIPES, quantize

def hard_tensor(rows: int, cols: int, seed: int) -> np.ndarray:
    """Values that reach every region of the grid: normal, subnormal after scaling, a zero tile, a huge outlier,
    exact grid points, ties between two grid points, negative zeros."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-12, 4, (rows, cols)))).astype(np.float32)
    x[0, : min(cols, 128)] = 0.0  # a zero tile (1x128) / part of a zero block
    x[-1, -1] = 3.0e4  # one outlier: the rest of its tile goes subnormal or to zero
    x[1, :8] = np.array([448, -448, 2 ** -9, 2 ** -10, 1.5 * 2 ** -9, 0.0, -0.0, 464], np.float32)
    return x


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
@pytest.mark.parametrize("operand", ["activation", "weight", "wgrad"])
def test_the_emulation_equals_the_numpy_reference_bit_for_bit(recipe, operand):
    r = RECIPES[recipe]
    x = hard_tensor(130, 300, seed=len(recipe) * 7 + len(operand))  # ragged: neither axis a multiple of 128
    tile = getattr(r, operand)
    for fmt in {r.forward_format, r.backward_format}:
        q = quantize(paddle.to_tensor(x), tile, fmt, r.pow2)
        codes, decodes, deq = ref_quantize(x, tile, fmt, r.pow2)
        np.testing.assert_array_equal(q.data.numpy().view(np.uint8), codes, err_msg=f"{recipe} {operand} {fmt}")
        np.testing.assert_array_equal(q.decode.numpy(), decodes)
        np.testing.assert_array_equal(q.dequantize().numpy(), deq)


def test_every_code_the_cast_can_produce_matches_the_reference():
    """Paddle's cast over every fp8 value and the midpoints between neighbours (ties to even), negative too."""
    for fmt, dtype in (("e4m3", "float8_e4m3fn"), ("e5m2", "float8_e5m2")):
        values, _ = grid(fmt)
        mids = (values[:-1] + values[1:]) / 2
        probe = np.concatenate([values, mids, values * 1.0001, [FMAX[fmt] * 1.01, 1e30, np.inf, 1e-30]])
        probe = np.concatenate([probe, -probe]).astype(np.float32)
        got = paddle.to_tensor(probe).astype(dtype).numpy().view(np.uint8)
        np.testing.assert_array_equal(got, ref_cast(probe, fmt), err_msg=fmt)


def test_nan_saturates_in_e4m3_and_stays_nan_in_e5m2():
    x = np.array([np.nan, -np.nan, np.inf, -np.inf], np.float32)
    e4 = paddle.to_tensor(x).astype("float8_e4m3fn").astype("float32").numpy()
    e5 = paddle.to_tensor(x).astype("float8_e5m2").astype("float32").numpy()
    assert list(e4) == [448.0, -448.0, 448.0, -448.0]  # why FP8Health must look before the cast
    assert np.isnan(e5[:2]).all() and list(e5[2:]) == [57344.0, -57344.0]


def test_paddles_cast_turns_e4m3_values_between_464_and_480_into_nan():
    """A defect of Paddle 3.3.1's CPU cast (not the saturation the reference implements): a magnitude strictly
    between 464 (halfway from 448 to the missing 480) and 480 gets the NaN code 0x7F; 464 itself, 480 and above
    saturate to 448. The recipe never meets it: every scaled value is <= 448 (next test)."""
    x = np.array([464.0, 464.0001, 470.0, 479.0, 480.0, 1000.0, -470.0], np.float32)
    got = paddle.to_tensor(x).astype("float8_e4m3fn").numpy().view(np.uint8)
    assert list(got) == [0x7E, 0x7F, 0x7F, 0x7F, 0x7E, 0x7E, 0xFF]


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_scaled_values_never_pass_the_largest_finite_value(recipe):
    r = RECIPES[recipe]
    rng = np.random.default_rng(3)
    for _ in range(20):
        x = (rng.standard_normal((64, 256)) * 10.0 ** rng.uniform(-30, 30)).astype(np.float32)
        q = quantize(paddle.to_tensor(x), r.activation, r.forward_format, r.pow2)
        assert np.isfinite(q.data.astype("float32").numpy()).all()
        assert np.abs(q.data.astype("float32").numpy()).max() <= FMAX[r.forward_format]


def test_pow2_scales_are_powers_of_two_and_use_the_range():
    x = hard_tensor(4, 512, seed=9)
    q = quantize(paddle.to_tensor(x), (1, 128), "e4m3", True)
    dec = q.decode.numpy()
    mant, _ = np.frexp(dec)
    assert (mant == 0.5).all()  # 2^k exactly
    amax = np.abs(q.data.astype("float32").numpy()).reshape(4, 4, 128).max(-1)
    nonzero = q.amax.numpy() > 0
    assert (amax[nonzero] >= 224).all() and (amax[nonzero] <= 448).all()  # within one binade of the top


def test_batched_tiles_stay_inside_each_expert():
    """[E, N, K] quantises each expert's matrix on its own (a 128x128 block never spans two experts)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 100, 200)).astype(np.float32) * np.array([1e-3, 1.0, 1e3], np.float32)[:, None, None]
    q = quantize(paddle.to_tensor(x), (128, 128), "e4m3", True)
    for e in range(3):
        codes, decodes, _ = ref_quantize(x[e], (128, 128), "e4m3", True)
        np.testing.assert_array_equal(q.data.numpy()[e].view(np.uint8), codes)
        np.testing.assert_array_equal(q.decode.numpy()[e], decodes)
