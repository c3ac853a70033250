"""The planner against published results (held to the same device constants, no per-point tuning).

    python benchmarks/planner.py            # published points
    python benchmarks/planner.py --cpu      # + predicted vs measured step time of CPU runs (1 process mb 1/2/4/8, 6 layouts)
    python benchmarks/planner.py --cpu-only [--passes N] [--calibrate-each-pass] [--no-run]
                                                         # the CPU table alone: N interleaved passes of the ten
                                                         # runs, each after its own calibration; --no-run:
                                                         # re-predict the last runs
    python benchmarks/planner.py --h200-moe --h200-long  # MoE and 16k-64k twin steps (benchmarks/data/h200_moe)
    python benchmarks/planner.py --long-cp               # llama-7b at 32k/128k on 8/64 h200s, with and without cp
    python benchmarks/planner.py --h200-only [DIR]       # H200 steps (DIR/steps_pass*.json, default
                                                         # benchmarks/data/h200) against the h200 profile (fitted by
                                                         # benchmarks/fit_h200.py)

Done: PaddleNLP's Llama2-7B/13B on 8 x A100-80G, tp2 + sharding4 stage 2, seq 4096, global batch 64, flash
attention, bf16 O2, no recompute (llm/docs/pretrain.md; llm/llama/pretrain-llama2_*-tp2sd4_stage2.json);
torchtitan's FSDP2 points on 64 x A100-80G (docs/performance.md: Llama2-13B local batch 2, seq 4096, no
activation checkpointing; Llama3-70B local batch 1, seq 8192, full checkpointing), FSDP taken as ZeRO-3
over 64 ranks. `--cpu`: gpt-tiny (vocabulary 16000, seq 128, global batch 8, micro-batch 2) for 8 steps
under dp2 tp2 pp2 sharding2 zero2 zero3 (one launch each) on this machine, measured step time (median of steps
3-8) against the cpu-here profile (calibrated by `python -m llmtrain.plan --calibrate` into work/cpu-here.json;
without that file: matmul peak measured now, gloo constants assumed).
Megatron-LM's H100 weak-scaling table (README, images/model_table.png: GPT 7.1B = h 4096, 30 layers, 32
heads on 96 GPUs TP2 PP1 DP48, 177B = h 12288, 96 layers, 96 heads on 2304 GPUs TP8 PP6 DP48; batch 192 /
1152, seq 4096, vocabulary 131072, untied embeddings (the parameter counts need them), the distributed
optimizer (`--overlap-param-gather` requires it: sharding stage 1 over the 48 data ranks)); not published
there and assumed: micro-batch 1 (Megatron's GPT-3 example script), no recompute, no interleaving; TFLOP/s
by Megatron's formula 72·L·h²·(1 + s/(6h) + V/(12·L·h)) per token. The ratios: Korthikanti et al. 2022,
530B (h 20480, 105 layers, 128 heads, TP8 PP35, 2240 A100, global batch 2240 of seq 2048, micro-batch 1,
vocabulary 51200: the abstract's figures, the rest recalled from the paper's Table 3 and the batch inferred,
see benchmarks/README.md) selective vs full recompute MFU; torchtitan (docs/performance.md before its removal,
Table 5) Llama 3.1 405B on 512 H100, FSDP8 TP8 PP8, local batch 32, global 256, seq 8192, full activation
checkpointing, 8 micro-batches (torchtitan's default: the pp degree), interleaved = 2 stages per rank:
interleaved 1F1B vs 1F1B tokens/s. `--cpu` uses the calibrated cpu-here profile when work/cpu-here.json
exists (`python -m llmtrain.plan --calibrate`).
"""
from __future__ import annotations

import os
import statistics
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the CPU leg's host-speed probe times kernels as `--calibrate` and the runs do: one thread (before Paddle loads)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from llmtrain.config import register_configs, compose_config, to_config
from llmtrain.plan.__main__ import plan

MIB = 2**20
LLAMA2_13B = ["model.hidden_size=5120", "model.num_layers=40", "model.num_heads=40", "model.num_kv_heads=40",
              "model.ffn_hidden_size=13824"]
LLAMA3_70B = ["model.hidden_size=8192", "model.num_layers=80", "model.num_heads=64", "model.num_kv_heads=8",
              "model.ffn_hidden_size=28672", "model.vocab_size=128256"]
