"""Plan before renting GPUs: every valid layout's per-rank memory and predicted throughput.

    python -m llmtrain.plan model=llama-7b data.seq_len=4096 train.global_batch_size=1024 plan.devices=64 plan.device=a100-80g
    python -m llmtrain.plan model=llama-7b plan.devices=8 +parallel=dp2tp2 parallel.dp=2 parallel.sharding=2   # explain one
    python -m llmtrain.plan model=llama-7b plan.devices=64 plan.format=json plan.top=3
    python -m llmtrain.plan --calibrate [--out work/cpu-here.json]      # measure cpu-here (calibrate.py)

Composed from the same Hydra tree as pretraining (conf/config.yaml + the `plan` section,
llmtrain/plan/config.py). Memory: llmtrain/plan/memory.py (exact parameter/optimizer
counts, the parameter list read off the model: params.py) and estimate.py (activations, time); time:
kernels.py (the kernels of a step), timeline.py (host and device), profile.py (device profiles as data,
profiles/*.json), calibrate.py (`--calibrate`: measure this machine).
"""
from __future__ import annotations

import json
import sys

import hydra

from llmtrain.config import refuse_unknown_keys, register_configs, to_config
from llmtrain.errors import ConfigError
from llmtrain.plan.model import planned_model

register_configs()
GIB = 2**30


RECOMPUTE_SHORT = {"none": "none", "full": "full", "selective": "sel*"}
NOT_RUNNABLE = "* selective recompute (attention core only): planned, not runnable in llmtrain yet"


def _fmt_row(r: dict) -> str:
    m = r["memory_bytes"]
    return (f"{r['name']:<22} {r['micro_batch']:>3} {RECOMPUTE_SHORT[r['recompute_granularity']]:>5} "
            + " ".join(f"{m[k] / GIB:7.1f}" for k in ("params", "grads", "optimizer", "activations", "other", "total"))
            + f" {'yes' if r['fits'] else 'NO':>4} {r['step_time_s']:8.2f} "
            + " ".join(f"{r[k]:6.2f}" for k in ("compute_s", "dp_sharding_comm_s", "tp_comm_s", "pp_p2p_s", "bubble_s",
                                             "loop_comm_s"))
            + f" {r['tokens_per_sec_per_device']:9.0f} {100 * r['mfu']:5.1f}")


HEADER = (f"{'layout':<22} {'mb':>3} {'recmp':>5} " + " ".join(f"{k:>7}" for k in ("params", "grads", "optim", "activ", "other", "total"))
          + f" {'fits':>4} {'step_s':>8} " + " ".join(f"{k:>6}" for k in ("comp", "dp/sh", "tp", "pp", "bubble", "loop"))
          + f" {'tok/s/dev':>9} {'mfu%':>5}")


def plan(cfg) -> list[dict]:
    from llmtrain.parallel.layout import layout_problems, model_fit_problems
    from llmtrain.plan.devices import get_device
    from llmtrain.plan.search import evaluate, rank_layouts

    model = planned_model(cfg)
    if cfg.parallel is not None:  # explain the given layout
        layout, problems = layout_problems(cfg.parallel, cfg.train, cfg.plan.devices)
        problems += model_fit_problems(cfg.parallel, model)
        if problems:
            raise ConfigError(problems)
        from llmtrain.plan.estimate import RECOMPUTE

        if cfg.plan.recompute is not None and cfg.plan.recompute not in RECOMPUTE:
            raise ConfigError([f"plan.recompute={cfg.plan.recompute!r}: expected one of {list(RECOMPUTE)} or null"])
        recompute = cfg.plan.recompute if cfg.plan.recompute is not None else cfg.train.recompute
        return [evaluate(cfg, model, layout, recompute, get_device(cfg.plan.device, cfg.plan.profile))]
    return rank_layouts(cfg, model)


@hydra.main(version_base="1.3", config_path="../../conf", config_name="config")
def main(dcfg) -> None:
    try:
        cfg = to_config(dcfg)
        rows = plan(cfg)
    except ConfigError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    p = cfg.plan
    if p.format == "json":
        print(json.dumps(rows[: p.top] if cfg.parallel is None else rows, indent=1))
        return
    if cfg.parallel is not None:
        r = rows[0]
        print(f"{cfg.model.name}, seq {cfg.data.seq_len}, global batch {r['micro_batch'] * r['grad_accum'] * r['dp'] * r['sharding']}, "
              f"{p.devices} x {p.device} ({p.devices_per_node} per node)")
        for k, v in r.items():
            print(f"  {k}: {v}")
        if not r["runnable"]:
            print(NOT_RUNNABLE)
        return
    fit = sum(r["fits"] for r in rows)
    print(f"{cfg.model.name}, seq {cfg.data.seq_len}, global batch {cfg.train.global_batch_size}, {p.devices} x {p.device} "
          f"({p.devices_per_node} per node): {len(rows)} valid (layout, micro-batch, recompute), {fit} fit; memory in GiB "
          "for the worst rank, times in s per step")
    print(HEADER)
    for r in rows[: p.top]:
        print(_fmt_row(r))
    if any(not r["runnable"] for r in rows[: p.top]):
        print(NOT_RUNNABLE)


if __name__ == "__main__":
    if "--calibrate" in sys.argv:
        from llmtrain.plan.calibrate import main as calibrate_main

        calibrate_main(sys.argv[1:])
    else:
        refuse_unknown_keys("config", command="python -m llmtrain.plan")  # exit 2 naming the nearest key
        main()
