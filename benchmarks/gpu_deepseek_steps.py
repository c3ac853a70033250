"""Training steps of the DeepSeek twin (latent attention, the sigmoid router with group limits) on one GPU.

    python benchmarks/gpu_deepseek_steps.py --out DIR                      # CUDA GPU (an H100: about 2 minutes)
    python benchmarks/gpu_deepseek_steps.py --out /tmp/smoke --smoke --cpu  # tiny shapes, logic only

`gpu_deepseek.DeepSeekDecoder` (bf16, Paddle's O2 as `gpu_model.MasterAdamW` holds it) at DeepSeek-V2-Lite's widths
with DeepSeek-V3's router: 4 blocks (the first dense, f 10944), h 2048, 16 heads, MLA (no q rank, kv rank 512, d_n 128,
d_r 64, d_v 128), 64 routed experts of 1408, top-6 within the 4 best of 8 groups, 2 shared experts, routed scale 2.5,
vocabulary 102400, seq 4096, micro-batch 1; capacity 1.25 and dropless. Each row: 2 warm-up and 8 timed steps
(`step_s`, median `step_s_median`), the peak memory, and dropless's mean C over T k / E (`capacity_mean_factor`).
Written as DIR/deepseek_steps.json (gpu_reference's provenance). The planner's prediction for the same rows
(llmtrain's config: `PLANNER_OVERRIDES`, `plan.device=h100`) is printed by

    python benchmarks/gpu_deepseek_steps.py --predict [--device h100] [--measured benchmarks/data/h100/launches/deepseek_steps.json]

so a measured file can be set beside it (benchmarks/README.md, "One op sequence").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PLANNER_OVERRIDES = ["model=deepseek-v2-lite", "model.num_layers=4", "model.rope_scaling.type=none",
                     "model.moe_router=sigmoid", "model.moe_n_group=8", "model.moe_topk_group=4",
                     "model.moe_group_score=top2", "model.moe_routed_scale=2.5", "model.moe_norm_topk=true",
                     "data.seq_len=4096", "train.micro_batch_size=1", "train.global_batch_size=1", "train.amp=bf16"]
"""llmtrain's configuration of the twin's rows (the capacity row adds model.moe_capacity_factor=1.25)."""


def rows(smoke: bool) -> dict:
    """{name: (Arch, MoE, MLA, SigmoidRouter, micro-batch)} (module docstring; `smoke`: tiny shapes)."""
    from gpu_deepseek import MLA, SigmoidRouter
    from gpu_model import llama
    from gpu_moe import MoE

    if smoke:
        a = llama(2, 64, 4, 4, 64, 32, vocab=256)
        mla, router = MLA(0, 32, 16, 8, 16), SigmoidRouter(4, 2, "top2", 2.5, 1, 128)
        experts = dict(experts=8, top_k=2, ffn=32, shared_ffn=64, aux_coef=0.001)
    else:
        a = llama(4, 2048, 16, 16, 2816, 4096, vocab=102400)
        mla, router = MLA(0, 512, 128, 64, 128), SigmoidRouter(8, 4, "top2", 2.5, 1, 10944)
        experts = dict(experts=64, top_k=6, ffn=1408, shared_ffn=2816, aux_coef=0.001)
    return {f"v2lite-mla-v3router-{a.layers}L-mb1-{kind}": (a, MoE(capacity_factor=factor, **experts), mla, router, 1)
            for kind, factor in (("cap1.25", 1.25), ("dropless", 0.0))}


def measure(args) -> None:
    import torch

    import gpu_moe
    from gpu_deepseek import DeepSeekDecoder
    from gpu_model import MasterAdamW, make_batch
    from gpu_reference import Bench
    from gpu_tables import _free as free, _timed_steps as timed

    b = Bench(args)
    deadline = time.time() + args.budget_s
    for name, (a, m, mla, router, mb) in rows(args.smoke).items():
        row = {"name": name, "arch": a.as_dict(), "moe": m.as_dict(), "mla": mla.as_dict(),
               "router": router.as_dict(), "micro_batch": mb}
        if time.time() > deadline:
            row["error"] = "time budget spent before this row"
            b.add("deepseek_steps", row)
            continue
        model = opt = None
        try:
            free(b)
            b.gen.manual_seed(zlib.crc32(name.rsplit("-", 1)[0].encode()))  # the same weights and batch per shape
            gpu_moe.CAPACITIES.clear()
            model = DeepSeekDecoder(a, m, mla, router, b.dev, b.dtype, generator=b.gen)
            opt = MasterAdamW(model.parameters())
            batch = make_batch(a, mb, b.dev, b.gen)
            times = timed(b, model, opt, batch, 2, 2 if args.smoke else 8)
            row.update(step_s=times, step_s_median=statistics.median(times))
            caps = list(gpu_moe.CAPACITIES)
            if m.capacity_factor == 0 and caps:
                row["capacity_mean_factor"] = statistics.mean(caps) / (mb * a.seq * m.top_k / m.experts)
            if b.cuda:
                row["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        del model, opt
        b.add("deepseek_steps", row, {"notes": "DeepSeek twin steps (benchmarks/gpu_deepseek_steps.py docstring)"})
        print(f"[deepseek_steps] {name}: " + (row.get("error") or f"{row['step_s_median'] * 1e3:.1f} ms"), flush=True)


def predict(device: str, measured_file: str | None = None) -> None:
    """The planner's step time for each row on `device` (one GPU, no parallelism), beside a measured
    deepseek_steps.json when given (dropless also priced at that row's measured busiest/mean load)."""
    sys.path.insert(0, os.path.dirname(HERE))
    from llmtrain.config import compose_config, to_config
    from llmtrain.parallel.layout import resolve_layout
    from llmtrain.plan.estimate import time_estimate
    from llmtrain.plan.profile import load_profile

    import json

    dev = load_profile(device)
    measured = {r["name"]: r for r in json.load(open(measured_file))["rows"]} if measured_file else {}
    for kind, extra in (("cap1.25", ["model.moe_capacity_factor=1.25"]), ("dropless", [])):
        name = f"v2lite-mla-v3router-4L-mb1-{kind}"
        c = to_config(compose_config([*PLANNER_OVERRIDES, *extra]))
        layout = resolve_layout(c.parallel, c.train, 1)
        r = time_estimate(c.model, layout, 4096, "none", dev, 8)
        line = f"{name} on {device}: step {r['step_time_s'] * 1e3:.1f} ms predicted (compute {r['compute_s'] * 1e3:.1f} ms)"
        m = measured.get(name)
        if m:
            err = r["step_time_s"] / m["step_s_median"] - 1
            line += f"; measured {m['step_s_median'] * 1e3:.1f} ms ({100 * err:+.1f}%)"
            if "capacity_mean_factor" in m:  # dropless: also at the busiest/mean load the measured routing had
                f = m["capacity_mean_factor"]
                at = time_estimate(c.model, layout, 4096, "none", dev, 8, moe_imbalance=f)["step_time_s"]
                line += f"; at the measured factor {f:.2f}: {at * 1e3:.1f} ms ({100 * (at / m['step_s_median'] - 1):+.1f}%)"
        print(line)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="output directory (deepseek_steps.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a logic check)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is present")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting rows after this many seconds")
    ap.add_argument("--predict", action="store_true", help="print the planner's prediction instead of measuring")
    ap.add_argument("--device", default="h100", help="the planner's profile for --predict")
    ap.add_argument("--measured", help="--predict: a deepseek_steps.json to set beside the prediction")
    args = ap.parse_args(argv)
    args.warmup, args.steps_n, args.reps = 2, (2 if args.smoke else 8), 0  # what gpu_reference's provenance records
    if args.predict:
        predict(args.device, args.measured)
        return
    if not args.out:
        ap.error("--out is required to measure")
    measure(args)


if __name__ == "__main__":
    main()
