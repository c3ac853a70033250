"""The GPU acceptance run behind scripts/gpu_acceptance.sh: build the steps, run them, write the report.

    bash scripts/gpu_acceptance.sh                       # 8 GPUs of this node, report in work/gpu_acceptance/
    bash scripts/gpu_acceptance.sh --gpus 4 --device h100 --steps 40
    bash scripts/gpu_acceptance.sh --dry-run             # print the exact commands, run nothing (works on CPU)

Steps, in order (each one's output in OUT/<step>.log; a failed step is reported and the run goes on):
  env               Paddle version, CUDA, visible GPUs (OUT/env.json)
  fused_kernels     tests/models/test_fused.py on GPU: every model.fuse_* path equals its unfused reference
                    (fp32, forward and gradients; fuse_rms_norm and fuse_rope are checked only here)
  parity_fp32       tests/parallel/test_parity.py over NCCL: every CI layout (2 and 4 processes) against one
                    process, fp32 with TF32 off, |loss or grad_norm difference| <= PARITY_TOL["fp32"]
  parity_bf16       the same with train.amp=bf16 (flash attention, fused kernels, O2), bound PARITY_TOL["bf16"]
  paddlenlp_logits  our logits against PaddleNLP's GPT/Llama/ERNIE on the same weights (<= 1e-4, fp32, TF32 off)
  gpu_paths         tests/gpu_paths on GPU: every GPU-only branch of the README's list (`GPU_PATHS`) with the real
                    kernels, compared with the CPU references its rehearsal uses on CPU
  moe_router_dtype  tests/models/test_moe_precision.py on GPU under real AMP O2 bf16: the MoE router GEMM's output
                    fp32 (bf16 with model.moe_router_dtype=amp), its weight and the expert bias kept fp32 by decorate,
                    the fused combine summing bf16 expert outputs in fp32 (rounded once)
  memory_levers     tests/models/test_recompute.py and tests/paddle_compat/test_host_offload.py on GPU: every recompute
                    mode equal to none, the optimizer state in pinned host memory between steps, a recomputed block's
                    input offloaded and prefetched (training unchanged)
  corpus            scripts/prepare_default_corpus.sh (the People's Daily corpus and tokenizer, CPU, idempotent)
  sft_data          question/answer pairs cut from that corpus (llmtrain.corpus.qa_pairs), for finetune_packed
  finetune_packed   packed fine-tuning on 2 GPUs with the GPU defaults (model.attention=auto -> flashmask with the
                    examples' segment ids, bf16, fused kernels): 20 steps that must run to the end (before commit
                    93a94ac this crashed at the first forward)
  fp16_overflow     tiny Llama, train.amp=fp16 with the dynamic GradScaler on 2 GPUs; rank 1's gradients of step 3
                    poisoned (tests/train/faults.py): step 3 must be a loss-scale overflow, the scale must halve and
                    the run go on to its last step (checked by `check_fp16_overflow`)
  ep_alltoall       moe-tiny under +parallel=ep2 on 2 GPUs, fp32 (TF32 off), once with the all-gather dispatcher and
                    once with parallel.ep_dispatcher=alltoall (NCCL all-to-all): every step's loss and grad norm
                    within PARITY_TOL["fp32"] of each other (checked by `check_ep_alltoall`)
  cp_exchanges      llama-tiny under +parallel=cp2 on 2 GPUs: the ring in fp32 (NCCL collectives, math blocks), then
                    each exchange (ring, allgather, a2a) in bf16 (flash blocks, flashmask chunks, the flash core under
                    a2a): every step's loss and grad norm of each bf16 run within PARITY_TOL["bf16"] of the fp32
                    ring's (checked by `check_cp_exchanges`)
  fp8_vs_bf16       llama-tiny (ffn 384: every GEMM side a multiple of 128) under +parallel=dp2 on 2 GPUs, bf16, once
                    plain and once with train.fp8=blockwise (Paddle's FP8 kernels): the FP8 run's loss within FP8_GAP of
                    the bf16 run's, mean over the last 10 steps, and no FP8 anomaly (checked by `check_fp8_vs_bf16`)
  plan_<layout>     python -m llmtrain.plan for the layout (predicted tokens/s, MFU, memory), before its run
  tput_<layout>     tinyllama-1.1b, bf16, seq 2048, global batch 64, --steps steps, per recommended layout
  report            OUT/report.md and OUT/report.json: every step's status, measured beside predicted, and what
                    this run could not check
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARITY_TOL = {"fp32": 5e-5, "bf16": 5e-2}
"""Bounds on |loss or grad_norm - one process| per step over NCCL. fp32: CPU/gloo agrees within 1e-6 (bound 1e-5);
cuBLAS picks shape-dependent kernels, so a tp-split matmul sums in another order: 5e-5, not yet measured on a GPU.
bf16: 8 mantissa bits (one ulp of a loss near 8 is 0.03), reductions in other orders: 5e-2, not yet measured."""
FOUR_PROC = ("dp4", "dp2tp2", "tp2pp2", "dp2pp2", "tp2sharding2", "pp4v2", "sharding2pp2", "pp4dpv")
PROCESSES = {"pp3": 3, "pp3v2": 3, **{name: 4 for name in FOUR_PROC}}
"""Parity layouts of more than two processes -> how many they need (the rest need 2)."""
THROUGHPUT = ["model=tinyllama-1.1b", "train.amp=bf16", "data.seq_len=2048", "train.global_batch_size=64",
              "train.micro_batch_size=1", "train.progress_bar=false", "train.visualdl=false",
              "checkpoint.save_final=false", "checkpoint.interval=0", "checkpoint.resume=none"]
GPU_PATHS = {
    "alltoall-dispatch": ["ep_alltoall"],
    "amp-fp16": ["gpu_paths", "fp16_overflow", "parity_bf16"],
    "async-save-device-copy": ["gpu_paths"],
    "cp-flash": ["gpu_paths", "cp_exchanges"],
    "cp-nccl-collectives": ["gpu_paths", "cp_exchanges"],
    "cp-ring-flash": ["gpu_paths", "cp_exchanges"],
    "flash-attention": ["gpu_paths", "parity_bf16", "tput_auto"],
    "flash-attn-v3": ["gpu_paths"],
    "fp8-blockwise": ["gpu_paths", "fp8_vs_bf16"],
    "flashmask": ["gpu_paths", "finetune_packed"],
    "flashmask-window": ["gpu_paths"],
    "fleet-nccl": ["gpu_paths", "parity_fp32", "parity_bf16"],
    "fused-rms-norm": ["gpu_paths", "fused_kernels", "parity_fp32", "parity_bf16", "finetune_packed"],
    "fused-rope": ["gpu_paths", "fused_kernels", "parity_fp32", "parity_bf16", "finetune_packed"],
    "fused-rope-scaled": ["gpu_paths"],
    "memory-metrics": ["gpu_paths", "tput_auto"],
    "mla-value-pad": ["gpu_paths"],
    "moe-combine": ["gpu_paths", "ep_alltoall", "moe_router_dtype"],
    "offload": ["gpu_paths", "memory_levers"],
    "overlap-knobs": ["gpu_paths", "tput_dp4tp2", "tput_dp2tp2pp2"],  # the step names of an 8-GPU run
    "peak-table": ["gpu_paths", "tput_auto"],
}
"""Every GPU-only branch (`# GPU-ONLY(<id>)` in llmtrain/, the README's and docs/gpus.md's lists) -> the steps that
run it here (Llama runs use the fused norm and RoPE, on by default on GPU); tests/gpu_paths/test_markers.py keeps
the keys equal to the marked branches and the steps equal to docs/gpus.md's."""
FP16_STEPS = 6
NOT_CHECKED = [
    "8-process layouts against one process (dp8, tp8, dp2tp2pp2): checked once on CPU, not in the parity suite",
    "more than one node (NCCL over the network): scripts/launch_multinode.sh is tested on CPU only",
    "fp16 with the dynamic GradScaler beyond the tiny fp16_overflow run (no parity or throughput run in fp16)",
    "sequence parallelism (parallel.sequence_parallel): not implemented in llmtrain yet",
    "parallel.sharding_tensor_fusion without sharding_split_param: refused by llmtrain's config checks (see "
    "llmtrain/parallel/config.py), so never run; the fused-buffer knobs run in the parity steps (sharding2v2, "
    "dp2pp2's llama_dpov) but in no throughput step",
    "throughput of layouts other than the ones listed, and of models other than tinyllama-1.1b",
]


