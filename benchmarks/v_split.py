"""DualPipeV's default split: each stage's cost under chunks balanced along the chain vs pairs balanced on the V.

    python benchmarks/v_split.py                          # DeepSeek-V3 (61 blocks) on h800, pp 4, 8, 16
    python benchmarks/v_split.py --model qwen3-8b --pp 8 --profile h100

The costs are the planner's (`llmtrain.plan.stage_cost.layer_costs`: forward + backward seconds of one micro-batch
of 1 x seq_len per piece on the profile, ep 1); "chain" is `llmtrain.parallel.pp_split.balanced_split` over the
2·pp chunks (the default before), "pair" `llmtrain.parallel.v_split.v_balanced_split` (the default now), both read
on the V (stage s: chunks s and 2·pp - 1 - s). Also printed: the time the pair split takes (process CPU, fresh).
"""
from __future__ import annotations

import argparse
import time

from llmtrain.config import compose_config, to_config
from llmtrain.parallel.pp_split import balanced_split
from llmtrain.parallel.v_split import _v_balanced_split, lower_bound, stage_costs
from llmtrain.plan.profile import load_profile
from llmtrain.plan.stage_cost import layer_costs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--profile", default="h800")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--pp", type=int, nargs="*", default=[4, 8, 16])
    args = ap.parse_args()
    cfg = to_config(compose_config([f"model={args.model}", f"data.seq_len={args.seq_len}"]))
    costs = layer_costs(cfg.model, load_profile(args.profile), micro_batch=1, seq_len=args.seq_len)
    print(f"{args.model} ({cfg.model.num_layers} blocks) on {args.profile}, seq {args.seq_len}: embedding "
          f"{costs[0] * 1e3:.2f} ms, head {costs[-1] * 1e3:.2f} ms, blocks {sorted({round(c * 1e3, 2) for c in costs[1:-1]})} ms")
    print("| pp | split | blocks per chunk | per-stage cost, ms | costliest, ms | stages at it | pair split CPU ms |")
    print("|---|---|---|---|---|---|---|")
    for pp in args.pp:
        t0 = time.process_time()
        pair = _v_balanced_split.__wrapped__(tuple(costs), pp)
        took = (time.process_time() - t0) * 1e3
        for name, split in (("chain", balanced_split(costs, 2 * pp)), ("pair", pair)):
            st = stage_costs(costs, split, pp)
            at = sum(c >= max(st) * (1 - 1e-9) for c in st)
            print(f"| {pp} | {name} | {list(split)} | {[round(c * 1e3, 1) for c in st]} | {max(st) * 1e3:.1f} | {at} | "
                  f"{f'{took:.1f}' if name == 'pair' else ''} |")
        print(f"| {pp} | bound | | | {lower_bound(costs, pp) * 1e3:.1f} | | |")


if __name__ == "__main__":
    main()
