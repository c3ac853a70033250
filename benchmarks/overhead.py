"""Trainer overhead: our training loop vs a bare hand-written Paddle loop, same model and batches.

    python benchmarks/overhead.py [--steps 30] [--rounds 2] [model=gpt-tiny data.seq_len=128 ...]

One process, one run, side by side: rounds alternate ours / bare so drift in the
machine's speed hits both. "Ours" is the real entry function
(`llmtrain.pretrain.pretrain`: config checks, PretrainData, the parallel plan,
StepRunner with the norm-recording clip, Meter with metrics.jsonl, progress bar
and VisualDL, stop-signal checks). "Bare" builds the same model with the same
initial weights, reads the same batches from the same PretrainData (the same
prefetch), and runs forward / loss / backward / AdamW step / clear_grad with
Paddle's own ClipGradByGlobalNorm. Both are timed by wall clock from the end of
the last warm-up step to the end of the last step (`benchmarks/walltime.py`), so
our logging is inside the measurement. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from walltime import StepClock, trainer_window  # noqa: E402

WARMUP = 3


def ours(overrides: list[str], steps: int) -> float:
    from llmtrain.config import compose_config
    from llmtrain.pretrain import pretrain
    run_dir = tempfile.mkdtemp(prefix="overhead_ours_")
    pretrain(compose_config(overrides + [f"run.dir={run_dir}", f"train.max_steps={steps}", "train.log_interval=1",
                                         "checkpoint.save_final=false", "checkpoint.resume=none"]))
    return trainer_window(run_dir, WARMUP, positions_per_step=0)["tokens_per_s"]


def bare(overrides: list[str], steps: int) -> float:
    import paddle

    from llmtrain.config import compose_config, to_config
    from llmtrain.data.loader import PretrainData
    from llmtrain.models import build_model
    from llmtrain.models.stages import canonical_parameters
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
    clock = StepClock()
    for _ in range(steps):
        (mb,) = data.next_step()
        ids = paddle.to_tensor(mb["input_ids"])
        labels = paddle.to_tensor(mb["labels"])
        logits = model(ids)
        loss = paddle.nn.functional.cross_entropy(logits, labels.unsqueeze(-1))
        loss.backward()
        opt.step()
        opt.clear_grad()
        float(loss)  # the same device sync our logging does each step
        clock.mark(mb["loss_mask"].sum(), 0)
    data.close()
    return clock.window(WARMUP)["tokens_per_s"]


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
          f"first {WARMUP} excluded; wall clock around whole steps on both sides")


if __name__ == "__main__":
    main()