BASE = ["model=llama-7b", "model.vocab_size=32000", "model.attention=flash", "train.amp=bf16"]
PADDLENLP = ["data.seq_len=4096", "train.global_batch_size=64", "plan.devices=8", "plan.device=a100-80g",
             "+parallel=tp2sharding2", "parallel.sharding=4", "parallel.sharding_stage=2",
             # the recipe's kernels (pretrain-llama2_*-tp2sd4_stage2.json: use_fused_rope true, use_fused_rms_norm
             # false; PaddleNLP's defaults fuse_attention_qkv/ffn false; its Llama MLP was silu(gate) * up until
             # the fused swiglu came in early 2024, PaddleNLP #7967, after these Nov 2023 figures)
             "model.fuse_rope=true", "model.fuse_rms_norm=false", "model.fuse_qkv=false", "model.fuse_ffn=false",
             "model.fuse_swiglu=false"]
FSDP64 = ["plan.devices=64", "plan.device=a100-80g", "+parallel=zero3", "parallel.sharding=64"]
PUBLISHED = [  # (label, overrides, tokens/s/device, max allocated MB or None)
    ("PaddleNLP Llama2-7B 8xA100-80G tp2 sd4 s2 mb2", PADDLENLP + ["train.micro_batch_size=2"], 3755, 52092),
    ("PaddleNLP Llama2-13B 8xA100-80G tp2 sd4 s2 mb1", PADDLENLP + LLAMA2_13B + ["train.micro_batch_size=1"], 1976, 64294),
    ("torchtitan Llama2-13B 64xA100-80G FSDP mb2 no AC", FSDP64 + LLAMA2_13B + [
        "data.seq_len=4096", "train.global_batch_size=128", "train.micro_batch_size=2"], 2162, None),
    ("torchtitan Llama3-70B 64xA100-80G FSDP mb1 full AC", FSDP64 + LLAMA3_70B + [
        "data.seq_len=8192", "train.global_batch_size=64", "train.micro_batch_size=1", "train.recompute=true"], 331, None),
]


def _gpt(h, layers, heads, vocab, seq) -> list[str]:
    """A Megatron-style GPT (LayerNorm, GeLU, learned positions, biases) of the given shape: planner-only overrides."""
    return ["model=gpt2-small", "model.name=gpt", f"model.vocab_size={vocab}", f"model.hidden_size={h}",
            f"model.num_layers={layers}", f"model.num_heads={heads}", f"model.ffn_hidden_size={4 * h}",
            f"model.max_position_embeddings={seq}", "model.activation=gelu", f"data.seq_len={seq}", "train.amp=bf16"]


def megatron_flops_per_token(layers, h, seq, vocab) -> float:
    """Megatron-LM's model FLOPs per token (no recompute): 72·L·h²·(1 + s/(6h) + V/(12·L·h))."""
    return 72 * layers * h * h * (1 + seq / (6 * h) + vocab / (12 * layers * h))


MEGATRON = [  # (label, (h, layers, heads), tp, pp, devices, global batch, published TFLOP/s per GPU)
    ("Megatron-LM GPT 7.1B 96xH100 TP2 PP1", (4096, 30, 32), 2, 1, 96, 192, 465.9),
    ("Megatron-LM GPT 177B 2304xH100 TP8 PP6", (12288, 96, 96), 8, 6, 2304, 1152, 432.8),
]
KORTHIKANTI_530B = _gpt(20480, 105, 128, 51200, 2048) + [
    "model.tie_embeddings=true", "model.attention=math", "plan.device=a100-80g", "plan.devices=2240", "+parallel=dp2tp2pp2",
    "parallel.dp=8", "parallel.tp=8", "parallel.pp=35", "train.global_batch_size=2240", "train.micro_batch_size=1"]
LLAMA31_405B = ["model=llama-7b", "model.name=llama3.1-405b", "model.vocab_size=128256", "model.hidden_size=16384",
                "model.num_layers=128", "model.num_heads=128", "model.num_kv_heads=8", "model.ffn_hidden_size=53248",
                "model.attention=flash", "data.seq_len=8192", "train.amp=bf16", "plan.device=h100", "plan.devices=512",
                "+parallel=tp2sharding2", "parallel.tp=8", "parallel.pp=8", "parallel.sharding=8", "parallel.sharding_stage=1",
                "train.global_batch_size=256", "train.micro_batch_size=4", "plan.recompute=full"]
RATIOS = [  # (label, overrides of the numerator, of the denominator, published numerator, denominator, key)
    ("Korthikanti 530B 2240xA100 MFU: selective / full recompute", KORTHIKANTI_530B + ["plan.recompute=selective"],
     KORTHIKANTI_530B + ["plan.recompute=full"], 54.2, 42.1, "mfu"),
    ("torchtitan Llama3.1-405B 512xH100 tokens/s: interleaved (v2) / 1F1B", LLAMA31_405B + [
        "parallel.pp_schedule=interleaved", "parallel.virtual_pp=2"], LLAMA31_405B + ["parallel.pp_schedule=1f1b"],
     128, 100, "tokens_per_sec_per_device"),
]