def layouts(n: int) -> dict[str, list[str]]:
    """Recommended layouts for n GPUs of one node: name -> `+parallel=` overrides."""
    out = {
        f"dp{n}": ["+parallel=dp2", f"parallel.dp={n}", f"parallel.name=dp{n}"],
        f"sharding{n}": ["+parallel=sharding2", f"parallel.sharding={n}", f"parallel.name=sharding{n}"],
        f"sharding{n}s3": ["+parallel=zero3", f"parallel.sharding={n}", f"parallel.name=sharding{n}s3"],
    }
    if n >= 4:
        out[f"dp{n // 2}tp2"] = ["+parallel=dp2tp2", f"parallel.dp={n // 2}", f"parallel.name=dp{n // 2}tp2",
                                 "parallel.mp_async_allreduce=true"]
        out[f"dp{n // 4}tp2pp2"] = ["+parallel=tp2pp2", f"parallel.dp={n // 4}", f"parallel.name=dp{n // 4}tp2pp2",
                                    "parallel.mp_async_allreduce=true", "parallel.pp_overlap_p2p_comm=true"]
    out["auto"] = ["+parallel=auto"]
    return out


def detect_device() -> str | None:
    """The planner's device name for GPU 0 (the profile whose `match` its name holds, llmtrain/plan/profiles/), or
    None off GPU / when unknown."""
    try:
        import paddle

        if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
            return None
        name = paddle.device.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 -- no usable CUDA
        return None
    from llmtrain.plan.profile import datasheet_peak

    found = datasheet_peak(name)
    return None if found is None else found[1]


