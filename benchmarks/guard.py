"""Cost of the divergence guard: optimizer steps with and without the per-step check, side by side in one run.

    python benchmarks/guard.py [--rounds 8] [--steps 5] [model=gpt-tiny data.seq_len=128 ...]
    python -m paddle.distributed.launch --nproc_per_node 2 benchmarks/guard.py +parallel=dp2

One model, optimizer and data stream, built by the trainer's own assembly
(`build_model_and_optimizer`, `StepRunner`, `AnomalyGuard`). Steps alternate one by one (the order
flipped every other pair, `--rounds` x `--steps` pairs): one through `AnomalyGuard.run_step` (the
gated clip: one all-reduce of six numbers, one host read, the median tests), one through the bare
`StepRunner.run` with the plain recording clip swapped back, so drift in the machine's speed hits
both sides. Every step on both sides ends by
reading its loss to the host (the same synchronisation), timed by `time.perf_counter` around the
whole step. Reported: median and fastest step time of each side (the fastest is the least disturbed by other
load on a shared machine), their ratios, and the time spent inside
`AnomalyGuard.judge` as a fraction of the guarded step (the direct cost, less noisy than the
difference of two medians). Rank 0 prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args, overrides = ap.parse_known_args()

    from llmtrain.config import compose_config, to_config
    from llmtrain.data.loader import PretrainData
    from llmtrain.paddle_compat.optim import get_grad_clip, optimizer_chain, set_grad_clip
    from llmtrain.parallel.strategy import init_distributed
    from llmtrain.train.amp import AmpPlan
    from llmtrain.train.anomaly_guard import AnomalyGuard
    from llmtrain.resolve import resolve
    from llmtrain.train.step import StepRunner
    from llmtrain.train.trainer import build_data, build_model_and_optimizer

    run = resolve(to_config(compose_config(overrides + [
        f"run.dir={tempfile.mkdtemp(prefix='guard_bench_')}", "train.max_steps=100000", "optim.warmup_steps=0",
        "checkpoint.resume=none"])))
    topo = init_distributed(run.layout, run.cfg.seed)
    data = build_data(PretrainData, run, topo)
    amp = AmpPlan.from_config(run.cfg.train.amp)
    b = build_model_and_optimizer(run, topo, amp)
    runner = StepRunner(b.model, b.loss_fn, b.optimizer, b.scheduler, b.clip, amp, b.pipeline, b.scaler,
                        accumulate_steps=run.layout.grad_accum, hooks=b.hooks)
    guard = AnomalyGuard(run.cfg.train.anomaly, topo, runner, b.clip, b.optimizer)
    gated = [(opt, get_grad_clip(opt)) for opt in optimizer_chain(b.optimizer) if get_grad_clip(opt) is not None
             and get_grad_clip(opt) is not b.clip and getattr(get_grad_clip(opt), "inner", None) is b.clip]
    judge_s = [0.0]
    judge = guard.judge

    def timed_judge(norm):
        t0 = time.perf_counter()
        try:
            return judge(norm)
        finally:
            judge_s[0] += time.perf_counter() - t0

    guard.judge = timed_judge
    times = {"guarded": [], "plain": []}
    step = 0

    def one(side: str) -> None:
        nonlocal step
        mbs = data.next_step()
        t0 = time.perf_counter()
        if side == "guarded":
            out = guard.run_step(runner, mbs, step + 1, (0, 0))
        else:
            out = runner.run(mbs)
        float(out.loss)  # both sides: the step's result on the host
        times[side].append(time.perf_counter() - t0)
        step += 1

    for side in ("guarded", "plain"):  # warm-up (first-step allocations, the guard's history)
        for opt, clip in gated:
            set_grad_clip(opt, clip if side == "guarded" else b.clip)
        for _ in range(3):
            one(side)
    times = {"guarded": [], "plain": []}
    judge_s[0] = 0.0
    for r in range(args.rounds):
        for i in range(args.steps):  # step by step, alternating, the order flipped every other pair
            for side in (("guarded", "plain") if (r + i) % 2 == 0 else ("plain", "guarded")):
                for opt, clip in gated:
                    set_grad_clip(opt, clip if side == "guarded" else b.clip)
                one(side)
    g, p = statistics.median(times["guarded"]), statistics.median(times["plain"])
    inside = judge_s[0] / sum(times["guarded"])
    if topo.rank == 0:
        gm, pm = min(times["guarded"]), min(times["plain"])
        print(f"| layout | model | steps per side | median step, guarded / plain (s) | guarded / plain (median) "
              f"| fastest step, guarded / plain (s) | guarded / plain (fastest) | time in the check / guarded step time |")
        print("|---|---|---|---|---|---|---|---|")
        print(f"| {run.layout.name} | {run.cfg.model.name} | {len(times['guarded'])} | {g:.4f} / {p:.4f} | {g / p:.4f} | "
              f"{gm:.4f} / {pm:.4f} | {gm / pm:.4f} | {100 * inside:.2f}% |")
        print(f"anomalies during the benchmark: {guard.counts['anomalies']}")
    from llmtrain.paddle_compat.process import exit_process

    exit_process(0)


if __name__ == "__main__":
    main()
