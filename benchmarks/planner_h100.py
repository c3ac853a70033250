"""The planner (`plan.device=h100`) against the H100's held-out twin steps (benchmarks/data/h100/steps, never fitted).

    python benchmarks/planner_h100.py                 # the tables of benchmarks/README.md's "H100" section
    python benchmarks/planner_h100.py --scaled /tmp/h100_scaled.json   # also a scaled profile's error (same rows)

Rows: dense <= 8k (steps.json), 16k-64k (long_steps.json), MoE capacity 1.25 and dropless (moe_steps.json), all
with cuDNN attention (the FA3-class kernel the h100 profile prices). The overrides are benchmarks/planner.py's
for the H200 rows with `plan.device=h100`; dropless rows are priced twice: with the routing's measured C (the
host reads, `plan.moe_imbalance` = capacity_mean_factor, an input) and with the planner's own expected busiest
expert from E, k and tokens (`plan.moe_imbalance` unset: llmtrain/plan/moe.py `expected_imbalance`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.planner import _row, h200_moe_overrides, h200_overrides  # noqa: E402
from llmtrain.config import register_configs  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "h100" / "steps"
HOST_BOUND = 0.85
"""A row whose profiled GPU busy time is below this share of its step is host-bound: its time is the VM host's
Python (20-39% between processes on the H200's VM), which a ±10% check cannot hold."""


def _device(overrides: list[str], device: str) -> list[str]:
    return [o if not o.startswith("plan.device=") else f"plan.device={device}" for o in overrides]


def _read(name: str, data: Path) -> list[dict]:
    return [r for r in json.loads((data / name).read_text())["rows"] if r.get("step_s_median")]


def dense_rows(data: Path = DATA, device: str = "h100", extra: list[str] | None = None) -> list[dict]:
    out = []
    for r in _read("steps.json", data):
        pred = _row(_device(h200_overrides(r["arch"], r["micro_batch"], r["recompute"]), device) + (extra or []))
        busy = r.get("kernel_time_s")
        out.append({"name": r["name"], "measured_s": r["step_s_median"], "predicted_s": pred["step_time_s"],
                    "error": pred["step_time_s"] / r["step_s_median"] - 1, "busy_s": busy,
                    "host_bound": bool(busy and busy < HOST_BOUND * r["step_s_median"])})
    return out


def long_rows(data: Path = DATA, device: str = "h100", extra: list[str] | None = None) -> list[dict]:
    out = []
    for r in _read("long_steps.json", data):
        pred = _row(_device(h200_overrides(r["arch"], r["micro_batch"], False), device) + (extra or []))
        out.append({"name": r["name"], "measured_s": r["step_s_median"], "predicted_s": pred["step_time_s"],
                    "error": pred["step_time_s"] / r["step_s_median"] - 1})
    return out


def moe_rows(data: Path = DATA, device: str = "h100", routing: str = "measured",
             extra: list[str] | None = None, dropless_only: bool = False) -> list[dict]:
    """`routing`: "measured" (dropless C from the row's host reads) or "expected" (the planner's own expected
    busiest-expert load: no plan.moe_imbalance)."""
    out = []
    for r in _read("moe_steps.json", data):
        dropless = r["moe"]["capacity_factor"] == 0
        if dropless_only and not dropless:
            continue
        imb = r.get("capacity_mean_factor") or 1.0
        ov = _device(h200_moe_overrides(r["arch"], r["moe"], r["micro_batch"], imb), device)
        if routing == "expected":
            ov = [o for o in ov if not o.startswith("plan.moe_imbalance=")]
        pred = _row(ov + (extra or []))
        out.append({"name": r["name"], "dropless": dropless, "measured_s": r["step_s_median"],
                    "predicted_s": pred["step_time_s"], "error": pred["step_time_s"] / r["step_s_median"] - 1,
                    "measured_factor": imb if dropless else None})
    return out


def _table(title: str, rows: list[dict]) -> None:
    print(f"\n| {title} | measured s | predicted s | error |")
    print("|---|---|---|---|")
    for r in rows:
        tag = " (host-bound)" if r.get("host_bound") else ""
        print(f"| {r['name']}{tag} | {r['measured_s']:.4f} | {r['predicted_s']:.4f} | {100 * r['error']:+.1f}% |")
    errs = [abs(r["error"]) for r in rows]
    print(f"mean |error| {100 * sum(errs) / len(errs):.1f}%, worst {100 * max(errs):.1f}%, "
          f"{sum(e <= 0.10 for e in errs)} of {len(rows)} within 10%")


def main(argv: list[str]) -> None:
    register_configs()
    _table("H100 dense row (cuDNN attention)", dense_rows())
    _table("H100 long row", long_rows())
    _table("H100 MoE row, dropless at the measured C", moe_rows())
    _table("H100 MoE row, dropless at the expected busiest expert", moe_rows(routing="expected"))


if __name__ == "__main__":
    main(sys.argv[1:])