def _row(overrides: list[str]) -> dict:
    return plan(to_config(compose_config(overrides)))[0]


def megatron_rows() -> list[tuple[str, float, dict]]:
    """(label, predicted TFLOP/s per GPU by Megatron's formula, row) of each Megatron-LM point."""
    out = []
    for label, (h, layers, heads), tp, pp, n, gb, _ in MEGATRON:
        row = _row(_gpt(h, layers, heads, 131072, 4096) + [
            "model.tie_embeddings=false", "model.attention=flash", "plan.device=h100", f"plan.devices={n}",
            "+parallel=tp2sharding2", f"parallel.tp={tp}", f"parallel.pp={pp}", "parallel.sharding=48",
            "parallel.sharding_stage=1", f"train.global_batch_size={gb}", "train.micro_batch_size=1",
            "parallel.sequence_parallel=true",
            # Megatron's distributed optimizer with --overlap-grad-reduce: llmtrain's V2 with its overlap knob
            "parallel.sharding_split_param=true",
            "parallel.sharding_comm_overlap=true" if pp == 1 else "parallel.pp_sharding_comm_overlap=true"])
        out.append((label, row["tokens_per_sec_per_device"] * megatron_flops_per_token(layers, h, 4096, 131072) / 1e12,
                    row))
    return out


def megatron_table() -> None:
    print("\n| point | TFLOP/s/GPU published | predicted | error | predicted memory GiB (fits) |")
    print("|---|---|---|---|---|")
    for (label, _, _, _, _, _, published), (_, tflops, row) in zip(MEGATRON, megatron_rows()):
        mem = row["memory_bytes"]["total"] / 2**30
        print(f"| {label} | {published} | {tflops:.1f} | {100 * (tflops / published - 1):+.1f}% | "
              f"{mem:.1f} ({'yes' if row['fits'] else 'no'}) |")


def ratio_table() -> None:
    print("\n| ratio | published | predicted (numerator / denominator) | predicted ratio | difference, points |")
    print("|---|---|---|---|---|")
    for label, num, den, pub_num, pub_den, key in RATIOS:
        a, b = _row(num)[key], _row(den)[key]
        scale = 100 if key == "mfu" else 1
        pub, pred = pub_num / pub_den, a / b
        print(f"| {label} | {pub_num} / {pub_den} = {pub:.3f} | {scale * a:.1f} / {scale * b:.1f} | {pred:.3f} | "
              f"{100 * (pred - pub):+.1f} |")


def main() -> None:
    register_configs()
    print("| point | tokens/s/device published | predicted | error | max allocated MiB published | predicted "
          "allocated MiB | error | predicted total with margin, MiB |")
    print("|---|---|---|---|---|---|---|---|")
    parts = []
    for label, extra, tps, mb in PUBLISHED:
        row = plan(to_config(compose_config(BASE + extra)))[0]
        m = row["memory_bytes"]
        pred_t, pred_m = row["tokens_per_sec_per_device"], m["allocated"] / MIB
        mem = f"{mb} | {pred_m:.0f} | {100 * (pred_m / mb - 1):+.1f}%" if mb else f"- | {pred_m:.0f} | -"
        print(f"| {label} | {tps} | {pred_t:.0f} | {100 * (pred_t / tps - 1):+.1f}% | {mem} | {m['total'] / MIB:.0f} |")
        parts.append(f"{label}: " + ", ".join(f"{k} {m[k] / MIB:.0f}" for k in
                                              ("params", "grads", "optimizer", "activations", "other", "allocated")))
    print("\nMiB on the worst rank (other = logits/loss buffers + the margin; allocated = total - margin):")
    for line in parts:
        print(f"- {line}")


CPU_LAYOUTS = ["dp2", "tp2", "pp2", "sharding2", "zero2", "zero3"]
CPU_MICRO_BATCHES = [1, 2, 4, 8]


def _cpu_common() -> list[str]:
    corpus = ["data.prefixes=[work/pd1998/pd1998_text_document]", "data.tokenizer=work/pd1998/tokenizer"]
    if not os.path.exists("work/pd1998/pd1998_text_document.bin"):
        corpus = ["data.prefixes=[/work/main/work/pd1998/pd1998_text_document]",
                  "data.tokenizer=/work/main/work/pd1998/tokenizer"]
    return corpus + ["train.max_steps=8", "train.global_batch_size=8", "train.progress_bar=false",
                     "train.visualdl=false", "checkpoint.save_final=false", "checkpoint.resume=none", "data.num_workers=0"]


