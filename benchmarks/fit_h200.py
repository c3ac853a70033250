"""Fit the packaged `h200` device profile from the H200's raw kernel tables (never from its end-to-end steps).

    python benchmarks/fit_h200.py benchmarks/data/h200              # -> llmtrain/plan/profiles/h200.json
    python benchmarks/fit_h200.py DATA_DIR --out /tmp/h200.json

DATA_DIR holds gemm.json, attention.json, memory_bound.json, host.json and optimizer.json as
benchmarks/gpu_reference.py writes them (their README.md describes each); steps.json, if there, is not read.
The constants that are not measured there come from the datasheet and are said so in the file.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmtrain.plan.fit import fit_profile, read_tables

GB, GIB = 1e9, 2**30
BASE = {
    "name": "h200", "match": ["H200"], "peak_flops": 989e12, "memory_bytes": 141 * GB, "framework_bytes": 2 * GIB,
    "dtype_bytes": 2, "async_launch": True, "tables_include_host": False,
    "links": {"nvlink_bw": 450 * GB, "net_bw": 50 * GB, "nvlink_alpha": 5e-6, "net_alpha": 10e-6,
              "source": "datasheet, not measured (one GPU was measured): NVLink 900 GB/s total = 450 per direction; "
                        "NDR 400 Gb/s per GPU = 50 GB/s; alpha: NCCL's per-message latency, a few us in a node, "
                        "~10 us across IB (assumed)"},
    "source": "NVIDIA H200 SXM datasheet for the peak (989 TFLOP/s bf16 dense, MFU's denominator), memory (141 GB) "
              "and links; every kernel table measured on one H200 (provenance)",
}


BWD_KERNELS = {"add": 1, "mul": 2, "matmul": 2, "rms_norm": 1, "layer_norm": 1, "silu": 1, "gelu_tanh": 1,
               "cat_split": 2}
"""Backward kernels of each tiny eager op of host.json (mul, matmul: one per input; cat/split: split and concat)."""


def host_times(host: dict) -> dict:
    """The profile's host block (timeline.py) from host.json's loops of tiny eager ops: `fwd_op_s` = median per-op
    time of the forward loops (autograd recording on), `bwd_op_s` = median of (forward+backward - forward) per
    op over its backward kernels, `view_op_s` = the eager launch floor (an in-place add without autograd)."""
    import statistics

    ops = [r for r in host["rows"] if r.get("kind") == "eager_op"]
    floor = [r["seconds_per_op"] for r in host["rows"] if r.get("kind") == "eager_launch_floor"]
    return {"fwd_op_s": statistics.median(r["fwd_s_per_op"] for r in ops),
            "bwd_op_s": statistics.median((r["fwd_bwd_s_per_op"] - r["fwd_s_per_op"]) / BWD_KERNELS.get(r["op"], 1)
                                          for r in ops),
            "view_op_s": floor[0] if floor else statistics.median(r["fwd_s_per_op"] for r in ops),
            "source": "host.json: loops of tiny eager PyTorch ops on the H200's host (16-core Xeon): forward per "
                      "op, backward per kernel, launch floor for host-only dispatches",
            "ops": {r["op"]: [r["fwd_s_per_op"], r["fwd_bwd_s_per_op"]] for r in ops}}


def optimizer_rows(rows: list[dict]) -> list[dict]:
    """optimizer.json rows -> {tensors, numel, seconds}: the whole step (clip, AdamW per chunk, zeroing)."""
    return [{"tensors": r["tensors"], "numel": r["params"], "seconds": r["step_s"]} for r in rows if r.get("step_s")]


def main(argv: list[str]) -> None:
    data = Path(argv[0] if argv and not argv[0].startswith("--") else "benchmarks/data/h200")
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else \
        Path(__file__).resolve().parent.parent / "llmtrain/plan/profiles/h200.json"
    raw, prov = read_tables(data)
    raw["host"] = host_times(raw["host"])
    raw["optimizer"] = optimizer_rows(raw["optimizer"])
    g = prov.get("gemm", {})
    prov["summary"] = (f"({g.get('gpu', 'H200')}, driver {g.get('driver', '?')}, CUDA {g.get('cuda', '?')}, torch "
                       f"{g.get('torch', '?')}, {g.get('date_utc', '?')}; CUDA events, medians)")
    prov["fitted_by"] = f"python benchmarks/fit_h200.py {data}"
    prof = fit_profile(raw, BASE, prov)
    prof["optimizer"]["includes_clip"] = True  # step_s holds the clip (and zeroing the grads)
    out.write_text(json.dumps(prof, indent=1))
    print(f"wrote {out}: {len(prof['gemm']['rows'])} GEMM shapes, {len(prof.get('attention', {}).get('rows', []))} "
          f"attention rows, memory-bound classes {sorted(prof['memory_bound']['classes'])}, host {prof['host']}, "
          f"optimizer {prof['optimizer']}")


if __name__ == "__main__":
    main(sys.argv[1:])
