"""What every rank of a parallel run holds, checked against the layout (reads `<run.dir>/memory.json`).

    from memory_checks import check_memory
    check_memory(json.load(open(run / "memory.json")), json.load(open(ref / "memory.json")), "tp2pp2", tied=True)

`ref` is the memory.json of the one-process run of the same model: it gives every
parameter's full shape. The expectations below are written from the layout's definition,
not read from the product: a layout whose ranks silently hold more than their part (tp
falling back to replication, pp giving every rank every layer, ZeRO-3 not slicing,
ZeRO-1/2 keeping all optimizer state on every rank) fails here even when its losses equal
one process.

Rules (AdamW: two moments of the parameter's shape plus two [1] beta powers per parameter):
- tp: the split tensors hold 1/tp of their split axis on each tp rank (`SPLIT_AXES`), every
  other tensor (norms, position tables, row-linear biases, MLA's replicated q_a/kv_a down-projections) is whole;
- pp: the ranks of one stage hold the same names; stages are disjoint except the tied word
  table (first and last stage); their union is the whole model; with v virtual stages the
  layers form pp x v equal chunks and stage s holds chunks s, s + pp, ... (interleaved);
- ZeRO-3 (`sharding_stage=3`): a parameter of more than `segment_size` elements (except a
  tied table, which stays whole) is held as a flat slice [start, end) of the flattened
  parameter padded to `padded` elements; the slices of the sharding ranks tile [0, padded)
  in rank order, and padded - numel < 1024 + sharding (Paddle aligns each parameter to
  4096 bytes = 1024 fp32 elements on CPU, then to a multiple of the sharding degree); the
  full tensor is not kept outside the forward;
- optimizer state: whole for every local parameter under dp/tp/pp; under ZeRO-1/2 the
  sharding ranks of a group own disjoint parameter sets covering the group's parameters,
  each at most 1/sharding of the parameter elements plus the largest parameter (Paddle's
  greedy partition); under ZeRO-3 the slices' state plus the unsliced parameters' whole state;
- sum over ranks of each parameter's elements / its number of copies == model_numel
  (ZeRO-3: + the padding of the sliced parameters);
- gradients (allocated after a step, zeros kept by clear_grad): as many bytes as the
  parameters, except under ZeRO-2/3, whose gradient buffers are Paddle's own (only > 0).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from fractions import Fraction
from math import prod

SPLIT_AXES = [  # (canonical name pattern, axis split over tp ranks): fleet's Megatron layout
    (r"embed\.word\.weight", 0),  # VocabParallelEmbedding [V/tp, h]
    (r".*\.(q|k|v|gate|up|q_b|kv_b)_proj\.weight", 1),  # ColumnParallelLinear [in, out/tp] (MLA: q_b, kv_b)
    (r".*\.(q|k|v|gate|up)_proj\.bias", 0),  # [out/tp]
    (r".*\.(o|down)_proj\.weight", 0),  # RowParallelLinear [in/tp, out] (its bias [out] is whole)
    (r"lm_head\.proj\.weight", 1),  # untied output projection [h, V/tp]
    (r"mlm_bias\.bias", 0),  # ERNIE's vocabulary bias [V/tp]
]
TIED = "embed.word.weight"
CPU_ALIGN_ELEMENTS = 4096 // 4


@dataclass
class Degrees:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sharding: int = 1
    stage: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.sharding * self.cp


DEGREES = {  # the layouts of conf/parallel/, written out here so a wrong config cannot go unnoticed
    "dp2": Degrees(dp=2), "tp2": Degrees(tp=2), "pp2": Degrees(pp=2), "sharding2": Degrees(sharding=2),
    "zero2": Degrees(sharding=2, stage=2), "zero3": Degrees(sharding=2, stage=3), "dp4": Degrees(dp=4),
    "dp2tp2": Degrees(dp=2, tp=2), "tp2pp2": Degrees(tp=2, pp=2), "dp2pp2": Degrees(dp=2, pp=2),
    "tp2sharding2": Degrees(tp=2, sharding=2), "pp4v2": Degrees(pp=4, vpp=2),
    "cp2": Degrees(cp=2), "dp2cp2": Degrees(dp=2, cp=2), "tp2cp2": Degrees(tp=2, cp=2), "pp2cp2": Degrees(pp=2, cp=2),
    "sharding2cp2": Degrees(sharding=2, cp=2), "zero2cp2": Degrees(sharding=2, stage=2, cp=2),
    "zero3cp2": Degrees(sharding=2, stage=3, cp=2),
}
"""Context parallelism (cp): every cp rank holds what its cp rank 0 holds (parameters, optimizer state, gradients
replicated over cp); `cp_rank` is one more coordinate of the rank entries."""


def split_axis(name: str):
    for pattern, axis in SPLIT_AXES:
        if re.fullmatch(pattern, name):
            return axis
    return None


def _layer(name: str):
    m = re.match(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def adam_state(numel: int) -> int:
    return 2 * numel + 2


def check_memory(got: dict, ref: dict, layout: str, tied: bool, segment_size: int = 2**20) -> None:
    d = DEGREES[layout]
    full = {n: p["shape"] for n, p in ref["ranks"][0]["params"].items()}  # one process: the whole model
    numel = {n: prod(s) for n, s in full.items()}
    assert ref["model_numel"] == got["model_numel"] == sum(numel.values()), (ref["model_numel"], got["model_numel"])
    assert all(ref["ranks"][0]["optimizer_params"][n] == adam_state(k) for n, k in numel.items())
    assert got["layout"] == {"dp": d.dp, "tp": d.tp, "pp": d.pp, "sharding": d.sharding,
                             "sharding_stage": d.stage, "virtual_pp": d.vpp, "cp": d.cp, "ep": d.ep}, (layout, got["layout"])
    ranks = got["ranks"]
    assert [e["rank"] for e in ranks] == list(range(d.world)), layout
    coords = sorted((e["dp_rank"], e["tp_rank"], e["pp_rank"], e["sharding_rank"], e.get("cp_rank", 0)) for e in ranks)
    assert coords == sorted(itertools.product(range(d.dp), range(d.tp), range(d.pp), range(d.sharding),
                                              range(d.cp))), coords

    # 1. shapes: tp slices, whole replicated tensors, ZeRO-3 flat slices
    for e in ranks:
        for name, p in e["params"].items():
            assert name in full, (layout, e["rank"], name)
            if d.stage == 3 and numel[name] > segment_size and not (tied and name == TIED):
                check_zero3_slice(layout, e, name, p, full[name])
                continue
            assert "zero3" not in p, (layout, e["rank"], name, p)
            want = list(full[name])
            axis = split_axis(name)
            if axis is not None and d.tp > 1:
                want[axis] //= d.tp
            assert p["shape"] == want and p["numel"] == prod(want), (
                f"{layout}: rank {e['rank']} (tp rank {e['tp_rank']}) holds {name} as {p['shape']}, expected {want} "
                f"(full {full[name]}, split axis {axis}, tp={d.tp})")
            assert p["bytes"] == 4 * p["numel"], (name, p)  # fp32

    # 2. pipeline stages: same names within a stage, disjoint across stages but for the tied table, union = model
    stage_names = {}
    for e in ranks:
        names = set(e["params"])
        assert stage_names.setdefault(e["pp_rank"], names) == names, (layout, e["rank"], "differs from its stage")
    assert set().union(*stage_names.values()) == set(full), (layout, set(full) - set().union(*stage_names.values()))
    for a, b in itertools.combinations(range(d.pp), 2):
        shared = stage_names[a] & stage_names[b]
        allowed = {TIED} if tied and (a, b) == (0, d.pp - 1) else set()
        assert shared == allowed, f"{layout}: pipeline stages {a} and {b} both hold {sorted(shared)[:5]}"
    n_layers = len({_layer(n) for n in full} - {None})
    chunk = n_layers // (d.pp * d.vpp)  # layers per (virtual) stage; stage s runs chunks s, s + pp, ...
    for s, names in stage_names.items():
        want = {(s + k * d.pp) * chunk + j for k in range(d.vpp) for j in range(chunk)}
        assert {_layer(n) for n in names} - {None} == want, (
            f"{layout}: pipeline stage {s} holds layers {sorted({_layer(n) for n in names} - {None})}, expected {sorted(want)}")

    # 3. every element counted once: sum over ranks of numel / copies == model (+ ZeRO-3 padding)
    total, padding = Fraction(0), 0
    for e in ranks:
        for name, p in e["params"].items():
            sliced = "zero3" in p
            copies = d.dp * d.cp * (1 if sliced else d.sharding) * (1 if split_axis(name) is not None else d.tp)
            copies *= 2 if tied and d.pp > 1 and name == TIED else 1
            total += Fraction(p["numel"], copies)
            if sliced and e["sharding_rank"] == 0 and e["dp_rank"] == 0:
                padding += p["zero3"]["padded"] - numel[name]
    assert total == got["model_numel"] + padding, (
        f"{layout}: ranks hold {float(total)} elements net of replication, the model has {got['model_numel']}"
        f" (+{padding} ZeRO-3 padding)")

    # 4. optimizer state
    for e in ranks:
        held = {n: adam_state(p["numel"]) for n, p in e["params"].items()}
        state = e["optimizer_params"]
        assert e["optimizer_numel"] == sum(state.values()), (layout, e["rank"])
        if d.sharding == 1 or d.stage == 3:
            assert state == held, f"{layout}: rank {e['rank']} optimizer state {_diff(state, held)}"
    if d.sharding > 1 and d.stage in (1, 2):
        check_sharded_optimizer(layout, ranks, lambda name: True)

    # 5. gradients
    for e in ranks:
        if d.stage in (2, 3) and d.sharding > 1:
            assert e["grad_bytes"] > 0, (layout, e["rank"])
        else:
            assert e["grad_bytes"] == e["param_bytes"], (layout, e["rank"], e["grad_bytes"], e["param_bytes"])


AXIS_OF = {"dp": "dp_rank", "tp": "tp_rank", "pp": "pp_rank", "sharding": "sharding_rank", "cp": "cp_rank"}


def check_groups(got: dict, sharding: int, ep: int) -> None:
    """Every rank's memory.json "groups" from its coordinates: an axis kind holds the ranks equal in every other
    coordinate, ordered by that axis; "data" the ranks of one (tp, pp, cp) coordinate ordered by the data index
    dp_rank x sharding + sharding_rank; "ep" those of its data group with the same data index // ep, "edp" with
    the same data index mod ep; every rank of a group names the same group."""
    ranks = {e["rank"]: e for e in got["ranks"]}
    coord = {r: {a: e.get(k, 0) for a, k in AXIS_OF.items()} for r, e in ranks.items()}
    index = {r: c["dp"] * sharding + c["sharding"] for r, c in coord.items()}
    for r, e in ranks.items():
        want = {}
        for axis in AXIS_OF:
            same = [m for m in ranks if all(coord[m][a] == coord[r][a] for a in AXIS_OF if a != axis)]
            want[axis] = sorted(same, key=lambda m: coord[m][axis])
        data = sorted((m for m in ranks if all(coord[m][a] == coord[r][a] for a in ("tp", "pp", "cp"))),
                      key=index.get)
        want["data"] = data
        want["ep"] = [m for m in data if index[m] // ep == index[r] // ep]
        want["edp"] = [m for m in data if index[m] % ep == index[r] % ep]
        assert e["groups"] == want, f"rank {r}: memory.json groups {e['groups']}, the layout says {want}"
        assert e["ep_rank"] == want["ep"].index(r), (r, e["ep_rank"], want["ep"])


def check_zero3_slice(layout: str, e: dict, name: str, p: dict, full_shape: list) -> None:
    """Rank entry `e` holds parameter `name` (memory.json entry `p`) as its ZeRO-3 flat slice: [start, end) of the
    flattened parameter padded to a multiple of the sharding degree after Paddle's CPU alignment, in rank order;
    the full tensor is not kept outside the forward."""
    d = DEGREES[layout]
    z = p.get("zero3")
    assert z is not None, f"{layout}: rank {e['rank']} holds {name} {p['shape']} whole; ZeRO-3 must slice it"
    padded = z["padded"]
    assert z["full_shape"] == full_shape and not z["full_held"], (layout, e["rank"], name, z)
    assert padded % d.sharding == 0 and 0 <= padded - prod(full_shape) < CPU_ALIGN_ELEMENTS + d.sharding, (name, z)
    share = padded // d.sharding
    assert (z["start"], z["end"]) == (e["sharding_rank"] * share, (e["sharding_rank"] + 1) * share), (name, z)
    assert p["shape"] == [share] and p["numel"] == share, (layout, e["rank"], name, p)


def check_sharded_optimizer(layout: str, ranks: list, trained) -> None:
    """ZeRO-1/2: the sharding ranks of each group keep optimizer state (AdamW's, whole) for disjoint sets of the
    group's `trained(name)` parameters covering them all, each at most 1/sharding of their elements plus the
    largest one (Paddle's greedy partition)."""
    d = DEGREES[layout]
    groups = {}  # ranks that share one copy of the parameters: a sharding group
    for e in ranks:
        groups.setdefault((e["dp_rank"], e["tp_rank"], e["pp_rank"], e.get("cp_rank", 0)), []).append(e)
    for key, members in groups.items():
        names = {n for n in members[0]["params"] if trained(n)}
        owned = [set(m["optimizer_params"]) for m in members]
        for a, b in itertools.combinations(owned, 2):
            assert not a & b, f"{layout}: sharding ranks {key} both keep optimizer state of {sorted(a & b)[:5]}"
        assert set().union(*owned) == names, (layout, key, sorted(names ^ set().union(*owned))[:5])
        group_elems = sum(members[0]["params"][n]["numel"] for n in names)
        biggest = max(members[0]["params"][n]["numel"] for n in names)
        for m in members:
            assert m["optimizer_params"] == {n: adam_state(m["params"][n]["numel"]) for n in m["optimizer_params"]}
            mine = sum(m["params"][n]["numel"] for n in m["optimizer_params"])
            assert 0 < mine <= group_elems / d.sharding + biggest and mine < group_elems, (
                f"{layout}: rank {m['rank']} keeps optimizer state for {mine} of {group_elems} elements")


def _diff(got: dict, want: dict) -> str:
    keys = sorted(set(got) ^ set(want))[:3] + [k for k in sorted(set(got) & set(want)) if got[k] != want[k]][:3]
    return ", ".join(f"{k}: {got.get(k)} (expected {want.get(k)})" for k in keys)


def check_predicted(got: dict, layout: str) -> None:
    """The planner's prediction (memory.json "predicted", from the config alone) equals the measurement on every
    rank: parameter elements and bytes, optimizer-state elements and bytes exactly; gradient bytes too except
    under ZeRO-2/3, whose gradient buffers are Paddle's own (the plan's figure there is an estimate)."""
    pred = got["predicted"]
    assert pred is not None and pred["device"] == "cpu", (layout, pred and pred.get("device"))
    by_coords = {(p["dp_rank"], p["tp_rank"], p["pp_rank"], p["sharding_rank"]): p for p in pred["ranks"]}
    held = {(e["dp_rank"], e["tp_rank"], e["pp_rank"], e["sharding_rank"]) for e in got["ranks"]}  # cp ranks: alike
    assert set(by_coords) == held, (layout, sorted(by_coords), sorted(held))
    zero23 = got["layout"]["sharding"] > 1 and got["layout"]["sharding_stage"] in (2, 3)
    keys = ("param_numel", "param_bytes", "optimizer_numel", "optimizer_bytes") + (() if zero23 else ("grad_bytes",))
    for e in got["ranks"]:
        p = by_coords[(e["dp_rank"], e["tp_rank"], e["pp_rank"], e["sharding_rank"])]
        wrong = [(k, p[k], e[k]) for k in keys if p[k] != e[k]]
        assert not wrong, f"{layout}: rank {e['rank']} predicted vs measured (field, plan, measured): {wrong}"


EXPERTS = re.compile(r"layers\.\d+\.mlp\.experts\.w_(gate|up|down)")
"""Stacked routed experts [E, ...]: under expert parallelism each ep rank holds E / ep of them."""
FROZEN = re.compile(r"layers\.\d+\.mlp\.expert_bias")
"""The auxiliary-loss-free bias: a parameter without gradient or optimizer state."""


def check_expert_memory(got: dict, ref: dict, dp: int, ep: int, tp: int = 1, pp: int = 1, sharding: int = 1) -> None:
    """An MoE run under dp (x tp, x pp, x ZeRO-1 sharding) with `ep` (1: experts replicated) against its one-process
    run. Every rank holds the dense parameters of its pipeline stage as the tp layout says (`SPLIT_AXES`) and exactly
    E / ep experts of each stacked expert tensor of its stage (axis 0; whole over tp); stage s holds the layers
    s * L/pp ... (s + 1) * L/pp - 1 (the embedding with the first, the final norm and head with the last), stages are
    disjoint and cover the model; the element counts of an ep group's ranks (dp ranks ep by ep, or with sharding the
    sharding group) sum to the model's for every expert tensor; over all ranks, numel / copies (dense: dp x sharding
    x tp unless tp-split, experts: dp x sharding / ep x tp) sums to the model. Optimizer state: AdamW's for every held
    trainable parameter, none for the frozen expert bias; under ZeRO-1 every rank keeps its own experts' state and
    the sharding ranks own disjoint sets of the dense parameters covering them, each at most 1/sharding of their
    elements plus the largest one."""
    full = {n: p["shape"] for n, p in ref["ranks"][0]["params"].items()}
    assert got["model_numel"] == ref["model_numel"] == sum(prod(s) for s in full.values())
    assert any(EXPERTS.fullmatch(n) for n in full), "not an MoE model"
    ranks = got["ranks"]
    coords = sorted((e["dp_rank"], e["tp_rank"], e["pp_rank"], e["sharding_rank"]) for e in ranks)
    assert coords == sorted(itertools.product(range(dp), range(tp), range(pp), range(sharding))), coords
    chunk = len({_layer(n) for n in full} - {None}) // pp
    stages: dict = {}
    for e in ranks:  # pipeline stages: this stage's layers only, the same names on every rank of a stage
        s = e["pp_rank"]
        want = {n for n in full if (_layer(n) is not None and _layer(n) // chunk == s)
                or (_layer(n) is None and (s == 0 if n.startswith("embed.") else s == pp - 1))}
        assert set(e["params"]) == want, (f"pp{pp}: rank {e['rank']} (stage {s}) holds {sorted(set(e['params']) ^ want)[:4]} "
                                          "beyond (or short of) its stage's layers")
        stages.setdefault(s, set(e["params"]))
    assert set().union(*stages.values()) == set(full)
    groups: dict = {}
    total = Fraction(0)
    for e in ranks:
        ep_group = (e["dp_rank"], e["tp_rank"], e["pp_rank"]) if sharding > 1 else \
            (e["dp_rank"] // ep, e["tp_rank"], e["pp_rank"])
        groups.setdefault(ep_group, []).append(e)
        for name, p in e["params"].items():
            want = list(full[name])
            expert = EXPERTS.fullmatch(name) is not None
            axis = None if expert else split_axis(name)
            if expert:
                want[0] //= ep
            elif axis is not None:
                want[axis] //= tp
            assert p["shape"] == want, (
                f"ep{ep} tp{tp}: rank {e['rank']} holds {name} as {p['shape']}, expected {want} (full {full[name]})")
            copies = (dp * sharding // ep if expert else dp * sharding) * (1 if axis is not None else tp)
            total += Fraction(p["numel"], copies)
            state = e["optimizer_params"].get(name)
            if sharding == 1 or expert or FROZEN.fullmatch(name):
                assert state == (None if FROZEN.fullmatch(name) else adam_state(p["numel"])), (e["rank"], name, state)
            else:
                assert state in (None, adam_state(p["numel"])), (e["rank"], name, state)
        frozen = 0 if sharding > 1 else sum(p["bytes"] for n, p in e["params"].items() if FROZEN.fullmatch(n))
        assert e["grad_bytes"] == e["param_bytes"] - frozen, (e["rank"], e["grad_bytes"], e["param_bytes"])
    assert total == got["model_numel"], (f"ep{ep} tp{tp}: ranks hold {float(total)} elements net of replication, "
                                         f"the model has {got['model_numel']}")
    for members in groups.values():
        assert len(members) == ep
        for name in stages[members[0]["pp_rank"]]:
            if EXPERTS.fullmatch(name):
                assert sum(m["params"][name]["numel"] for m in members) == prod(full[name]), name
        if sharding > 1:  # ZeRO-1: the dense state is partitioned over the group, disjointly and completely
            dense = {n for n in members[0]["params"] if not EXPERTS.fullmatch(n) and not FROZEN.fullmatch(n)}
            owned = [{n for n in m["optimizer_params"] if n in dense} for m in members]
            for a, b in itertools.combinations(owned, 2):
                assert not a & b, f"sharding ranks both keep optimizer state of {sorted(a & b)[:5]}"
            assert set().union(*owned) == dense, dense - set().union(*owned)
            elems = {n: members[0]["params"][n]["numel"] for n in dense}
            for m, mine in zip(members, owned):
                held = sum(elems[n] for n in mine)
                assert 0 < held <= sum(elems.values()) / sharding + max(elems.values()) and held < sum(elems.values()), (
                    f"rank {m['rank']} keeps optimizer state for {held} of {sum(elems.values())} dense elements")
