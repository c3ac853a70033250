"""Blending several sample streams by weight, deterministically and in O(1) per sample.

    blend = Blend([0.7, 0.3])
    dataset_ids, local_ids = blend.locate(np.arange(1000))  # which stream, which sample of it

The global stream is periodic with period ``P`` (65536 samples): in every period
dataset ``d`` gets ``q_d`` samples, ``q`` being the largest-remainder apportionment
of ``P * w`` (so each dataset's share is exact to 1/P), and inside a period the
samples are interleaved by "due time" ``(k + 0.5) / q_d`` (ties by dataset index),
so even a short prefix of the stream follows the weights (error below one sample
per dataset at every point of a period). Global sample ``n`` is dataset
``pattern[n % P]``, sample ``(n // P) * q_d + rank[n % P]`` of that dataset.
This is what Megatron's greedy blending index computes, without building an
array over the whole run.
"""

from __future__ import annotations

import numpy as np

PERIOD = 1 << 16


def apportion(weights, total: int) -> np.ndarray:
    """Largest-remainder integer shares of ``total`` proportional to ``weights`` (sum == total)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    q = np.floor(exact).astype(np.int64)
    rest = total - int(q.sum())
    order = np.argsort(-(exact - q), kind="stable")  # largest remainders first, ties by index
    q[order[:rest]] += 1
    return q


class Blend:
    """Maps global sample ids to (dataset, sample-of-that-dataset)."""

    def __init__(self, weights, period: int = PERIOD):
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"blend weights {list(weights)}: need non-negative finite numbers with a positive sum")
        self.weights = w / w.sum()
        self.period = int(period)
        self.quota = apportion(self.weights, self.period)  # [n_datasets] samples per period
        ds = np.repeat(np.arange(len(w)), self.quota)  # [P]
        k = np.concatenate([np.arange(q) for q in self.quota]).astype(np.int64)  # [P] rank within dataset
        due = (k + 0.5) / np.maximum(self.quota[ds], 1)  # [P]
        order = np.lexsort((ds, due))  # by due time, then dataset index
        self.pattern = ds[order].astype(np.int32)  # [P] dataset of each position in a period
        self.rank = k[order]  # [P] its sample rank within the period

    def locate(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(dataset [n], local sample id [n]) of global sample ids [n]."""
        ids = np.asarray(ids, dtype=np.int64)
        period, r = np.divmod(ids, self.period)
        d = self.pattern[r]
        return d, period * self.quota[d] + self.rank[r]