def steps(out: Path, gpus: int, device: str, n_steps: int) -> list[dict]:
    """Every step: name, argv, extra environment, and where its stdout goes."""
    py = sys.executable
    nccl_fp32 = {"NVIDIA_TF32_OVERRIDE": "0"}
    parity_k = "test_layout_matches_single_process"
    too_big = [name for name, n in PROCESSES.items() if n > gpus]
    if too_big:
        parity_k += " and not (" + " or ".join(too_big) + ")"
    parity = [py, "-m", "pytest", "tests/parallel/test_parity.py", "-q", "-k", parity_k, "-p", "no:cacheprovider"]
    s = [
        dict(name="env", argv=[py, str(REPO / "scripts/gpu_acceptance.py"), "env", str(out / "env.json")], env={}),
        dict(name="fused_kernels", argv=[py, "-m", "pytest", "tests/models/test_fused.py", "-q", "-p", "no:cacheprovider"],
             env=nccl_fp32),
        dict(name="parity_fp32", argv=parity, env=nccl_fp32 | {"LLMTRAIN_PARITY_TOL": str(PARITY_TOL["fp32"])}),
        dict(name="parity_bf16", argv=parity, env={"LLMTRAIN_PARITY_TOL": str(PARITY_TOL["bf16"]),
                                                   "LLMTRAIN_PARITY_OVERRIDES": "train.amp=bf16"}),
        dict(name="paddlenlp_logits", argv=[py, "-m", "pytest", "tests/interop/test_import_paddlenlp.py",
                                            "tests/interop/test_export_paddlenlp.py", "tests/interop/test_ernie_import.py",
                                            "-q", "-p", "no:cacheprovider"], env=nccl_fp32),
        dict(name="gpu_paths", argv=[py, "-m", "pytest", "tests/gpu_paths", "-q", "-p", "no:cacheprovider"],
             env=nccl_fp32),
        dict(name="moe_router_dtype", argv=[py, "-m", "pytest", "tests/models/test_moe_precision.py", "-q", "-p",
                                            "no:cacheprovider"], env={}),
        dict(name="memory_levers", argv=[py, "-m", "pytest", "tests/models/test_recompute.py",
                                         "tests/paddle_compat/test_host_offload.py", "-q", "-p", "no:cacheprovider"],
             env=nccl_fp32),
        dict(name="corpus", argv=["bash", "scripts/prepare_default_corpus.sh"], env={}),
        dict(name="sft_data", argv=[py, "-m", "llmtrain.corpus.qa_pairs", "--input", str(CORPUS / "pd1998.jsonl"),
                                    "--output", str(out / "sft"), "--valid", "50", "--max-lines", "2"], env={}),
        dict(name="finetune_packed", argv=[
            py, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(out / "finetune_packed" / "log"),
            "llmtrain/finetune.py", *finetune_packed_overrides(out)], env={}),
        dict(name="fp16_overflow", argv=[py, str(REPO / "scripts/gpu_acceptance.py"), "fp16-overflow", str(out)], env={}),
        dict(name="ep_alltoall", argv=[py, str(REPO / "scripts/gpu_acceptance.py"), "ep-alltoall", str(out)],
             env=nccl_fp32),
        dict(name="cp_exchanges", argv=[py, str(REPO / "scripts/gpu_acceptance.py"), "cp-exchanges", str(out)],
             env=nccl_fp32),
        dict(name="fp8_vs_bf16", argv=[py, str(REPO / "scripts/gpu_acceptance.py"), "fp8-vs-bf16", str(out)], env={}),
    ]
    run = THROUGHPUT + [f"train.max_steps={n_steps}", f"train.log_interval={max(1, n_steps // 3)}"]
    for name, par in layouts(gpus).items():
        plan_layout = ["plan.top=1"] if name == "auto" else par  # auto: the planner's first choice
        s.append(dict(name=f"plan_{name}", argv=[py, "-m", "llmtrain.plan", *THROUGHPUT, *plan_layout,
                                                  f"plan.devices={gpus}", f"plan.device={device}", "plan.format=json"],
                      env={}, stdout=str(out / "throughput" / name / "plan.json")))
        env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if "parallel.mp_async_allreduce=true" in par else {}
        s.append(dict(name=f"tput_{name}", argv=[
            py, "-m", "paddle.distributed.launch", "--nproc_per_node", str(gpus),
            "--log_dir", str(out / "throughput" / name / "log"), "llmtrain/pretrain.py", *run, *par,
            f"plan.device={device}", f"run.dir={out / 'throughput' / name}"], env=env))
    return s


