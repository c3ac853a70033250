"""Training stall per checkpoint save, synchronous vs `checkpoint.async_save=true`, and step time while saving.

    python benchmarks/async_save.py [--model gpt2-small] [--layouts dp2,zero2] [--steps 9] [--interval 4] [data.prefixes=[...] data.tokenizer=...]

For each layout and mode: one `paddle.distributed.launch` of 2 CPU processes running the
real recipe (`llmtrain/pretrain.py`, global batch 2 x seq 128, fp32) for `--steps` steps with a
checkpoint every `--interval` steps (no final save). Every rank logs, per save, how long the
training thread was paused (`Checkpointer.save`: waiting for the previous write + copying the
state out, plus the whole write when synchronous); the slowest rank counts for each save.
Also from metrics.jsonl: the median step time after the first step (the save's pause excluded,
but a background write may be running beside it) and the wall time per step over the whole run, saves
included. Prints markdown tables.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAUSE = re.compile(r"checkpoint step (\d+): training paused ([\d.]+) s \(waiting for the previous write ([\d.]+) s, "
                   r"copying the state ([\d.]+) s")


def run(layout: str, mode: str, model: str, steps: int, interval: int, extra: list[str]) -> dict:
    out = tempfile.mkdtemp(prefix=f"bench_async_{layout}_{mode}_")
    log_dir = os.path.join(out, "log")
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", log_dir,
           "llmtrain/pretrain.py", f"model={model}", f"+parallel={layout}", "train.global_batch_size=2",
           "train.micro_batch_size=1", "data.seq_len=128", f"train.max_steps={steps}", "train.progress_bar=false",
           "train.visualdl=false", f"checkpoint.interval={interval}", "checkpoint.save_final=false",
           "checkpoint.resume=none", "checkpoint.keep_last=2", f"checkpoint.async_save={mode == 'async'}",
           f"run.dir={os.path.join(out, 'run')}", *extra]
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pauses: dict[int, list] = {}
    for r in range(2):
        with open(os.path.join(log_dir, f"workerlog.{r}"), errors="replace") as f:
            for m in PAUSE.finditer(f.read()):
                pauses.setdefault(int(m.group(1)), []).append(tuple(float(x) for x in m.groups()[1:]))
    per_save = [max(v, key=lambda t: t[0]) for _, v in sorted(pauses.items())]  # the slowest rank of each save
    with open(os.path.join(out, "run", "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    recs = [r for r in recs if "loss" in r]
    quiet = [r["step_time"] for r in recs[1:]]  # the Meter restarts its window after a save: the pause is not in here
    wall = (recs[-1]["time"] - recs[0]["time"]) / (len(recs) - 1)
    return {"stalls": [p[0] for p in per_save], "waits": [p[1] for p in per_save], "copies": [p[2] for p in per_save],
            "step_time": statistics.median(quiet), "wall_per_step": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--layouts", default="dp2,zero2")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--interval", type=int, default=4)
    args, extra = ap.parse_known_args()
    rows = {}
    for layout in args.layouts.split(","):
        for mode in ("sync", "async"):
            rows[layout, mode] = run(layout, mode, args.model, args.steps, args.interval, extra)
            print(layout, mode, rows[layout, mode], flush=True)
    print(f"\nModel {args.model}, 2 CPU processes, fp32, global batch 2 x seq 128, {args.steps} steps, "
          f"a checkpoint every {args.interval} steps; the slowest rank of each save counts.\n")
    print("| layout | mode | training paused per save, s | of which waiting for the previous write | copying the state out "
          "| async stall / sync stall | median step time (pause excluded), s | wall time per step, saves included, s |")
    print("|---|---|---|---|---|---|---|---|")
    for (layout, mode), r in rows.items():
        sync = statistics.mean(rows[layout, "sync"]["stalls"])
        ratio = f"{statistics.mean(r['stalls']) / sync:.3f}" if mode == "async" else ""
        print(f"| {layout} | {mode} | {', '.join(f'{x:.2f}' for x in r['stalls'])} | "
              f"{', '.join(f'{x:.2f}' for x in r['waits'])} | {', '.join(f'{x:.2f}' for x in r['copies'])} | {ratio} | "
              f"{r['step_time']:.2f} | {r['wall_per_step']:.2f} |")


if __name__ == "__main__":
    main()
