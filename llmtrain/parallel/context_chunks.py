"""Which positions of a sequence each context-parallel rank holds: 2·cp chunks, rank r chunks r and 2·cp-1-r.

    python -m pytest tests/parallel/test_context.py -q
    layout = ChunkLayout(seq_len=s, cp=cp); local = layout.localize(micro_batch, rank)   # its [m, 2c] arrays

(llmtrain/parallel/context.py explains the plan; the exchanges in context_exchange.py read the same layout.)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SEQUENCE_KEYS = ("input_ids", "labels", "loss_mask", "position_ids", "segment_ids")
"""Micro-batch arrays [m, s] cut along the sequence by `ChunkLayout.localize`."""


@dataclass(frozen=True)
class ChunkLayout:
    """Which positions of a sequence of `seq_len` each of `cp` ranks holds: rank r chunks r and 2·cp-1-r."""

    seq_len: int
    cp: int

    @property
    def chunk(self) -> int:
        """Positions per chunk: seq_len / (2·cp)."""
        return self.seq_len // (2 * self.cp)

    def chunks(self, rank: int) -> tuple[int, int]:
        """The two chunk indices rank `rank` holds (early, late)."""
        return rank, 2 * self.cp - 1 - rank

    def index(self, rank: int) -> np.ndarray:
        """[2 c] int64: the sequence index of each local position of `rank` (its chunks, early one first)."""
        c = self.chunk
        return np.concatenate([np.arange(i * c, (i + 1) * c) for i in self.chunks(rank)]).astype(np.int64)

    def order(self) -> np.ndarray:
        """[s]: sequence index of each position when the cp ranks' local sequences are concatenated in rank order
        (what an all-gather over the cp group returns); `np.argsort(order())` puts them back in sequence order."""
        return np.concatenate([self.index(r) for r in range(self.cp)])

    def localize(self, mb: dict, rank: int) -> dict:
        """A micro-batch {key: [m, s] array, ...} -> this rank's {key: [m, 2 c]}; `position_ids` added (the global
        positions) when the batch has none. Other entries (sample ids) are kept as they are."""
        s = np.asarray(mb["input_ids"]).shape[1]
        if s != self.seq_len:
            raise ValueError(f"context parallelism was planned for sequences of {self.seq_len}, got {s}")
        idx = self.index(rank)
        out = dict(mb)
        if "position_ids" not in mb:
            out["position_ids"] = np.broadcast_to(np.arange(s, dtype=np.int64), np.asarray(mb["input_ids"]).shape)
        for key in SEQUENCE_KEYS:
            if key in out:
                out[key] = np.ascontiguousarray(np.asarray(out[key])[:, idx])
        return out
