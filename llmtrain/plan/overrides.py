"""The command-line overrides that launch a row of the planner's table.

    python -m llmtrain.plan model=llama-7b plan.devices=64 plan.device=h100     # each row's overrides, printed
    launch_overrides(row, given_amp="none")  # ["+parallel=custom", "parallel.dp=8", "parallel.sharding=8", ...]

A row's `name` (`dp8sharding8s1`) spells its degrees; it is not a file of conf/parallel/. The overrides select the
preset of exactly those degrees when one exists (`+parallel=dp8`), else `+parallel=custom` with every degree that
is not 1 (nothing for one device), then the row's micro-batch (`train.micro_batch_size`; grad_accum follows from the global batch),
`train.recompute=true` for full recompute, and `train.amp=bf16` when the row was planned in bf16 but the config
said `train.amp=none` (a GPU profile plans bf16 AMP). They go after the model, data and train overrides the plan
was made with.
"""
from __future__ import annotations

import functools
import os

DEGREES = {"dp": 1, "tp": 1, "pp": 1, "sharding": 1, "sharding_stage": 1, "pp_schedule": "1f1b", "virtual_pp": 1,
           "cp": 1, "cp_comm": "ring", "ep": 1}
"""The fields of a planned layout, with ParallelConfig's defaults."""


@functools.lru_cache(maxsize=1)
def _presets() -> dict:
    """conf/parallel presets that set degrees only: their full degrees (defaults filled in) -> file name."""
    from omegaconf import OmegaConf

    from llmtrain.utils.paths import REPO_ROOT

    found = {}
    folder = os.path.join(REPO_ROOT, "conf", "parallel")
    for fname in sorted(os.listdir(folder)):
        raw = OmegaConf.to_container(OmegaConf.load(os.path.join(folder, fname)))
        keys = set(raw) - {"defaults", "name"}
        if fname.endswith(".yaml") and keys and keys <= set(DEGREES):
            found.setdefault(tuple(sorted((DEGREES | raw | {"name": None, "defaults": None}).items())), fname[:-5])
    return found


@functools.lru_cache(maxsize=4096)
def _layout_overrides(values: tuple) -> tuple:
    """The overrides that select the layout of degrees `values` (DEGREES' order): a preset, or `+parallel=custom`
    with every degree that is not 1 (none for one device); remembered (a ranking asks for every row)."""
    degrees = dict(zip(DEGREES, values))
    key = tuple(sorted((degrees | {"name": None, "defaults": None}).items()))
    preset = _presets().get(key)
    if degrees == DEGREES:
        return ()  # one device: no +parallel
    if preset:
        return (f"+parallel={preset}",)
    return ("+parallel=custom", *(f"parallel.{k}={v}" for k, v in degrees.items() if v != DEGREES[k]))


def launch_overrides(row: dict, given_amp: str) -> list[str]:
    """The overrides that run `row` (a `llmtrain.plan.search.evaluate` row) as planned."""
    out = list(_layout_overrides(tuple(map(row.get, DEGREES, DEGREES.values()))))  # row.get(k, default) per k
    out += [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in row.get("knobs", {}).items()]
    out.append(f"train.micro_batch_size={row['micro_batch']}")
    if row["recompute"] not in (False, "none"):
        out.append(f"train.recompute={'full' if row['recompute'] is True else row['recompute']}")
    out += [f"train.{k}=true" for k in ("offload_optimizer", "offload_activations") if row.get(k)]
    if row["amp"] != given_amp and row["amp"] != "none":
        out.append(f"train.amp={row['amp']}")
    return out
