"""Every valid layout of a job, by the training's own validity rules, with its estimates, best first.

    python -m llmtrain.plan model=llama-7b data.seq_len=4096 train.global_batch_size=1024 plan.devices=64
    rows = rank_layouts(cfg, model_cfg)       # [{"dp", "tp", ..., "fits", "memory_bytes", "step_time_s", ...}]

Validity is `llmtrain.parallel.layout.layout_problems` + `model_fit_problems` (the rules
`resolve` applies before training), so a row here is a layout pretrain.py accepts.
"""
from __future__ import annotations

import dataclasses

from llmtrain.parallel.config import ParallelConfig
from llmtrain.parallel.layout import layout_problems, model_fit_problems
from llmtrain.plan.devices import get_device
from llmtrain.plan.estimate import RECOMPUTE, memory_estimate, moe_plan, recompute_mode, time_estimate
from llmtrain.plan.overrides import launch_overrides
from llmtrain.plan.stage_cost import with_pipeline_split

MICRO_BATCHES = (1, 2, 4, 8, 16)
HAS_CP = "cp" in {f.name for f in dataclasses.fields(ParallelConfig)}
"""Whether this llmtrain's parallel config has context parallelism (`parallel.cp`, `parallel.cp_comm`)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_name(dp, tp, pp, sharding, stage, v, cp=1, cp_comm="ring") -> str:
    """`dp8tp2sharding4s1`, `pp4v2`, `dp2cp4ring`, ...: the degrees above 1 (s = sharding stage, v = virtual
    stages, cp with its exchange)."""
    name = "".join(f"{a}{d}" for a, d in (("dp", dp), ("tp", tp), ("pp", pp)) if d > 1)
    name += f"sharding{sharding}s{stage}" if sharding > 1 else ""
    name += f"v{v}" if v > 1 else ""
    name += f"cp{cp}{cp_comm}" if cp > 1 else ""
    return name or "single"


def candidates(n: int, context: bool = False):
    """ParallelConfig for every (dp, tp, pp, sharding, stage, schedule, v) with dp·tp·pp·sharding = n; with
    `context` (a parallel config that has cp), instead every layout with cp > 1 (dp·tp·pp·sharding·cp = n), each
    cp exchange (ring, allgather, a2a)."""
    cps = [c for c in _divisors(n) if c > 1] if context else [1]
    for cp in cps:
        for tp in _divisors(n // cp):
            for pp in _divisors(n // (cp * tp)):
                for sh in _divisors(n // (cp * tp * pp)):
                    dp = n // (cp * tp * pp * sh)
                    for stage in ((1, 2, 3) if sh > 1 else (1,)):
                        for sched, v in [("1f1b", 1)] + ([("interleaved", k) for k in (2, 4)] if pp > 2 else []):
                            for comm in (("ring", "allgather", "a2a") if cp > 1 else ("ring",)):
                                extra = {"cp": cp, "cp_comm": comm} if cp > 1 else {}
                                yield ParallelConfig(name=layout_name(dp, tp, pp, sh, stage, v, cp, comm), dp=dp,
                                                     tp=tp, pp=pp, sharding=sh, sharding_stage=stage,
                                                     pp_schedule=sched, virtual_pp=v, **extra)


def evaluate(cfg, model_cfg, layout, recompute, dev) -> dict:
    """One row: the layout's fields (names as conf/parallel), fits, memory_bytes, time split, tokens/s, mfu.

    `recompute`: `train.recompute` (bool) or "none" | "full" | "selective". The row's `recompute` is the bool
    `train.recompute` takes (true only for full recompute), `recompute_granularity` the mode, and `runnable`
    is false for selective recompute (a planner option: llmtrain's Trainer recomputes whole blocks only).
    `amp` is the precision planned: `none` (fp32) on a CPU profile; on a GPU profile `train.amp`, and bf16 when
    that is `none` (the GPU profiles hold bf16 kernel tables: fp32 training on a GPU is not modelled; the table
    says so). `overrides`: the command-line overrides that launch the row (`llmtrain.plan.overrides`)."""
    mode = recompute_mode(recompute)
    gpu = dev.async_launch  # a GPU profile (a CPU's ops run where they are dispatched)
    flash = model_cfg.attention == "flash" or (model_cfg.attention == "auto" and gpu)
    amp = "none" if not gpu else (cfg.train.amp if cfg.train.amp != "none" else "bf16")
    device = "gpu" if gpu else "cpu"
    mem = memory_estimate(model_cfg, layout, cfg.data.seq_len, mode, amp, device, dev.dtype_bytes, flash,
                          dev.framework_bytes, moe_imbalance=getattr(cfg.plan, "moe_imbalance", None))
    est = time_estimate(model_cfg, layout, cfg.data.seq_len, mode, dev, cfg.plan.devices_per_node, flash,
                        "none" if amp == "none" else "bf16", moe_imbalance=getattr(cfg.plan, "moe_imbalance", None))
    cp, cp_comm = getattr(layout, "cp", 1), getattr(layout, "cp_comm", "ring")
    name = layout_name(layout.dp, layout.tp, layout.pp, layout.sharding, layout.sharding_stage, layout.virtual_pp,
                       cp, cp_comm)
    row = {"name": name, "dp": layout.dp, "cp": cp, "cp_comm": cp_comm, "tp": layout.tp, "pp": layout.pp,
           "virtual_pp": layout.virtual_pp, "pp_layers": list(layout.pp_layers),
           "pp_schedule": layout.pp_schedule, "sharding": layout.sharding, "sharding_stage": layout.sharding_stage,
           "micro_batch": layout.micro_batch, "grad_accum": layout.grad_accum, "recompute": mode == "full",
           "recompute_granularity": mode, "runnable": mode != "selective",
           "amp": amp, "fits": mem["total"] <= dev.memory_bytes, "memory_bytes": mem, **est}
    row["overrides"] = launch_overrides(row, cfg.train.amp)
    return row


def rank_layouts(cfg, model_cfg, context: bool | None = None) -> list[dict]:
    """Every valid (layout, micro-batch, recompute none/full/selective) for cfg.plan.devices: fitting ones first, then by predicted tokens/s,
    then by less memory on the worst rank. When no layout without context parallelism fits (a sequence too long
    for one device's memory) and the parallel config has cp, the layouts with cp > 1 are ranked too (`context`
    True: always; False: never)."""
    rows = _rank(cfg, model_cfg, context=False)
    if HAS_CP and context is not False and (context or not any(r["fits"] for r in rows)):
        rows = _rank(cfg, model_cfg, context=True) + rows
        rows.sort(key=lambda r: (not r["fits"], -round(r["tokens_per_sec_per_device"], 6), r["memory_bytes"]["total"]))
    return rows


def _rank(cfg, model_cfg, context: bool) -> list[dict]:
    from llmtrain.plan.fp8 import with_fp8

    dev = with_fp8(get_device(cfg.plan.device, cfg.plan.profile), cfg.train.fp8)  # train.fp8: FP8 GEMMs priced
    rows = []
    if context:  # what llmtrain's context parallelism refuses (the model, the sequence, the exchange)
        from llmtrain.parallel.context import context_problems
    for pc in candidates(cfg.plan.devices, context):
        if model_fit_problems(pc, model_cfg):
            continue
        if context and context_problems(pc, model_cfg, cfg.data.seq_len, bool(getattr(cfg.data, "document_mask", False)),
                                        dev.async_launch):
            continue
        for mb in MICRO_BATCHES:
            train = dataclasses.replace(cfg.train, micro_batch_size=mb, grad_accum=None)
            layout, problems = layout_problems(pc, train, cfg.plan.devices)
            if problems:
                continue
            for recompute in RECOMPUTE:  # the default pipeline split is priced as the run would resolve it
                split = with_pipeline_split(layout, model_cfg, dev, seq_len=cfg.data.seq_len, recompute=recompute,
                                            moe=moe_plan(layout, dev, cfg.plan.devices_per_node,
                                                         cfg.plan.moe_imbalance))
                rows.append(evaluate(cfg, model_cfg, split, recompute, dev))
    rows.sort(key=lambda r: (not r["fits"], -round(r["tokens_per_sec_per_device"], 6), r["memory_bytes"]["total"]))
    return rows
