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
from llmtrain.parallel.overlap import enabled
from llmtrain.plan.devices import get_device
from llmtrain.plan.estimate import (RECOMPUTE, memory_estimate, moe_plan, recompute_kept_bytes, recompute_mode,
                                    time_estimate)
from llmtrain.plan.overrides import launch_overrides
from llmtrain.plan.prune import split_free_bound
from llmtrain.plan.recompute import mode_name, plan_recompute, with_offload
from llmtrain.plan.stage_cost import with_pipeline_split

MICRO_BATCHES = (1, 2, 4, 8, 16)
"""Whether this llmtrain's parallel config has context parallelism (`parallel.cp`, `parallel.cp_comm`)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_name(dp, tp, pp, sharding, stage, v, cp=1, cp_comm="ring", ep=1, schedule="1f1b") -> str:
    """`dp8tp2sharding4s1`, `pp4v2`, `pp8dpv`, `dp2cp4ring`, `pp8sharding32s1ep32`, ...: the degrees above 1 (s =
    sharding stage, v = virtual stages, dpv the DualPipeV schedule, cp with its exchange, ep the expert-parallel
    degree)."""
    name = "".join(f"{a}{d}" for a, d in (("dp", dp), ("tp", tp), ("pp", pp)) if d > 1)
    name += f"sharding{sharding}s{stage}" if sharding > 1 else ""
    name += "dpv" if schedule == "dualpipev" and pp > 1 else f"v{v}" if v > 1 else ""
    name += f"cp{cp}{cp_comm}" if cp > 1 else ""
    name += f"ep{ep}" if ep > 1 else ""
    return name or "single"


def expert_degrees(data: int, experts: int) -> list[int]:
    """The expert-parallel degrees a layout with `data` = dp x sharding ranks can take for a model of `experts`
    routed experts: 1 and every divisor of both (none but 1 for a dense model)."""
    return [e for e in _divisors(data) if experts > 0 and experts % e == 0] if experts > 0 else [1]


def candidates(n: int, context: bool = False, experts: int = 0):
    """ParallelConfig for every (dp, tp, pp, sharding, stage, schedule, v, ep) with dp·tp·pp·sharding = n (schedule:
    1F1B, interleaved with v = 2 or 4 for pp > 2, DualPipeV for pp >= 2, where `layout_problems` admits it; ep: every
    degree `expert_degrees` allows for `experts` routed experts); with `context` (a parallel config that has cp),
    instead every layout with cp > 1 (dp·tp·pp·sharding·cp = n), each cp exchange (ring, allgather, a2a), ep 1
    (expert parallelism under cp is refused)."""
    cps = [c for c in _divisors(n) if c > 1] if context else [1]
    for cp in cps:
        for tp in _divisors(n // cp):
            for pp in _divisors(n // (cp * tp)):
                for sh in _divisors(n // (cp * tp * pp)):
                    dp = n // (cp * tp * pp * sh)
                    for stage in ((1, 2, 3) if sh > 1 else (1,)):
                        # DualPipeV not generated where `dualpipe_problems` refuses it (tp, cp)
                        for sched, v in ([("1f1b", 1)] + ([("interleaved", k) for k in (2, 4)] if pp > 2 else [])
                                         + ([("dualpipev", 1)] if pp > 1 and tp == 1 and cp == 1 else [])):
                            for comm in (("ring", "allgather", "a2a") if cp > 1 else ("ring",)):
                                extra = {"cp": cp, "cp_comm": comm} if cp > 1 else {}
                                for ep in (expert_degrees(dp * sh, experts) if cp == 1 else [1]):
                                    yield ParallelConfig(name=layout_name(dp, tp, pp, sh, stage, v, cp, comm, ep, sched),
                                                         dp=dp, tp=tp, pp=pp, sharding=sh, sharding_stage=stage,
                                                         pp_schedule=sched, virtual_pp=v, ep=ep, **extra)


def evaluate(cfg, model_cfg, layout, recompute, dev, timed: bool = True,
             offload: tuple = (False, False), mem: dict | None = None) -> dict:
    """One row: the layout's fields (names as conf/parallel), fits, memory_bytes, time split, tokens/s, mfu.

    `recompute`: `train.recompute` (bool or mode name: none, full, full_attn, core_attn; `selective` = core_attn) or
    a `llmtrain.models.recompute.Recompute`, priced by `llmtrain.plan.recompute`. The row's `recompute` and
    `recompute_granularity` are the mode's name (what `train.recompute` takes); every mode is `runnable`.
    `amp` is the precision planned: `none` (fp32) on a CPU profile; on a GPU profile `train.amp`, and bf16 when
    that is `none` (the GPU profiles hold bf16 kernel tables: fp32 training on a GPU is not modelled; the table
    says so). `overrides`: the command-line overrides that launch the row (`llmtrain.plan.overrides`).
    `timed` False: memory only when the row does not fit (the ranking's memory-first pruning): its time fields
    (`TIME_FIELDS`) are None. `offload`: (optimizer state, activations) offloaded to the host
    (`train.offload_optimizer`, `train.offload_activations`, priced by `llmtrain.plan.recompute.with_offload`;
    timed only when it fits with what it moves off the device). `mem`: the layout's `memory_estimate` under this
    recompute when the caller has it already (the ranking's offloaded row after its plain row), not recomputed."""
    gpu = dev.async_launch  # a GPU profile (a CPU's ops run where they are dispatched)
    flash = model_cfg.attention == "flash" or (model_cfg.attention == "auto" and gpu)
    amp = "none" if not gpu else (cfg.train.amp if cfg.train.amp != "none" else "bf16")
    device = "gpu" if gpu else "cpu"
    label = mode_name(plan_recompute(recompute))
    imbalance = getattr(cfg.plan, "moe_imbalance", None)
    if mem is not None:
        mem = dict(mem)  # a copy: the rows do not share their memory dicts
    else:
        mem = memory_estimate(model_cfg, layout, cfg.data.seq_len, recompute, amp, device, dev.dtype_bytes, flash,
                              dev.framework_bytes, moe_imbalance=imbalance, fp8=getattr(dev, "fp8", None) is not None,
                              fp8_cached_copies=dev.fp8.cached_copies if getattr(dev, "fp8", None) is not None else 0)
    if any(offload) and not timed:  # its memory first (what offload saves in bytes does not depend on times)
        unit = dict.fromkeys(("compute_s", "step_time_s", "tokens_per_sec_per_device", "mfu"), 1.0)
        offloaded, _ = with_offload(model_cfg, layout, cfg.data.seq_len, dev, mem, unit, optimizer=offload[0],
                                    activations=offload[1], kept=recompute_kept_bytes(
                                        model_cfg, cfg.data.seq_len // getattr(layout, "cp", 1), layout.micro_batch,
                                        dev.dtype_bytes))
        timed = offloaded["total"] <= dev.memory_bytes
    if timed or mem["total"] <= dev.memory_bytes:
        est = time_estimate(model_cfg, layout, cfg.data.seq_len, recompute, dev, cfg.plan.devices_per_node, flash,
                            "none" if amp == "none" else "bf16", moe_imbalance=imbalance)
    else:
        est = dict.fromkeys(TIME_FIELDS)
    if any(offload) and est["step_time_s"] is not None:
        kept = recompute_kept_bytes(model_cfg, cfg.data.seq_len // getattr(layout, "cp", 1), layout.micro_batch,
                                    dev.dtype_bytes)
        mem, est = with_offload(model_cfg, layout, cfg.data.seq_len, dev, mem, est, optimizer=offload[0],
                                activations=offload[1], kept=kept)
    fits = mem["total"] <= dev.memory_bytes
    if not fits and not timed:
        est = {**est, **dict.fromkeys(TIME_FIELDS)}
    cp, cp_comm = getattr(layout, "cp", 1), getattr(layout, "cp_comm", "ring")
    ep = getattr(layout, "ep", 1)
    name = layout_name(layout.dp, layout.tp, layout.pp, layout.sharding, layout.sharding_stage, layout.virtual_pp,
                       cp, cp_comm, ep, layout.pp_schedule)
    row = {"name": name, "dp": layout.dp, "cp": cp, "cp_comm": cp_comm, "tp": layout.tp, "pp": layout.pp,
           "virtual_pp": layout.virtual_pp, "pp_layers": list(layout.pp_layers),
           "pp_schedule": layout.pp_schedule, "sharding": layout.sharding, "sharding_stage": layout.sharding_stage,
           "ep": ep, "edp": layout.dp * layout.sharding // ep,
           "micro_batch": layout.micro_batch, "grad_accum": layout.grad_accum, "recompute": label,
           "recompute_granularity": label, "runnable": True,
           "offload_optimizer": bool(offload[0]), "offload_activations": bool(offload[1]),
           "amp": amp, "fits": fits, "memory_bytes": mem, **est}
    row["knobs"] = {k: True for k in enabled(layout)}  # the communication options priced (plan/overlap.py)
    if layout.sharding_split_param and layout.sharding_comm_buffer_mb != 256:
        row["knobs"]["sharding_comm_buffer_mb"] = layout.sharding_comm_buffer_mb
    row["overrides"] = launch_overrides(row, cfg.train.amp)
    return row


TIME_FIELDS = ("compute_s", "host_s", "device_s", "ep_comm_s", "kernels_per_step", "dp_sharding_comm_s", "tp_comm_s",
               "pp_p2p_s", "bubble_s", "loop_comm_s", "cp_comm_s", "step_time_s", "tokens_per_sec_per_device", "mfu")
"""The fields of a row `time_estimate` fills (None in a row that does not fit: not timed)."""


def _order(r: dict) -> tuple:
    """Fitting rows by predicted tokens/s (fastest first), then less memory on the worst rank; the rest by memory."""
    speed = r["tokens_per_sec_per_device"]
    return (not r["fits"], -round(speed, 6) if speed is not None else 0.0, r["memory_bytes"]["total"])


def rank_layouts(cfg, model_cfg, context: bool | None = None, progress: bool = False) -> list[dict]:
    """Every valid (layout, micro-batch, recompute none/full/full_attn/core_attn) for cfg.plan.devices: fitting ones first, then by predicted tokens/s,
    then by less memory on the worst rank. When no layout without context parallelism fits (a sequence too long
    for one device's memory) and the parallel config has cp, the layouts with cp > 1 are ranked too (`context`
    True: always; False: never). `progress`: a progress bar on stderr while it ranks (a terminal only)."""
    rows = _rank(cfg, model_cfg, context=False, progress=progress)
    if context is not False and (context or not any(r["fits"] for r in rows)):
        both = _rank(cfg, model_cfg, context=True, progress=progress)
        both.pruned += rows.pruned
        both += rows
        rows = both
        rows.sort(key=_order)
    return rows


class Ranking(list):
    """The ranked rows, with `pruned`: the valid (layout, micro-batch, recompute) combinations not listed because no
    split of their pipeline stages fits the device (`llmtrain.plan.prune.split_free_bound`)."""

    pruned: int = 0


def _rank(cfg, model_cfg, context: bool, progress: bool = False) -> list[dict]:
    """Every valid row; memory first, and only the rows that fit are timed (`evaluate(timed=False)`)."""
    from llmtrain.plan.fp8 import with_fp8

    dev = with_fp8(get_device(cfg.plan.device, cfg.plan.profile), cfg.train.fp8,  # train.fp8: FP8 GEMMs priced
                   weight_cache=cfg.train.fp8_weight_cache)
    rows = Ranking()
    amp = "none" if not dev.async_launch else (cfg.train.amp if cfg.train.amp != "none" else "bf16")
    device = "gpu" if dev.async_launch else "cpu"
    if context:  # what llmtrain's context parallelism refuses (the model, the sequence, the exchange)
        from llmtrain.parallel.context_checks import context_problems
    fit_memo: dict = {}
    trains = {mb: dataclasses.replace(cfg.train, micro_batch_size=mb, grad_accum=None) for mb in MICRO_BATCHES}
    import sys

    pcs = list(candidates(cfg.plan.devices, context, model_cfg.moe_num_experts))
    if progress and sys.stderr.isatty():  # a progress bar on a terminal only (tqdm not even imported otherwise)
        from tqdm import tqdm

        pcs = tqdm(pcs, file=sys.stderr, leave=False, unit=" parallel configs",
                   desc=f"ranking {model_cfg.name} on {cfg.plan.devices} x {cfg.plan.device}" + (" (cp)" if context else ""))
    for pc in pcs:
        key = (pc.tp, pc.pp, pc.virtual_pp, pc.pp_schedule, pc.ep, pc.dp * pc.sharding)  # all model_fit_problems reads
        if key not in fit_memo:
            fit_memo[key] = bool(model_fit_problems(pc, model_cfg))
        if fit_memo[key]:
            continue
        if context and context_problems(pc, model_cfg, cfg.data.seq_len, bool(getattr(cfg.data, "document_mask", False)),
                                        dev.async_launch):
            continue
        for mb in MICRO_BATCHES:
            train = trains[mb]
            layout, problems = layout_problems(pc, train, cfg.plan.devices)
            if problems:
                continue
            moe = moe_plan(layout, dev, cfg.plan.devices_per_node, cfg.plan.moe_imbalance)
            # memory floors shared by the modes: each block keeps at least its input under any recompute (what
            # full keeps), so where that floor does not fit, no mode does (counted in `pruned`, not listed)
            if layout.pp > 1 and not layout.pp_layers and split_free_bound(
                    model_cfg, layout, seq_len=cfg.data.seq_len, mode="parts", amp=amp, device=device, dev=dev,
                    moe_imbalance=cfg.plan.moe_imbalance) > dev.memory_bytes:
                rows.pruned += len(RECOMPUTE)  # fits under no split of its blocks (llmtrain/plan/prune.py)
                continue
            floor_fits = True
            for recompute in ("full", *(r for r in RECOMPUTE if r != "full")):
                if not floor_fits:
                    rows.pruned += 1
                    continue
                if layout.pp > 1 and not layout.pp_layers and recompute in ("none", "full") and split_free_bound(
                        model_cfg, layout, seq_len=cfg.data.seq_len, mode=recompute, amp=amp, device=device, dev=dev,
                        moe_imbalance=cfg.plan.moe_imbalance) > dev.memory_bytes:
                    rows.pruned += 1
                    continue
                # the default pipeline split is priced as the run would resolve it
                split = with_pipeline_split(layout, model_cfg, dev, seq_len=cfg.data.seq_len,
                                            recompute=recompute_mode(recompute), moe=moe)
                plain = evaluate(cfg, model_cfg, split, recompute, dev, timed=False)
                rows.append(plain)
                # + offload (a GPU's PCIe link), where the row does not fit without it (where it does, the same
                # layout without offload is as small a step or smaller: the offloaded row would only be slower)
                if recompute == "full" and getattr(dev, "host_bw", None) and not plain["fits"]:
                    rows.append(evaluate(cfg, model_cfg, split, recompute, dev, timed=False,
                                         offload=(True, model_cfg.moe_num_experts == 0), mem=plain["memory_bytes"]))
                if recompute == "full" and layout.pp == 1:  # one stage: the same blocks under every mode
                    held = plain["memory_bytes"]
                    floor_fits = held["total"] - held.get("recompute_transient", 0) <= dev.memory_bytes
    rows.sort(key=_order)
    return rows
