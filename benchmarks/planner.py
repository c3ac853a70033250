"""The planner against published results (held to the same device constants, no per-point tuning).

    python benchmarks/planner.py            # published points
    python benchmarks/planner.py --cpu      # + predicted vs measured step time of six 2-process CPU layouts

Done: PaddleNLP's Llama2-7B/13B on 8 x A100-80G, tp2 + sharding4 stage 2, seq 4096, global batch 64, flash
attention, bf16 O2, no recompute (llm/docs/pretrain.md; llm/llama/pretrain-llama2_*-tp2sd4_stage2.json);
torchtitan's FSDP2 points on 64 x A100-80G (docs/performance.md: Llama2-13B local batch 2, seq 4096, no
activation checkpointing; Llama3-70B local batch 1, seq 8192, full checkpointing), FSDP taken as ZeRO-3
over 64 ranks. `--cpu`: gpt-tiny (vocabulary 16000, seq 128, global batch 8, micro-batch 2) for 8 steps
under dp2 tp2 pp2 sharding2 zero2 zero3 (one launch each) on this machine, measured step time (median of steps
3-8) against the cpu-here profile (matmul peak measured now; gloo constants assumed, not calibrated).
Not done yet: Megatron-LM's H100 table, the recompute and interleaving ratios, `--calibrate`.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmtrain.config import register_configs, compose_config, to_config
from llmtrain.plan.__main__ import plan

MIB = 2**20
LLAMA2_13B = ["model.hidden_size=5120", "model.num_layers=40", "model.num_heads=40", "model.num_kv_heads=40",
              "model.ffn_hidden_size=13824"]
LLAMA3_70B = ["model.hidden_size=8192", "model.num_layers=80", "model.num_heads=64", "model.num_kv_heads=8",
              "model.ffn_hidden_size=28672", "model.vocab_size=128256"]
BASE = ["model=llama-7b", "model.vocab_size=32000", "model.attention=flash", "train.amp=bf16"]
PADDLENLP = ["data.seq_len=4096", "train.global_batch_size=64", "plan.devices=8", "plan.device=a100-80g",
             "+parallel=tp2sharding2", "parallel.sharding=4", "parallel.sharding_stage=2"]
FSDP64 = ["plan.devices=64", "plan.device=a100-80g", "+parallel=zero3", "parallel.sharding=64"]
PUBLISHED = [  # (label, overrides, tokens/s/device, max allocated MB or None)
    ("PaddleNLP Llama2-7B 8xA100-80G tp2 sd4 s2 mb2", PADDLENLP + ["train.micro_batch_size=2"], 3755, 52092),
    ("PaddleNLP Llama2-13B 8xA100-80G tp2 sd4 s2 mb1", PADDLENLP + LLAMA2_13B + ["train.micro_batch_size=1"], 1976, 64294),
    ("torchtitan Llama2-13B 64xA100-80G FSDP mb2 no AC", FSDP64 + LLAMA2_13B + [
        "data.seq_len=4096", "train.global_batch_size=128", "train.micro_batch_size=2"], 2162, None),
    ("torchtitan Llama3-70B 64xA100-80G FSDP mb1 full AC", FSDP64 + LLAMA3_70B + [
        "data.seq_len=8192", "train.global_batch_size=64", "train.micro_batch_size=1", "train.recompute=true"], 331, None),
]


def main() -> None:
    register_configs()
    print("| point | tokens/s/device published | predicted | error | max allocated MB published | predicted MiB | error |")
    print("|---|---|---|---|---|---|---|")
    for label, extra, tps, mb in PUBLISHED:
        row = plan(to_config(compose_config(BASE + extra)))[0]
        pred_t, pred_m = row["tokens_per_sec_per_device"], row["memory_bytes"]["total"] / MIB
        mem = f"{mb} | {pred_m:.0f} | {100 * (pred_m / mb - 1):+.1f}%" if mb else f"- | {pred_m:.0f} | -"
        print(f"| {label} | {tps} | {pred_t:.0f} | {100 * (pred_t / tps - 1):+.1f}% | {mem} |")


CPU_LAYOUTS = ["dp2", "tp2", "pp2", "sharding2", "zero2", "zero3"]


def cpu_table(workdir: str = "/tmp/llmtrain_planner_cpu") -> None:
    """Predicted vs measured step time of six 2-process CPU layouts (one launch each, through tests/launch.py)."""
    import statistics
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from launch import metrics, run_many

    corpus = ["data.prefixes=[work/pd1998/pd1998_text_document]", "data.tokenizer=work/pd1998/tokenizer"]
    if not os.path.exists("work/pd1998/pd1998_text_document.bin"):
        corpus = ["data.prefixes=[/work/main/work/pd1998/pd1998_text_document]",
                  "data.tokenizer=/work/main/work/pd1998/tokenizer"]
    common = corpus + ["train.max_steps=8", "train.global_batch_size=8", "train.micro_batch_size=2",
                       "train.progress_bar=false", "train.visualdl=false", "checkpoint.save_final=false",
                       "checkpoint.resume=none", "data.num_workers=0"]
    out = Path(workdir)
    for name in CPU_LAYOUTS:  # one launch per layout (fleet is initialised once per process)
        run_many([common + [f"+parallel={name}", f"run.dir={out / name}"]], nproc=2, workdir=out / f"{name}_launch")
    print("| layout | measured step s (median, steps 3-8) | predicted | error |")
    print("|---|---|---|---|")
    for name in CPU_LAYOUTS:
        measured = statistics.median(r["step_time"] for r in metrics(out / name)[2:])
        row = plan(to_config(compose_config(common + [f"+parallel={name}", "plan.devices=2", "plan.device=cpu-here"])))[0]
        pred = row["step_time_s"]
        print(f"| {name} | {measured:.3f} | {pred:.3f} | {100 * (pred / measured - 1):+.1f}% |")


if __name__ == "__main__":
    main()
    if "--cpu" in sys.argv:
        cpu_table()
