"""Per-rank memory under dp2 vs ZeRO-1/2/3, and checkpoint save/load time and size, for one model.

    python benchmarks/layouts.py [--model gpt2-small] [--layouts dp2,sharding2,zero2,zero3,zero3@65536]

(`zero3@N`: ZeRO-3 with parallel.zero3_segment_size=N; Paddle leaves parameters with
fewer elements than the segment size, 2^20 by default, whole on every rank.)

For each layout: one `paddle.distributed.launch` of 2 CPU processes that builds the
model through the real trainer's assembly (`llmtrain.train.trainer.build_model_and_optimizer`), trains one
step (so every optimizer state exists), then measures on every rank
- parameter bytes held (a ZeRO-3 slice counts its slice, a released parameter nothing),
- optimizer-state bytes held (Adam moments, beta powers, master weights),
and times `Checkpointer.save` and `Checkpointer.load` of that state (best of 2),
with the checkpoint's size on disk. Prints markdown tables; ratios are per rank
against dp2 (expected ~1/2 of the optimizer state at sharding degree 2, and ~1/2 of
the parameters too for ZeRO-3).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def tensor_bytes(t) -> int:
    return int(t._numel()) * t.element_size() if t._is_initialized() else 0


def worker(layout: str, model: str, out: str) -> None:
    import paddle

    from llmtrain.checkpoint.manager import Checkpointer
    from llmtrain.config import compose_config, to_config
    from llmtrain.data.loader import PretrainData
    from llmtrain.parallel.strategy import init_distributed
    from llmtrain.train.amp import AmpPlan
    from llmtrain.resolve import resolve
    from llmtrain.train.step import StepRunner
    from llmtrain.train.trainer import build_data, build_model_and_optimizer

    run_dir = os.path.join(out, "run")
    layout, _, segment = layout.partition("@")
    extra = [f"parallel.zero3_segment_size={segment}"] if segment else []
    run = resolve(to_config(compose_config(extra + [
        f"model={model}", f"+parallel={layout}", "train.global_batch_size=2", "train.micro_batch_size=1",
        "data.seq_len=128", f"run.dir={run_dir}", "checkpoint.keep_last=0"])))
    cfg, lay = run.cfg, run.layout
    topo = init_distributed(lay, cfg.seed)
    data = build_data(PretrainData, run, topo)
    amp = AmpPlan.from_config("none")
    built = build_model_and_optimizer(run, topo, amp)
    StepRunner(built.model, built.loss_fn, built.optimizer, built.scheduler, built.clip, amp,
               hooks=built.hooks).run(data.next_step())
    params = 0
    for p in built.core.parameters():
        store = getattr(p, "fw_storage", None)
        params += tensor_bytes(store) if store is not None and not p._is_initialized() else tensor_bytes(p)
    state = built.optimizer.state_dict()
    opt = sum(tensor_bytes(v) for k, v in state.items() if hasattr(v, "_numel"))
    opt += sum(tensor_bytes(v) for v in (state.get("master_weights") or {}).values())
    from llmtrain.checkpoint.state import training_state

    ckpt = Checkpointer(cfg, lay, topo, training_state(built.named_params, built.model, built.optimizer,
                                                       built.scheduler, built.scaler, data), run.tokenizer)
    saves, loads = [], []
    for i in range(2):
        t0 = time.perf_counter()
        path = ckpt.save(1 + i, 0)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ckpt.load(path)
        loads.append(time.perf_counter() - t0)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    with open(os.path.join(out, f"rank{topo.rank}.json"), "w") as f:
        json.dump({"params": params, "optim": opt, "save": min(saves), "load": min(loads), "size": size}, f)


def launch(layout: str, model: str) -> list[dict]:
    out = tempfile.mkdtemp(prefix=f"bench_{layout.replace('@', '_')}_")
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
           os.path.join(out, "log"), os.path.abspath(__file__), "--worker", layout, "--model", model, "--out", out]
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--layouts", default="dp2,sharding2,zero2,zero3,zero3@65536")
    ap.add_argument("--worker")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.out)
    rows = {lay: launch(lay, args.model) for lay in args.layouts.split(",")}
    base = rows[args.layouts.split(",")[0]]
    mb = 1e6
    print(f"\nModel {args.model} (vocabulary of tokenizers/pd1998-bpe16k), 2 CPU processes, fp32, after one step.\n")
    print("| layout | params MB/rank (r0, r1) | optimizer state MB/rank (r0, r1) | params vs dp2 | optimizer state vs dp2 |")
    print("|---|---|---|---|---|")
    for lay, r in rows.items():
        p = [x["params"] / mb for x in r]
        o = [x["optim"] / mb for x in r]
        print(f"| {lay} | {p[0]:.1f}, {p[1]:.1f} | {o[0]:.1f}, {o[1]:.1f} | "
              f"{max(p) / max(x['params'] / mb for x in base):.3f} | {max(o) / max(x['optim'] / mb for x in base):.3f} |")
    print("\n| layout | checkpoint size MB | save s (best of 2) | load s (best of 2) |")
    print("|---|---|---|---|")
    for lay, r in rows.items():
        print(f"| {lay} | {r[0]['size'] / mb:.1f} | {max(x['save'] for x in r):.2f} | {max(x['load'] for x in r):.2f} |")


if __name__ == "__main__":
    main()
