"""An independent numpy reference of FP8 quantisation: the formats from their bit layouts, the recipes' tiles and
scales (llmtrain/fp8/recipe.py's table), in numpy fp32 — used by tests/fp8 and the GPU-kernel rehearsal.

    python -m pytest tests/fp8/test_recipe.py -q
    codes, decodes, values = ref_quantize(x, (1, 128), "e4m3", pow2=True)     # x [R, C] float32

Every finite FP8 value is decoded from its 8 bits (e4m3fn: bias 7, no infinity, S.1111.111 is NaN; e5m2: bias 15,
IEEE-style inf and NaN); a value is rounded to the nearest representable one with ties to the even code,
magnitudes at or above the largest finite value saturate (inf too), NaN becomes +-448 in e4m3 (the saturating
cast) and stays NaN in e5m2. A tile's scale: amax = max |x| over the tile (NaN propagates), m = 1 for a zero tile,
else fmax / amax in fp32, rounded down to a power of two with `pow2` (from the float64 log2 of the fp32 ratio, no
bit tricks); the decode scale is 1 / m in fp32.
"""
from __future__ import annotations

import numpy as np

BIAS = {"e4m3": 7, "e5m2": 15}
MANT = {"e4m3": 3, "e5m2": 2}
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}


def decode(code: int, fmt: str) -> float:
    """The value of an 8-bit code (NaN for the NaN codes, inf for e5m2's infinities)."""
    m_bits, bias = MANT[fmt], BIAS[fmt]
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> m_bits) & ((1 << (7 - m_bits)) - 1), code & ((1 << m_bits) - 1)
    if fmt == "e4m3" and exp == 15 and man == 7:
        return float("nan")
    if fmt == "e5m2" and exp == 31:
        return sign * float("inf") if man == 0 else float("nan")
    if exp == 0:
        return sign * man * 2.0 ** (1 - bias - m_bits)  # subnormal
    return sign * (1 + man / 2 ** m_bits) * 2.0 ** (exp - bias)


def grid(fmt: str):
    """(sorted finite non-negative values, their codes) of a format."""
    pairs = sorted((decode(c, fmt), c) for c in range(128) if np.isfinite(decode(c, fmt)))
    return np.array([v for v, _ in pairs]), np.array([c for _, c in pairs])


def ref_cast(x: np.ndarray, fmt: str) -> np.ndarray:
    """float32 -> uint8 codes: round to nearest, ties to the even code, saturating; NaN -> 448 (e4m3) or NaN (e5m2)."""
    values, codes = grid(fmt)
    v = x.astype(np.float64).ravel()
    sign = np.where(np.signbit(v), 0x80, 0).astype(np.uint8)
    a = np.abs(v)
    nan = np.isnan(a)
    a = np.where(nan, 0.0, a)
    hi = np.clip(np.searchsorted(values, a), 1, len(values) - 1)
    lo = hi - 1
    d_lo, d_hi = a - values[lo], values[hi] - a
    even_lo = codes[lo] % 2 == 0
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(even_lo, lo, hi)))
    out = codes[pick].astype(np.uint8)
    out = np.where(a >= values[-1], codes[-1], out).astype(np.uint8)  # saturation (inf included)
    out = np.where(nan, 0x7F if fmt == "e5m2" else 0x7E, out).astype(np.uint8)
    return (out | sign).reshape(x.shape)


def values_of(codes: np.ndarray, fmt: str) -> np.ndarray:
    """uint8 codes -> float32 values."""
    table = np.array([decode(c, fmt) for c in range(256)], np.float32)
    return table[codes]


def ref_quantize(x: np.ndarray, tile, fmt: str, pow2: bool):
    """(codes uint8 [R, C], decode scales float32 [tiles], dequantised float32 [R, C]) of a 2-D array."""
    rows, cols = x.shape
    tr = rows if tile[0] is None else min(tile[0], rows)
    tc = cols if tile[1] is None else min(tile[1], cols)
    nr, nc = -(-rows // tr), -(-cols // tc)
    codes, deq = np.zeros(x.shape, np.uint8), np.zeros(x.shape, np.float32)
    decodes = np.zeros((nr, nc), np.float32)
    for i in range(nr):
        for j in range(nc):
            rs, cs = slice(i * tr, (i + 1) * tr), slice(j * tc, (j + 1) * tc)
            block = x[rs, cs].astype(np.float32)
            amax = np.float32(np.max(np.abs(block)))
            if amax > 0 or np.isnan(amax):
                m = np.float32(FMAX[fmt]) / amax
                if pow2 and np.isfinite(m) and m > 0:
                    m = np.float32(2.0 ** np.floor(np.log2(np.float64(min(m, np.float32(2.0 ** 127))))))
            else:
                m = np.float32(1.0)
            c = ref_cast((block * m).astype(np.float32), fmt)
            codes[rs, cs] = c
            decodes[i, j] = np.float32(1.0) / m
            deq[rs, cs] = values_of(c, fmt) * decodes[i, j]
    return codes, decodes, deq
