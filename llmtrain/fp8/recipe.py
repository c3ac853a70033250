"""FP8 recipes: how a tensor is cut into tiles, how each tile's scale is chosen, and the quantisation itself.

    python -m pytest tests/fp8/test_recipe.py -q
    recipe = RECIPES["blockwise"]                                  # or "tensorwise"
    q = quantize(x, recipe.activation, recipe.forward_format)      # x [.., R, C] fp32 -> Quantized
    x_hat = q.dequantize()                                         # [.., R, C] fp32 on the FP8 grid times the scale

A tile is `(rows, cols)` of the last two axes (leading axes are batches: the routed experts' [E, N, h]); None
means the whole axis. The recipes (DeepSeek-V3's blockwise, as Paddle's `fp8_quant_blockwise` kernel takes it,
and Transformer Engine's tensorwise current scaling):

| recipe     | forward x (GEMM x W)      | W                  | backward dY (dX = dY Wᵀ) | dW = Xᵀ dY: X and dY  | scale         |
|------------|---------------------------|--------------------|--------------------------|-----------------------|---------------|
| blockwise  | 1x128 tiles, e4m3         | 128x128 blocks e4m3| 1x128 tiles, e4m3        | 128x1 tiles (along the tokens), e4m3 | power of two |
| tensorwise | one scale per tensor, e4m3| one scale, e4m3    | one scale, e5m2          | the same tensors      | fmax / amax   |

Scale (the encode multiplier m, one per tile): amax = max |x| over the tile; a zero tile takes m = 1;
`pow2`: m = 2^floor(log2(fmax / amax)) read from the fp32 exponent bits of fmax / amax (exact: never a rounded
log2, so amax x m <= fmax always), else m = fmax / amax in fp32. The FP8 value is `cast(x * m)` by Paddle's
saturating cast (round to nearest even); the decode scale is 1 / m (exact for a power of two) and the dequantised
value is fp32(q) * (1 / m). A tile that does not fill its shape (a width that is no multiple of 128) is the part
that exists, as zero padding would give (zeros do not change amax).

Under tensor parallelism a GPU rank quantises its own slice, so tiles never cross a slice boundary: `quantize(...,
split=(axis, parts))` cuts the tensor into `parts` equal slices along `axis` (-1: columns, -2: rows) and quantises
each slice on its own, as the `parts` ranks of a tp run would (`llmtrain.fp8.emulate`: one process as the reference
of a tp run).

A non-finite amax (inf or NaN in the tile) is recorded by `FP8Health` (`llmtrain.fp8.health`) before the cast
would turn it into 448 (e4m3) or 57344 (e5m2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import paddle

Tile = Tuple[Optional[int], Optional[int]]
Split = Optional[Tuple[int, int]]
"""(axis, parts): the tensor's slices along axis -1 or -2 quantised each on its own; None: the whole tensor."""

FORMATS = {"e4m3": ("float8_e4m3fn", 448.0), "e5m2": ("float8_e5m2", 57344.0)}
"""FP8 format -> (Paddle dtype, largest finite value fmax)."""


@dataclass(frozen=True)
class Recipe:
    """One FP8 training recipe: the tiles of each GEMM operand, the formats and the scale rule."""

    name: str
    """`blockwise` or `tensorwise` (`train.fp8`)."""

    activation: Tile
    """Tile of the forward GEMM's input x [M, K] and of the backward's dY [M, N] for dX (along the contraction)."""

    weight: Tile
    """Tile of the weight W [K, N] (the same blocks serve W and Wᵀ)."""

    wgrad: Tile
    """Tile of x [M, K] and dY [M, N] for dW = xᵀ dY (along the tokens M, the contraction of that GEMM)."""

    forward_format: str
    """FP8 format of x and W."""

    backward_format: str
    """FP8 format of dY."""

    pow2: bool
    """Scales are powers of two (exact to apply and to invert)."""


RECIPES = {
    "blockwise": Recipe("blockwise", activation=(1, 128), weight=(128, 128), wgrad=(128, 1),
                        forward_format="e4m3", backward_format="e4m3", pow2=True),
    "tensorwise": Recipe("tensorwise", activation=(None, None), weight=(None, None), wgrad=(None, None),
                         forward_format="e4m3", backward_format="e5m2", pow2=False),
}
"""The recipes `train.fp8` names (`none` is no recipe)."""


@dataclass
class Quantized:
    """An FP8 tensor [.., R, C] with one fp32 decode scale per tile [.., ceil(R/tr), ceil(C/tc)] (split: the slices
    stacked on a new axis before the last two, [.., P, R/P, C] or [.., P, R, C/P], each with its own tiles)."""

    data: paddle.Tensor
    """The FP8 values (`float8_e4m3fn` / `float8_e5m2`), shape of the input (split: of the stacked slices)."""

    decode: paddle.Tensor
    """1 / m per tile, fp32 [.., row tiles, col tiles]."""

    tile: Tuple[int, int]
    """The tile's (rows, cols) as applied (None resolved to the axis length)."""

    amax: paddle.Tensor
    """max |x| per tile, fp32 (the health check reads it)."""

    split: Split = None
    """(axis, parts) the slices were cut along, or None (`quantize`)."""

    def dequantize(self) -> paddle.Tensor:
        """fp32 [.., R, C]: fp32(q) x the tile's decode scale (slices put back in place)."""
        return join_slices(per_tile_product(self.data.astype("float32"), self.decode, self.tile), self.split)