PROBE_GEMMS = ((256, 16384, 256), (256, 256, 16384), (256, 1024, 256), (1024, 1024, 1024))
PROBE_MEM = (("add", 2**20), ("add", 2**21), ("add", 2**22), ("cross_entropy", 2**21), ("mul", 2**21))
"""The host-speed probe: GEMMs on `--calibrate`'s grid and memory-bound ops at its sizes (so the profile holds
each one's own measured time, nothing interpolated), in the mix a gpt-tiny step spends its time on."""


def host_speed(prof) -> float:
    """This host's speed now against the moment `prof` was calibrated: the probe's measured seconds over the
    seconds `prof`'s tables hold for the same kernels (1.3 = 30% slower now). Timed the way `--calibrate` times
    (measure.timeit: a typical call), in this process, alone on the host (between two runs of the leg)."""
    from llmtrain.plan import measure

    rows = measure.gemm_table(PROBE_GEMMS, reps=6)
    measured = sum(r["seconds"] for r in rows)
    held = sum(prof.gemm_seconds(r["m"], r["n"], r["k"]) for r in rows)
    for op, numel in PROBE_MEM:
        make, n = measure._mem_ops(numel, "float32")[op]
        measured += measure.timeit(make(), 6)
        held += prof.mem_seconds(op, n)
    return measured / held


def cpu_rows(workdir: str = "/tmp/llmtrain_planner_cpu", run: bool = True, passes: int = 1,
             calibrate_each: bool = False) -> list[dict]:
    """Predicted vs measured step time on this CPU: one process at micro-batches 1, 2, 4, 8, then six 2-process
    layouts at micro-batch 2; every run its own process or launch (through tests/launch.py), as users run it
    (four Trainer runs in turn in one process ran each later run slower than alone). `passes` > 1 runs the ten
    rows that many times, interleaved (pass 1 of every row, then pass 2, ...); `calibrate_each`: each pass
    starts with its own `--calibrate` (into the pass's folder) and its runs are predicted from it. This host's
    speed drifts by up to 30% over minutes (phases that outlast a calibration): one pass of a row, and one
    calibration, are one draw of it. A row's error is the median over the passes of predicted / measured - 1
    (each pass's median step against that pass's prediction). Around every run the host's speed is probed
    (`host_speed`) against the pass's profile. `run=False` re-predicts the runs already in `workdir`."""
    import json
    import subprocess
    from pathlib import Path

    from llmtrain.paddle_compat.cpu_backend.host_allocator import keep_freed_memory
    from llmtrain.plan.devices import get_device

    keep_freed_memory()  # the host-speed probe times kernels under the allocator the runs and calibration use
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from launch import metrics, run_many

    common = _cpu_common()
    out = Path(workdir)
    single = [(f"single mb{mb}", common + [f"train.micro_batch_size={mb}"], ["+parallel=dp2", "parallel.dp=1", "plan.devices=1"], 0,
               f"mb{mb}") for mb in CPU_MICRO_BATCHES]
    layouts = [(name, common + ["train.micro_batch_size=2", f"+parallel={name}"], ["plan.devices=2"], 2, name)
               for name in CPU_LAYOUTS]
    rows_spec = single + layouts  # one process per single run (see the docstring); one launch per layout
    run_dir = lambda i, tag: out / (f"pass{i}" if passes > 1 else "") / tag  # noqa: E731
    profile = lambda i: str(run_dir(i, "cpu-here.json")) if calibrate_each else "work/cpu-here.json"  # noqa: E731
    loads = []
    if run:
        for i in range(1, passes + 1):
            if calibrate_each:
                run_dir(i, "").mkdir(parents=True, exist_ok=True)
                subprocess.run([sys.executable, "-m", "llmtrain.plan", "--calibrate", "--out", profile(i)], check=True)
            prof = get_device("cpu-here", profile(i))
            before = host_speed(prof)
            loads.append(os.getloadavg()[0])
            for _, overrides, _, nproc, tag in rows_spec:
                run_many([overrides + [f"run.dir={run_dir(i, tag)}"]], nproc=nproc, workdir=run_dir(i, tag + "_launch"))
                loads.append(os.getloadavg()[0])
                after = host_speed(prof)
                (run_dir(i, tag) / "host_speed.json").write_text(json.dumps({"before": before, "after": after}))
                before = after
    rows = []
    for name, overrides, plan_extra, _, tag in rows_spec:
        medians, predicted, speed = [], [], []
        for i in range(1, passes + 1):
            medians.append(statistics.median(r["step_time"] for r in metrics(run_dir(i, tag))[2:]))
            predicted.append(plan(to_config(compose_config(overrides + plan_extra + [
                "plan.device=cpu-here", f"plan.profile={profile(i)}"])))[0]["step_time_s"])
            probe = run_dir(i, tag) / "host_speed.json"
            speed.append(statistics.fmean(json.loads(probe.read_text()).values()) if probe.exists() else float("nan"))
        rows.append({"name": name, "pass_medians_s": medians, "predicted_s": predicted, "host_speed": speed,
                     "error": statistics.median(p / m - 1 for p, m in zip(predicted, medians))})
    if loads:
        print(f"load average (1 min) before and after each launch: {', '.join(f'{x:.1f}' for x in loads)}")
    return rows


