"""The planner's exposed gradient communication with and without each overlap option, on one model and profile.

    python benchmarks/overlap_options.py                 # Llama-7B on 64 H100 (8 per node), bf16, seq 4096
    python benchmarks/overlap_options.py --device h200 --devices 32

Prints a markdown table (benchmarks/README.md "Communication overlap, priced"): per layout and option set, the
gradient sync's collective time, its buckets, what the step waits for of it (llmtrain/plan/overlap.py) and the
step time. Planner only: no launch.
"""
from __future__ import annotations

import argparse

from llmtrain.config import compose_config, register_configs, to_config
from llmtrain.parallel.layout import resolve_layout
from llmtrain.plan.estimate import time_estimate
from llmtrain.plan.profile import load_profile

MODEL = ["model=llama-7b", "data.seq_len=4096", "train.amp=bf16", "train.micro_batch_size=1", "model.attention=flash"]


def cases(devices: int) -> list[tuple[str, list[str]]]:
    """(label, overrides): each layout without and with its options."""
    dp = ["+parallel=dp4", f"parallel.dp={devices}", f"train.global_batch_size={devices}"]
    dppp = ["+parallel=dp2pp2", f"parallel.dp={devices // 4}", "parallel.pp=4", f"train.global_batch_size={devices}"]
    sh = ["+parallel=zero2", f"parallel.sharding={devices}", "parallel.sharding_stage=1",
          f"train.global_batch_size={devices}"]
    shpp = ["+parallel=dp2pp2", "parallel.dp=1", f"parallel.sharding={devices // 4}", "parallel.pp=4",
            f"train.global_batch_size={devices}"]
    return [
        ("dp (DataParallel buckets)", dp),
        ("dp x pp4", dppp),
        ("dp x pp4 + dp_comm_overlap", dppp + ["parallel.dp_comm_overlap=true"]),
        ("sharding stage 1 (V1)", sh),
        ("sharding + split_param (V2)", sh + ["parallel.sharding_split_param=true"]),
        ("V2 + sharding_comm_overlap", sh + ["parallel.sharding_split_param=true", "parallel.sharding_comm_overlap=true"]),
        ("V2 + overlap, 64 MiB buckets", sh + ["parallel.sharding_split_param=true", "parallel.sharding_comm_overlap=true",
                                              "parallel.sharding_comm_buffer_mb=64"]),
        ("sharding x pp4 (V1)", shpp),
        ("sharding x pp4 + pp_sharding_comm_overlap", shpp + ["parallel.pp_sharding_comm_overlap=true"]),
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="h100")
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--per-node", type=int, default=8)
    args = ap.parse_args(argv)
    register_configs()
    dev = load_profile(args.device)
    print(f"Llama-7B, seq 4096, micro-batch 1, global batch {args.devices}, bf16, {args.devices} x {args.device} "
          f"({args.per_node} per node)\n")
    print("| layout, options | sync | gradient bytes/elem | buckets x MiB | collective s | exposed s | step s |")
    print("|---|---|---|---|---|---|---|")
    for label, over in cases(args.devices):
        cfg = to_config(compose_config(MODEL + over))
        layout = resolve_layout(cfg.parallel, cfg.train, args.devices)
        row = time_estimate(cfg.model, layout, 4096, False, dev, args.per_node)
        for axis, s in row["comm_syncs"].items():
            bucket = f"{s['buckets']} x {s['bucket_bytes'] / 2**20:.0f}" if s["bucket_bytes"] else f"{s['buckets']} tensors"
            main_grad = any(getattr(layout, k) for k in ("dp_comm_overlap", "pp_sharding_comm_overlap",
                                                           "sharding_comm_overlap", "sharding_split_param"))
            print(f"| {label} | {axis} {s['kind']}{' (overlapped)' if s['overlapped'] else ''} | "
                  f"{4 if main_grad else dev.dtype_bytes} | {bucket} | {s['comm_s']:.4f} | {s['exposed_s']:.4f} | "
                  f"{row['step_time_s']:.3f} |")


if __name__ == "__main__":
    main()
