"""Fine-tuning benchmarks: LoRA vs full-parameter memory and speed, and packing efficiency vs padding.

    scripts/prepare_default_corpus.sh                      # work/pd1998/ (tokenizer, articles)
    python benchmarks/finetune.py --part lora [--model gpt2-small] [--steps 4] [--seq 128] [--rank 8]
    python benchmarks/finetune.py --part packing [--seq 512,1024,2048]

--part lora: two real `llmtrain/finetune.py` runs on one CPU process (full fine-tuning, then LoRA
with `finetune.lora.rank` on every block linear), same SFT data and batch; reads what the rank
held after step 1 (`memory.json`: parameters, optimizer state, gradients, measured on the built
objects) and the median tokens/s of steps 2.. (`metrics.jsonl`: loss-bearing response tokens per
second). The base is randomly initialised: memory and speed do not depend on the weights. Also
prints the same accounting computed (not measured) for llama-7b in bf16 with fp32 master weights.

--part packing: the fraction of processed positions that hold a real token (real / positions),
one example per padded row vs `data.packing=true` (best-fit-decreasing rows,
`llmtrain.data.sft.pack_examples`), on two length distributions tokenized with the corpus's
tokenizer: (a) question/answer pairs cut from People's Daily articles (prompt: an article's first
line; response: the next 1-8 lines, count drawn uniformly), (b) a heavy-tailed chat-like
distribution: prompt and response token counts log-normal with medians 40 and 120 tokens and
sigma 1.0 (our assumption of a typical instruction/chat mix, not a measured dataset), cut at the
row length like the trainer does.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
CORPUS = os.environ.get("LLMTRAIN_PD1998", os.path.join(REPO, "work", "pd1998"))  # scripts/prepare_default_corpus.sh


def qa_records(n: int, seed: int = 0) -> list[dict]:
    """Prompt/response pairs from the embedded corpus's articles (real text lengths; `llmtrain.corpus.qa_pairs`)."""
    from llmtrain.corpus.qa_pairs import qa_records as pairs

    return pairs(os.path.join(CORPUS, "pd1998.jsonl"), n, seed)


def run_finetune(args, run_dir: str, data_file: str, extra: list[str]) -> tuple[dict, list[dict]]:
    cmd = [sys.executable, os.path.join(REPO, "llmtrain", "finetune.py"), f"model={args.model}",
           f"data.files=[{data_file}]", f"data.tokenizer={os.path.join(CORPUS, 'tokenizer')}",
           f"data.seq_len={args.seq}", f"train.max_steps={args.steps}", "train.global_batch_size=2",
           "train.micro_batch_size=1", "train.progress_bar=false", "train.visualdl=false",
           "checkpoint.save_final=false", "checkpoint.resume=none", "optim.warmup_steps=1",
           f"run.dir={run_dir}", *extra]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "memory.json")) as f:
        mem = json.load(f)["ranks"][0]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(x) for x in f if x.strip()]
    return mem, [r for r in recs if "loss" in r]


def llama7b_prediction(rank: int) -> list[tuple]:
    """(what, full fine-tuning, LoRA) per device for llama-7b on one GPU, bf16 with fp32 master weights, from the
    planner's exact accounting (`llmtrain.plan.memory.predict_ranks`, which equals memory.json under LoRA too)."""
    from types import SimpleNamespace

    from llmtrain.config import compose_config, to_config
    from llmtrain.models.lora import LoraConfig
    from llmtrain.plan.memory import predict_ranks

    cfg = to_config(compose_config(["model=llama-7b", "model.vocab_size=32000"])).model
    one = SimpleNamespace(dp=1, tp=1, pp=1, sharding=1, sharding_stage=1, virtual_pp=1, zero3_segment_size=2**20)
    full = predict_ranks(cfg, one, "bf16", "gpu")[0]
    lora = predict_ranks(cfg, one, "bf16", "gpu", LoraConfig(rank=rank))[0]
    gb = 1e9
    return [("parameters (bf16)", full["param_bytes"] / gb, lora["param_bytes"] / gb),
            ("optimizer state (fp32 master + 2 moments)", full["optimizer_bytes"] / gb, lora["optimizer_bytes"] / gb),
            ("gradients (bf16)", full["grad_bytes"] / gb, lora["grad_bytes"] / gb),
            ("trainable parameters (M)", full["param_numel"] / 1e6, (lora["param_numel"] - full["param_numel"]) / 1e6)]