CORPUS = REPO / "work" / "pd1998"
"""Where scripts/prepare_default_corpus.sh (the `corpus` step) writes the corpus and its tokenizer."""


def finetune_packed_overrides(out: Path) -> list[str]:
    """Packed fine-tuning of a randomly initialised tiny Llama (RoPE, GQA) with every GPU default left on."""
    return ["+parallel=dp2", "model=llama-tiny", "model.attention=auto", f"data.files=[{out / 'sft' / 'train.jsonl'}]",
            f"data.tokenizer={CORPUS / 'tokenizer'}", "data.seq_len=256", "data.packing=true", "train.amp=bf16",
            "train.max_steps=20", "train.global_batch_size=16", "train.micro_batch_size=4", "train.log_interval=5",
            "train.progress_bar=false", "train.visualdl=false", "checkpoint.save_final=false", "checkpoint.interval=0",
            "checkpoint.resume=none", f"run.dir={out / 'finetune_packed'}"]


def fp16_overflow_runs(out: Path) -> list[dict]:
    """tests/e2e/multirun_worker.py entries: poison rank 1's gradients of step 3, then one fp16 run."""
    overrides = ["+parallel=dp2", "model=llama-tiny", "train.amp=fp16", "data.seq_len=256",
                 f"train.max_steps={FP16_STEPS}", "train.global_batch_size=16", "train.micro_batch_size=4",
                 "train.log_interval=1", "train.progress_bar=false", "train.visualdl=false",
                 "checkpoint.save_final=false", "checkpoint.interval=0", "checkpoint.resume=none",
                 f"run.dir={out / 'fp16_overflow'}"]
    return [{"call": "tests/train/faults.py:poison_grads", "args": [3, 1]}, {"overrides": overrides}]


