"""One process quantising as the ranks of a tp / sequence-parallel / cp run would (`train.fp8_emulate`).

    python llmtrain/pretrain.py model=llama-tiny train.fp8=blockwise train.fp8_emulate.tp=2 \
        train.fp8_emulate.sequence_parallel=true          # the FP8 numerics of a tp2 + sp run, on one device
    python -m pytest tests/fp8/test_emulate.py -q

Under a layout that splits a GEMM's operands each rank quantises what it holds, so the tiles of the recipe
(`llmtrain.fp8.recipe`) never cross a rank's boundary, and one process, whose tiles run over the whole tensor, does
not quantise the same way. Three things move:

- tensor parallelism (tp = P): a column linear's W [K, N] is held as P slices [K, N/P] and its dY as [M, N/P]; a
  row linear's W as [K/P, N] and its x as [M, K/P]. Each slice is its own set of 128x128 blocks and 1x128 tiles
  (tensorwise: its own amax, per rank, as a kernel on the local slice computes it; llmtrain reduces no amax over
  the tp group). `tp_slices` says which operand is cut along which axis.
- sequence parallelism: the tp linears see the tokens of a micro-batch as [s, b] (the gathered sequence, fleet's
  convention) instead of [b, s], which moves the 128-token tiles of the weight gradient's operands (`wgrad`).
- context parallelism (cp = C): rank r holds chunks r and 2C-1-r of each sequence (`llmtrain.parallel.context`)
  and quantises its [b, 2s/2C] tokens alone: the weight gradient's 128-token tiles cover that rank's tokens only
  (tensorwise: a per-rank amax).

`TokenView` puts one process's tokens [b, s, K] in the ranks' order and grouping ([G, M/G, K], one group per cp
rank) before the GEMM and back after it; the weight gradient is summed over the groups as cp sums it over ranks.
The GEMMs then equal the ranks' up to the order of fp32 sums (tests/parallel/test_parity.py,
tests/parallel/test_context_parity.py). The forward's 1x128 tiles run along each token's own row, so the token
order moves only the weight-gradient tiles.

How far one process without emulation is from a tp / cp run (docs/fp8.md "Under parallel layouts"): `blockwise`
uses power-of-two scales, and on the e4m3 grid rounding x·2^k for a normal x·2^k does not depend on k, so moving
a tile boundary changes a dequantised value only where x·m is subnormal (|x| < 2^-6 of the tile's decode scale)
under one of the two scales, by at most one subnormal step 2^-9 of the larger decode scale, that is at most
2^-8 / 448 (8.7e-6) of the larger tile's amax. `tensorwise` scales are fmax / amax: every value may move by up
to a grid step (2^-3 of its magnitude in e4m3, 2^-2 in e5m2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:  # paddle is imported where tokens move: `train.fp8_emulate` (a config field) stays paddle-free
    import paddle

    from llmtrain.fp8.recipe import Split


@dataclass
class FP8Emulate:
    """`train.fp8_emulate`: the layout whose ranks one process quantises as (default: none, the process's own)."""

    tp: int = 1
    """Quantise each linear's operands as the `tp` ranks of a tensor-parallel run hold them (column: W and dY cut
    along the outputs, row: W and x along the inputs). Needs a run without tensor parallelism."""

    sequence_parallel: bool = False
    """Tokens in the order sequence parallelism gives the tp linears ([s, b]); needs `tp` > 1."""

    cp: int = 1
    """Quantise the tokens of each cp rank (chunks r and 2·cp-1-r of every sequence) on their own. Needs a run
    without context parallelism."""


def emulate_problems(emulate: FP8Emulate, *, fp8: str, tp: int, cp: int, seq_len: int, has_experts: bool,
                     fused: bool) -> list[str]:
    """Why `train.fp8_emulate` cannot run with these settings (empty: it can). tp / cp: the run's own degrees."""
    if (emulate.tp, emulate.cp, emulate.sequence_parallel) == (1, 1, False):
        return []
    problems = []
    if fp8 == "none":
        problems.append("train.fp8_emulate is set but train.fp8=none: nothing is quantised")
    if emulate.tp < 1 or emulate.cp < 1:
        problems.append(f"train.fp8_emulate.tp={emulate.tp}, cp={emulate.cp}: degrees are >= 1")
    if emulate.tp > 1 and tp > 1:
        problems.append(f"train.fp8_emulate.tp={emulate.tp} under parallel.tp={tp}: emulating a tp split inside a "
                        "tp rank is not implemented (the reference of a tp run is a run without tp)")
    if emulate.cp > 1 and cp > 1:
        problems.append(f"train.fp8_emulate.cp={emulate.cp} under parallel.cp={cp}: the reference of a cp run is a "
                        "run without cp")
    if emulate.sequence_parallel and emulate.tp == 1:
        problems.append("train.fp8_emulate.sequence_parallel=true needs train.fp8_emulate.tp > 1")
    if emulate.cp > 1 and seq_len % (2 * emulate.cp):
        problems.append(f"train.fp8_emulate.cp={emulate.cp}: data.seq_len={seq_len} is not a multiple of "
                        f"2 x cp = {2 * emulate.cp} (the chunks of context parallelism)")
    if has_experts:
        problems.append("train.fp8_emulate: a model with routed experts is not emulated (their dispatched token "
                        "order under tp / sp / cp is not modelled)")
    if fused and emulate.tp > 1:
        problems.append("train.fp8_emulate.tp: the fused projections (model.fuse_qkv / fuse_ffn) are not emulated "
                        "(a tp rank concatenates its own slices of q, k, v); turn them off for the reference")
    return problems


def tp_slices(kind: str, parts: int) -> tuple[Split, Split, Split]:
    """(x, W, dY) splits of a `kind` linear ("column" / "row" / "replicated") as `parts` tp ranks hold them."""
    if parts == 1 or kind == "replicated":
        return None, None, None
    if kind == "column":  # W [K, N/P], dY [M, N/P]
        return None, (-1, parts), (-1, parts)
    if kind == "row":  # x [M, K/P], W [K/P, N]
        return (-1, parts), (-2, parts), None
    raise ValueError(f"unknown linear kind {kind!r}")


def cp_order(seq_len: int, cp: int) -> np.ndarray:
    """[s]: the sequence index of each position when the cp ranks' local positions (rank r: chunks r and 2·cp-1-r,
    as `llmtrain.parallel.context_chunks.ChunkLayout.order`) are concatenated in rank order."""
    c = seq_len // (2 * cp)
    return np.concatenate([np.arange(i * c, (i + 1) * c) for r in range(cp) for i in (r, 2 * cp - 1 - r)])


@dataclass(frozen=True)
class TokenView:
    """The order and grouping of a micro-batch's tokens inside the linears of the emulated ranks."""

    cp: int = 1
    """Groups: one per cp rank, its chunks of every sequence."""

    sequence_parallel: bool = False
    """Within a group, tokens position-major ([s, b]) as sequence parallelism gathers them."""

    def to_ranks(self, x: paddle.Tensor) -> paddle.Tensor:
        """x [b, s, K] -> [G, M/G, K]: group g holds cp rank g's tokens in its order."""
        import paddle

        b, s, k = (int(d) for d in x.shape)
        if self.cp > 1:
            x = paddle.index_select(x, paddle.to_tensor(cp_order(s, self.cp)), axis=1)  # [b, s] rank-major
        x = x.reshape([b, self.cp, s // self.cp, k]).transpose([1, 0, 2, 3])  # [G, b, s/G, K]
        if self.sequence_parallel:
            x = x.transpose([0, 2, 1, 3])  # [G, s/G, b, K]
        return x.reshape([self.cp, b * s // self.cp, k])

    def from_ranks(self, y: paddle.Tensor, b: int, s: int) -> paddle.Tensor:
        """The inverse of `to_ranks`: y [G, M/G, N] -> [b, s, N]."""
        import paddle

        n = int(y.shape[-1])
        if self.sequence_parallel:
            y = y.reshape([self.cp, s // self.cp, b, n]).transpose([0, 2, 1, 3])
        y = y.reshape([self.cp, b, s // self.cp, n]).transpose([1, 0, 2, 3]).reshape([b, s, n])
        if self.cp > 1:
            y = paddle.index_select(y, paddle.to_tensor(np.argsort(cp_order(s, self.cp))), axis=1)
        return y


def token_view(emulate: Optional[FP8Emulate]) -> Optional[TokenView]:
    """The `TokenView` of `train.fp8_emulate`, or None when the tokens stay as the process holds them."""
    if emulate is None or (emulate.cp == 1 and not emulate.sequence_parallel):
        return None
    return TokenView(cp=emulate.cp, sequence_parallel=emulate.sequence_parallel)
