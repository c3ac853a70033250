"""Plan before renting GPUs: every valid layout's per-rank memory and predicted throughput.

    python -m llmtrain.plan model=llama-7b data.seq_len=4096 train.global_batch_size=1024 plan.devices=64 plan.device=a100-80g
    python -m llmtrain.plan model=llama-7b plan.devices=8 +parallel=dp2tp2 parallel.dp=2 parallel.sharding=2   # explain one
    python -m llmtrain.plan model=llama-7b plan.devices=64 plan.format=json plan.top=3
    python -m llmtrain.plan --calibrate [--out work/cpu-here.json]      # measure cpu-here (calibrate.py)
    python -m llmtrain.plan --help                                       # the options, the plan.* fields

Composed from the same Hydra tree as pretraining (conf/config.yaml + the `plan` section,
llmtrain/plan/config.py). Memory: llmtrain/plan/memory.py (exact parameter/optimizer
counts, the parameter list read off the model: params.py) and estimate.py (activations, time); time:
kernels.py (the kernels of a step), timeline.py (host and device), profile.py (device profiles as data,
profiles/*.json), calibrate.py (`--calibrate`: measure this machine); what is printed: report.py (units, each
row's launch overrides from overrides.py).
"""
from __future__ import annotations

import json
import sys

import hydra

from llmtrain.config import refuse_unknown_keys, register_configs, to_config
from llmtrain.errors import ConfigError
from llmtrain.plan.model import planned_model

register_configs()


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

        if cfg.plan.recompute is not None and cfg.plan.recompute not in RECOMPUTE + ("selective",):
            raise ConfigError([f"plan.recompute={cfg.plan.recompute!r}: expected one of {list(RECOMPUTE)} or null"])
        if cfg.plan.recompute is not None:
            recompute = cfg.plan.recompute
        else:
            from llmtrain.models.recompute import recompute_of

            recompute = recompute_of(cfg.train, model.num_layers, layout.pp_layers)
        from llmtrain.plan.fp8 import with_fp8

        dev = with_fp8(get_device(cfg.plan.device, cfg.plan.profile), cfg.train.fp8,  # train.fp8: FP8 GEMMs priced
                   weight_cache=cfg.train.fp8_weight_cache)
        from llmtrain.plan.estimate import moe_plan, recompute_mode
        from llmtrain.plan.stage_cost import with_pipeline_split

        layout = with_pipeline_split(layout, model, dev, seq_len=cfg.data.seq_len, recompute=recompute_mode(recompute),
                                     moe=moe_plan(layout, dev, cfg.plan.devices_per_node, cfg.plan.moe_imbalance))
        return [evaluate(cfg, model, layout, recompute, dev)]
    return rank_layouts(cfg, model, progress=True)


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
    from llmtrain.plan.devices import get_device
    from llmtrain.plan.report import explained, ranked_table

    if cfg.parallel is not None:
        print("\n".join(explained(rows[0], cfg, get_device(p.device, p.profile).memory_bytes)))
    else:
        print("\n".join(ranked_table(rows, cfg, p.top)))


USAGE = """\
usage: python -m llmtrain.plan [OVERRIDE ...]                      rank every valid layout of the job
       python -m llmtrain.plan +parallel=NAME [OVERRIDE ...]       explain one layout (NAME: conf/parallel/, or
                                                                   custom with parallel.dp=... as a row prints)
       python -m llmtrain.plan --calibrate [--out PATH] [--quick]  measure this machine into a cpu-here profile
       python -m llmtrain.plan --help                              this text (--hydra-help: Hydra's own options)

Predicts every layout's per-rank memory (GiB) and step time before launch, for plan.devices devices of profile
plan.device. OVERRIDEs are Hydra overrides of the pretraining config (conf/config.yaml: model=, data.seq_len=,
train.global_batch_size=, train.amp=, model.vocab_size=, ...) plus the plan section:

{plan_fields}

device profiles (plan.device; UNMEASURED ones are another profile's tables scaled by datasheet ratios):
{profiles}

--calibrate measures this machine with Paddle (kernel tables, the training loop's host time, gloo collectives)
into a profile file: --out PATH (default work/cpu-here.json, which plan.profile reads for plan.device=cpu-here),
--quick for small tables (seconds). The ranked table ends with the overrides that launch each row.

examples:
  python -m llmtrain.plan model=llama-7b data.seq_len=4096 train.global_batch_size=1024 plan.devices=64 plan.device=h100
  python -m llmtrain.plan model=llama-7b plan.devices=8 +parallel=dp2tp2 parallel.dp=2 parallel.sharding=2
  python -m llmtrain.plan model=llama-7b plan.devices=64 plan.format=json plan.top=3
  python -m llmtrain.plan --calibrate

docs/planning.md explains the model and how well it predicts measured runs."""


def usage() -> str:
    from llmtrain.plan.config import PlanConfig
    from llmtrain.utils.cli import field_help

    from llmtrain.plan.profile import measured_note, names

    profiles = "\n".join(f"  {n:9} {measured_note(n)}" for n in names())
    return USAGE.format(plan_fields="\n".join(field_help(PlanConfig, "plan")), profiles=profiles)


def cli(argv: list[str]) -> None:
    """The command line: --help and --calibrate before Hydra (whose own --help is a dump of the config)."""
    if "--help" in argv or "-h" in argv:
        print(usage())
        return
    if "--calibrate" in argv:
        from llmtrain.plan.calibrate import main as calibrate_main

        calibrate_main(argv)
        return
    refuse_unknown_keys("config", argv, command="python -m llmtrain.plan")  # exit 2 naming the nearest key
    main()


if __name__ == "__main__":
    cli(sys.argv[1:])
