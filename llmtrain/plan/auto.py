"""`+parallel=auto`: replace the layout by the planner's top-ranked one that fits, before `resolve`.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py +parallel=auto
    cfg = choose_layout(to_config(dcfg))      # cfg unchanged unless parallel.name == "auto"

The job's world size is the launcher's (PADDLE_TRAINERS_NUM); the device profile is
`plan.device` on GPU and `cpu-here` on CPU (`plan.profile`, the calibrated file, when it exists; else the
packaged one). Every rank computes the same choice from the config and the same profile file (nothing is
measured per process), so no two ranks can rank differently (no collective exists yet). The micro-batch and
recompute choices follow the operator-level cost model (llmtrain/plan/timeline.py): a micro-batch too small
to keep the device busy is predicted slow, as it measures.
The chosen degrees, micro-batch and recompute replace `parallel.*`, `train.micro_batch_size`
(grad_accum derived from the global batch) and `train.recompute` (none, full, full_attn or core_attn, each priced
by llmtrain/plan/recompute.py); the run then goes on
exactly as if they had been given. The top three, the reason the first won and the overrides that pin the choice
are logged, and so is a precision the plan assumed but the config does not train in (bf16 on a GPU profile when
`train.amp=none`).
"""
from __future__ import annotations

import dataclasses
import os

from llmtrain.parallel.config import ParallelConfig


def choose_layout(cfg, world_size: int | None = None, log=None):
    """`cfg` with the planner's first fitting layout when `parallel.name == "auto"`, else `cfg` itself."""
    if cfg.parallel is None or cfg.parallel.name != "auto":
        return cfg
    import paddle

    from llmtrain.errors import ConfigError
    from llmtrain.plan.model import planned_model
    from llmtrain.plan.search import rank_layouts

    if log is None:
        from llmtrain.utils.log import log0 as log
    world = world_size or int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    on_cpu = paddle.get_device() == "cpu"
    plan_cfg = dataclasses.replace(cfg.plan, devices=world, device="cpu-here" if on_cpu else cfg.plan.device)
    planned = dataclasses.replace(cfg, plan=plan_cfg)
    rows = rank_layouts(planned, planned_model(planned))
    fitting = [r for r in rows if r["fits"] and r["runnable"]]
    if not fitting:
        raise ConfigError([f"parallel=auto: none of the {len(rows)} valid layouts of {world} x {plan_cfg.device} fits in memory "
                           "with any recompute mode"])
    best = fitting[0]
    log(f"parallel=auto on {world} x {plan_cfg.device}: {len(fitting)} of {len(rows)} valid (layout, micro-batch, recompute) "
        "fit; top three:")
    for r in fitting[:3]:
        log(f"  {r['name']} micro-batch {r['micro_batch']} recompute {r['recompute']}: {r['tokens_per_sec_per_device']:.0f} "
            f"tokens/s/device predicted, step {r['step_time_s']:.3f} s, worst rank {r['memory_bytes']['total'] / 2**30:.2f} GiB")
    if len(fitting) > 1:
        second = fitting[1]
        why = ("highest predicted tokens/s per device" if best["tokens_per_sec_per_device"] > second["tokens_per_sec_per_device"]
               else "tied on predicted tokens/s; less memory on the worst rank")
    else:
        why = "the only layout that fits"
    log(f"parallel=auto chose {best['name']}: {why} (to pin it: {' '.join(best['overrides']) or 'no +parallel'})")
    if best["amp"] != cfg.train.amp:  # a GPU profile plans bf16 when train.amp=none
        log(f"parallel=auto: the layouts were planned in {best['amp']} AMP, but train.amp={cfg.train.amp}: the run "
            f"trains as configured (set train.amp={best['amp']} to train as planned)")
    knobs = _kept_knobs(cfg.parallel, best, log)
    if best.get("cp", 1) > 1:  # chosen only when no layout without context parallelism fits (search.rank_layouts)
        knobs.update(cp=best["cp"], cp_comm=best["cp_comm"])
    parallel = ParallelConfig(name=best["name"], dp=best["dp"], tp=best["tp"], pp=best["pp"], sharding=best["sharding"],
                              sharding_stage=best["sharding_stage"], pp_schedule=best["pp_schedule"],
                              virtual_pp=best["virtual_pp"], pp_layers=best["pp_layers"] or None,
                              ep=best.get("ep", 1), ep_dispatcher=cfg.parallel.ep_dispatcher,
                              zero3_segment_size=cfg.parallel.zero3_segment_size,
                              order=list(cfg.parallel.order), **knobs)
    train = dataclasses.replace(cfg.train, micro_batch_size=best["micro_batch"], grad_accum=None,
                                recompute=best["recompute"], offload_optimizer=best.get("offload_optimizer", False),
                                offload_activations=best.get("offload_activations", False))
    return dataclasses.replace(cfg, parallel=parallel, train=train)


def _kept_knobs(given, best: dict, log) -> dict:
    """The switches given with +parallel=auto (sequence parallelism, communication overlap) that apply to the
    chosen layout: tp ones when tp > 1, pipeline ones when pp > 1; the others are logged and dropped."""
    from llmtrain.parallel.overlap import KNOBS

    needs = {"sequence_parallel": "tp", "mp_async_allreduce": "tp", "pp_overlap_p2p_comm": "pp", "pp_enable_timer": "pp"}
    kept = {}
    for name in ("sequence_parallel", *KNOBS):
        if getattr(given, name, False):
            axis = needs.get(name)
            if axis is None or best[axis] > 1:
                kept[name] = True  # the refused ones stay, so the run says why they are refused
            else:
                log(f"parallel=auto: parallel.{name}=true dropped: the chosen layout has {axis}=1")
    return kept
