"""Mixture-of-Experts: CPU throughput vs a dense model of the same active size, the dispatcher's share of an ep2
step, and all-gather vs all-to-all dispatch traffic for the GPU presets.

    python benchmarks/moe.py [--steps 10] [--rounds 2] [--no-ep] [data.seq_len=128 ...]

1. One process, one run, side by side: `moe-tiny` and a dense model with the same
   ACTIVE parameters (`flops_parameters` equal: moe-tiny's first block is dense at
   width 352 and its 3 MoE blocks run 2 routed + 1 shared expert of width 96 plus an
   8-way router per token, so a dense FFN of width (352 + 3 x (3 x 96 + 8)) / 4 = 306
   in every block). Both through the real entry function (`llmtrain.pretrain.pretrain`),
   rounds alternating moe / dense, each timed by wall clock from the end of warm-up
   step 3 to the last step (`benchmarks/walltime.py`); medians printed.
2. `moe-tiny +parallel=ep2` on 2 processes (gloo), with the all-gather dispatcher's
   collectives (forward and backward) timed by wall clock on every rank: their share of
   the step time after warm-up. The collectives run where the real ones do; only a
   timer is wrapped around them here (the routing indices' all_gather, T k int64, is
   not timed).
3. Analytic bytes per rank and step of one micro-batch of 4096 tokens in bf16, per
   MoE layer summed over layers, forward + backward, for the GPU presets:
   all-gather dispatcher as implemented (all_gather of x [T, h], all_reduce of
   [ep T, h] in place of reduce-scatter, and the mirror in backward: a ring moves
   (ep-1) T h bytes per all-gather and 2 (ep-1) T h per all-reduce: 6 (ep-1) T h b) vs
   all-to-all (each choice row whose expert lives elsewhere, (ep-1)/ep of T k rows,
   out and back, forward and backward: 4 T k h b (ep-1)/ep); routing indices and
   weights (T k x 12 bytes) are left out of both. Ratio 1.5 ep / k.
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

WARMUP = 3
DENSE = ["model.moe_num_experts=0", "model.ffn_hidden_size=306", "model.name=dense-306"]
PRESETS = ("mixtral-8x7b", "qwen-moe-a2.7b", "deepseek-v2-lite")


def base_overrides(extra: list[str], steps: int, run_dir: str) -> list[str]:
    return ["model=moe-tiny", "train.progress_bar=false", "train.visualdl=false", "train.log_interval=1",
            "checkpoint.save_final=false", "checkpoint.resume=none", f"train.max_steps={steps}",
            f"run.dir={run_dir}", *extra]


def one_run(extra: list[str], steps: int) -> float:
    from llmtrain.config import compose_config
    from llmtrain.pretrain import pretrain

    run_dir = tempfile.mkdtemp(prefix="moe_bench_")
    pretrain(compose_config(base_overrides(extra, steps, run_dir)))
    return trainer_window(run_dir, WARMUP, positions_per_step=0)["tokens_per_s"]


def side_by_side(extra: list[str], steps: int, rounds: int) -> dict:
    from llmtrain.config import compose_config, to_config
    from llmtrain.models.size import flops_parameters
    import dataclasses

    cfgs = {k: to_config(compose_config(base_overrides(extra + e, steps, "/tmp/unused"))).model
            for k, e in (("moe", []), ("dense", DENSE))}
    active = {k: flops_parameters(dataclasses.replace(c, vocab_size=c.vocab_size or 16000)) for k, c in cfgs.items()}
    rates = {"moe": [], "dense": []}
    for _ in range(rounds):
        rates["moe"].append(one_run(extra, steps))
        rates["dense"].append(one_run(extra + DENSE, steps))
    return {"active": active, "rates": rates}


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


def traffic_table(seq_tokens: int = 4096, elem_bytes: int = 2, eps=(2, 8)) -> list[str]:
    from llmtrain.config import compose_config, to_config

    rows = ["| preset | MoE layers | h | top-k | ep | all-gather (as built) GB/step | all-to-all GB/step | ratio |",
            "|---|---|---|---|---|---|---|---|"]
    for name in PRESETS:
        c = to_config(compose_config([f"model={name}"])).model
        layers = sum(c.is_moe_layer(i) for i in range(c.num_layers))
        t, h, k = seq_tokens, c.hidden_size, c.moe_top_k
        for ep in eps:
            ag = layers * 6 * (ep - 1) * t * h * elem_bytes
            a2a = layers * 4 * t * k * h * elem_bytes * (ep - 1) / ep
            rows.append(f"| {name} | {layers} | {h} | {k} | {ep} | {ag / 1e9:.2f} | {a2a / 1e9:.2f} | {ag / a2a:.1f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-ep", action="store_true", help="skip the 2-process ep2 measurement")
    ap.add_argument("--ep-worker", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args()
    if args.ep_worker:
        return ep_worker(args.ep_worker)
    res = side_by_side(extra, args.steps, args.rounds)
    m, d = (statistics.median(res["rates"][k]) for k in ("moe", "dense"))
    print("| model | active parameters (flops_parameters) | tokens/s (median) | rounds |")
    print("|---|---|---|---|")
    print(f"| moe-tiny | {res['active']['moe'] / 1e6:.3f}M | {m:.0f} | {', '.join(f'{x:.0f}' for x in res['rates']['moe'])} |")
    print(f"| dense, ffn 306 | {res['active']['dense'] / 1e6:.3f}M | {d:.0f} | {', '.join(f'{x:.0f}' for x in res['rates']['dense'])} |")
    print(f"\nmoe-tiny / dense tokens/s: {m / d:.2f}")
    if not args.no_ep:
        ranks = ep_share(extra, args.steps)
        print("\n| ep2 rank | steps timed | step time s | dispatcher collectives s/step | share |")
        print("|---|---|---|---|---|")
        for r, x in enumerate(ranks):
            print(f"| {r} | {x['steps']} | {x['seconds'] / x['steps']:.3f} | {x['dispatch_s'] / x['steps']:.3f} | "
                  f"{x['dispatch_s'] / x['seconds']:.1%} |")
    print()
    print("\n".join(traffic_table()))


if __name__ == "__main__":
    main()
