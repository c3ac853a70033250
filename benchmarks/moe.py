"""Mixture-of-Experts on CPU: the batched dispatcher against the old per-expert loop (before / after), side by side
in one run, the dispatcher's share of an ep2 step, and the exchange's traffic for the GPU presets.

    python benchmarks/moe.py [--steps 10] [--rounds 3] [--reps 7] [--no-ep] [data.seq_len=128 ...]

1. Before / after through the real entry function (`llmtrain.pretrain.pretrain`), one process: `moe-tiny` (8
   experts top-2) and `moe-tiny` with 64 experts, each trained with the old per-expert loop
   (`tests/models/moe_loop.py`: a `nonzero` + gather + index_add per expert, installed over `Experts.forward` for
   that run only; the routing statistics are the new on-device ones in both) and with the batched dispatcher
   (`llmtrain/models/experts.py`). Each round runs the loop and the dispatcher back to back, in alternating order
   (loop first in even rounds), timed by wall clock from the end of warm-up step 3 to the last step
   (`benchmarks/walltime.py`); the ratio new / old is taken within each round (the pair shares the host's load of
   that minute) and reported as the median and the range over rounds.
2. The MoE layer alone (moe-tiny's shape, 4096 tokens, forward + backward): old loop and dispatcher alternating
   `--reps` times after a warm-up; the per-pair ratio old / new, median and range. Where the layer's own cost shows
   without the 16000-row output projection around it.
3. `moe-tiny +parallel=ep2` on 2 processes (gloo), with the dispatcher's exchanges (forward and backward) timed by
   wall clock on every rank: their share of the step time after warm-up. The exchanges run where the real ones
   do; only a timer is wrapped around them here.
4. Analytic bytes per rank and step of one micro-batch of 4096 tokens in bf16, summed over MoE layers, forward +
   backward, for the GPU presets: the dispatcher moves the expert-major buffer [E, C, h] four times per layer (to
   the experts and back, forward and backward), E C = f T k rows at capacity factor f (1.25 here; dropless: the
   largest load sets C). All-to-all sends (ep-1)/ep of it each time: 4 f T k h b (ep-1)/ep; the all-gather
   transport receives every other rank's whole buffer: 4 f T k h b (ep-1), ep times more.
Prints markdown tables (benchmarks/README.md holds a run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from walltime import trainer_window  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "tests", "models"))
from moe_loop import installed_loop  # noqa: E402  (the old loop: a test reference, not shipped)

WARMUP = 3
PRESETS = ("mixtral-8x7b", "qwen-moe-a2.7b", "deepseek-v2-lite")
MODELS = {"moe-tiny (8 experts top-2)": [], "moe-tiny, 64 experts top-2": ["model.moe_num_experts=64"]}


def base_overrides(extra: list[str], steps: int, run_dir: str) -> list[str]:
    return ["model=moe-tiny", "train.progress_bar=false", "train.visualdl=false", "train.log_interval=1",
            "checkpoint.save_final=false", "checkpoint.resume=none", f"train.max_steps={steps}",
            f"run.dir={run_dir}", *extra]


def one_run(extra: list[str], steps: int, loop: bool = False) -> float:
    import contextlib

    from llmtrain.config import compose_config
    from llmtrain.pretrain import pretrain

    run_dir = tempfile.mkdtemp(prefix="moe_bench_")
    with installed_loop() if loop else contextlib.nullcontext():
        pretrain(compose_config(base_overrides(extra, steps, run_dir)))
    return trainer_window(run_dir, WARMUP, positions_per_step=0)["tokens_per_s"]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def side_by_side(extra: list[str], steps: int, rounds: int) -> dict:
    """{model: {"loop": [tokens/s per round], "dispatcher": [...]}}, each round's pair back to back."""
    rates = {m: {"loop": [], "dispatcher": []} for m in MODELS}
    for r in range(rounds):
        for m, overrides in MODELS.items():
            order = ("loop", "dispatcher") if r % 2 == 0 else ("dispatcher", "loop")
            for kind in order:
                rates[m][kind].append(one_run(extra + overrides, steps, loop=kind == "loop"))
    return rates


def layer_timing(experts: int, tokens: int = 4096, reps: int = 7) -> dict:
    """ms per forward + backward of one moe-tiny MoE layer, old loop and dispatcher alternating (one warm-up each)."""
    import paddle

    from llmtrain.config import compose_config, to_config
    from llmtrain.models.moe import MoEFeedForward
    from llmtrain.models.roles import Roles

    cfg = to_config(compose_config(["model=moe-tiny", f"model.moe_num_experts={experts}"])).model
    paddle.seed(0)
    layer = MoEFeedForward(cfg, Roles(), index=1)
    x = paddle.randn([1, tokens, cfg.hidden_size])
    x.stop_gradient = False

    def once(loop: bool) -> float:
        import contextlib

        with installed_loop() if loop else contextlib.nullcontext():
            t0 = time.perf_counter()
            layer(x).sum().backward()
            elapsed = (time.perf_counter() - t0) * 1e3
        layer.loss_terms.clear()
        return elapsed

    once(True), once(False)  # warm-up
    times = {"loop": [], "dispatcher": []}
    for r in range(reps):
        for kind in (("loop", "dispatcher") if r % 2 == 0 else ("dispatcher", "loop")):
            times[kind].append(once(kind == "loop"))
    return times


