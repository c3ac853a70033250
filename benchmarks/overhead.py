"""Trainer overhead: our training loop vs a bare hand-written Paddle loop, same model and batches.

    python benchmarks/overhead.py [--steps 30] [--rounds 2] [model=gpt-tiny data.seq_len=128 ...]

One process, one run, side by side: rounds alternate ours / bare so drift in the
machine's speed hits both. "Ours" is the real entry function
(`llmtrain.pretrain.pretrain`: config checks, PretrainData, the parallel plan,
StepRunner with the norm-recording clip, Meter with metrics.jsonl, progress bar
and VisualDL, stop-signal checks); its tokens/s is recomputed from metrics.jsonl
over the steps after warm-up. "Bare" builds the same model with the same
initial weights, reads the same batches from the same PretrainData, and runs
forward / loss / backward / AdamW step / clear_grad with Paddle's own
ClipGradByGlobalNorm, timed over the same steps. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WARMUP = 3


def ours(overrides: list[str], steps: int) -> float:
    from llmtrain.config import compose_config
    from llmtrain.pretrain import pretrain
    from llmtrain.train.metrics import read_metrics

    run_dir = tempfile.mkdtemp(prefix="overhead_ours_")
    pretrain(compose_config(overrides + [f"run.dir={run_dir}", f"train.max_steps={steps}", "train.log_interval=1",
                                         "checkpoint.save_final=false", "checkpoint.resume=none"]))
    recs = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if r["step"] > WARMUP]
    return sum(r["tokens"] for r in recs) / sum(r["step_time"] for r in recs)


def bare(overrides: list[str], steps: int) -> float:
    import paddle

    from llmtrain.config import compose_config, to_config
    from llmtrain.data.loader import PretrainData
    from llmtrain.models import build_model
    from llmtrain.models.decoder import canonical_parameters
    from llmtrain.models.init import init_parameters
    from llmtrain.tokenizer import load_tokenizer

    cfg = to_config(compose_config(overrides))
    cfg.model.vocab_size = cfg.model.vocab_size or load_tokenizer(cfg.data.tokenizer).vocab_size
    g = cfg.train.global_batch_size
    data = PretrainData(cfg.data, seed=cfg.seed, global_batch_size=g, micro_batch_size=g, dp_rank=0, dp_world=1)
    model = build_model(cfg.model)
    init_parameters(canonical_parameters(model), cfg.model, cfg.seed)
    o = cfg.optim
    opt = paddle.optimizer.AdamW(learning_rate=o.lr, beta1=o.beta1, beta2=o.beta2, epsilon=o.eps,
                                 parameters=model.parameters(), weight_decay=o.weight_decay,
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(o.clip_grad))
    tokens, seconds = 0, 0.0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        (mb,) = data.next_step()
        ids = paddle.to_tensor(mb["input_ids"])
        labels = paddle.to_tensor(mb["labels"])
        logits = model(ids)
        loss = paddle.nn.functional.cross_entropy(logits, labels.unsqueeze(-1))
        loss.backward()
        opt.step()
        opt.clear_grad()
        float(loss)  # the same device sync our logging does each step
        if step > WARMUP:
            seconds += time.perf_counter() - t0
            tokens += int(mb["loss_mask"].sum())
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    args, overrides = ap.parse_known_args()
    overrides = ["train.global_batch_size=8", "train.micro_batch_size=8", "train.progress_bar=true"] + overrides
    results = {"ours": [], "bare": []}
    for _ in range(args.rounds):
        results["ours"].append(ours(overrides, args.steps))
        results["bare"].append(bare(overrides, args.steps))
    o, b = statistics.median(results["ours"]), statistics.median(results["bare"])
    print("\n| loop | tokens/s (median of %d rounds) | all rounds |" % args.rounds)
    print("|---|---|---|")
    print(f"| llmtrain trainer | {o:.0f} | {', '.join(f'{x:.0f}' for x in results['ours'])} |")
    print(f"| bare Paddle loop | {b:.0f} | {', '.join(f'{x:.0f}' for x in results['bare'])} |")
    print(f"\nratio ours / bare = {o / b:.3f} (goal >= 0.95); overrides: {' '.join(overrides)}; {args.steps} steps, "
          f"first {WARMUP} excluded")


if __name__ == "__main__":
    main()
