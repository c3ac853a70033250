"""The `h100` profile against the H100's held-out twin steps (benchmarks/data/h100/steps, committed data the profile
was never fitted to; benchmarks/fit_h100.py reads only the kernel tables beside them).

    python -m pytest tests/plan/test_h100_held_out.py -q
    LLMTRAIN_SAMPLE_SEED=all python -m pytest tests/plan/test_h100_held_out.py -q     # every group, not a draw

Every row was measured with cuDNN attention (the FA3-class kernel the profile prices). The bounds are the issue's:
dense <= 8k, 16k-64k and MoE capacity rows within 10% (one capacity row misses: pinned as a known miss below),
dropless rows within 15% when the routing's busiest-expert load is stated (`plan.moe_imbalance` = the factor the
twin's dispatcher read). The planner's own expectation from E, k and tokens is a balanced router's, a lower bound:
the twin's random-initialised routers load their busiest expert 2.6-5.2x the mean, so those rows are checked to be
under-priced, not within a bound. Each group of rows is one draw of `llmtest.drawn_or_skip` (a plan takes ~1-2 s
here).
"""
from __future__ import annotations

import pytest

from llmtest import drawn_or_skip

from benchmarks import planner_h100 as bench
from llmtrain.config import register_configs

register_configs()
GROUPS = [("dense",), ("long",), ("moe",)]
CAPACITY_MISS = {"qwen-moe-4L-mb1-slots-cap1.25", "deepseek-v2-lite-4L-mb1-slots-cap1.25", "mixtral-2L-mb1-slots-cap1.25"}
"""Capacity rows outside ±10% (-14.0%, -11.5%, -11.1%): with every MoE row class measured on the H100
(moe_ops.json complete since the second call) the micro-batch-1 capacity rows are priced 11-14% too fast (with
the H200's curves scaled by the `mul` ratio, only the first missed, at -11.3%); pinned here so that a fix shows.
Where the time goes (benchmarks/data/h100/twin2, benchmarks/README.md): the forward+backward is host-bound at mb1
(the twin launches about twice the kernels the planner lists) and the optimizer is priced 10-12% fast."""


def test_dense_rows_within_ten_percent():
    drawn_or_skip("dense", GROUPS)
    rows = bench.dense_rows()
    assert len(rows) == 12
    assert all(abs(r["error"]) <= 0.10 for r in rows), [(r["name"], round(r["error"], 3)) for r in rows]


def test_long_rows_within_ten_percent():
    drawn_or_skip("long", GROUPS)
    rows = bench.long_rows()
    assert {r["name"] for r in rows} >= {"llama-1b-s16k", "llama-1b-12L-s32k", "llama-1b-8L-s64k"}
    assert all(abs(r["error"]) <= 0.10 for r in rows), [(r["name"], round(r["error"], 3)) for r in rows]


def test_moe_rows_capacity_and_dropless():
    drawn_or_skip("moe", GROUPS)
    rows = bench.moe_rows()
    cap = [r for r in rows if not r["dropless"]]
    drop = [r for r in rows if r["dropless"]]
    assert len(cap) == 5 and len(drop) == 5
    assert all(abs(r["error"]) <= 0.10 for r in cap if r["name"] not in CAPACITY_MISS), \
        [(r["name"], round(r["error"], 3)) for r in cap]
    missed = {r["name"] for r in cap if abs(r["error"]) > 0.10}
    assert missed == CAPACITY_MISS, missed
    assert all(abs(r["error"]) <= 0.15 for r in drop), [(r["name"], round(r["error"], 3)) for r in drop]
    expected = {r["name"]: r for r in bench.moe_rows(routing="expected", dropless_only=True)}
    for r in drop:  # a balanced router's busiest expert: below the twin's random-init routing, so cheaper
        assert expected[r["name"]]["predicted_s"] < r["predicted_s"], r["name"]


def test_expected_imbalance_is_a_balanced_routers_busiest_expert():
    """The dropless default against a direct simulation of a balanced router (each token k distinct experts,
    uniformly): within 5% of the simulated mean busiest-expert load."""
    import numpy as np

    from llmtrain.plan.moe import expected_imbalance

    rng = np.random.default_rng(0)
    for E, k, T in ((8, 2, 4096), (60, 4, 4096), (64, 6, 8192), (256, 8, 4096)):
        peaks = []
        for _ in range(20):
            choice = np.argsort(rng.random((T, E)), axis=1)[:, :k]  # k distinct experts per token
            peaks.append(np.bincount(choice.ravel(), minlength=E).max() / (T * k / E))
        assert expected_imbalance(E, k, T) == pytest.approx(float(np.mean(peaks)), rel=0.05), (E, k, T)
