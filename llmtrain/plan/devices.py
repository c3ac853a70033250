"""Device profiles of the planner, by name: the data files under llmtrain/plan/profiles/ (profile.py).

    python -m llmtrain.plan plan.device=h100 ...      # llmtrain/plan/profiles/h100.json
    python -m llmtrain.plan plan.device=cpu-here plan.profile=work/cpu-here.json

Every constant and table of a profile, and where it comes from, is in its file (`source` / `provenance`
fields): `h200` is fitted from kernel tables measured on a real H200; the other GPUs are the H200's tables
scaled by datasheet ratios (said in each file); `cpu-here` is what `python -m llmtrain.plan --calibrate`
measures on this machine with Paddle. `plan.profile` names a calibrated profile file: it is used when it
exists and its `name` is `plan.device` (the default, work/cpu-here.json, serves cpu-here). The packaged cpu-here
profile is another machine's: using it says so, with the command that measures this one.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Optional

from llmtrain.plan.profile import Profile, from_dict, load_profile, names

Device = Profile


def get_device(name: str, profile: Optional[str] = None) -> Profile:
    """The profile `name`; the calibrated file `profile` instead when it exists and is a profile of `name`."""
    if name not in names():
        raise ValueError(f"plan.device={name!r}: expected one of {names()}")
    if profile and os.path.exists(profile):
        with open(profile) as f:
            raw = json.load(f)
        if "gemm" not in raw:
            raise ValueError(f"{profile}: not a device profile with kernel tables (written by an older "
                             "`--calibrate`?); run python -m llmtrain.plan --calibrate again")
        if raw.get("name") == name:
            return from_dict(raw, profile)
    if name == "cpu-here":
        _packaged_cpu_note(profile or "work/cpu-here.json")
    return load_profile(name)


@lru_cache(maxsize=None)
def _packaged_cpu_note(calibrated: str) -> None:
    """Say once that the packaged cpu-here profile is the development host's, and how to measure this machine."""
    from llmtrain.plan.profile import PROFILE_DIR
    from llmtrain.utils.log import log0

    with open(PROFILE_DIR / "cpu-here.json") as f:
        when = json.load(f).get("measured_at", "?")
    log0(f"plan.device=cpu-here: the packaged profile, measured on the development host ({when}); a CPU's speed "
         "differs by machine and load (the quickstart's gpt-tiny dp2 on a loaded 2-core host: 1,001 tokens/s per "
         "device predicted, 600-720 measured): `python -m llmtrain.plan --calibrate` measures this machine into "
         f"{calibrated}, which is used from then on")
