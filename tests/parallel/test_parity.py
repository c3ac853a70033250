"""Every parallel layout equals one process: per-step loss and grad_norm within 1e-4.

    python -m pytest tests/parallel/test_parity.py -q

A tiny GPT-2-style and a tiny Llama-style model (8 layers, so pp4 x 2 virtual
stages divides them), fixed seed and data, fp32, 8 optimizer steps with a
global batch of 8 (micro-batch 2), run through the real entry function under
`paddle.distributed.launch` on CPU processes (gloo + llmtrain's CPU backend).
Loss and grad_norm are read from each run's metrics.jsonl; tokens must never be
multiplied by tp or pp.
"""
from __future__ import annotations

import pytest

from llmtest import tiny_overrides
from launch import metrics, run_many

MODELS = ("gpt", "llama")
LAYERS = ["model.num_layers=8"]
TOL = 1e-4

LAYOUTS = [
    ("dp2", 2), ("tp2", 2), ("pp2", 2), ("sharding2", 2), ("zero2", 2), ("zero3", 2),
    ("dp4", 4), ("dp2tp2", 4), ("tp2pp2", 4), ("dp2pp2", 4), ("tp2sharding2", 4), ("pp4v2", 4),
]


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("parity_ref")
    run_many([tiny_overrides(tiny_corpus, str(out / m), m) + LAYERS for m in MODELS], nproc=0, workdir=out)
    return {m: metrics(out / m) for m in MODELS}


@pytest.mark.slow
@pytest.mark.parametrize("layout,nproc", LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_layout_matches_single_process(layout, nproc, reference, tiny_corpus, tmp_path):
    extra = ["parallel.zero3_segment_size=1024"] if layout == "zero3" else []  # slice even the tiny parameters
    runs = [tiny_overrides(tiny_corpus, str(tmp_path / m), m) + LAYERS + [f"+parallel={layout}"] + extra for m in MODELS]
    run_many(runs, nproc=nproc, workdir=tmp_path)
    for m in MODELS:
        ref, got = reference[m], metrics(tmp_path / m)
        assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, 9))
        for r, g in zip(ref, got):
            assert abs(g["loss"] - r["loss"]) <= TOL, (m, layout, r["step"], g["loss"], r["loss"])
            assert abs(g["grad_norm"] - r["grad_norm"]) <= TOL, (m, layout, r["step"], g["grad_norm"], r["grad_norm"])
            assert g["tokens"] == r["tokens"] == 8 * 32  # global batch x seq: never x tp or x pp
            assert g["tokens_total"] == r["tokens_total"]
        assert got[-1]["loss"] < got[0]["loss"]