def part_lora(args) -> None:
    tmp = tempfile.mkdtemp(prefix="bench-ft-")
    data = os.path.join(tmp, "qa.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for r in qa_records(400):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    rows = []
    for name, extra in (("full", ["optim.lr=2e-5"]),
                        (f"LoRA r={args.rank}", [f"finetune.lora.rank={args.rank}", f"finetune.lora.alpha={2 * args.rank}",
                                                 "optim.lr=2e-4"])):
        mem, recs = run_finetune(args, os.path.join(tmp, name.split()[0]), data, extra)
        tps = statistics.median(r["tokens_per_sec"] for r in recs[1:])
        step = statistics.median(r["step_time"] for r in recs[1:])
        trainable = sum(mem["optimizer_params"] and [mem["params"][n]["numel"] for n in mem["optimizer_params"]])
        rows.append((name, mem["param_bytes"] / 2**20, trainable / 1e6, mem["optimizer_bytes"] / 2**20,
                     mem["grad_bytes"] / 2**20, step, tps))
    print(f"\n{args.model}, one CPU process, global batch 2 x seq {args.seq}, {args.steps} steps (median of steps 2..):\n")
    print("| run | parameters MiB | trainable M | optimizer state MiB | gradients MiB | step s | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]:.2f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.2f} | {r[6]:.1f} |")
    print(f"\nLoRA / full: optimizer state {rows[1][3] / rows[0][3]:.4f}, gradients {rows[1][4] / rows[0][4]:.4f}, "
          f"tokens/s {rows[1][6] / rows[0][6]:.2f}")
    part_predict(args)


def part_predict(args) -> None:
    print(f"\nllama-7b on one device, predicted by the planner (not measured), LoRA r={args.rank} on q k v o gate up "
          "down:\n")
    print("| held | full fine-tuning | LoRA |")
    print("|---|---|---|")
    for what, full, lora in llama7b_prediction(args.rank):
        unit = "" if "(M)" in what else " GB"
        print(f"| {what} | {full:.1f}{unit} | {lora:.2f}{unit} |")


def chat_lengths(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    p = np.maximum(1, rng.lognormal(np.log(40), 1.0, n)).astype(int)
    r = np.maximum(1, rng.lognormal(np.log(120), 1.0, n)).astype(int)
    return list(zip(p, r))


def part_packing(args) -> None:
    from llmtrain.data.sft import SFTDataConfig, pack_examples, parse_record, render
    from llmtrain.tokenizer import load_tokenizer

    tok = load_tokenizer(os.path.join(CORPUS, "tokenizer"))
    qa = [render(parse_record(r, SFTDataConfig(files=[], tokenizer="")), tok) for r in qa_records(2000)]
    chat = []
    for p, r in chat_lengths(2000):
        ids = [tok.bos_id] + [7] * (p + 2) + [8] * r + [tok.eos_id]  # bos, header + prompt, response, eos
        chat.append((ids, [0] * (p + 3) + [1] * (r + 1)))
    print("\n| data | examples | median tokens | row length | padded: real / positions | packed: real / positions "
          "| rows padded -> packed |")
    print("|---|---|---|---|---|---|---|")
    for name, examples in (("People's Daily QA pairs", qa), ("log-normal chat (40 / 120)", chat)):
        med = int(np.median([len(i) for i, _ in examples]))
        for seq in [int(s) for s in args.seq_list.split(",")]:
            cut = [(np.asarray(i[: seq + 1], np.int64), np.asarray(m[: seq + 1], np.float32)) for i, m in examples]
            real = sum(len(i) - 1 for i, _ in cut)
            packed = pack_examples(cut, seq, tok.pad_id)
            rows = len(packed["input_ids"])
            print(f"| {name} | {len(cut)} | {med} | {seq} | {real / (len(cut) * seq):.3f} | {real / (rows * seq):.3f} "
                  f"| {len(cut)} -> {rows} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["lora", "packing", "predict", "all"], default="all")
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seq-list", default="512,1024,2048")
    args = ap.parse_args()
    if not os.path.isdir(os.path.join(CORPUS, "tokenizer")):
        raise SystemExit(f"{CORPUS}/tokenizer missing: run scripts/prepare_default_corpus.sh first")
    if args.part in ("packing", "all"):
        part_packing(args)
    if args.part in ("lora", "all"):
        part_lora(args)
    if args.part == "predict":
        part_predict(args)


if __name__ == "__main__":
    main()
