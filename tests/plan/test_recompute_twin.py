"""The planner's recompute prices against the H100 twin steps (benchmarks/data/h100/steps/recompute_steps.json).

    python -m pytest tests/plan/test_recompute_twin.py -q -s

Rows: a llama-7b-shaped twin (h 4096, 32 heads, f 11008, 4 or 8 blocks, seq 4096, micro-batch 1-2, bf16, flash
attention) under none / full / full_attn / core_attn / mlp, step time and peak memory measured on one H100. Checked:
each mode's step time over the same shape's `none` within 10% of the planner's ratio (`time_estimate` on the h100
profile, `Recompute` of the mode). Not checked, because they miss (benchmarks/README.md gives the figures): the
absolute step times (the planner is 11-18% slow) and the activation bytes (the twin's peak minus its static bytes
include what its PyTorch ops keep, not Paddle's; the planner is 12% over to 40% under). Skipped, saying so, where
the data file is absent.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from llmtest import compose
from llmtrain.config import to_config

DATA = Path(__file__).resolve().parents[2] / "benchmarks/data/h100/steps/recompute_steps.json"
MODES = {"none": ("none", ()), "full": ("full", ()), "full_attn": ("full_attn", ()), "core_attn": ("core_attn", ()),
         "mlp": ("selective", ("mlp",))}


def test_recompute_time_overheads_within_10_percent_of_the_twin():
    from llmtrain.models.recompute import recompute_from
    from llmtrain.parallel.layout import Layout
    from llmtrain.plan.devices import get_device
    from llmtrain.plan.estimate import time_estimate

    dev = get_device("h100")
    rows = [r for r in json.loads(DATA.read_text())["rows"] if r["model"] == "llama-7b-twin"]
    assert {r["mode"] for r in rows} == set(MODES)
    planned, base = {}, {}
    for r in rows:
        cfg = to_config(compose(["model=llama-7b", f"model.num_layers={r['layers']}", f"data.seq_len={r['seq']}"])).model
        layout = dataclasses.replace(Layout(), micro_batch=r["mb"], grad_accum=1)
        mode, modules = MODES[r["mode"]]
        planned[id(r)] = time_estimate(cfg, layout, r["seq"], recompute_from(mode=mode, modules=modules), dev, 8, True,
                                       "bf16")["step_time_s"]
        if r["mode"] == "none":
            base[(r["layers"], r["seq"], r["mb"])] = r, planned[id(r)]
    worst = 0.0
    for r in rows:
        ref, ref_plan = base[(r["layers"], r["seq"], r["mb"])]
        measured, plan = r["step_ms"] / ref["step_ms"], planned[id(r)] / ref_plan
        worst = max(worst, abs(plan / measured - 1))
        print(f"L{r['layers']} mb{r['mb']} {r['mode']}: step / none measured {measured:.3f}, planned {plan:.3f}")
        assert abs(plan / measured - 1) <= 0.10, (r["layers"], r["mb"], r["mode"], measured, plan)
    print(f"largest difference {worst:.1%}")