def check_fp16_overflow(run_dir: Path) -> list[str]:
    """What the fp16_overflow run's metrics.jsonl must show: step 3 an overflow, the loss scale halved there, every
    step logged with a finite loss and no stop."""
    try:
        recs = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]
    except OSError as e:
        return [f"metrics: {e}"]
    steps = {r["step"]: r for r in recs if "loss" in r}
    problems = []
    if sorted(steps) != list(range(1, FP16_STEPS + 1)):
        problems.append(f"logged steps {sorted(steps)}, expected 1..{FP16_STEPS}")
    if any(r.get("event") == "stopped" for r in recs):
        problems.append("the run stopped (an anomaly): " + json.dumps([r for r in recs if r.get("event") == "stopped"]))
    if 2 in steps and 3 in steps:
        if not steps[3].get("loss_scale_overflow"):
            problems.append(f"step 3 not counted as a loss-scale overflow: {steps[3]}")
        before, after = steps[2].get("loss_scale"), steps[3].get("loss_scale")
        if before is None or after is None or after != before / 2:
            problems.append(f"loss scale {before} at step 2 -> {after} at step 3: expected it to halve")
    bad = [s for s, r in steps.items() if not isinstance(r["loss"], (int, float)) or r["loss"] != r["loss"]]
    if bad:
        problems.append(f"non-finite loss at steps {bad}")
    return problems


EP_STEPS = 6


def ep_alltoall_runs(out: Path) -> list[dict]:
    """tests/e2e/multirun_worker.py entries: the same moe-tiny ep2 run with each dispatcher (one fleet layout)."""
    def run(dispatcher):
        return {"overrides": ["+parallel=ep2", "model=moe-tiny", f"parallel.ep_dispatcher={dispatcher}",
                              "data.seq_len=256", f"train.max_steps={EP_STEPS}", "train.global_batch_size=8",
                              "train.micro_batch_size=4", "train.log_interval=1", "train.progress_bar=false",
                              "train.visualdl=false", "checkpoint.save_final=false", "checkpoint.interval=0",
                              "checkpoint.resume=none", f"run.dir={out / 'ep_alltoall' / dispatcher}"]}
    return [run("allgather"), run("alltoall")]


def check_ep_alltoall(run_dir: Path) -> list[str]:
    """Per-step loss and grad norm of the alltoall run within PARITY_TOL["fp32"] of the allgather run's."""
    try:
        recs = {d: [json.loads(line) for line in open(run_dir / d / "metrics.jsonl") if '"loss"' in line]
                for d in ("allgather", "alltoall")}
    except OSError as e:
        return [f"metrics: {e}"]
    if [r["step"] for r in recs["alltoall"]] != [r["step"] for r in recs["allgather"]] or not recs["alltoall"]:
        return [f"steps differ: {[r['step'] for r in recs['allgather']]} vs {[r['step'] for r in recs['alltoall']]}"]
    problems = []
    for a, b in zip(recs["allgather"], recs["alltoall"]):
        for key in ("loss", "grad_norm"):
            if abs(a[key] - b[key]) > PARITY_TOL["fp32"]:
                problems.append(f"step {a['step']} {key}: allgather {a[key]} alltoall {b[key]}")
    return problems


CP_COMMS = ("ring", "allgather", "a2a")


def cp_exchanges_runs(out: Path) -> list[dict]:
    """tests/e2e/multirun_worker.py entries: llama-tiny under cp2, the ring in fp32 (NCCL collectives, math blocks),
    then each exchange in bf16 (flash blocks, flashmask chunks, the flash core under a2a); one layout."""
    def run(comm, amp):
        return {"overrides": ["+parallel=cp2", "model=llama-tiny", f"parallel.cp_comm={comm}",
                              "train.amp=" + ("none" if amp == "fp32" else amp),
                              "data.seq_len=1024", f"train.max_steps={EP_STEPS}", "train.global_batch_size=8",
                              "train.micro_batch_size=4", "train.log_interval=1", "train.progress_bar=false",
                              "train.visualdl=false", "checkpoint.save_final=false", "checkpoint.interval=0",
                              "checkpoint.resume=none", f"run.dir={out / 'cp_exchanges' / f'{comm}_{amp}'}"]}
    return [run("ring", "fp32")] + [run(comm, "bf16") for comm in CP_COMMS]


