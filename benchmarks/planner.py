"""The planner against published results (held to the same device constants, no per-point tuning).

    python benchmarks/planner.py

Done: PaddleNLP's Llama2-7B/13B on 8 x A100-80G, tp2 + sharding4 stage 2, seq 4096, global batch 64, flash
attention, bf16 O2, no recompute (llm/docs/pretrain.md; llm/llama/pretrain-llama2_*-tp2sd4_stage2.json).
Not done yet: Megatron-LM's H100 table, torchtitan's 64 x A100 points, the recompute and interleaving
ratios, and the CPU time comparison (they are listed in issue 10).
"""
from __future__ import annotations

if __package__ in (None, ""):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmtrain.config import register_configs, compose_config, to_config
from llmtrain.plan.__main__ import plan

MIB = 2**20
LLAMA2_13B = ["model.hidden_size=5120", "model.num_layers=40", "model.num_heads=40", "model.num_kv_heads=40",
              "model.ffn_hidden_size=13824"]
PUBLISHED = [  # (label, overrides, tokens/s/card, max allocated MB)
    ("PaddleNLP Llama2-7B 8xA100-80G tp2 sd4 s2", ["train.micro_batch_size=2"], 3755, 52092),
    ("PaddleNLP Llama2-13B 8xA100-80G tp2 sd4 s2", LLAMA2_13B + ["train.micro_batch_size=1"], 1976, 64294),
]
COMMON = ["model=llama-7b", "model.vocab_size=32000", "model.attention=flash", "data.seq_len=4096",
          "train.global_batch_size=64", "train.amp=bf16", "plan.devices=8", "plan.device=a100-80g",
          "+parallel=tp2sharding2", "parallel.sharding=4", "parallel.sharding_stage=2"]


def main() -> None:
    register_configs()
    print("| point | tokens/s/card published | predicted | error | max allocated MB published | predicted MiB | error |")
    print("|---|---|---|---|---|---|---|")
    for label, extra, tps, mb in PUBLISHED:
        row = plan(to_config(compose_config(COMMON + extra)))[0]
        pred_t, pred_m = row["tokens_per_sec_per_device"], row["memory_bytes"]["total"] / MIB
        print(f"| {label} | {tps} | {pred_t:.0f} | {100 * (pred_t / tps - 1):+.1f}% | {mb} | {pred_m:.0f} | "
              f"{100 * (pred_m / mb - 1):+.1f}% |")


if __name__ == "__main__":
    main()
