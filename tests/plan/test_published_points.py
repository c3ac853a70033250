"""The planner against the published runs it is held to: each prediction within the stated goal of the PUBLISHED
figure, and the figures `python benchmarks/planner.py` prints pinned.

    python -m pytest tests/plan/test_published_points.py -q

Two checks per point. (1) Against the published value, with the goals benchmarks/README.md states: tokens/s (or
TFLOP/s) within 15%, PaddleNLP's max allocated memory within 10%, a ratio of two runs within 5 points of the
published ratio. The published values are written here from their sources (below) and must equal the ones
benchmarks/planner.py carries, so changing a published figure in either place fails. (2) The pin: the figure the
planner prints now, 1% relative on tokens/s and TFLOP/s, 0.5% on memory (the planner is deterministic: the margin
only absorbs floating-point order), so a change to the cost model, profiles or memory model that moves one is
seen and must update the pin and benchmarks/README.md. No launches: the planner alone.

Sources: PaddleNLP llm/docs/pretrain.md (Llama2 7B/13B on 8 x A100-80G, tp2 sharding4 stage 2, tokens/s/device
and max_memory_allocated MiB); torchtitan docs/performance.md (64 x A100-80G FSDP: Llama2-13B 2162, Llama3-70B 331
tokens/s/device; 512 x H100 Llama 3.1 405B: 128 interleaved vs 100 1F1B tokens/s); Megatron-LM README weak-scaling
table (465.9 and 432.8 TFLOP/s per H100); Korthikanti et al. 2022 abstract (530B: 54.2% vs 42.1% MFU).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from llmtest import planner_benchmark

from llmtrain.config import compose_config, register_configs, to_config
from llmtrain.plan.__main__ import plan

ROOT = Path(__file__).resolve().parents[2]
bench = planner_benchmark()
register_configs()

THROUGHPUT_GOAL, MEMORY_GOAL, RATIO_GOAL_POINTS = 0.15, 0.10, 5.0
"""benchmarks/README.md's goals: |predicted / published - 1| for tokens/s and TFLOP/s, for memory; |difference| of
the ratios x 100."""
PUBLISHED_FIGURES = {  # label: (tokens/s/device, max allocated MiB or None)
    "PaddleNLP Llama2-7B 8xA100-80G tp2 sd4 s2 mb2": (3755, 52092),
    "PaddleNLP Llama2-13B 8xA100-80G tp2 sd4 s2 mb1": (1976, 64294),
    "torchtitan Llama2-13B 64xA100-80G FSDP mb2 no AC": (2162, None),
    "torchtitan Llama3-70B 64xA100-80G FSDP mb1 full AC": (331, None),
}
MEGATRON_FIGURES = {"Megatron-LM GPT 7.1B 96xH100 TP2 PP1": 465.9, "Megatron-LM GPT 177B 2304xH100 TP8 PP6": 432.8}
RATIO_FIGURES = {"Korthikanti 530B 2240xA100 MFU: selective / full recompute": (54.2, 42.1),
                 "torchtitan Llama3.1-405B 512xH100 tokens/s: interleaved (v2) / 1F1B": (128, 100)}

TOKENS_TOL, MEM_TOL = 0.01, 0.005
# label: (predicted tokens/s/device, predicted allocated MiB) as printed by benchmarks/planner.py
PUBLISHED = {
    "PaddleNLP Llama2-7B 8xA100-80G tp2 sd4 s2 mb2": (3374, 57269),
    "PaddleNLP Llama2-13B 8xA100-80G tp2 sd4 s2 mb1": (1836, 65027),
    "torchtitan Llama2-13B 64xA100-80G FSDP mb2 no AC": (2176, 57262),
    "torchtitan Llama3-70B 64xA100-80G FSDP mb1 full AC": (306, 37421),
}
MEGATRON = {"Megatron-LM GPT 7.1B 96xH100 TP2 PP1": 480.8, "Megatron-LM GPT 177B 2304xH100 TP8 PP6": 384.9}  # h100 fitted, overlap priced
RATIOS = {"Korthikanti 530B 2240xA100 MFU: selective / full recompute": (48.2, 36.96),
          "torchtitan Llama3.1-405B 512xH100 tokens/s: interleaved (v2) / 1F1B": (104.77, 80.97)}


def test_the_benchmark_carries_the_published_figures():
    """benchmarks/planner.py's published columns are the sources' figures above (a figure changed there fails)."""
    assert {lbl: (tok, mib) for lbl, _, tok, mib in bench.PUBLISHED} == PUBLISHED_FIGURES
    assert {lbl: pub for lbl, *_, pub in bench.MEGATRON} == MEGATRON_FIGURES
    assert {r[0]: (r[3], r[4]) for r in bench.RATIOS} == RATIO_FIGURES


def _within(predicted: float, published: float, goal: float) -> bool:
    return abs(predicted / published - 1) <= goal


def _row(overrides):
    return plan(to_config(compose_config(overrides)))[0]


@pytest.mark.parametrize("label", list(PUBLISHED))
def test_published_point(label):
    extra = next(e for lbl, e, _, _ in bench.PUBLISHED if lbl == label)
    row = _row(bench.BASE + extra)
    predicted_tokens, predicted_mib = row["tokens_per_sec_per_device"], row["memory_bytes"]["allocated"] / 2**20
    published_tokens, published_mib = PUBLISHED_FIGURES[label]
    assert _within(predicted_tokens, published_tokens, THROUGHPUT_GOAL), (predicted_tokens, published_tokens)
    if published_mib is not None:
        assert _within(predicted_mib, published_mib, MEMORY_GOAL), (predicted_mib, published_mib)
    tokens, mib = PUBLISHED[label]
    assert predicted_tokens == pytest.approx(tokens, rel=TOKENS_TOL, abs=0.5)
    assert predicted_mib == pytest.approx(mib, rel=MEM_TOL)


def test_megatron_points():
    got = {lbl: tflops for lbl, tflops, _ in bench.megatron_rows()}
    for label, published in MEGATRON_FIGURES.items():
        assert _within(got[label], published, THROUGHPUT_GOAL), (label, got[label], published)
    assert got == {k: pytest.approx(v, rel=TOKENS_TOL, abs=0.05) for k, v in MEGATRON.items()}


@pytest.mark.parametrize("label", list(RATIOS))
def test_ratio(label):
    _, num, den, _, _, key = next(r for r in bench.RATIOS if r[0] == label)
    scale = 100 if key == "mfu" else 1
    a, b = scale * _row(num)[key], scale * _row(den)[key]
    pub_a, pub_b = RATIO_FIGURES[label]
    assert abs(a / b - pub_a / pub_b) * 100 <= RATIO_GOAL_POINTS, (label, a / b, pub_a / pub_b)
    assert (a, b) == (pytest.approx(RATIOS[label][0], rel=TOKENS_TOL, abs=0.05),
                      pytest.approx(RATIOS[label][1], rel=TOKENS_TOL, abs=0.05))


# H200 validation rows (issue 22; benchmarks/data/h200): predicted step seconds as printed by
# `python benchmarks/planner.py --h200-only`
H200_PREDICTED = {"llama-1b-mb1": 0.05948, "llama-1b-mb2": 0.08662, "llama-1b-mb4": 0.14862, "llama-1b-mb8": 0.27888,
                  "gpt-1024-mb8": 0.06057, "gpt-1024-mb2": 0.05262, "gpt-2048-mb4": 0.16671, "gpt-2048-mb1": 0.06529,
                  "llama-7b-8L-mb1": 0.12472, "llama-7b-8L-mb2": 0.21331, "llama-7b-8L-mb4": 0.38957,
                  "llama-7b-8L-mb4-recompute": 0.49888, "llama-7b-mb1": 0.46409}


def test_h200_rows_hold_the_goal():
    """Predicted step time of the 13 H200 rows pinned, and the goal they meet against the committed measurements
    (the median of three passes): every row within ±10%, mean |error| <= 5%."""
    rows = bench.h200_rows(str(ROOT / "benchmarks" / "data" / "h200"))
    assert {r["name"]: r["predicted_s"] for r in rows} == {k: pytest.approx(v, rel=TOKENS_TOL)
                                                           for k, v in H200_PREDICTED.items()}
    errs = [abs(r["error"]) for r in rows]
    assert max(errs) <= 0.10 and sum(errs) / len(errs) <= 0.05, [(r["name"], round(r["error"], 3)) for r in rows]