def check_cp_exchanges(run_dir: Path) -> list[str]:
    """Each bf16 exchange within PARITY_TOL["bf16"] of the fp32 ring, every step."""
    try:
        recs = {d: [json.loads(line) for line in open(run_dir / d / "metrics.jsonl") if '"loss"' in line]
                for d in ["ring_fp32"] + [f"{c}_bf16" for c in CP_COMMS]}
    except OSError as e:
        return [f"metrics: {e}"]
    base = recs["ring_fp32"]
    problems = []
    for name, got in recs.items():
        if [r["step"] for r in got] != [r["step"] for r in base] or not got:
            problems.append(f"{name}: steps {[r['step'] for r in got]}, ring_fp32 {[r['step'] for r in base]}")
            continue
        tol = PARITY_TOL[name.split("_")[1]]
        for a, b in zip(base, got):
            for key in ("loss", "grad_norm"):
                if abs(a[key] - b[key]) > tol:
                    problems.append(f"step {a['step']} {key}: ring_fp32 {a[key]} {name} {b[key]} (bound {tol})")
    return problems


FP8_STEPS = 60
FP8_GAP = 0.1
"""Bound on the mean |FP8 loss - bf16 loss| (nats) over the last 10 of FP8_STEPS steps. On CPU the emulated blockwise
recipe stayed within ~0.03 of fp32 on llama-tiny (benchmarks/README.md, FP8); the GPU adds bf16 rounding on both
sides: 0.1, not yet measured on a GPU."""


def fp8_vs_bf16_runs(out: Path) -> list[dict]:
    """tests/e2e/multirun_worker.py entries: the same bf16 run without and with train.fp8=blockwise (one layout)."""
    def run(fp8):
        return {"overrides": ["+parallel=dp2", "model=llama-tiny", "model.ffn_hidden_size=384", "train.amp=bf16",
                              f"train.fp8={fp8}", "data.seq_len=256", f"train.max_steps={FP8_STEPS}",
                              "train.global_batch_size=16", "train.micro_batch_size=4", "train.log_interval=1",
                              "train.progress_bar=false", "train.visualdl=false", "checkpoint.save_final=false",
                              "checkpoint.interval=0", "checkpoint.resume=none", f"run.dir={out / 'fp8_vs_bf16' / fp8}"]}
    return [run("none"), run("blockwise")]


def check_fp8_vs_bf16(run_dir: Path) -> list[str]:
    """Every step logged in both runs, no anomaly in the FP8 run, the mean loss gap of the last 10 steps <= FP8_GAP."""
    try:
        recs = {d: [json.loads(line) for line in open(run_dir / d / "metrics.jsonl") if line.strip()]
                for d in ("none", "blockwise")}
    except OSError as e:
        return [f"metrics: {e}"]
    loss = {d: {r["step"]: r["loss"] for r in rs if "loss" in r} for d, rs in recs.items()}
    if sorted(loss["none"]) != sorted(loss["blockwise"]) or len(loss["none"]) != FP8_STEPS:
        return [f"steps differ: {sorted(loss['none'])} vs {sorted(loss['blockwise'])}"]
    problems = [f"FP8 run: {r.get('anomaly')} at step {r['step']}" for r in recs["blockwise"] if r.get("anomaly")]
    last = sorted(loss["none"])[-10:]
    gap = sum(abs(loss["blockwise"][s] - loss["none"][s]) for s in last) / len(last)
    if not gap <= FP8_GAP:
        problems.append(f"mean |FP8 - bf16| loss over steps {last[0]}..{last[-1]}: {gap:.4f} > {FP8_GAP}")
    print(f"fp8_vs_bf16: mean |FP8 - bf16| loss over the last 10 steps {gap:.4f} (bound {FP8_GAP})")
    return problems


