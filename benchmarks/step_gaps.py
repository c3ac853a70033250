"""Where a profiled GPU step sits idle: the gaps between its kernels, and the host op that launched the kernel each
gap waited for (benchmarks/gpu_step_traces.py's gzipped Chrome traces; any machine, no GPU).

    python benchmarks/step_gaps.py benchmarks/data/h100/traces/trace_llama-1b-mb1.json.gz [--min-us 5] [--top 15]

Per trace: the step's span on the device (first kernel start to last kernel end), the time some kernel, copy or
memset ran (their union), and the idle rest; the same per phase (the `phase_forward` / `phase_backward` /
`phase_optimizer` ranges gpu_step_traces records on the host, a kernel counted in the phase whose host range
holds its launch). Then the idle gaps of at least `--min-us`, summed by the host op that launched the kernel
ending the gap (the kernel's launch and the runtime call share a correlation id; the op is the innermost
`cpu_op` around that call): where the host was late, or synchronised.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def analyse(events: list[dict], min_us: float = 5.0) -> dict:
    dev = sorted((e for e in events if e.get("cat") in DEVICE_CATS and e.get("ph") == "X"), key=lambda e: e["ts"])
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"), key=lambda e: e["ts"])
    phases = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("cat") == "user_annotation" and e.get("name", "").startswith("phase_")}
    starts = [o["ts"] for o in ops]

    def launching_op(k: dict) -> str:
        r = runtime.get(k.get("args", {}).get("correlation"))
        if r is None:
            return "?"
        i = bisect.bisect_right(starts, r["ts"])
        best = None
        for o in reversed(ops[max(0, i - 400):i]):  # the innermost op whose range holds the runtime call
            if o["ts"] <= r["ts"] <= o["ts"] + o["dur"] and (best is None or o["dur"] < best["dur"]):
                best = o
        return best["name"] if best else r["name"]

    def phase_of(k: dict) -> str:
        r = runtime.get(k.get("args", {}).get("correlation"))
        t = r["ts"] if r else k["ts"]
        return next((p for p, (a, b) in phases.items() if a <= t <= b), "other")

    out = {"kernels": len(dev), "span_us": dev[-1]["ts"] + dev[-1]["dur"] - dev[0]["ts"] if dev else 0.0,
           "busy_us": union([(k["ts"], k["ts"] + k["dur"]) for k in dev]), "phases": {}, "gaps_by_op": {}}
    for p in sorted({phase_of(k) for k in dev}):
        ks = [k for k in dev if phase_of(k) == p]
        span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
        busy = union([(k["ts"], k["ts"] + k["dur"]) for k in ks])
        out["phases"][p] = {"kernels": len(ks), "span_us": span, "busy_us": busy}
    end = dev[0]["ts"] if dev else 0.0
    gaps: dict[str, list] = {}
    for k in dev:
        gap = k["ts"] - end
        if gap >= min_us:
            g = gaps.setdefault(launching_op(k), [0, 0.0])
            g[0] += 1
            g[1] += gap
        end = max(end, k["ts"] + k["dur"])
    out["gaps_by_op"] = dict(sorted(gaps.items(), key=lambda kv: -kv[1][1]))
    out["gaps_us"] = sum(v[1] for v in gaps.values())
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--min-us", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    for path in args.traces:
        r = analyse(load(path), args.min_us)
        print(f"\n{path}: {r['kernels']} device events; span {r['span_us'] / 1e3:.2f} ms, busy {r['busy_us'] / 1e3:.2f} ms, "
              f"idle {(r['span_us'] - r['busy_us']) / 1e3:.2f} ms (gaps >= {args.min_us:g} us: {r['gaps_us'] / 1e3:.2f} ms)")
        for p, v in r["phases"].items():
            print(f"  {p}: {v['kernels']} events, span {v['span_us'] / 1e3:.2f} ms, busy {v['busy_us'] / 1e3:.2f} ms")
        print(f"  | op launching the kernel after a gap | gaps | idle ms |\n  |---|---|---|")
        for op, (n, us) in list(r["gaps_by_op"].items())[:args.top]:
            print(f"  | {op[:70]} | {n} | {us / 1e3:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
