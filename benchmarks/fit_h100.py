"""Fit the packaged `h100` device profile from the H100's raw kernel tables (never from its end-to-end steps).

    python benchmarks/fit_h100.py benchmarks/data/h100              # -> llmtrain/plan/profiles/h100.json
    python benchmarks/fit_h100.py DATA_DIR --out /tmp/h100.json
    python benchmarks/fit_h100.py benchmarks/data/h100 --host benchmarks/data/h100/rounds   # host block of another call
    python benchmarks/fit_h100.py benchmarks/data/h100 --dispatch DIR/dispatch.json   # per-op host at real shapes

DATA_DIR is benchmarks/data/h100 as the one device call of 2026-12-06 left it (its README.md): gemm.json,
memory_bound.json, host.json, host_model.json, optimizer.json (benchmarks/gpu_reference.py), bmm.json,
gemm_extra.json, moe_ops.json (benchmarks/gpu_tables.py) and attention_fa3.json (benchmarks/gpu_h100.py); its
steps/ folder holds the held-out steps, never read here. The fitting is fit_h200.py's, with three differences:
- attention: the cuDNN rows of attention_fa3.json (the FA3-class kernel, on the layout Paddle's flash_attention
  reads), since llmtrain runs FlashAttention-3 on Hopper where the installed Paddle has it
  (llmtrain/paddle_compat/flash_attn.py); rows up to 8k fill `attention`, the long configs' rows from 4k on
  fill `attention_long`. A run that falls back to FA2 is slower than this profile says (FA2's rows are in the
  same file, `impl` "flash2", 1.3-1.9x slower);
- the constants that are not measured (peak, memory, links) are the H100 SXM datasheet's;
- the optimizer: the planner's GPU stream fitted to optimizer.json by relative error (`optimizer_block`).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fit_h200 import host_block, moe_tables, optimizer_rows
from llmtrain.plan.fit import fit_attention, fit_optimizer_stream, fit_profile, read_tables, stream_optimizer_seconds

GB, GIB = 1e9, 2**30
BASE = {
    "name": "h100", "match": ["H100 80GB HBM3", "H100 SXM"], "peak_flops": 989e12, "memory_bytes": 80 * GIB, "framework_bytes": 2 * GIB,
    "dtype_bytes": 2, "async_launch": True, "tables_include_host": False,
    "links": {"nvlink_bw": 450 * GB, "net_bw": 50 * GB, "nvlink_alpha": 5e-6, "net_alpha": 10e-6,
              "host_bw": 64 * GB,  # PCIe Gen5 x16 per direction (datasheet): the price of offload
              "source": "datasheet, not measured (one GPU was measured): NVLink 900 GB/s total = 450 per direction; "
                        "NDR 400 Gb/s per GPU = 50 GB/s; alpha: NCCL's per-message latency, a few us in a node, "
                        "~10 us across IB (assumed)"},
    "attention_kernel": "fa3",
    "source": "NVIDIA H100 SXM datasheet for the peak (989 TFLOP/s bf16 dense, MFU's denominator), memory (80 GB) "
              "and links; every kernel table measured on one H100 80GB HBM3 (provenance); attention: cuDNN's "
              "flash attention, the FA3-class kernel (FlashAttention-3 is not in the measuring image's PyTorch)",
}
LONG_FROM = 4096
"""attention_fa3 rows of the long configs (batch 1, 32 heads) from this length on fill `attention_long`."""


def fa3_rows(data: Path) -> tuple[list[dict], list[dict], dict]:
    """(rows <= 8k for `attention`, long-config rows for `attention_long`, provenance) of attention_fa3.json's
    cuDNN rows."""
    d = json.loads((data / "attention_fa3.json").read_text())
    rows = [r for r in d["rows"] if r.get("impl") == "cudnn" and r.get("fwd_s") and r.get("bwd_s")]
    short = [r for r in rows if r["seq"] <= 8192 and r["batch"] * r["seq"] <= 32768]
    long_ = [r for r in rows if r["batch"] == 1 and r["heads"] == 32 and r["seq"] >= LONG_FROM
             and (r["kv_heads"], r["head_dim"]) in ((4, 64), (32, 128))]
    return short, long_, d.get("provenance", {})


def optimizer_block(rows: list[dict], summary: str) -> dict:
    """The profile's `optimizer` block: the stream the planner runs AdamW in on a GPU (llmtrain/plan/fit.py
    `fit_optimizer_stream`: per step, per tensor host and device, per element), fitted to optimizer.json's rows by
    relative error, with each row's residual. (The plain least squares of seconds = a·tensors + b·elements gave
    1.72e-11 s per element where the 1e9-element rows take 1.87-1.90e-11, and the stream it feeds priced those
    rows 8-22% fast.)"""
    o = fit_optimizer_stream(rows)
    res = {f"{r['numel']}x{r['tensors']}": round(stream_optimizer_seconds(o, r["tensors"], r["numel"]) / r["seconds"] - 1, 4)
           for r in rows}
    return {**o, "includes_clip": True,
            "source": f"fitted to measured AdamW steps {summary} (optimizer.json: clip, AdamW per chunk, zeroing) as "
                      "the planner's stream prices them, squared relative errors (benchmarks/fit_h100.py optimizer_block)",
            "residuals": {"relative_error_by_elements_x_tensors": res}}


SINGLE_CALL = ("add_bf16", "mul_bf16", "cast_f32", "ge_kT", "clamp_kT", "index_select_rows", "gather_k", "mean0_f32",
               "bmm")
"""launches.json's generic rows that are one torch call each (the others are small compositions of calls)."""
LISTED_ELSEWHERE = ("moe_swiglu_view", "moe_swiglu_view_bwd", "moe_t_copy_i64")
"""Classes the planner lists with their other dispatches beside them (silu(g) * u: the mul as a view of its own;
the transpose's view): their extra launches are already dispatches of the list."""


