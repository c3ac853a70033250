"""ERNIE masked-LM pretraining on CPU: our trainer vs a bare Paddle loop, and the cost of masking.

    python benchmarks/ernie.py [--steps 8] [--rounds 2] [--seq-len 512] [--models ernie-tiny ernie-3.0-base-zh]
                               [--batch ernie-tiny=8 --batch ernie-3.0-base-zh=2] [--markdown FILE]

For each model, one process, rounds alternating ours / bare so that drift in the machine's speed
hits both. "Ours" is the real entry function (`llmtrain.pretrain.pretrain`: config checks, MLMData
with whole-word masking in its prefetch thread, the parallel plan, StepRunner, Meter with
metrics.jsonl). "Bare" builds the same model with the same initial weights, reads the same masked
batches from the same MLMData (with the same prefetch thread), and runs forward / masked
cross-entropy / backward / AdamW with Paddle's ClipGradByGlobalNorm / clear_grad. Both are timed by
wall clock from the end of the last warm-up step to the end of the last step
(`benchmarks/walltime.py`), our logging included. Rates: loss-bearing (masked) tokens/s, the trainer's `tokens`,
and positions/s (all input tokens, what the FLOPs follow). Masking cost: `Masker` alone on the
run's batches ([batch, seq] ids and word flags already read), median of repeated calls, as a share
of our median step time (goal: under 2%). Prints markdown tables (and writes them with --markdown).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from walltime import StepClock, trainer_window  # noqa: E402

WARMUP = 2
STRATEGIES = ("whole_word", "token", "ngram", "entity")


def base_overrides(model: str, seq_len: int, batch: int, steps: int) -> list[str]:
    return [f"model={model}", f"data.seq_len={seq_len}", f"train.global_batch_size={batch}",
            f"train.micro_batch_size={batch}", f"train.max_steps={steps}", "train.log_interval=1",
            "train.progress_bar=false", "train.visualdl=false", "checkpoint.save_final=false",
            "checkpoint.resume=none"]


def ours(overrides: list[str]) -> dict:
    from llmtrain.config import compose_config
    from llmtrain.pretrain import pretrain
    from llmtrain.config import to_config

    run_dir = tempfile.mkdtemp(prefix="ernie_ours_")
    dcfg = compose_config(overrides + [f"run.dir={run_dir}"])
    pretrain(dcfg)
    cfg = to_config(dcfg)
    return trainer_window(run_dir, WARMUP, positions_per_step=cfg.train.global_batch_size * cfg.data.seq_len)


def bare(overrides: list[str]) -> dict:
    import paddle
    import paddle.nn.functional as F

    from llmtrain.config import compose_config, to_config
    from llmtrain.data.mlm import MLMData
    from llmtrain.models import build_model
    from llmtrain.models.stages import canonical_parameters
    from llmtrain.models.init import init_parameters
    from llmtrain.tokenizer import load_tokenizer

    cfg = to_config(compose_config(overrides))
    cfg.model.vocab_size = cfg.model.vocab_size or load_tokenizer(cfg.data.tokenizer).vocab_size
    g = cfg.train.global_batch_size
    data = MLMData(cfg.data, seed=cfg.seed, global_batch_size=g, micro_batch_size=g)
    paddle.seed(cfg.seed)
    model = build_model(cfg.model)
    init_parameters(canonical_parameters(model), cfg.model, cfg.seed)
    o = cfg.optim
    opt = paddle.optimizer.AdamW(learning_rate=o.lr, beta1=o.beta1, beta2=o.beta2, epsilon=o.eps,
                                 parameters=model.parameters(), weight_decay=o.weight_decay,
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(o.clip_grad))
    clock = StepClock()
    for _ in range(cfg.train.max_steps):
        (mb,) = data.next_step()
        ids = paddle.to_tensor(mb["input_ids"])
        labels = paddle.to_tensor(mb["labels"])
        mask = paddle.to_tensor(mb["loss_mask"])
        logits = model(ids)  # [b, s, V]
        ce = F.cross_entropy(logits, labels.unsqueeze(-1), reduction="none").squeeze(-1)  # [b, s]
        loss = (ce * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.clear_grad()
        float(loss)  # the same device sync our logging does each step
        clock.mark(mb["loss_mask"].sum(), mb["input_ids"].size)
    data.close()
    return clock.window(WARMUP)


def masking_cost(overrides: list[str], repeats: int = 30) -> dict:
    """Median seconds of `Masker` on one [batch, seq] batch, per strategy (ids and flags already read)."""
    import numpy as np

    from llmtrain.config import compose_config, to_config
    from llmtrain.data.mlm import MLMData

    out = {}
    for strategy in STRATEGIES:
        cfg = to_config(compose_config(overrides + [f"data.masking.strategy={strategy}", "data.num_workers=0"]))
        g = cfg.train.global_batch_size
        data = MLMData(cfg.data, seed=cfg.seed, global_batch_size=g, micro_batch_size=g)
        times = []
        for k in range(4):  # four different batches
            ids = np.arange(k * g, (k + 1) * g)
            tokens, flags = data.train.get_many(ids, side="wbd")
            tokens, flags = tokens[:, :data.seq_len], flags[:, :data.seq_len]
            data.masker(tokens, ids, flags)
            for _ in range(repeats):
                t0 = time.perf_counter()
                data.masker(tokens, ids, flags)
                times.append(time.perf_counter() - t0)
        out[strategy] = statistics.median(times)
        data.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="steps per run; the first 2 are warm-up")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--models", nargs="+", default=["ernie-tiny", "ernie-3.0-base-zh"])
    ap.add_argument("--batch", action="append", default=[], help="MODEL=N sequences per step")
    ap.add_argument("--markdown", default=None, help="also write the tables to this file")
    args, extra = ap.parse_known_args()
    batch = {"ernie-tiny": 8, "ernie-3.0-base-zh": 2}
    batch.update({k: int(v) for k, v in (b.split("=") for b in args.batch)})
    load0 = os.getloadavg()[0]
    rows, cost_rows = [], []
    for model in args.models:
        ov = base_overrides(model, args.seq_len, batch.get(model, 8), args.steps) + extra
        res = {"ours": [], "bare": []}
        for _ in range(args.rounds):
            res["ours"].append(ours(ov))
            res["bare"].append(bare(ov))
        b, s = batch.get(model, 8), args.seq_len
        o_tok = statistics.median(r["tokens_per_s"] for r in res["ours"])
        b_tok = statistics.median(r["tokens_per_s"] for r in res["bare"])
        o_step = statistics.median(r["step_s"] for r in res["ours"])
        b_step = statistics.median(r["step_s"] for r in res["bare"])
        rows.append((model, b, s, o_tok, b_tok, o_tok / b_tok, b * s / o_step, b * s / b_step, o_step, b_step,
                     [round(r["tokens_per_s"], 1) for r in res["ours"]],
                     [round(r["tokens_per_s"], 1) for r in res["bare"]]))
        cost = masking_cost(ov)
        cost_rows.append((model, b, s, o_step, cost))
    lines = [f"Measured by `python benchmarks/ernie.py --steps {args.steps} --rounds {args.rounds} --seq-len "
             f"{args.seq_len}` on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
             f"{load0:.2f} at start, {time.strftime('%Y-%m-%d')}; load average {os.getloadavg()[0]:.2f} at the end. "
             f"One process, fp32, whole-word masking (the encoder default) on the embedded People's Daily corpus; "
             f"medians over rounds; each round timed by wall clock from the end of warm-up step {WARMUP} to the "
             f"end of the last step, on both sides.", "",
             "| model | batch x seq | ours masked tokens/s | bare masked tokens/s | ours / bare | ours positions/s "
             "| bare positions/s | ours s/step | bare s/step | ours, all rounds | bare, all rounds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (m, b, s, ot, bt, ratio, op, bp, os_, bs, oall, ball) in rows:
        lines.append(f"| {m} | {b} x {s} | {ot:.1f} | {bt:.1f} | {ratio:.3f} | {op:.0f} | {bp:.0f} | {os_:.3f} | "
                     f"{bs:.3f} | {', '.join(map(str, oall))} | {', '.join(map(str, ball))} |")
    lines += ["", "Masking cost: `Masker` alone on one step's batch (median of 120 calls over 4 batches), and its "
              "share of our median step time (goal < 2%).", "",
              "| model | batch x seq | step s | " + " | ".join(f"{st} ms (share)" for st in STRATEGIES) + " |",
              "|---|---|---|" + "---|" * len(STRATEGIES)]
    for (m, b, s, step, cost) in cost_rows:
        cells = " | ".join(f"{cost[st] * 1e3:.2f} ({cost[st] / step:.2%})" for st in STRATEGIES)
        lines.append(f"| {m} | {b} x {s} | {step:.3f} | {cells} |")
    text = "\n".join(lines)
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
