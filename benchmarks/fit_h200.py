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


def host_times(host: dict) -> dict:
    """The profile's host block from host.json: seconds per forward op with autograd recording, per backward
    node, per view op (timeline.py)."""
    def pick(*keys):
        for k in keys:
            if k in host and isinstance(host[k], (int, float)):
                return float(host[k])
        raise KeyError(f"host.json: none of {keys} (keys: {sorted(host)})")

    return {"fwd_op_s": pick("fwd_op_s", "forward_op_s", "per_op_fwd_s"),
            "bwd_op_s": pick("bwd_op_s", "backward_op_s", "per_op_bwd_s"),
            "view_op_s": pick("view_op_s", "view_s", "launch_floor_s"),
            "source": "host.json: time per op of long loops of tiny eager ops (PyTorch on the H200's host)"}


def main(argv: list[str]) -> None:
    data = Path(argv[0] if argv and not argv[0].startswith("--") else "benchmarks/data/h200")
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else \
        Path(__file__).resolve().parent.parent / "llmtrain/plan/profiles/h200.json"
    raw, prov = read_tables(data)
    raw["host"] = host_times(raw["host"])
    g = prov.get("gemm", {})
    prov["summary"] = (f"({g.get('gpu', g.get('device', 'H200'))}, {g.get('date', g.get('date_utc', '?'))}, "
                       f"{g.get('method', g.get('timing', ''))})").replace(", )", ")")
    prov["fitted_by"] = f"python benchmarks/fit_h200.py {data}"
    prof = fit_profile(raw, BASE, prov)
    out.write_text(json.dumps(prof, indent=1))
    print(f"wrote {out}: {len(prof['gemm']['rows'])} GEMM shapes, {len(prof.get('attention', {}).get('rows', []))} "
          f"attention rows, memory-bound classes {sorted(prof['memory_bound']['classes'])}, host {prof['host']}, "
          f"optimizer {prof['optimizer']}")


if __name__ == "__main__":
    main(sys.argv[1:])