def launch_block(path: Path) -> dict:
    """{"launches", "extra_launch_s", "launch_fit"} for the profile's host block from launches.json
    (benchmarks/gpu_moe_launches.py): per MoE op class the device launches of one call (kernels, memsets and
    copies; the median over the sizes measured) and the host seconds of one more launch inside one call: the slope
    of host seconds over launches, least squares over the one-call rows (each MoE class but those of
    LISTED_ELSEWHERE, and SINGLE_CALL's generic ops) of the forward (a `_bwd` class runs through autograd.grad)."""
    import numpy as np

    d = json.loads(path.read_text())
    rows = [r for r in d["rows"] if r.get("host_s") and "error" not in r and "kernels" in r]
    n = lambda r: r["kernels"] + r["memsets"] + r["memcpys"]  # noqa: E731
    by: dict = {}
    for r in rows:
        if r["kind"] in ("route", "rows") and r["op"] not in LISTED_ELSEWHERE:
            by.setdefault(r["op"], []).append(n(r))
    launches = {op: max(1, round(statistics.median(v))) for op, v in sorted(by.items())}
    fit = [r for r in rows if not r["op"].endswith("_bwd") and (r["op"] in by or r["op"] in SINGLE_CALL)]
    x, y = np.array([n(r) for r in fit], float), np.array([r["host_s"] for r in fit])
    slope, icpt = (float(v) for v in np.polyfit(x, y, 1))
    res = {f"{r['op']}@{r['n']}": [round(n(r), 2), round(r["host_s"] * 1e6, 2), round((icpt + slope * n(r)) * 1e6, 2)]
           for r in fit}
    prov = d.get("provenance", {})
    return {"launches": launches, "extra_launch_s": max(slope, 0.0),
            "launch_fit": {"intercept_s": icpt, "slope_s": slope, "rows": res,
                           "note": "[launches per call, host us measured, host us fitted] per one-call row",
                           "source": f"{path.name} ({prov.get('gpu', '?')}, {prov.get('date_utc', '?')}, torch "
                                     f"{prov.get('torch', '?')}): benchmarks/fit_h100.py launch_block"}}


def borrow_classes(prof: dict, base: str = "h200", ref: str = "mul") -> list[str]:
    """Add to `prof` the memory-bound classes the `base` profile has and `prof` lacks, each the base's curve times
    the measured ratio of the `ref` class (prof / base) at the same size; returns the names added."""
    import math

    other = json.loads((Path(__file__).resolve().parent.parent / f"llmtrain/plan/profiles/{base}.json").read_text())
    mine, theirs = prof["memory_bound"]["classes"], other["memory_bound"]["classes"]
    a, b = dict(map(tuple, mine[ref])), dict(map(tuple, theirs[ref]))
    pts = sorted((math.log(n), a[n] / b[n]) for n in set(a) & set(b))

    def ratio(n: float) -> float:
        x = math.log(max(n, 1.0))
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return pts[-1][1]
    added = sorted(set(theirs) - set(mine))
    for c in added:
        mine[c] = [[n, t * ratio(n)] for n, t in theirs[c]]
    return added


