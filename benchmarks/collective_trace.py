"""Where a multi-process CPU step spends its time in collectives: every collective each rank calls, per step.

    python benchmarks/collective_trace.py [--layouts dp2,zero2,sharding2,zero3] [--reps 3] [--steps 16]
                                          [--out /tmp/llmtrain_collective_trace]

Runs the planner's CPU leg model (benchmarks/planner.py `--cpu`: gpt-tiny, vocabulary 16000, seq 128, global
batch 8, micro-batch 2) under each layout, `--reps` launches each, interleaved (rep 1 of every layout, then rep
2, ...). Every rank loads benchmarks/collective_trace/sitecustomize.py, which times each call of Paddle's Python
process-group methods (all_reduce, reduce, broadcast, ...) and each `Tensor.backward`. A step is cut at the end of
its last backward (the optimizer and its broadcasts count in the next step's window); steps 3 to the last are
averaged. Printed per launch: the median step time (metrics.jsonl), and per rank the median backward, and for
each collective its calls per step x its total milliseconds per step (the wait for the other rank included).
Not seen: collectives issued from C++ (DataParallel's fused gradient all-reduce in dp2)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))


def run(out: Path, layouts: list[str], reps: int, steps: int) -> None:
    from launch import run_launch
    from planner import _cpu_common

    common = [o for o in _cpu_common() if not o.startswith("train.max_steps")] + [f"train.max_steps={steps}"]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE / "collective_trace"), os.environ.get("PYTHONPATH")) if p)
    for rep in range(1, reps + 1):
        for layout in layouts:
            d = out / f"{layout}_rep{rep}"
            d.mkdir(parents=True, exist_ok=True)
            os.environ["LLMTRAIN_TRACE_OUT"] = str(d)
            run_launch(["llmtrain/pretrain.py", *common, "train.micro_batch_size=2", f"+parallel={layout}",
                        f"run.dir={d / 'run'}"], 2, d / "log")


def per_step(events: list, accum: int) -> tuple[float, dict]:
    """(median backward s, {method: (calls, seconds) per step}) of one rank's events."""
    backward = [e for e in events if e[0] == "backward"]
    ends = [backward[i][4] for i in range(accum - 1, len(backward), accum)]  # end of each step's last backward
    totals, windows = {}, list(zip(ends[1:], ends[2:]))  # step k: after step k-1's last backward to its own
    for lo, hi in windows:
        for kind, name, _, t0, t1 in events:
            if kind == "collective" and lo <= t0 < hi:
                calls, secs = totals.get(name, (0, 0.0))
                totals[name] = (calls + 1, secs + t1 - t0)
    n = max(1, len(windows))
    return (statistics.median(e[4] - e[3] for e in backward[2 * accum:]),
            {k: (c / n, s / n) for k, (c, s) in sorted(totals.items())})


def report(out: Path, accum: int = 2) -> None:
    for d in sorted(p for p in out.iterdir() if p.is_dir()):
        with open(d / "run" / "metrics.jsonl") as f:
            times = [r["step_time"] for r in map(json.loads, filter(str.strip, f)) if "step_time" in r][2:]
        cells = []
        for f in sorted(d.glob("rank*.json")):
            bwd, ops = per_step(json.loads(f.read_text()), accum)
            cells.append(f"{f.name.split('_')[0]}: backward {1e3 * bwd:.0f} ms; " +
                         ", ".join(f"{k} {c:.0f} x {1e3 * s:.1f} ms" for k, (c, s) in ops.items()))
        print(f"| {d.name} | {1e3 * statistics.median(times):.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="dp2,zero2,sharding2,zero3")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default="/tmp/llmtrain_collective_trace")
    ap.add_argument("--no-run", action="store_true", help="report the traces already in --out")
    a = ap.parse_args()
    if not a.no_run:
        run(Path(a.out), a.layouts.split(","), a.reps, a.steps)
    print("| launch | step ms (median) | rank 0: collectives per step (calls x ms) | rank 1 |")
    print("|---|---|---|---|")
    report(Path(a.out))