def run_multirun(out: Path, name: str, runs: list[dict], check) -> int:
    """Write `runs` to OUT/<name>/runs.json, launch them on 2 GPUs, then `check(OUT/<name>)` (exit 0: no problem)."""
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = run_dir / "runs.json"
    spec.write_text(json.dumps(runs, indent=1))
    argv = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(run_dir / "log"),
            str(REPO / "tests/e2e/multirun_worker.py"), str(spec)]
    print(" ".join(shlex.quote(a) for a in argv), flush=True)
    rc = subprocess.run(argv, cwd=REPO).returncode
    problems = check(run_dir) if rc == 0 else [f"the launch exited {rc} (see {run_dir / 'log'})"]
    print("\n".join(problems) or f"{name}: every check held")
    return 1 if problems else 0


def shell_line(step: dict) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in step["env"].items())
    line = " ".join(shlex.quote(a) for a in step["argv"])
    redirect = f" > {shlex.quote(step['stdout'])}" if step.get("stdout") else ""
    return f"{env + ' ' if env else ''}{line}{redirect}"


def run_step(step: dict, out: Path) -> dict:
    log = out / f"{step['name']}.log"
    start = time.time()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.update(step["env"])
    with open(log, "w") as lf:
        lf.write(shell_line(step) + "\n")
        lf.flush()
        if step.get("stdout"):
            Path(step["stdout"]).parent.mkdir(parents=True, exist_ok=True)
            with open(step["stdout"], "w") as so:
                rc = subprocess.run(step["argv"], cwd=REPO, env=env, stdout=so, stderr=lf).returncode
        else:
            rc = subprocess.run(step["argv"], cwd=REPO, env=env, stdout=lf, stderr=subprocess.STDOUT).returncode
    return {"name": step["name"], "command": shell_line(step), "exit": rc, "seconds": round(time.time() - start, 1),
            "log": str(log)}


def write_env(path: str) -> None:
    import paddle

    info = {"paddle": paddle.__version__, "cuda_compiled": paddle.is_compiled_with_cuda(),
            "device": paddle.get_device(), "cuda": paddle.version.cuda(), "cudnn": paddle.version.cudnn()}
    if info["cuda_compiled"]:
        n = paddle.device.cuda.device_count()
        info["gpus"] = [paddle.device.cuda.get_device_name(i) for i in range(n)]
    Path(path).write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1))
    if not info["cuda_compiled"] or not info.get("gpus"):
        sys.exit(1)


