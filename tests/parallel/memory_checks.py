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
  table (first and last stage); their union is the whole model; the layers form pp x v chunks
  of the run's split (memory.json layout.pp_layers: every block once, at least one per chunk,
  the test's split when it gave one) and stage s holds chunks s, s + pp, ... (interleaved), or under DualPipeV
  chunks s and 2·pp - 1 - s (the V: embedding, head and a tied table once, all on stage 0);
  each rank's "blocks" lists exactly those;
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
    v2: bool = False
    """Stage 1 through fleet's DygraphShardingOptimizerV2 (parallel.sharding_split_param): state split by position."""
    fused: bool = False
    """Stage 1 V1 with tensor fusion (parallel.sharding_tensor_fusion): state on fused parameters per rank."""
    split: tuple = ()
    """Blocks per pipeline chunk the run must have been given (parallel.pp_layers); () = the default split, read
    from memory.json and checked to be a split of the model (`stage_layers`)."""
    pp_overlap: bool = False
    """Stage 1 V1 with the pipeline's sharding overlap (parallel.pp_sharding_comm_overlap): fleet's own reduce, which
    gives a frozen parameter a zero gradient, does not run (the pipeline's buckets take trainable parameters only)."""
    v: bool = False
    """DualPipeV's V (vpp = 2): stage s holds chunks s and 2·pp - 1 - s, so the head sits with the embedding on stage
    0 and a tied table is held once."""

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.sharding * self.cp


