"""What every rank of a LoRA run holds, checked against the layout (reads `<run.dir>/memory.json`).

    from lora_checks import check_lora_memory
    check_lora_memory(json.load(open(run / "memory.json")), json.load(open(ref / "memory.json")), "tp2")

Written from the definitions, not read from the product (`ref` is the one-process run: full shapes):
- the optimizer holds state for exactly this rank's adapters (AdamW: 2 moments + 2 [1] beta powers each),
  nothing for the frozen base; gradients exist for the adapters only;
- tp: an adapter on a column-parallel base (q, k, v, gate, up) holds lora_B [r, out/tp] and lora_A whole,
  on a row-parallel base (o, down) lora_A [in/tp, r] and lora_B whole; the base weights are split as in
  `memory_checks.SPLIT_AXES`; an adapter replicated whole on every tp rank fails;
- pp: the adapters of a layer sit on the stage holding the layer: stages disjoint, union = all adapters;
- dp: every rank holds every adapter whole;
- ZeRO-1/2 (sharding2, zero2): the sharding ranks keep the adapters' optimizer state in disjoint shares covering
  all adapters (`memory_checks.check_sharded_optimizer`), none for the base; V1 tensor fusion (sharding2tf): on
  fused parameters of each rank's own adapters, disjoint and covering them (`memory_checks.check_fused_optimizer`);
- ZeRO-3 (zero3): every parameter above `segment_size` elements, frozen base and adapters alike, is held as its
  flat slice and not whole (`memory_checks.check_zero3_slice`: the frozen base is cut back after the backward,
  which Paddle 3.3.1 does not do for frozen parameters), the others whole; optimizer state for this rank's
  adapter slices and whole small adapters only;
- ZeRO-2/3 gradients live in Paddle's buffers: more than zero, at most the adapters' bytes plus one CPU alignment
  (4096 bytes) per adapter, and less than the frozen base's bytes.
"""
from __future__ import annotations

import itertools
import re
from math import prod

from memory_checks import CPU_ALIGN_ELEMENTS, DEGREES, check_fused_optimizer, check_sharded_optimizer, check_v2_split, check_zero3_slice, split_axis

COLUMN = re.compile(r".*\.(q|k|v|gate|up)_proj\.lora_[AB]")
ALIGN_BYTES = 4 * CPU_ALIGN_ELEMENTS
"""Paddle's ZeRO-2/3 gradient storages align each parameter's gradient to 4096 bytes on CPU."""


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def adapter_axis(name: str):
    """The axis of an adapter factor split across tp ranks (None: whole)."""
    if COLUMN.fullmatch(name):
        return 1 if name.endswith("lora_B") else None
    return 0 if name.endswith("lora_A") else None


def check_lora_memory(got: dict, ref: dict, layout: str, segment_size: int = 2**20) -> None:
    d = DEGREES[layout]
    full = {n: p["shape"] for n, p in ref["ranks"][0]["params"].items()}
    adapters = {n for n in full if is_adapter(n)}
    assert adapters and set(ref["ranks"][0]["optimizer_params"]) == adapters
    assert len(got["ranks"]) == d.world, layout
    sharded = d.sharding > 1 and d.stage in (1, 2)  # optimizer state shared out over the sharding ranks
    zero3 = d.sharding > 1 and d.stage == 3
    stage_adapters, sliced = {}, set()
    for e in got["ranks"]:
        mine = {n for n in e["params"] if is_adapter(n)}
        trained = 0
        for name, p in e["params"].items():
            if zero3 and prod(full[name]) > segment_size:  # frozen base and adapters alike, by size
                check_zero3_slice(layout, e, name, p, full[name])
                sliced.add(name)
            else:
                want = list(full[name])
                axis = adapter_axis(name) if name in adapters else split_axis(name)
                if axis is not None and d.tp > 1:
                    want[axis] //= d.tp
                assert p["shape"] == want and "zero3" not in p, (
                    f"{layout}: rank {e['rank']} (tp rank {e['tp_rank']}) holds {name} as {p['shape']}, expected "
                    f"{want} (full {full[name]}, split axis {axis}, tp={d.tp})")
            if name in adapters:
                trained += p["numel"]
        state = set(e["optimizer_params"]) if not d.fused else set()  # V1 tensor fusion: fused names, checked below
        assert (state <= mine) if sharded else (state == mine), (layout, e["rank"], sorted(state ^ mine)[:4])
        for name in state if not d.v2 else ():  # V2: flat slices, checked per sharding group below
            assert e["optimizer_params"][name] == 2 * e["params"][name]["numel"] + 2, (layout, name)
        if d.sharding > 1 and d.stage in (2, 3):  # Paddle's own gradient buffers: for the adapters, never the base
            frozen_bytes = e["param_bytes"] - 4 * trained
            assert 0 < e["grad_bytes"] <= 4 * trained + len(mine) * ALIGN_BYTES and e["grad_bytes"] < frozen_bytes, (
                layout, e["rank"], e["grad_bytes"], trained, frozen_bytes)
        else:
            assert e["grad_bytes"] == 4 * trained, (layout, e["rank"], e["grad_bytes"], trained)
        assert stage_adapters.setdefault(e["pp_rank"], mine) == mine, (layout, e["rank"], "differs from its stage")
    assert set().union(*stage_adapters.values()) == adapters, layout
    for a, b in itertools.combinations(range(d.pp), 2):
        assert not stage_adapters[a] & stage_adapters[b], f"{layout}: stages {a} and {b} share adapters"
    if sharded and d.v2:  # stage-1 V2: the adapters' states split by position over each sharding group
        groups = {}
        for e in got["ranks"]:
            groups.setdefault((e["dp_rank"], e["tp_rank"], e["pp_rank"]), []).append(e)
        for members in groups.values():
            check_v2_split("sharding", members, is_adapter, d.sharding, require_split=False)
    elif sharded and d.fused:  # V1 tensor fusion: each rank's state on fused parameters of its own adapters
        check_fused_optimizer(layout, got["ranks"], is_adapter)
    elif sharded:
        check_sharded_optimizer(layout, got["ranks"], is_adapter)
    if zero3:  # the segment slices some adapters and leaves others whole, and slices the base: every path runs
        assert sliced & adapters and adapters - sliced and sliced - adapters, (layout, sorted(sliced)[:6])