def ep_worker(spec_path: str) -> None:
    """Under paddle.distributed.launch: moe-tiny +parallel=ep2 with the dispatcher's collectives timed."""
    from llmtrain.parallel import experts

    spent = {"s": 0.0}

    def timed(fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            spent["s"] += time.perf_counter() - t0
            return out
        return staticmethod(wrapper)

    experts._Exchange.forward = timed(experts._Exchange.forward)
    experts._Exchange.backward = timed(experts._Exchange.backward)
    with open(spec_path) as f:
        spec = json.load(f)
    from llmtrain.config import compose_config
    from llmtrain.pretrain import pretrain
    from llmtrain.train import trainer as trainer_mod

    marks = []
    loop = trainer_mod.Meter.update

    def update(self, step, out, lr, data_wait, extra=None):
        rec = loop(self, step, out, lr, data_wait, extra)
        marks.append((step, time.time(), spent["s"]))
        return rec

    trainer_mod.Meter.update = update
    pretrain(compose_config(spec["overrides"]))
    import paddle.distributed as dist

    (s0, t0, d0), (s1, t1, d1) = marks[WARMUP - 1], marks[-1]
    with open(f"{spec['out']}.{dist.get_rank()}", "w") as f:
        json.dump({"steps": s1 - s0, "seconds": t1 - t0, "dispatch_s": d1 - d0}, f)
    from llmtrain.paddle_compat.process import exit_process

    exit_process(0)


def ep_share(extra: list[str], steps: int) -> list[dict]:
    work = tempfile.mkdtemp(prefix="moe_bench_ep_")
    spec = os.path.join(work, "spec.json")
    out = os.path.join(work, "result")
    with open(spec, "w") as f:
        json.dump({"overrides": base_overrides(extra + ["+parallel=ep2"], steps, os.path.join(work, "run")),
                   "out": out}, f)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    env.pop("PADDLE_TRAINERS_NUM", None)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
           os.path.join(work, "log"), os.path.abspath(__file__), "--ep-worker", spec]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"ep2 launch failed ({proc.returncode}); logs in {work}/log\n{proc.stderr[-2000:]}")
    return [json.load(open(f"{out}.{r}")) for r in range(2)]


def traffic_table(seq_tokens: int = 4096, elem_bytes: int = 2, eps=(2, 8), factor: float = 1.25) -> list[str]:
    from llmtrain.config import compose_config, to_config

    rows = ["| preset | MoE layers | h | top-k | ep | all-gather transport GB/step | all-to-all GB/step | ratio |",
            "|---|---|---|---|---|---|---|---|"]
    for name in PRESETS:
        c = to_config(compose_config([f"model={name}"])).model
        layers = sum(c.is_moe_layer(i) for i in range(c.num_layers))
        t, h, k = seq_tokens, c.hidden_size, c.moe_top_k
        buffer = factor * t * k * h * elem_bytes  # [E, C, h] bytes, E C = f T k
        for ep in eps:
            ag = layers * 4 * buffer * (ep - 1)
            a2a = layers * 4 * buffer * (ep - 1) / ep
            rows.append(f"| {name} | {layers} | {h} | {k} | {ep} | {ag / 1e9:.2f} | {a2a / 1e9:.2f} | {ag / a2a:.1f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7, help="repetitions of the layer-alone timing")
    ap.add_argument("--no-ep", action="store_true", help="skip the 2-process ep2 measurement")
    ap.add_argument("--ep-worker", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args()
    if args.ep_worker:
        return ep_worker(args.ep_worker)
    rates = side_by_side(extra, args.steps, args.rounds)
    print("| model | old loop tokens/s (rounds) | dispatcher tokens/s (rounds) | new / old, median (range) |")
    print("|---|---|---|---|")
    for m, r in rates.items():
        ratios = [b / a for a, b in zip(r["loop"], r["dispatcher"])]
        print(f"| {m} | {', '.join(f'{x:.0f}' for x in r['loop'])} | {', '.join(f'{x:.0f}' for x in r['dispatcher'])} "
              f"| {spread(ratios)} |")
    print(f"\n| MoE layer alone, 4096 tokens, fwd + bwd ({args.reps} pairs) | old loop ms, median "
          "| dispatcher ms, median | old / new, median (range) |")
    print("|---|---|---|---|")
    for e in (8, 64):
        t = layer_timing(e, reps=args.reps)
        ratios = [a / b for a, b in zip(t["loop"], t["dispatcher"])]
        print(f"| {e} experts top-2 | {statistics.median(t['loop']):.1f} | {statistics.median(t['dispatcher']):.1f} "
              f"| {spread(ratios)} |")
    if not args.no_ep:
        ranks = ep_share(extra, args.steps)
        print("\n| ep2 rank | steps timed | step time s | dispatcher exchanges s/step | share |")
        print("|---|---|---|---|---|")
        for r, x in enumerate(ranks):
            print(f"| {r} | {x['steps']} | {x['seconds'] / x['steps']:.3f} | {x['dispatch_s'] / x['steps']:.3f} | "
                  f"{x['dispatch_s'] / x['seconds']:.1%} |")
    print()
    print("\n".join(traffic_table()))


if __name__ == "__main__":
    main()
