"""The frontier table of benchmarks/README.md ("Frontier MoE layouts on 256 and 512 H800"), row by row, with the
best DualPipeV row of each ranking set against its 1F1B twin (same degrees, micro-batch, recompute, offload).

    python benchmarks/plan_frontier.py --out work/frontier.json deepseek-v3 ernie-4.5-300b-a47b qwen3-235b-a22b

Each ranking is `python -m llmtrain.plan model=<preset> plan.device=h800 plan.devices=<256|512>
train.global_batch_size=4096 data.seq_len=4096 train.amp=bf16`, through `rank_layouts` (one process, no launch).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SAME = ("dp", "tp", "pp", "sharding", "sharding_stage", "ep", "micro_batch", "recompute", "offload_optimizer")
"""The fields a DualPipeV row and its 1F1B twin share."""


def describe(r: dict | None) -> dict | None:
    if r is None:
        return None
    return {k: r[k] for k in ("name", "pp_schedule", "micro_batch", "recompute", "pp_layers", "offload_optimizer",
                              "fits")} | {
        "mfu": round(100 * r["mfu"], 2) if r["mfu"] is not None else None,
        "step_s": r["step_time_s"] and round(r["step_time_s"], 2), "bubble_s": r["bubble_s"] and round(r["bubble_s"], 2),
        "activations_gib": round(r["memory_bytes"]["activations"] / 2**30, 1),
        "total_gib": round(r["memory_bytes"]["total"] / 2**30, 1)}


def summary(rows) -> dict:
    """Counts, the best row, the best with pp > 1 and ep > 1, the best DualPipeV row with its 1F1B twin, and the
    DualPipeV / twin speed ratios (step time of the twin / of the DualPipeV row) where both fit."""
    fit = [r for r in rows if r["fits"]]
    first = lambda f: next((r for r in fit if f(r)), None)  # noqa: E731
    dpv = first(lambda r: r["pp_schedule"] == "dualpipev")
    twins = {tuple(r[k] for k in SAME): r for r in rows if r["pp_schedule"] == "1f1b"}
    ratios = sorted(twins[key]["step_time_s"] / r["step_time_s"] for r in fit if r["pp_schedule"] == "dualpipev"
                    and (key := tuple(r[k] for k in SAME)) in twins and twins[key]["fits"])
    return {"rows": len(rows), "fitting": len(fit), "pruned": rows.pruned,
            "dualpipev_rows": sum(r["pp_schedule"] == "dualpipev" for r in rows),
            "dualpipev_fitting": sum(r["pp_schedule"] == "dualpipev" for r in fit),
            "best": describe(fit[0] if fit else None),
            "best_pp_ep": describe(first(lambda r: r["pp"] > 1 and r["ep"] > 1)),
            "pp_ep_fitting": sum(r["pp"] > 1 and r["ep"] > 1 for r in fit),
            "best_dualpipev": describe(dpv),
            "its_1f1b_twin": describe(twins.get(tuple(dpv[k] for k in SAME))) if dpv else None,
            "twin_pairs": len(ratios),
            "speed_vs_twin_min_median_max": [round(ratios[0], 3), round(ratios[len(ratios) // 2], 3),
                                             round(ratios[-1], 3)] if ratios else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--devices", nargs="+", type=int, default=[256, 512])
    ap.add_argument("--out", default=None, help="write the summaries as JSON here")
    args = ap.parse_args()
    from llmtrain.config import compose_config, register_configs, to_config
    from llmtrain.plan.model import planned_model
    from llmtrain.plan.search import rank_layouts

    register_configs()
    out = {}
    for model in args.models:
        for n in args.devices:
            cfg = to_config(compose_config([f"model={model}", "plan.device=h800", f"plan.devices={n}",
                                            "train.global_batch_size=4096", "data.seq_len=4096", "train.amp=bf16"]))
            t = time.process_time()
            rows = rank_layouts(cfg, planned_model(cfg))
            out[f"{model} {n}"] = summary(rows) | {"cpu_s": round(time.process_time() - t, 1)}
            print(f"{model} {n}: {json.dumps(out[f'{model} {n}'])}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