def cut_slices(x: paddle.Tensor, split: Split) -> paddle.Tensor:
    """x [.., R, C] -> its `parts` slices along `axis` stacked: [.., P, R/P, C] (axis -2) or [.., P, R, C/P] (-1)."""
    if split is None or split[1] == 1:
        return x
    axis, parts = split
    lead, (rows, cols) = list(x.shape[:-2]), (int(x.shape[-2]), int(x.shape[-1]))
    if axis == -2:
        return x.reshape(lead + [parts, rows // parts, cols])
    n = len(lead)
    return x.reshape(lead + [rows, parts, cols // parts]).transpose([*range(n), n + 1, n, n + 2])


def join_slices(x: paddle.Tensor, split: Split) -> paddle.Tensor:
    """The inverse of `cut_slices`: [.., P, r, c] -> [.., R, C]."""
    if split is None or split[1] == 1:
        return x
    axis, n = split[0], x.ndim - 3
    lead, (parts, rows, cols) = list(x.shape[:-3]), (int(x.shape[-3]), int(x.shape[-2]), int(x.shape[-1]))
    if axis == -2:
        return x.reshape(lead + [parts * rows, cols])
    return x.transpose([*range(n), n + 1, n, n + 2]).reshape(lead + [rows, parts * cols])


def resolve_tile(tile: Tile, shape) -> Tuple[int, int]:
    """(rows, cols) of `tile` on a tensor of `shape` [.., R, C] (None: the whole axis)."""
    rows, cols = int(shape[-2]), int(shape[-1])
    return (rows if tile[0] is None else min(tile[0], rows)), (cols if tile[1] is None else min(tile[1], cols))


def _tiles(x: paddle.Tensor, tile: Tuple[int, int]) -> paddle.Tensor:
    """x [.., R, C] -> [B, nr, tr, nc, tc] (B the leading axes flattened; a ragged last tile padded with zeros)."""
    tr, tc = tile
    rows, cols = int(x.shape[-2]), int(x.shape[-1])
    nr, nc = -(-rows // tr), -(-cols // tc)
    a = x.reshape([-1, rows, cols])  # [B, R, C]
    if nc * tc != cols:
        a = paddle.concat([a, paddle.zeros([a.shape[0], rows, nc * tc - cols], a.dtype)], axis=2)
    if nr * tr != rows:
        a = paddle.concat([a, paddle.zeros([a.shape[0], nr * tr - rows, nc * tc], a.dtype)], axis=1)
    return a.reshape([-1, nr, tr, nc, tc])


def per_tile_product(x: paddle.Tensor, per_tile: paddle.Tensor, tile: Tuple[int, int]) -> paddle.Tensor:
    """x [.., R, C] times its tile's value per_tile [.., nr, nc] -> [.., R, C] (fp32 multiply)."""
    rows, cols = int(x.shape[-2]), int(x.shape[-1])
    t = _tiles(x, tile)  # [B, nr, tr, nc, tc]
    y = t * per_tile.reshape([t.shape[0], t.shape[1], 1, t.shape[3], 1])
    y = y.reshape([t.shape[0], t.shape[1] * t.shape[2], t.shape[3] * t.shape[4]])[:, :rows, :cols]
    return y.reshape(list(x.shape))


def tile_amax(x: paddle.Tensor, tile: Tuple[int, int]) -> paddle.Tensor:
    """max |x| per tile: x [.., R, C] fp32 -> [.., ceil(R/tr), ceil(C/tc)] (NaN propagates)."""
    t = _tiles(x.abs(), tile)  # [B, nr, tr, nc, tc]
    return t.max(axis=[2, 4]).reshape(list(x.shape[:-2]) + [t.shape[1], t.shape[3]])


def encode_multiplier(amax: paddle.Tensor, fmax: float, pow2: bool) -> paddle.Tensor:
    """m per tile (module docstring): fp32 like amax; 1 where amax is 0."""
    safe = paddle.where(amax > 0, amax, paddle.ones_like(amax))
    ratio = paddle.full([], fmax, "float32") / safe  # fmax / amax, fp32 (IEEE division)
    if pow2:  # 2^floor(log2 ratio): keep the exponent bits, clear the mantissa (ratio is a normal fp32 number)
        ratio = paddle.minimum(ratio, paddle.full([], 2.0 ** 127, "float32"))  # a subnormal amax: no inf multiplier
        bits = ratio.view(paddle.int32)
        ratio = paddle.bitwise_and(bits, paddle.full([], 0x7F800000, "int32")).view(paddle.float32)
    return paddle.where(amax > 0, ratio, paddle.ones_like(ratio))


def quantize(x: paddle.Tensor, tile: Tile, fmt: str, pow2: bool, split: Split = None) -> Quantized:
    """x [.., R, C] (any float dtype; computed in fp32) -> `Quantized` on the FP8 grid of `fmt` ("e4m3"/"e5m2");
    `split` (axis, parts): each of `parts` slices along `axis` quantised on its own (a tp rank's slice)."""
    dtype, fmax = FORMATS[fmt]
    if split is not None and int(x.shape[split[0]]) % split[1]:
        raise ValueError(f"cannot cut an axis of {int(x.shape[split[0]])} into {split[1]} equal slices")
    x = cut_slices(x.astype("float32"), split)  # [.., R, C], or [.., P, r, c]
    t = resolve_tile(tile, x.shape)
    amax = tile_amax(x, t)
    m = encode_multiplier(amax, fmax, pow2)
    data = per_tile_product(x, m, t).astype(dtype)  # Paddle's saturating cast, round to nearest even
    return Quantized(data=data, decode=paddle.full([], 1.0, "float32") / m, tile=t, amax=amax,
                     split=None if split is None or split[1] == 1 else split)


def fake_quantize(x: paddle.Tensor, tile: Tile, fmt: str, pow2: bool, split: Split = None) -> paddle.Tensor:
    """x [.., R, C] -> fp32 [.., R, C]: quantised and dequantised (what an FP8 GEMM sees of x)."""
    return quantize(x, tile, fmt, pow2, split).dequantize()
