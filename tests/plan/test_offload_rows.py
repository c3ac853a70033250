"""Offloading takes off the device only what the reported stage holds: no ranked row shows negative activations.

    python -m pytest tests/plan/test_offload_rows.py -q
"""
from __future__ import annotations

from llmtest import compose
from llmtrain.config import to_config
from llmtrain.plan.search import rank_layouts


def test_offloaded_rows_never_hold_negative_activations():
    # qwen3-32b at 8k on 8 H100s: tp2 x pp4 x 4 virtual stages, micro-batch 2, needs activation offload to fit; its
    # worst stage is not the one with the most micro-batches in flight, whose count once took 4 GiB off it too many
    cfg = to_config(compose(["model=qwen3-32b", "plan.device=h100", "plan.devices=8", "data.seq_len=8192",
                             "train.global_batch_size=16", "train.amp=bf16"]))
    rows = rank_layouts(cfg, cfg.model)
    offloaded = [r for r in rows if r["offload_activations"]]
    assert offloaded, "no row needed activation offload: the case no longer tests it"
    bad = [(r["name"], r["micro_batch"], r["memory_bytes"]["activations"]) for r in rows
           if r["memory_bytes"]["activations"] < 0]
    assert not bad, bad
    for r in offloaded:  # what stays: at least the re-running block's kept input and the one on its way back
        assert r["memory_bytes"]["activations"] >= r["memory_bytes"].get("recompute_transient", 0), r["name"]