def _summary(errs: list[float]) -> str:
    """The CPU leg's criterion over rows' signed errors: mean and worst |error|, rows within ±15%."""
    mags = [abs(e) for e in errs]
    return (f"mean |error| {100 * sum(mags) / len(mags):.1f}%, worst {100 * max(mags):.1f}%, "
            f"{sum(m <= 0.15 for m in mags)} of {len(mags)} within 15%")


def cpu_table(workdir: str = "/tmp/llmtrain_planner_cpu", run: bool = True, passes: int = 1,
              calibrate_each: bool = False) -> None:
    """Prints `cpu_rows` as a table, its summary (the criterion), and the same rows drift-corrected: each
    prediction times the host-speed probe around its run."""
    rows = cpu_rows(workdir, run, passes, calibrate_each)
    print("| run | measured step s (median of steps 3-8), each pass | predicted, each pass | error, each pass | "
          "host speed (probe / profile) | error (median of the passes) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        errs = [p / m - 1 for p, m in zip(r["predicted_s"], r["pass_medians_s"])]
        print(f"| {r['name']} | {' / '.join(f'{x:.3f}' for x in r['pass_medians_s'])} | "
              f"{' / '.join(f'{x:.3f}' for x in r['predicted_s'])} | {' / '.join(f'{100 * e:+.0f}%' for e in errs)} | "
              f"{' / '.join(f'{x:.2f}' for x in r['host_speed'])} | {100 * r['error']:+.1f}% |")
    print(_summary([r["error"] for r in rows]))
    # the same rows with each prediction scaled by the probe around its run (the host's drift since the pass's
    # calibration, measured on kernels): what the model misses when its tables are as fresh as the run
    drift = [statistics.median(p * h / m - 1 for p, h, m in zip(r["predicted_s"], r["host_speed"], r["pass_medians_s"]))
             for r in rows]
    print("drift-corrected (prediction x probe), error (median of the passes): "
          + ", ".join(f"{r['name']} {100 * d:+.1f}%" for r, d in zip(rows, drift)))
    print("drift-corrected " + _summary(drift))


H200_DATA = "benchmarks/data/h200"


def h200_overrides(arch: dict, micro_batch: int, recompute: bool) -> list[str]:
    """Planner overrides for one steps.json row: llmtrain's preset of the family with the row's shape, one
    micro-batch per step, bf16, flash attention, and the kernels the instrument runs (benchmarks/gpu_model.py:
    fused q|k|v and gate|up GEMMs and RMSNorm as on llmtrain's GPU path; RoPE and silu * up unfused)."""
    a = arch
    if a["family"] == "llama":
        base = ["model=llama-7b", "model.fuse_rope=false", "model.fuse_swiglu=false", "model.fuse_rms_norm=true",
                "model.fuse_qkv=true", "model.fuse_ffn=true", f"model.num_kv_heads={a['kv_heads']}"]
    else:
        base = ["model=gpt2-small", "model.activation=gelu_tanh", "model.fuse_qkv=true"]
    return base + [f"model.name={a['family']}-h{a['hidden']}", f"model.hidden_size={a['hidden']}",
                   f"model.num_layers={a['layers']}", f"model.num_heads={a['heads']}",
                   f"model.ffn_hidden_size={a['ffn']}", f"model.vocab_size={a['vocab']}",
                   f"model.max_position_embeddings={a['seq']}", f"model.tie_embeddings={str(a['tie_embeddings']).lower()}",
                   "model.attention=flash", "train.amp=bf16", f"data.seq_len={a['seq']}",
                   f"train.global_batch_size={micro_batch}", f"train.micro_batch_size={micro_batch}",
                   f"train.recompute={str(recompute).lower()}", "plan.device=h200", "plan.devices=1",
                   "+parallel=dp2", "parallel.dp=1"]


PASSES = ("steps_pass1.json", "steps_pass2.json", "steps_pass3.json")
"""The re-measurement (benchmarks/data/h200/README.md): every row in three interleaved passes, 10 timed steps each."""


def measured_steps(data_dir: str = H200_DATA) -> dict:
    """{row: {"measured_s", "passes_s", "first_s", "busy_s", "kernels"}}: `measured_s` is the median of all timed
    steps of the three passes (the statistic fixed before predictions were compared); without the pass files,
    steps.json's median. `first_s` is steps.json's median (the first measurement); `busy_s` and `kernels` the
    profiled step's CUDA kernels (step_profile.json, GPU user-annotation ranges left out)."""
    import json
    from pathlib import Path

    d = Path(data_dir)
    out = {r["name"]: {"measured_s": r["step_s_median"], "passes_s": [], "first_s": r["step_s_median"],
                       "busy_s": r.get("kernel_time_s"), "kernels": r.get("kernels_per_step"), "arch": r["arch"],
                       "micro_batch": r["micro_batch"], "recompute": r["recompute"]}
           for r in json.loads((d / "steps.json").read_text())["rows"] if r.get("step_s_median")}
    pooled: dict[str, list] = {}
    for name in PASSES:
        if (d / name).exists():
            for r in json.loads((d / name).read_text())["rows"]:
                if r.get("step_s") and r["name"] in out:
                    pooled.setdefault(r["name"], []).extend(r["step_s"])
                    out[r["name"]]["passes_s"].append(r["step_s_median"])
    for name, steps in pooled.items():
        out[name]["measured_s"] = statistics.median(steps)
    if (d / "step_profile.json").exists():
        for r in json.loads((d / "step_profile.json").read_text())["rows"]:
            ks = [k for k in r["kernels_by_name"] if not k["name"].startswith(("phase_", "Optimizer."))]
            out[r["name"]].update(busy_s=sum(k["seconds"] for k in ks), kernels=sum(k["count"] for k in ks))
    return out


def h200_rows(data_dir: str = H200_DATA) -> list[dict]:
    """Predicted (the fitted h200 profile) vs measured (`measured_steps`, never fitted) step time of every H200 row."""
    out = []
    for name, m in measured_steps(data_dir).items():
        row = _row(h200_overrides(m["arch"], m["micro_batch"], m["recompute"]))
        out.append({"name": name, **m, "predicted_s": row["step_time_s"],
                    "error": row["step_time_s"] / m["measured_s"] - 1, "host_s": row["host_s"],
                    "device_s": row["device_s"], "kernels_predicted": row["kernels_per_step"]})
    return out


def h200_table(data_dir: str = H200_DATA) -> None:
    rows = h200_rows(data_dir)
    print("\n| H200 row | measured step s (median of 3 passes x 10 steps) | pass medians s | predicted | error "
          "| steps.json s (first run) | error vs steps.json | predicted host / device s | GPU busy s (profiled) "
          "| kernels predicted / profiled |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        passes = " / ".join(f"{x:.4f}" for x in r["passes_s"]) or "-"
        busy = f"{r['busy_s']:.4f}" if r["busy_s"] else "-"
        print(f"| {r['name']} | {r['measured_s']:.4f} | {passes} | {r['predicted_s']:.4f} | {100 * r['error']:+.1f}% | "
              f"{r['first_s']:.4f} | {100 * (r['predicted_s'] / r['first_s'] - 1):+.1f}% | "
              f"{r['host_s']:.4f} / {r['device_s']:.4f} | {busy} | {r['kernels_predicted']} / {r['kernels']} |")
    errs = [abs(r["error"]) for r in rows]
    within = sum(e <= 0.10 for e in errs)
    print(f"mean |error| {100 * sum(errs) / len(errs):.1f}%, worst {100 * max(errs):.1f}%, {within} of {len(rows)} "
          "within 10% (against the median of the three passes)")


H200_MOE_DATA = "benchmarks/data/h200_moe"
H200_MOE_FINAL = "benchmarks/data/h200_moe/final"
"""The second MoE run (2026-12-03 13:33): llmtrain's final op sequence, the rows the planner is checked against."""


def h200_moe_overrides(arch: dict, moe: dict, micro_batch: int, imbalance: float) -> list[str]:
    """Planner overrides for one moe_steps.json row (benchmarks/gpu_moe.py's twin): the dense row's overrides
    (`h200_overrides`: the attention, the shared expert as the fused dense FFN) with every block MoE, the row's
    experts, top-k, widths, router (its GEMM's dtype: `amp`, bf16, for rows measured before the twin had
    `router_dtype`) and losses, its capacity factor (0: dropless) and, for dropless, the row's
    routing imbalance as the stated factor (`plan.moe_imbalance`: an input of the routing, not a time)."""
    m = moe
    return h200_overrides(arch, micro_batch, False) + [
        f"model.moe_num_experts={m['experts']}", f"model.moe_top_k={m['top_k']}", f"model.moe_ffn_hidden_size={m['ffn']}",
        f"model.moe_num_shared_experts={m['shared_ffn'] // m['ffn']}", "model.moe_first_dense_layers=0",
        "model.moe_router=softmax", f"model.moe_norm_topk={str(m['norm_topk']).lower()}",
        f"model.moe_router_dtype={m.get('router_dtype', 'amp')}",  # rows before the fp32 router ran a bf16 GEMM
        f"model.moe_aux_loss_coef={m['aux_coef']}", f"model.moe_z_loss_coef={m['z_coef']}",
        f"model.moe_capacity_factor={m['capacity_factor']}", f"plan.moe_imbalance={imbalance:.4f}"]


def stated_imbalance(row: dict) -> float:
    """A dropless row's stated factor: the mean over its timed steps and layers of the capacity C the dispatcher
    used (the host reads, recorded: `capacity_mean_factor`, C over T k / E); the first run recorded none, so its
    rows fall back to `imbalance` (the busiest expert's load over the mean in one forward after the timed steps).
    Capacity rows ignore it."""
    return row.get("capacity_mean_factor") or row["imbalance"]


def h200_moe_rows(data_dir: str = H200_MOE_FINAL, impl: str = "slots") -> list[dict]:
    """Predicted vs measured step time of the MoE twin's rows of llmtrain's formulation (moe_steps.json; never
    fitted): `impl` slots with the twin's defaults (the variants, tagged `slots_*`, are left out)."""
    import json
    from pathlib import Path

    out = []
    for r in json.loads((Path(data_dir) / "moe_steps.json").read_text())["rows"]:
        if r.get("moe", {}).get("impl") != impl or not r.get("step_s_median") or f"-{impl}-" not in r["name"]:
            continue
        if r["moe"].get("scan", "paddle") != "paddle" or r["moe"].get("dispatch", "gather") != "gather":
            continue
        imb = stated_imbalance(r)
        pred = _row(h200_moe_overrides(r["arch"], r["moe"], r["micro_batch"], imb))
        out.append({"name": r["name"], "measured_s": r["step_s_median"], "predicted_s": pred["step_time_s"],
                    "error": pred["step_time_s"] / r["step_s_median"] - 1, "imbalance": imb,
                    "busy_s": r.get("kernel_time_s"), "host_s": pred["host_s"], "device_s": pred["device_s"],
                    "memory_allocated": pred["memory_bytes"]["allocated"], "peak_measured": r.get("peak_mem_bytes")})
    return out


def h200_moe_table(data_dir: str = H200_MOE_FINAL) -> None:
    import json
    from pathlib import Path

    measured = {r["name"]: r for r in json.loads((Path(data_dir) / "moe_steps.json").read_text())["rows"]
                if r.get("step_s_median")}
    print("\n| MoE row (H200 twin, seq 4096) | measured s | predicted s | error | stated dropless C / (T k / E) | predicted host / "
          "device s | GPU busy s (profiled) | predicted / measured peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    rows = h200_moe_rows(data_dir)
    for r in rows:
        print(f"| {r['name']} | {r['measured_s']:.4f} | {r['predicted_s']:.4f} | {100 * r['error']:+.1f}% | "
              f"{r['imbalance']:.2f} | {r['host_s']:.4f} / {r['device_s']:.4f} | {r['busy_s'] or 0:.4f} | "
              f"{r['memory_allocated'] / 2**30:.1f} / {(r['peak_measured'] or 0) / 2**30:.1f} |")
    errs = [abs(r["error"]) for r in rows]
    print(f"mean |error| {100 * sum(errs) / len(errs):.1f}%, worst {100 * max(errs):.1f}%, "
          f"{sum(e <= 0.10 for e in errs)} of {len(rows)} within 10%")
    print("\n| shape, micro-batch | slots cap 1.25 s | slots dropless s | grouped GEMM (dropless) s | loop cap 1.25 s | "
          "loop / slots (cap) | slots / grouped (cap; dropless) |")
    print("|---|---|---|---|---|---|---|")
    for key in sorted({n.rsplit("-", 2)[0] for n in measured}):
        get = lambda tag: measured.get(f"{key}-{tag}", {}).get("step_s_median")  # noqa: E731
        cap, drop, grp, loop = get("slots-cap1.25"), get("slots-dropless"), get("grouped-dropless"), get("loop-cap1.25")
        fmt = lambda x: f"{x:.4f}" if x else "-"  # noqa: E731
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
        print(f"| {key} | {fmt(cap)} | {fmt(drop)} | {fmt(grp)} | {fmt(loop)} | {ratio(loop, cap)} | "
              f"{ratio(cap, grp)}; {ratio(drop, grp)} |")


def h200_long_rows(data_dir: str = H200_MOE_DATA) -> list[dict]:
    """Predicted vs measured step time of the dense twin at 16k-64k tokens (long_steps.json; never fitted)."""
    import json
    from pathlib import Path

    out = []
    for r in json.loads((Path(data_dir) / "long_steps.json").read_text())["rows"]:
        if not r.get("step_s_median"):
            continue
        pred = _row(h200_overrides(r["arch"], r["micro_batch"], r["recompute"]))
        out.append({"name": r["name"], "measured_s": r["step_s_median"], "predicted_s": pred["step_time_s"],
                    "error": pred["step_time_s"] / r["step_s_median"] - 1, "busy_s": r.get("kernel_time_s"),
                    "memory_allocated": pred["memory_bytes"]["allocated"], "peak_measured": r.get("peak_mem_bytes")})
    return out


def h200_long_table(data_dir: str = H200_MOE_DATA) -> None:
    rows = h200_long_rows(data_dir)
    print("\n| long row (H200 twin, one micro-batch) | measured s | predicted s | error | GPU busy s (profiled) | "
          "predicted allocated / measured peak GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['measured_s']:.4f} | {r['predicted_s']:.4f} | {100 * r['error']:+.1f}% | "
              f"{r['busy_s'] or 0:.4f} | {r['memory_allocated'] / 2**30:.1f} / {(r['peak_measured'] or 0) / 2**30:.1f} |")
    errs = [abs(r["error"]) for r in rows]
    print(f"mean |error| {100 * sum(errs) / len(errs):.1f}%, worst {100 * max(errs):.1f}%, "
          f"{sum(e <= 0.10 for e in errs)} of {len(rows)} within 10%")


LONG_CP_MODEL = ["model=llama-7b", "model.vocab_size=32000", "model.attention=flash", "train.amp=bf16"]


def long_cp_rows(seqs=(32768, 131072), devices=(8, 64)) -> list[dict]:
    """The planner's best layouts for llama-7b at long sequences on h200 nodes (global batch = devices): the best
    that fits without context parallelism and the best with cp for each exchange (`rank_layouts(context=True)`;
    needs parallel.cp). Predictions only: no multi-GPU step was measured."""
    from llmtrain.plan.model import planned_model
    from llmtrain.plan.search import rank_layouts

    out = []
    for s in seqs:
        for n in devices:
            cfg = to_config(compose_config(LONG_CP_MODEL + [f"data.seq_len={s}", f"train.global_batch_size={n}",
                                                            f"plan.devices={n}", "plan.device=h200"]))
            rows = [r for r in rank_layouts(cfg, planned_model(cfg), context=True) if r["fits"] and r["runnable"]]
            best = {"none": next((r for r in rows if r["cp"] == 1), None)}
            for comm in ("ring", "allgather", "a2a"):
                best[comm] = next((r for r in rows if r["cp"] > 1 and r["cp_comm"] == comm), None)
            out.append({"seq": s, "devices": n, "best": best})
    return out


def long_cp_table() -> None:
    print("\n| llama-7b, h200 | best without cp | best with cp, ring | all-gather | all-to-all (a2a) |")
    print("|---|---|---|---|---|")
    cell = lambda r: "-" if r is None else (  # noqa: E731
        f"{r['name']} mb{r['micro_batch']}{' recompute' if r['recompute'] else ''}: {r['step_time_s']:.2f} s, "
        f"{r['tokens_per_sec_per_device']:.0f} tok/s/dev, {r['memory_bytes']['total'] / 2**30:.0f} GiB"
        + (f", cp exposed {r['cp_comm_s']:.2f} s" if r["cp"] > 1 else ""))
    for row in long_cp_rows():
        b = row["best"]
        print(f"| seq {row['seq'] // 1024}k, {row['devices']} GPUs | {cell(b['none'])} | {cell(b['ring'])} | "
              f"{cell(b['allgather'])} | {cell(b['a2a'])} |")


if __name__ == "__main__":
    register_configs()
    if "--long-cp" in sys.argv:
        long_cp_table()
    if "--h200-moe" in sys.argv:
        h200_moe_table()
    if "--h200-long" in sys.argv:
        h200_long_table()
    if not {"--cpu-only", "--h200-only", "--h200-moe", "--h200-long", "--long-cp"} & set(sys.argv):
        main()
        megatron_table()
        ratio_table()
    for flag in ("--h200", "--h200-only"):
        if flag in sys.argv:
            i = sys.argv.index(flag)
            h200_table(sys.argv[i + 1] if i + 1 < len(sys.argv) and not sys.argv[i + 1].startswith("--") else H200_DATA)
    if "--cpu" in sys.argv or "--cpu-only" in sys.argv:
        n = int(sys.argv[sys.argv.index("--passes") + 1]) if "--passes" in sys.argv else 1
        cpu_table(run="--no-run" not in sys.argv, passes=n, calibrate_each="--calibrate-each-pass" in sys.argv)