DEGREES = {  # the layouts of conf/parallel/, written out here so a wrong config cannot go unnoticed
    "dp2": Degrees(dp=2), "tp2": Degrees(tp=2), "pp2": Degrees(pp=2), "sharding2": Degrees(sharding=2),
    "zero2": Degrees(sharding=2, stage=2), "zero3": Degrees(sharding=2, stage=3), "dp4": Degrees(dp=4),
    "dp2tp2": Degrees(dp=2, tp=2), "tp2pp2": Degrees(tp=2, pp=2), "dp2pp2": Degrees(dp=2, pp=2),
    "tp2sharding2": Degrees(tp=2, sharding=2), "pp4v2": Degrees(pp=4, vpp=2), "sharding2v2": Degrees(sharding=2, v2=True),
    "sharding2pp2": Degrees(sharding=2, pp=2, v2=True), "tp2sharding2v2": Degrees(tp=2, sharding=2, v2=True),
    "tp2sharding2tf": Degrees(tp=2, sharding=2, fused=True), "sharding2v2ep": Degrees(sharding=2, v2=True),
    "sharding2pp2tf": Degrees(sharding=2, pp=2, fused=True), "sharding2tf": Degrees(sharding=2, fused=True),
    "sharding2pp2v1": Degrees(sharding=2, pp=2), "sharding2pp2v1ov": Degrees(sharding=2, pp=2, pp_overlap=True),
    "pp3": Degrees(pp=3), "pp3v2": Degrees(pp=3, vpp=2),
    "pp2dpv": Degrees(pp=2, vpp=2, v=True), "pp4dpv": Degrees(pp=4, vpp=2, v=True),
    "dp2pp2dpv": Degrees(dp=2, pp=2, vpp=2, v=True), "sharding2pp2dpv": Degrees(sharding=2, pp=2, vpp=2, v=True),
    "cp2": Degrees(cp=2), "dp2cp2": Degrees(dp=2, cp=2), "tp2cp2": Degrees(tp=2, cp=2), "pp2cp2": Degrees(pp=2, cp=2),
    "sharding2cp2": Degrees(sharding=2, cp=2), "sharding2v2cp2": Degrees(sharding=2, cp=2, v2=True),
    "sharding2tfcp2": Degrees(sharding=2, cp=2, fused=True), "sharding2pp2cp2": Degrees(sharding=2, pp=2, cp=2, v2=True),
    "sharding2pp2cp2v1": Degrees(sharding=2, pp=2, cp=2), "dp2pp2cp2": Degrees(dp=2, pp=2, cp=2),
    "zero2cp2": Degrees(sharding=2, stage=2, cp=2),
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


def stage_layers(got: dict, n_layers: int, pp: int, vpp: int = 1, split: tuple = (), v: bool = False) -> dict:
    """{pipeline stage: the blocks it must hold}. The run's split (memory.json layout.pp_layers) must be blocks per
    chunk of all `n_layers` (pp x vpp chunks of at least one block; equal to `split` when the test gave one); chunk
    i holds the next pp_layers[i] blocks and runs on stage i % pp (fleet's interleaved assignment), or with `v`
    (DualPipeV, vpp = 2) on stage i for i < pp and 2·pp - 1 - i after."""
    recorded = tuple(got["layout"]["pp_layers"])
    if pp == 1:
        assert recorded == (), recorded
        return {0: set(range(n_layers))}
    assert len(recorded) == pp * vpp and min(recorded) >= 1 and sum(recorded) == n_layers, (
        f"pp{pp} x {vpp}: the run's split {list(recorded)} is not {pp * vpp} chunks of >= 1 of the {n_layers} blocks")
    assert not split or recorded == tuple(split), f"the run was split {list(recorded)}, the test gave {list(split)}"
    out, at = {s: set() for s in range(pp)}, 0
    for i, n in enumerate(recorded):
        out[(i if i < pp else 2 * pp - 1 - i) if v else i % pp] |= set(range(at, at + n))
        at += n
    return out


def adam_state(numel: int) -> int:
    return 2 * numel + 2


def check_memory(got: dict, ref: dict, layout: str, tied: bool, segment_size: int = 2**20, split: tuple = ()) -> None:
    d = DEGREES[layout]
    full = {n: p["shape"] for n, p in ref["ranks"][0]["params"].items()}  # one process: the whole model
    numel = {n: prod(s) for n, s in full.items()}
    assert ref["model_numel"] == got["model_numel"] == sum(numel.values()), (ref["model_numel"], got["model_numel"])
    assert all(ref["ranks"][0]["optimizer_params"][n] == adam_state(k) for n, k in numel.items())
    assert got["layout"] == {"dp": d.dp, "tp": d.tp, "pp": d.pp, "sharding": d.sharding, "sharding_stage": d.stage,
                             "virtual_pp": d.vpp, "cp": d.cp, "ep": d.ep,
                             "pp_layers": got["layout"]["pp_layers"]}, (layout, got["layout"])
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
        allowed = {TIED} if tied and (a, b) == (0, d.pp - 1) and not d.v else set()  # the V: one table, stage 0
        assert shared == allowed, f"{layout}: pipeline stages {a} and {b} both hold {sorted(shared)[:5]}"
    blocks = stage_layers(got, len({_layer(n) for n in full} - {None}), d.pp, d.vpp, split or d.split, d.v)
    if d.v:  # the V: embedding, final norm and head all on stage 0
        ends = {n for n in full if _layer(n) is None}
        assert ends <= stage_names[0], (layout, sorted(ends - stage_names[0]))
    for s, names in stage_names.items():
        assert {_layer(n) for n in names} - {None} == blocks[s], (
            f"{layout}: pipeline stage {s} holds layers {sorted({_layer(n) for n in names} - {None})}, expected "
            f"{sorted(blocks[s])}")
    for e in ranks:
        assert e["blocks"] == sorted(blocks[e["pp_rank"]]), (layout, e["rank"], e["blocks"])

    # 3. every element counted once: sum over ranks of numel / copies == model (+ ZeRO-3 padding)
    total, padding = Fraction(0), 0
    for e in ranks:
        for name, p in e["params"].items():
            sliced = "zero3" in p
            copies = d.dp * d.cp * (1 if sliced else d.sharding) * (1 if split_axis(name) is not None else d.tp)
            copies *= 2 if tied and d.pp > 1 and not d.v and name == TIED else 1
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
    if d.sharding > 1 and d.v2:
        check_v2_optimizer(layout, ranks)
    elif d.sharding > 1 and d.fused:
        check_fused_optimizer(layout, ranks)
    elif d.sharding > 1 and d.stage in (1, 2):
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


def check_zero3_slice(layout: str, e: dict, name: str, p: dict, full_shape: list, d: Degrees = None) -> None:
    """Rank entry `e` holds parameter `name` (memory.json entry `p`) as its ZeRO-3 flat slice: [start, end) of the
    flattened parameter padded to a multiple of the sharding degree after Paddle's CPU alignment, in rank order;
    the full tensor is not kept outside the forward. `d`: the degrees, when `layout` is not a name in DEGREES."""
    d = d or DEGREES[layout]
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


V2_ALIGN_ELEMENTS = 64
"""fleet's 256-byte alignment of a parameter in a V2 bucket, in fp32 elements (times the sharding degree)."""


def check_v2_optimizer(layout: str, ranks: list) -> None:
    """Stage-1 V2: each parameter's AdamW state (two moments of its slice length L, two [1] beta powers) is split
    over the sharding ranks of its group, the slices' lengths summing to the parameter padded to a multiple of
    64 x sharding elements (each element of the padded parameter on exactly one rank); every rank holds 1/sharding
    of the group's padded elements; at least one parameter is held in parts by two ranks. A V1 partition (whole
    tensors, unpadded) or a replicated state fails."""
    d = DEGREES[layout]
    groups = {}
    for e in ranks:
        groups.setdefault((e["dp_rank"], e["tp_rank"], e["pp_rank"], e.get("cp_rank", 0)), []).append(e)
    for key, members in groups.items():
        params = members[0]["params"]
        unit = V2_ALIGN_ELEMENTS * d.sharding
        padded = {n: -(-p["numel"] // unit) * unit for n, p in params.items()}
        lengths = [{n: (k - 2) // 2 for n, k in m["optimizer_params"].items()} for m in members]
        for m, mine in zip(members, lengths):
            assert all(m["optimizer_params"][n] == 2 * k + 2 for n, k in mine.items()), (layout, m["rank"])
            assert sum(mine.values()) == sum(padded.values()) // d.sharding, (
                f"{layout}: rank {m['rank']} keeps {sum(mine.values())} state elements, 1/{d.sharding} of the padded "
                f"{sum(padded.values())} expected")
        total = {n: sum(mine.get(n, 0) for mine in lengths) for n in params}
        assert total == padded, f"{layout}: {key} slices per parameter {_diff(total, padded)}"
        split = [n for n in params if sum(n in mine for mine in lengths) > 1]
        assert split, f"{layout}: {key} no parameter is split between sharding ranks"


def check_fused_optimizer(layout: str, ranks: list, trained=lambda name: True) -> None:
    """Stage-1 V1 with tensor fusion: each rank's AdamW state is on its fused parameters only (memory.json
    "fused_state": two moments of the fused length, two [1] beta powers each); the parameters laid in them are
    disjoint over the sharding ranks of a group and cover its parameters; a fused parameter is its parameters
    end to end, each padded to the 256-byte alignment (< 64 fp32 elements); every rank keeps some and less than
    all. A replicated or unfused state fails. `trained(name)`: the parameters the optimizer holds (LoRA: the
    adapters; the frozen base is in no fused parameter)."""
    groups = {}
    for e in ranks:
        groups.setdefault((e["dp_rank"], e["tp_rank"], e["pp_rank"], e.get("cp_rank", 0)), []).append(e)
    for key, members in groups.items():
        params = {n: p for n, p in members[0]["params"].items() if trained(n)}
        owned = []
        for m in members:
            fused = m.get("fused_state")
            assert fused, f"{layout}: rank {m['rank']} has no fused optimizer state"
            assert m["optimizer_params"] == {f: 2 * v["numel"] + 2 for f, v in fused.items()}, (layout, m["rank"])
            for f, v in fused.items():
                laid = sum(params[n]["numel"] for n in v["params"])
                assert laid <= v["numel"] < laid + V2_ALIGN_ELEMENTS * len(v["params"]), (layout, m["rank"], f, v)
            owned.append({n for v in fused.values() for n in v["params"]})
            assert 0 < len(owned[-1]) < len(params), (layout, m["rank"], len(owned[-1]))
        for a, b in itertools.combinations(owned, 2):
            assert not a & b, f"{layout}: sharding ranks {key} both keep optimizer state of {sorted(a & b)[:5]}"
        assert set().union(*owned) == set(params), (layout, key, sorted(set(params) ^ set().union(*owned))[:5])


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


def check_expert_memory(got: dict, ref: dict, d: Degrees, segment_size: int = 2**20, split: tuple = ()) -> None:
    """An MoE run under the degrees `d` (dp, tp, pp, sharding at ZeRO stage `d.stage`, ep; ep = 1: experts
    replicated) against its one-process run. Written from the definitions, not read from the product:

    - every rank holds its pipeline stage's parameters (stage s: the blocks of its chunk of the run's split,
      `stage_layers`; `split`: the one the test gave; the embedding
      with the first, the final norm and head with the last), the same names on every rank of a stage, the stages
      covering the model; dense ones as the tp layout says (`SPLIT_AXES`), or under ZeRO-3 as flat slices when larger
      than `segment_size`; exactly E / ep experts of each stacked expert tensor (axis 0, whole over tp);
    - the ep group (data index = dp_rank x sharding + sharding_rank; index // ep equal) holds every expert once;
      over all ranks, numel / copies sums to the model (+ ZeRO-3 padding): dense dp x sharding x tp copies (tp-split:
      no tp factor; ZeRO-3 slices: dp), experts dp x sharding / ep x tp;
    - optimizer state (AdamW's, none for the frozen expert bias): dense parameters' as without experts (whole; ZeRO-1/2
      a disjoint, balanced partition over each sharding group; ZeRO-3 the slices' and the unsliced parameters');
      experts: with sharding and edp = dp x sharding / ep > 1, each expert tensor's state on exactly one rank of
      its edp group (data index mod ep equal), each rank at most 1/edp of the expert elements plus the largest;
      otherwise on every rank holding it;
    - gradients after the step: without ZeRO-2/3 the held parameters' bytes, less the frozen bias (without sharding)
      and the expert tensors whose state another rank keeps (freed once reduced to their owner)."""
    full = {n: p["shape"] for n, p in ref["ranks"][0]["params"].items()}
    assert got["model_numel"] == ref["model_numel"] == sum(prod(s) for s in full.values())
    assert any(EXPERTS.fullmatch(n) for n in full), "not an MoE model"
    ranks = got["ranks"]
    coords = sorted((e["dp_rank"], e["tp_rank"], e["pp_rank"], e["sharding_rank"]) for e in ranks)
    assert coords == sorted(itertools.product(range(d.dp), range(d.tp), range(d.pp), range(d.sharding))), coords
    zero3 = d.sharding > 1 and d.stage == 3
    edp = d.dp * d.sharding // d.ep
    sharded_experts = d.sharding > 1 and edp > 1
    blocks = stage_layers(got, len({_layer(n) for n in full} - {None}), d.pp, d.vpp, split, d.v)
    head = 0 if d.v else d.pp - 1  # the stage of the final norm and head (DualPipeV's V: with the embedding)
    stages: dict = {}
    for e in ranks:  # pipeline stages: this stage's layers only, the same names on every rank of a stage
        s = e["pp_rank"]
        want = {n for n in full if (_layer(n) is not None and _layer(n) in blocks[s])
                or (_layer(n) is None and (s == 0 if n.startswith("embed.") else s == head))}
        assert set(e["params"]) == want, (f"pp{d.pp}: rank {e['rank']} (stage {s}) holds "
                                          f"{sorted(set(e['params']) ^ want)[:4]} beyond (or short of) its stage's layers")
        stages.setdefault(s, set(e["params"]))
    assert set().union(*stages.values()) == set(full)
    index = lambda e: e["dp_rank"] * d.sharding + e["sharding_rank"]  # noqa: E731
    ep_groups, edp_groups, sharding_groups = {}, {}, {}
    total, padding = Fraction(0), 0
    for e in ranks:
        ep_groups.setdefault((index(e) // d.ep, e["tp_rank"], e["pp_rank"]), []).append(e)
        edp_groups.setdefault((index(e) % d.ep, e["tp_rank"], e["pp_rank"]), []).append(e)
        sharding_groups.setdefault((e["dp_rank"], e["tp_rank"], e["pp_rank"]), []).append(e)
        for name, p in e["params"].items():
            want = list(full[name])
            expert = EXPERTS.fullmatch(name) is not None
            axis = None if expert else split_axis(name)
            if zero3 and not expert and prod(want) > segment_size:
                check_zero3_slice(f"ep{d.ep} zero3", e, name, p, want, d)
                total += Fraction(p["numel"], d.dp)
                padding += p["zero3"]["padded"] - prod(want) if index(e) == 0 else 0
                state = e["optimizer_params"].get(name)
                assert state == adam_state(p["numel"]), (e["rank"], name, state)
                continue
            if expert:
                want[0] //= d.ep
            elif axis is not None:
                want[axis] //= d.tp
            assert p["shape"] == want and "zero3" not in p, (
                f"ep{d.ep} tp{d.tp}: rank {e['rank']} holds {name} as {p['shape']}, expected {want} (full {full[name]})")
            copies = (d.dp * d.sharding // d.ep if expert else d.dp * d.sharding) * (1 if axis is not None else d.tp)
            total += Fraction(p["numel"], copies)
            state = e["optimizer_params"].get(name)
            if FROZEN.fullmatch(name):
                assert state is None, (e["rank"], name, state)
            elif d.v2:
                pass  # flat V2 slices, checked per group below
            elif (not sharded_experts) if expert else (d.sharding == 1 or zero3):
                assert state == adam_state(p["numel"]), (e["rank"], name, state)
            else:
                assert state in (None, adam_state(p["numel"])), (e["rank"], name, state)
        if d.sharding == 1 or d.stage == 1:
            frozen = 0 if d.sharding > 1 and not d.v2 and not d.pp_overlap else \
                sum(p["bytes"] for n, p in e["params"].items() if FROZEN.fullmatch(n))  # V2: not in its buckets
            freed = sum(p["bytes"] for n, p in e["params"].items() if EXPERTS.fullmatch(n) and sharded_experts
                        and n not in e["optimizer_params"] and not d.v2)
            assert e["grad_bytes"] == e["param_bytes"] - frozen - freed, (e["rank"], e["grad_bytes"], e["param_bytes"])
        else:
            assert e["grad_bytes"] > 0, e["rank"]
    assert total == got["model_numel"] + padding, (
        f"ep{d.ep} tp{d.tp}: ranks hold {float(total)} elements net of replication, the model has {got['model_numel']}")
    for members in ep_groups.values():  # together they hold every expert once
        assert len(members) == d.ep
        for name in stages[members[0]["pp_rank"]]:
            if EXPERTS.fullmatch(name):
                assert sum(m["params"][name]["numel"] for m in members) == prod(full[name]), name
    if d.v2:  # stage-1 V2: dense states split by position over sharding, the experts' (own buckets) over edp
        for members in edp_groups.values():
            check_v2_split("edp", members, lambda n: EXPERTS.fullmatch(n) is not None, edp)
        for members in sharding_groups.values():
            check_v2_split("sharding", members, lambda n: not EXPERTS.fullmatch(n) and not FROZEN.fullmatch(n),
                            d.sharding)
        return
    if sharded_experts:  # each expert tensor's state on one rank of its edp group, balanced
        for members in edp_groups.values():
            _check_partition("edp", members, lambda n: EXPERTS.fullmatch(n) is not None, edp)
    if d.sharding > 1 and d.stage in (1, 2):  # the dense state partitioned over each sharding group
        for members in sharding_groups.values():
            _check_partition("sharding", members, lambda n: not EXPERTS.fullmatch(n) and not FROZEN.fullmatch(n),
                             d.sharding)


def check_v2_split(kind: str, members: list, trained, degree: int, require_split: bool = True) -> None:
    """Stage-1 V2 over a group of `degree` `members`: each `trained(name)` parameter's AdamW state (two moments of
    its slice length L, two [1] beta powers) in slices whose lengths sum to the parameter padded to a multiple of
    64 x degree elements, each member 1/degree of the padded total, some parameter held in parts by two members
    when degree > 1 and `require_split` (the LoRA adapters, all multiples of 64 x degree, may meet the members'
    boundary between two of them); the frozen expert bias has no state."""
    assert len(members) == degree, (kind, [m["rank"] for m in members])
    params = members[0]["params"]
    names = {n for n in params if trained(n)}
    unit = V2_ALIGN_ELEMENTS * degree
    padded = {n: -(-params[n]["numel"] // unit) * unit for n in names}
    lengths = [{n: (k - 2) // 2 for n, k in m["optimizer_params"].items() if n in names} for m in members]
    for m, mine in zip(members, lengths):
        assert all(m["optimizer_params"][n] == 2 * k + 2 for n, k in mine.items()), (kind, m["rank"])
        assert not any(FROZEN.fullmatch(n) for n in m["optimizer_params"]), (kind, m["rank"])
        assert sum(mine.values()) == sum(padded.values()) // degree, (
            f"{kind}: rank {m['rank']} keeps {sum(mine.values())} state elements, 1/{degree} of the padded "
            f"{sum(padded.values())} expected")
    total = {n: sum(mine.get(n, 0) for mine in lengths) for n in names}
    assert total == padded, f"{kind}: slices per parameter {_diff(total, padded)}"
    assert degree == 1 or not require_split or any(sum(n in mine for mine in lengths) > 1 for n in names), \
        f"{kind}: nothing split"


def _check_partition(kind: str, members: list, trained, degree: int) -> None:
    """The `trained(name)` parameters' optimizer states kept by exactly one of `members` each (together all of them),
    each member at most 1/degree of their elements plus the largest one (a greedy partition)."""
    assert len(members) == degree, (kind, [m["rank"] for m in members])
    names = {n for n in members[0]["params"] if trained(n)}
    owned = [{n for n in m["optimizer_params"] if n in names} for m in members]
    for a, b in itertools.combinations(owned, 2):
        assert not a & b, f"{kind} ranks both keep optimizer state of {sorted(a & b)[:5]}"
    assert set().union(*owned) == names, (kind, sorted(names - set().union(*owned))[:5])
    elems = {n: members[0]["params"][n]["numel"] for n in names}
    for m, mine in zip(members, owned):
        held = sum(elems[n] for n in mine)
        assert 0 < held <= sum(elems.values()) / degree + max(elems.values()) and held < sum(elems.values()), (
            f"{kind}: rank {m['rank']} keeps optimizer state for {held} of {sum(elems.values())} elements")