def main(argv: list[str]) -> None:
    data = Path(argv[0] if argv and not argv[0].startswith("--") else "benchmarks/data/h100")
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else \
        Path(__file__).resolve().parent.parent / "llmtrain/plan/profiles/h100.json"
    raw, prov = read_tables(data)
    raw["gemm"] = [r for r in raw["gemm"] if r.get("seconds")]  # the budget's "time budget spent" note row
    short, long_, aprov = fa3_rows(data)
    raw["attention"] = short
    prov["attention"] = aprov
    launches = data / "launches" / "launches.json"
    hdir = Path(argv[argv.index("--host") + 1]) if "--host" in argv else None
    if hdir is not None:  # the host block of another call: its host.json, host_model.json and launches.json
        rows = [r for r in json.loads((hdir / "host.json").read_text())["rows"] if r.get("when", "before") == "before"]
        raw["host"] = host_block(hdir, {"rows": rows}, hdir / "launches.json")
    else:
        raw["host"] = host_block(data, raw["host"], launches if launches.exists() else None)
    if "--dispatch" in argv:  # the per-op host seconds from unsynchronised dispatch at real shapes
        from benchmarks.fit_h200 import host_from_dispatch

        rows = json.loads(Path(argv[argv.index("--dispatch") + 1]).read_text())["rows"]
        raw["host"] = host_from_dispatch([r for r in rows if r.get("variant") == "llmtrain"], raw["host"])
    raw["optimizer"] = optimizer_rows(raw["optimizer"])
    g = prov.get("gemm", {})
    prov["summary"] = (f"({g.get('gpu', 'H100')}, driver {g.get('driver', '?')}, CUDA {g.get('cuda', '?')}, torch "
                       f"{g.get('torch', '?')}, {g.get('date_utc', '?')}; CUDA events, medians)")
    prov["fitted_by"] = f"python benchmarks/fit_h100.py {data}"
    prof = fit_profile(raw, BASE, prov)
    prof["attention"]["source"] = f"fitted from cuDNN flash attention (FA3-class) {prov['summary']}"
    prof["optimizer"] = optimizer_block(raw["optimizer"], prov["summary"])
    fitted = fit_attention(long_)
    prof["attention_long"] = {"source": "attention_fa3.json cuDNN rows of batch 1, 32 heads (GQA 32/4 d64, MHA d128), "
                                        f"{LONG_FROM} to 65536 tokens",
                              "rows": [[*f[:4], r["kv_heads"], *f[4:]] for f, r in zip(fitted, long_)]}
    extra = moe_tables([data])
    src = f"fitted from {data} (benchmarks/gpu_tables.py), kernel tables only"
    for key in ("bmm", "gemm_exact"):
        if key in extra:
            prof[key] = {"source": src, **extra[key]}
    prof["memory_bound"]["classes"].update(extra.get("moe_classes", {}))
    if extra:
        prof["provenance"]["moe_tables"] = extra["provenance"]
    borrowed = borrow_classes(prof)
    if borrowed:
        prof["memory_bound"]["borrowed"] = {
            "classes": borrowed, "source": "not measured on the H100 (moe_ops.json's time budget ended before these "
            "row classes): the h200 profile's curves x the measured H100/H200 time ratio of the `mul` class at the "
            "same size (interpolated in log size; 1.22-1.42 over the measured sizes)"}
    launches = hdir / "launches.json" if hdir is not None else data / "launches" / "launches.json"
    if launches.exists():  # MoE op classes that launch several device kernels per call (timeline._priced)
        prof["host"].update(launch_block(launches))
    if prof["host"].get("micro_batch_s", 0) < 0:  # one sweep of host_model: an intercept below zero is noise
        prof["host"]["check"]["micro_batch_s_fitted"] = prof["host"]["micro_batch_s"]
        prof["host"]["micro_batch_s"] = 0.0
    out.write_text(json.dumps(prof, indent=1))
    print(f"wrote {out}: {len(prof['gemm']['rows'])} GEMM shapes, {len(prof['attention']['rows'])} attention rows, "
          f"{len(prof['attention_long']['rows'])} long, bmm {len(prof.get('bmm', {}).get('rows', []))}, classes "
          f"{len(prof['memory_bound']['classes'])}, host {({k: v for k, v in prof['host'].items() if k.endswith('_s')})}")


if __name__ == "__main__":
    main(sys.argv[1:])
