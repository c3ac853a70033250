"""Why the h100 profile misses two held-out rows (llama-1b mb1 dense, qwen-moe-4L mb1 capacity): the evidence.

    python benchmarks/h100_miss_causes.py        # the tables of benchmarks/README.md "Where the two misses come from"

Nothing here is fitted or fed back into the profile: it prints (1) the planner's step of each row phase by phase
(host and device clocks of `timeline.Stream`, kernel by kernel) beside the measured step and GPU busy time;
(2) the profile's optimizer price against the optimizer phase of the held-out dense llama-7b-8L mb1 step profiled
in the third call (benchmarks/data/h100/twin2/moe_profile.json: a check of the refit, read here only);
(3) gemm.json's sections against the same `gemm_row` re-timed minutes later (gemm_extra.json). Its fourth table
(the dense rows with `view_op_s` capped at a bare dispatch, a sensitivity) was retired when the fifth call measured
bare views (1.4 us) and the list told views from the ops inside composite rows (`kernel_ops.part`): the profile now
prices both as measured (benchmarks/README.md).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import planner_h100 as bench  # noqa: E402
from benchmarks.planner import compose_config, h200_moe_overrides, h200_overrides  # noqa: E402
from llmtrain.config import register_configs, to_config  # noqa: E402

DATA = bench.DATA.parent
ROWS = ("llama-1b-mb1", "llama-1b-mb2", "qwen-moe-4L-mb1-slots-cap1.25", "qwen-moe-4L-mb2-slots-cap1.25")


def _config(r: dict):
    ov = h200_moe_overrides(r["arch"], r["moe"], r["micro_batch"], 1.0) if "moe" in r else \
        h200_overrides(r["arch"], r["micro_batch"], r["recompute"])
    return to_config(compose_config(bench._device(ov, "h100"))).model


def phases(r: dict) -> dict:
    """{phase: (host advance s, device busy s)} of one step of row `r` on the h100 profile, kernel by kernel, and
    the step's end ("end")."""
    from llmtrain.parallel.layout import Layout
    from llmtrain.plan.devices import get_device
    from llmtrain.plan.estimate import rank_tensors
    from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels, optimizer_kernels
    from llmtrain.plan.moe import MoEPlan
    from llmtrain.plan.timeline import Stream

    dev, cfg = get_device("h100"), _config(r)
    grads, owned = rank_tensors(cfg, dataclasses.replace(Layout(), micro_batch=r["micro_batch"], grad_accum=1),
                                "bf16", 0)
    mb = micro_batch_kernels(MicroBatchSpec(cfg, r["micro_batch"], r["arch"]["seq"], 1, 2, True, True, "none",
                                            moe=MoEPlan() if "moe" in r else None))
    st, out = Stream(dev, fast=False), {}

    def run(name, fn):
        h, d = st.host, st.device_total
        fn()
        out[name] = (st.host - h, st.device_total - d)
    run("forward", lambda: st.run(mb.forward, False))
    run("backward", lambda: st.run(mb.backward, True))
    run("grad adds, loop", lambda: (st.add_host(dev.host.get("step_s", 0.0)),
                                    st.run(optimizer_kernels(grads, owned, 1, clip=False, accumulate_first=True), True)))
    run("AdamW + clip", lambda: st.run_optimizer(owned))
    out["end"] = (st.elapsed, st.device_total)
    return out


def phase_table() -> None:
    rows = {r["name"]: r for f in ("steps.json", "moe_steps.json") for r in bench._read(f, bench.DATA)}
    print("\n| row | forward host / device ms | backward host / device ms | adds host / device ms | AdamW host / "
          "device ms | planned step ms | measured step ms (GPU busy) |")
    print("|---|---|---|---|---|---|---|")
    for name in ROWS:
        r = rows[name]
        p = phases(r)
        cells = " | ".join(f"{p[k][0] * 1e3:.1f} / {p[k][1] * 1e3:.1f}" for k in
                           ("forward", "backward", "grad adds, loop", "AdamW + clip"))
        busy = f" ({r['kernel_time_s'] * 1e3:.1f})" if r.get("kernel_time_s") else ""
        print(f"| {name} | {cells} | {p['end'][0] * 1e3:.1f} | {r['step_s_median'] * 1e3:.1f}{busy} |")


def optimizer_check() -> None:
    from llmtrain.plan.fit import stream_optimizer_seconds
    from llmtrain.plan.profile import load_profile

    prof = json.loads((DATA / "twin2" / "moe_profile.json").read_text())
    row = next(r for r in prof["rows"] if r["name"] == "dense-llama-7b-8L-mb1")
    phase = next(o for o in row["ops"] if o["op"] == "phase_optimizer")["self_device_s"]
    a = next(r for r in bench._read("steps.json", bench.DATA) if r["name"] == "llama-7b-8L-mb1")
    cfg = _config(a)
    from llmtrain.parallel.layout import Layout
    from llmtrain.plan.estimate import rank_tensors
    _, owned = rank_tensors(cfg, dataclasses.replace(Layout(), micro_batch=1, grad_accum=1), "bf16", 0)
    o = load_profile("h100").optimizer
    device = sum(o.get("per_tensor_device_s", 0.0) + o["per_elem_s"] * n for n, _ in owned)
    n = sum(x for x, _ in owned)
    print(f"\noptimizer, llama-7b-8L ({n / 1e9:.3f}e9 elements, {len(owned)} tensors): h100 profile device "
          f"{device * 1e3:.2f} ms (from idle {stream_optimizer_seconds(o, len(owned), n) * 1e3:.2f} ms); held-out "
          f"profiled step's optimizer phase {phase * 1e3:.2f} ms on the device, {row['opt_s'] * 1e3:.2f} ms timed apart")


def gemm_retiming() -> None:
    later = {(r["m"], r["n"], r["k"], r["layout"]): r["seconds"]
             for r in json.loads((DATA / "gemm_extra.json").read_text())["rows"] if r.get("seconds")}
    by: dict = {}
    for r in json.loads((DATA / "gemm.json").read_text())["rows"]:
        t = r.get("seconds") and later.get((r["m"], r["n"], r["k"], r["layout"]))
        if t:
            by.setdefault(r["source"], []).append(r["seconds"] / t)
    print("\n| gemm.json section | shapes re-timed in gemm_extra.json | time / re-timed: median (range) |")
    print("|---|---|---|")
    for src, v in sorted(by.items()):
        print(f"| {src} | {len(v)} | {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f}) |")


def main() -> None:
    register_configs()
    phase_table()
    optimizer_check()
    gemm_retiming()


if __name__ == "__main__":
    main()
