"""How long a full ranking takes, and every row it produces (to check that a speed-up keeps the results).

    python benchmarks/plan_speed.py                          # time the rankings (best of 3, median; CPU and wall s)
    python benchmarks/plan_speed.py --repeats 1 --only deepseek-v3-256
    python benchmarks/plan_speed.py --dump /tmp/rows         # also write each ranking's rows as JSON there
    python benchmarks/plan_speed.py --compare /tmp/rows      # and check them against a dump (relative 1e-9)

The jobs are the frontier MoE rankings of benchmarks/README.md ("Frontier MoE layouts on 256 and 512 H800") and
three small ones. Each is `rank_layouts` on the composed config (what `python -m llmtrain.plan <overrides>` runs),
timed by process CPU time (`time.process_time`, what the README reports: the host's 2 cores are shared) and wall
clock, after one untimed warm-up ranking of a small job (imports, profiles, the tokenizer).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmtrain.config import compose_config, register_configs, to_config  # noqa: E402

FRONTIER = ["plan.device=h800", "train.global_batch_size=4096", "data.seq_len=4096", "train.amp=bf16"]
JOBS = {
    "deepseek-v3-256": ["model=deepseek-v3", "plan.devices=256", *FRONTIER],
    "deepseek-v3-512": ["model=deepseek-v3", "plan.devices=512", *FRONTIER],
    "ernie-4.5-300b-a47b-256": ["model=ernie-4.5-300b-a47b", "plan.devices=256", *FRONTIER],
    "ernie-4.5-300b-a47b-512": ["model=ernie-4.5-300b-a47b", "plan.devices=512", *FRONTIER],
    "qwen3-235b-a22b-256": ["model=qwen3-235b-a22b", "plan.devices=256", *FRONTIER],
    "qwen3-235b-a22b-512": ["model=qwen3-235b-a22b", "plan.devices=512", *FRONTIER],
    "deepseek-v3-256-fp8": ["model=deepseek-v3", "plan.devices=256", *FRONTIER, "train.fp8=blockwise"],
    "llama-7b-8-h100": ["model=llama-7b", "plan.devices=8", "plan.device=h100", "model.vocab_size=32000"],
    "qwen3-30b-a3b-64": ["model=qwen3-30b-a3b", "plan.devices=64", "plan.device=h800",
                         "train.global_batch_size=1024", "data.seq_len=4096", "train.amp=bf16"],
}
"""name -> the overrides of `python -m llmtrain.plan` (the first six: the README's frontier table)."""


def rank(overrides: list[str]) -> list[dict]:
    from llmtrain.plan.model import planned_model
    from llmtrain.plan.search import rank_layouts

    cfg = to_config(compose_config(overrides))
    return rank_layouts(cfg, planned_model(cfg))


def timed(overrides: list[str]) -> tuple[float, float, list[dict]]:
    """(process CPU s, wall s, rows) of one ranking, config composition excluded."""
    from llmtrain.plan.model import planned_model
    from llmtrain.plan.search import rank_layouts

    cfg = to_config(compose_config(overrides))
    model = planned_model(cfg)
    c0, w0 = time.process_time(), time.perf_counter()
    rows = rank_layouts(cfg, model)
    return time.process_time() - c0, time.perf_counter() - w0, rows


def differences(a, b, path: str = "", rel: float = 1e-9) -> list[str]:
    """Where two JSON-like values differ (floats: beyond `rel` relative)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only on one side" for k in set(a) ^ set(b)]
        for k in a.keys() & b.keys():
            out += differences(a[k], b[k], f"{path}.{k}", rel)
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]", rel)]
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
                and not isinstance(b, bool) and math.isclose(a, b, rel_tol=rel, abs_tol=0.0):
            return []
        return [f"{path}: {a!r} vs {b!r}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def rows_json(rows) -> dict:
    return {"pruned": getattr(rows, "pruned", 0), "rows": json.loads(json.dumps(list(rows)))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=None, help="job names (default: all)")
    ap.add_argument("--dump", default=None, help="a folder: write <job>.json (the ranked rows) there")
    ap.add_argument("--compare", default=None, help="a folder of such dumps: check the rows equal them")
    args = ap.parse_args()
    register_configs()
    rank(JOBS["llama-7b-8-h100"])  # warm-up: imports, profiles, caches of a small job
    print("| job | CPU s best | CPU s median | wall s best | wall s median | rows | fitting |")
    print("|---|---|---|---|---|---|---|")
    bad = 0
    for name, overrides in JOBS.items():
        if args.only and name not in args.only:
            continue
        runs = [timed(overrides) for _ in range(args.repeats)]
        rows = runs[-1][2]
        cpu, wall = [r[0] for r in runs], [r[1] for r in runs]
        print(f"| {name} | {min(cpu):.2f} | {statistics.median(cpu):.2f} | {min(wall):.2f} | "
              f"{statistics.median(wall):.2f} | {len(rows)} | {sum(r['fits'] for r in rows)} |", flush=True)
        got = rows_json(rows)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, f"{name}.json"), "w") as f:
                json.dump(got, f)
        if args.compare:
            with open(os.path.join(args.compare, f"{name}.json")) as f:
                want = json.load(f)
            diff = differences(want, got)
            bad += bool(diff)
            print(f"  {name}: {'same rows' if not diff else f'{len(diff)} differences, e.g. ' + '; '.join(diff[:5])}",
                  flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
