"""One process quantising as the ranks of a tp / sp / cp run (`train.fp8_emulate`), and how far that is from not.

    python -m pytest tests/fp8/test_emulate.py -q

- A split tensor (a tp rank's slices) is quantised slice by slice, bit for bit as the numpy reference quantises each
  slice on its own (tests/fp8_reference.py).
- The emulated GEMMs equal the ranks' GEMMs computed one by one in this process: a column / row linear's slices
  (outputs concatenated, row partial sums added) and the cp ranks' token sets (weight gradients summed), 1e-5 of
  the output's scale (the order of fp32 sums).
- The bound between quantising with and without moved tile boundaries (llmtrain/fp8/emulate.py): blockwise
  (power-of-two scales) changes only values that are subnormal under one of the two scales, by at most 2^-9 times
  the larger decode scale; tensorwise moves any value by up to 2^-3 |x| (e4m3) or 2^-2 |x| (e5m2) plus that
  subnormal step.
The training runs under tp2 + sp and cp2 against their emulated one-process runs are in
tests/parallel/test_parity.py and tests/parallel/test_context_parity.py.
"""
from __future__ import annotations

import numpy as np
import paddle
import pytest

from fp8_reference import ref_quantize
from llmtrain.fp8.emulate import TokenView, cp_order, tp_slices
from llmtrain.fp8.linear import FP8Gemm
from llmtrain.fp8.recipe import RECIPES, join_slices, per_tile_product, quantize

TOL = 1e-5


