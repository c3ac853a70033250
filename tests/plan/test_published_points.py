"""The figures `python benchmarks/planner.py` prints for the published points, pinned: a change to the planner
(cost model, profiles, memory) that moves one is seen here and must update the pin and benchmarks/README.md.

    python -m pytest tests/plan/test_published_points.py -q

Tolerance: 1% relative on tokens/s and TFLOP/s, 0.5% on memory (the planner is deterministic: the margin only
absorbs floating-point order; a deliberate change moves a figure by more). No launches: the planner alone.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from llmtrain.config import compose_config, register_configs, to_config
from llmtrain.plan.__main__ import plan

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("planner_benchmark", ROOT / "benchmarks" / "planner.py")
bench = importlib.util.module_from_spec(spec)
sys.modules.setdefault("planner_benchmark", bench)
spec.loader.exec_module(bench)
register_configs()

TOKENS_TOL, MEM_TOL = 0.01, 0.005
# label: (predicted tokens/s/device, predicted allocated MiB) as printed by benchmarks/planner.py
PUBLISHED = {
    "PaddleNLP Llama2-7B 8xA100-80G tp2 sd4 s2 mb2": (3398, 57269),
    "PaddleNLP Llama2-13B 8xA100-80G tp2 sd4 s2 mb1": (1848, 65027),
    "torchtitan Llama2-13B 64xA100-80G FSDP mb2 no AC": (2195, 74062),
    "torchtitan Llama3-70B 64xA100-80G FSDP mb1 full AC": (308, 40627),
}
MEGATRON = {"Megatron-LM GPT 7.1B 96xH100 TP2 PP1": 455.5, "Megatron-LM GPT 177B 2304xH100 TP8 PP6": 388.5}
RATIOS = {"Korthikanti 530B 2240xA100 MFU: selective / full recompute": (48.9, 37.4),
          "torchtitan Llama3.1-405B 512xH100 tokens/s: interleaved (v2) / 1F1B": (100.1, 77.0)}


def _row(overrides):
    return plan(to_config(compose_config(overrides)))[0]


@pytest.mark.parametrize("label", list(PUBLISHED))
def test_published_point(label):
    extra = next(e for lbl, e, _, _ in bench.PUBLISHED if lbl == label)
    row = _row(bench.BASE + extra)
    tokens, mib = PUBLISHED[label]
    assert row["tokens_per_sec_per_device"] == pytest.approx(tokens, rel=TOKENS_TOL, abs=0.5)
    assert row["memory_bytes"]["allocated"] / 2**20 == pytest.approx(mib, rel=MEM_TOL)


def test_megatron_points():
    got = {lbl: tflops for lbl, tflops, _ in bench.megatron_rows()}
    assert got == {k: pytest.approx(v, rel=TOKENS_TOL, abs=0.05) for k, v in MEGATRON.items()}


@pytest.mark.parametrize("label", list(RATIOS))
def test_ratio(label):
    _, num, den, _, _, key = next(r for r in bench.RATIOS if r[0] == label)
    scale = 100 if key == "mfu" else 1
    a, b = scale * _row(num)[key], scale * _row(den)[key]
    assert (a, b) == (pytest.approx(RATIOS[label][0], rel=TOKENS_TOL, abs=0.05),
                      pytest.approx(RATIOS[label][1], rel=TOKENS_TOL, abs=0.05))