def throughput_row(run_dir: Path) -> dict:
    """Measured (metrics.jsonl after the first logging window, memory.json) beside the planner's prediction."""
    row: dict = {"layout": run_dir.name}
    try:
        recs = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]
        steady = recs[1:] or recs
        row["tokens_per_sec_per_device"] = sum(r["tokens_per_sec_per_device"] for r in steady) / len(steady)
        mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
        row["mfu"] = sum(mfus) / len(mfus) if mfus else None
        row["max_memory_allocated_gib"] = max(r.get("max_memory_allocated", 0) for r in recs) / 2**30
    except (OSError, KeyError, ValueError, ZeroDivisionError) as e:
        row["error"] = f"metrics: {e}"
    try:
        d = json.load(open(run_dir / "memory.json"))["layout"]  # the degrees the run really used (auto too)
        row["degrees"] = f"dp{d['dp']} tp{d['tp']} pp{d['pp']} sharding{d['sharding']} stage{d['sharding_stage']}"
    except (OSError, ValueError, KeyError):
        pass
    try:
        pred = json.load(open(run_dir / "plan.json"))[0]
        row["predicted_layout"] = pred.get("name")
        row["predicted_tokens_per_sec_per_device"] = pred["tokens_per_sec_per_device"]
        row["predicted_mfu"] = pred["mfu"]
        row["predicted_memory_gib"] = pred["memory_bytes"]["total"] / 2**30
    except (OSError, ValueError, KeyError, IndexError) as e:
        row["predicted_error"] = str(e)
    return row


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def write_report(out: Path, results: list[dict], gpus: int, device: str) -> int:
    rows = [throughput_row(d) for d in sorted((out / "throughput").glob("*")) if d.is_dir()]
    failed = [r["name"] for r in results if r["exit"] != 0]
    report = {"gpus": gpus, "device": device, "parity_tolerance": PARITY_TOL, "steps": results,
              "throughput": rows, "failed": failed, "not_checked": NOT_CHECKED}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    lines = [f"# llmtrain GPU acceptance: {gpus} x {device}", "",
             f"Parity bounds per step: fp32 {PARITY_TOL['fp32']:g}, bf16 {PARITY_TOL['bf16']:g}.", "",
             "| step | exit | seconds | log |", "|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['exit']} | {r['seconds']} | {r['log']} |" for r in results]
    lines += ["", "## tinyllama-1.1b throughput (bf16, seq 2048, global batch 64): measured beside predicted", "",
              "| layout | degrees run | tokens/s/device | MFU | max memory allocated GiB | predicted tokens/s/device "
              "| predicted MFU | predicted memory GiB (worst rank) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r.get('degrees', '-')} | {_fmt(r.get('tokens_per_sec_per_device'), '.0f')} | "
                     f"{_fmt(r.get('mfu'), '.3f')} | {_fmt(r.get('max_memory_allocated_gib'), '.1f')} | "
                     f"{_fmt(r.get('predicted_tokens_per_sec_per_device'), '.0f')} | {_fmt(r.get('predicted_mfu'), '.3f')} | "
                     f"{_fmt(r.get('predicted_memory_gib'), '.1f')} |")
    lines += ["", "## Not checked by this run", ""] + [f"- {x}" for x in NOT_CHECKED]
    lines += [f"- step {name} failed: see its log" for name in failed]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["env"]:
        write_env(argv[1])
        return 0
    if argv[:1] == ["fp16-overflow"]:
        return run_multirun(Path(argv[1]), "fp16_overflow", fp16_overflow_runs(Path(argv[1])), check_fp16_overflow)
    if argv[:1] == ["fp8-vs-bf16"]:
        return run_multirun(Path(argv[1]), "fp8_vs_bf16", fp8_vs_bf16_runs(Path(argv[1])), check_fp8_vs_bf16)
    if argv[:1] == ["ep-alltoall"]:
        return run_multirun(Path(argv[1]), "ep_alltoall", ep_alltoall_runs(Path(argv[1])), check_ep_alltoall)
    if argv[:1] == ["cp-exchanges"]:
        return run_multirun(Path(argv[1]), "cp_exchanges", cp_exchanges_runs(Path(argv[1])), check_cp_exchanges)
    ap = argparse.ArgumentParser(prog="scripts/gpu_acceptance.sh")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs of this node to use (default 8; at least 2)")
    ap.add_argument("--device", default="auto", help="planner device profile (a100-80g, h100, ...; default: detected)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per throughput run (default 30)")
    ap.add_argument("--out", default=str(REPO / "work" / "gpu_acceptance"), help="report directory")
    ap.add_argument("--only", default="", help="comma-separated step names to run (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="print the exact commands and exit 0")
    a = ap.parse_args(argv)
    if a.gpus < 2:
        ap.error(f"--gpus {a.gpus}: the parity suite needs at least 2 GPUs")
    device = a.device
    if device == "auto":
        device = detect_device()
        if device is None:
            device = "a100-80g"
            print(f"# no known GPU detected: planner profile {device} (pass --device)")
    out = Path(a.out).resolve()
    todo = steps(out, a.gpus, device, a.steps)
    if a.only:
        keep = set(a.only.split(","))
        todo = [s for s in todo if s["name"] in keep]
    if a.dry_run:
        print(f"# cd {REPO}; every command runs with PYTHONPATH={REPO}")
        for s in todo:
            print(f"# {s['name']}\n{shell_line(s)}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for s in todo:
        print(f"== {s['name']}: {shell_line(s)}", flush=True)
        results.append(run_step(s, out))
        print(f"   exit {results[-1]['exit']} after {results[-1]['seconds']} s (log {results[-1]['log']})", flush=True)
        if s["name"] == "env" and results[-1]["exit"] != 0:
            print("   no usable GPU (see env.json): nothing else is run", flush=True)
            break
    return write_report(out, results, a.gpus, device)


if __name__ == "__main__":
    sys.exit(main())