def wide_range(rows: int, cols: int, seed: int) -> np.ndarray:
    """Magnitudes over 16 binades (many values land subnormal after scaling), a few zero rows."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-12, 4, (rows, cols)))).astype(np.float32)
    x[3] = 0.0
    return x


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
@pytest.mark.parametrize("axis", [-1, -2])
def test_each_slice_is_quantised_on_its_own(recipe, axis):
    r = RECIPES[recipe]
    x = wide_range(130, 320, seed=5)  # slices of 65 rows / 160 columns: ragged 1x128 tiles and 128x128 blocks
    for operand in ("activation", "weight", "wgrad"):
        tile = getattr(r, operand)
        q = quantize(paddle.to_tensor(x), tile, r.forward_format, r.pow2, split=(axis, 2))
        pieces = np.split(x, 2, axis=axis)
        want = np.concatenate([ref_quantize(p, tile, r.forward_format, r.pow2)[2] for p in pieces], axis=axis)
        np.testing.assert_array_equal(q.dequantize().numpy(), want, err_msg=f"{recipe} {operand} axis {axis}")


def _per_element_decode(q) -> np.ndarray:
    """The decode scale each element of a Quantized was scaled with, [R, C]."""
    ones = paddle.ones(q.data.shape, "float32")
    return join_slices(per_tile_product(ones, q.decode, q.tile), q.split).numpy()


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_moving_tile_boundaries_moves_values_by_at_most_the_stated_bound(recipe):
    r = RECIPES[recipe]
    x = wide_range(320, 384, seed=9)
    for operand in ("activation", "weight", "wgrad"):
        moved = 0
        for fmt in {r.forward_format, r.backward_format}:
            for split in ((-1, 2), (-2, 2), (-1, 3), (-2, 4)):
                whole = quantize(paddle.to_tensor(x), getattr(r, operand), fmt, r.pow2)
                cut = quantize(paddle.to_tensor(x), getattr(r, operand), fmt, r.pow2, split=split)
                diff = np.abs(whole.dequantize().numpy() - cut.dequantize().numpy())
                d = np.maximum(_per_element_decode(whole), _per_element_decode(cut))  # the larger decode scale
                sub = 2.0 ** -9 if fmt == "e4m3" else 2.0 ** -16  # one subnormal step on the FP8 grid
                if r.pow2:  # normal under both scales: the same value; else within one subnormal step
                    assert (diff[np.abs(x) >= 2.0 ** -6 * d] == 0).all(), (operand, fmt, split)
                    assert (diff <= sub * d).all(), (operand, fmt, split)
                else:
                    rel = 2.0 ** -3 if fmt == "e4m3" else 2.0 ** -2  # two half-steps of the mantissa
                    assert (diff <= rel * np.abs(x) + sub * d).all(), (operand, fmt, split)
                moved += int((diff > 0).sum())
        assert moved > 0, f"{operand}: no split moved a value (the bound was never exercised)"


def _gemm(recipe, x, w, dy, **emulate):
    xt, wt = paddle.to_tensor(x, stop_gradient=False), paddle.to_tensor(w, stop_gradient=False)
    y = FP8Gemm(RECIPES[recipe], None, "t", **emulate)(xt, wt)
    y.backward(paddle.to_tensor(dy))
    return y.numpy(), xt.grad.numpy(), wt.grad.numpy()


def _close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * np.abs(want).max(), err_msg=what)


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_tp_emulation_equals_the_ranks_gemms(recipe, kind):
    """Each of 2 ranks runs its own FP8Gemm on its slice (column: W[:, r], row: x[..., r] and W[r, :]); the
    emulated one-process GEMM equals their concatenated outputs / summed partials and their gradients."""
    rng = np.random.default_rng(3)
    b, s, k, n = 2, 80, 320, 384
    x = wide_range(b * s, k, seed=4).reshape(b, s, k)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    dy = (rng.standard_normal((b, s, n)) * 1e-3).astype(np.float32)
    y, dx, dw = _gemm(recipe, x, w, dy, splits=tp_slices(kind, 2))
    ranks = []
    for r in range(2):
        if kind == "column":
            cols = slice(r * n // 2, (r + 1) * n // 2)
            ranks.append(_gemm(recipe, x, w[:, cols], dy[..., cols]))
        else:
            rows = slice(r * k // 2, (r + 1) * k // 2)
            ranks.append(_gemm(recipe, x[..., rows], w[rows], dy))
    if kind == "column":
        want = (np.concatenate([t[0] for t in ranks], -1), ranks[0][1] + ranks[1][1], np.concatenate([t[2] for t in ranks], 1))
    else:
        want = (ranks[0][0] + ranks[1][0], np.concatenate([t[1] for t in ranks], -1), np.concatenate([t[2] for t in ranks], 0))
    for got, ref, what in zip((y, dx, dw), want, ("y", "dx", "dW")):
        _close(got, ref, f"{recipe} {kind} {what}")
    plain = _gemm(recipe, x, w, dy)
    if recipe == "tensorwise":  # a per-rank amax differs from the whole tensor's: the emulation is not a no-op
        assert max(np.abs(p - g).max() / np.abs(g).max() for p, g in zip(plain, (y, dx, dw))) > 1e-3


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
@pytest.mark.parametrize("cp,sp", [(2, False), (1, True), (2, True)])
def test_token_view_equals_the_ranks_gemms(recipe, cp, sp):
    """cp ranks (chunks r and 2cp-1-r of each sequence) each run the GEMM on their own tokens (under sp in [s, b]
    order); the emulated one-process GEMM equals their outputs put back in place and their weight gradients summed."""
    from llmtrain.parallel.context_chunks import ChunkLayout

    rng = np.random.default_rng(5)
    b, s, k, n = 2, 192, 96, 64  # 384 tokens: 128-token wgrad tiles that the ranks' token sets move
    x = wide_range(b * s, k, seed=6).reshape(b, s, k)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    dy = (rng.standard_normal((b, s, n)) * 1e-3).astype(np.float32)
    y, dx, dw = _gemm(recipe, x, w, dy, tokens=TokenView(cp=cp, sequence_parallel=sp))
    layout = ChunkLayout(seq_len=s, cp=cp)
    np.testing.assert_array_equal(cp_order(s, cp), layout.order())
    want_y, want_dx, want_dw = np.zeros_like(y), np.zeros_like(dx), np.zeros_like(dw)
    for r in range(cp):
        idx = layout.index(r)
        xr, dyr = x[:, idx], dy[:, idx]  # [b, 2c, .]
        if sp:
            xr, dyr = xr.transpose(1, 0, 2), dyr.transpose(1, 0, 2)  # [2c, b, .]: the gathered sequence's order
        yr, dxr, dwr = _gemm(recipe, np.ascontiguousarray(xr), w, np.ascontiguousarray(dyr))
        if sp:
            yr, dxr = yr.transpose(1, 0, 2), dxr.transpose(1, 0, 2)
        want_y[:, idx], want_dx[:, idx] = yr, dxr
        want_dw += dwr
    for got, ref, what in zip((y, dx, dw), (want_y, want_dx, want_dw), ("y", "dx", "dW")):
        _close(got, ref, f"{recipe} cp{cp} sp={sp} {what}")


def test_what_the_emulation_refuses():
    from llmtrain.fp8.emulate import FP8Emulate, emulate_problems

    ok = dict(fp8="blockwise", tp=1, cp=1, seq_len=32, has_experts=False, fused=False)
    assert emulate_problems(FP8Emulate(tp=2, sequence_parallel=True, cp=2), **ok) == []
    assert emulate_problems(FP8Emulate(), **dict(ok, fp8="none", tp=4, has_experts=True, fused=True)) == []
    cases = [(FP8Emulate(tp=2), dict(fp8="none"), "train.fp8=none"),
             (FP8Emulate(tp=2), dict(tp=2), "under parallel.tp=2"),
             (FP8Emulate(cp=2), dict(cp=2), "under parallel.cp=2"),
             (FP8Emulate(sequence_parallel=True), {}, "needs train.fp8_emulate.tp > 1"),
             (FP8Emulate(cp=3), dict(seq_len=32), "not a multiple of 2 x cp = 6"),
             (FP8Emulate(tp=2), dict(has_experts=True), "routed experts"),
             (FP8Emulate(tp=2), dict(fused=True), "fused projections")]
    for emulate, change, words in cases:
        problems = emulate_problems(emulate, **dict(ok, **change))
        assert len(problems) == 1 and words in problems[0], (emulate, change, problems)
