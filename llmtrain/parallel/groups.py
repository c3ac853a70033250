"""The parallel-group algebra: every process group of a layout as lists of global ranks, from its degrees and nesting.

    python -m pytest tests/parallel/test_groups.py -q
    layout.group_ranks("edp")           # [[0, 2], [1, 3]] for dp2 x sharding2 with ep2
    layout.state_sharding(expert=True)  # StateSharding(group='edp', degree=2, ...) under ZeRO

Pure arithmetic, no Paddle: `Layout` (llmtrain/parallel/layout.py) calls it, `Topology`
(llmtrain/parallel/strategy.py) creates one process group per list, and the planner reads it.

The grid. Global ranks number the points of the grid `grid_order(layout.order)` (outermost axis first, the last
axis adjacent: rank = sum of coordinate x stride), as fleet's `CommunicateTopology` numbers them. A group of an axis
kind ("dp", "sharding", "pp", "cp", "tp") holds the ranks that differ in that axis only, in its coordinate's order.

The composite kinds:
- "data": the dp x sharding ranks of one (pp, cp, tp) coordinate, the ranks reading different samples; data index
  = dp coordinate x sharding + sharding coordinate (dp outer), whatever `order` says;
- "ep": ep consecutive data indices (data index // ep equal): together they hold every routed expert once, member j
  the j-th block of num_experts / ep. With ep = sharding it is the sharding group, with sharding = 1 a block of dp;
- "edp" (expert data parallel): the data indices with the same index mod ep, the dp x sharding / ep ranks that hold
  the same experts; their expert gradients are summed over it, and under ZeRO their expert states sharded over it.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

AXES = ("dp", "pp", "sharding", "tp")
"""The axes `parallel.order` must list (cp may be listed too)."""
AXIS_KINDS = ("dp", "pp", "sharding", "cp", "tp")
"""Group kinds of one grid axis each: fleet's groups (dp, pp, sharding, sep, mp)."""
KINDS = (*AXIS_KINDS, "data", "ep", "edp")
"""Every group kind, in the order `Topology` creates them."""


def grid_order(order) -> tuple:
    """The grid's axes, outermost first: `order`, with cp placed just outside tp when it is not listed (Megatron's
    tp-cp nesting; fleet's grid always has the axis, `sep`)."""
    axes = list(order)
    if "cp" not in axes:
        axes.insert(axes.index("tp"), "cp")
    return tuple(axes)


def axis_groups(degrees: dict, grid: tuple, axes: tuple) -> list[list[int]]:
    """Every group of ranks that differ only in `axes` (a tuple of grid axes; the first listed is the outer one in
    the members' order), in the order of their smallest rank. `degrees`: axis -> degree."""
    stride, step = {}, 1
    for axis in reversed(grid):
        stride[axis] = step
        step *= degrees[axis]
    others = [a for a in grid if a not in axes]
    groups = []
    for fixed in product(*(range(degrees[a]) for a in others)):
        base = sum(c * stride[a] for a, c in zip(others, fixed))
        groups.append([base + sum(c * stride[a] for a, c in zip(axes, inner))
                       for inner in product(*(range(degrees[a]) for a in axes))])
    return groups


def group_ranks(layout, kind: str) -> list[list[int]]:
    """Every group of `kind` (one of KINDS) of `layout` as lists of global ranks (see the module docstring)."""
    degrees = {"dp": layout.dp, "pp": layout.pp, "sharding": layout.sharding, "cp": layout.cp, "tp": layout.tp}
    grid = grid_order(layout.order)
    if kind in AXIS_KINDS:
        return axis_groups(degrees, grid, (kind,))
    data = axis_groups(degrees, grid, ("dp", "sharding"))
    if kind == "data":
        return data
    if kind == "ep":
        return [ranks[i:i + layout.ep] for ranks in data for i in range(0, len(ranks), layout.ep)]
    if kind == "edp":
        return [ranks[j::layout.ep] for ranks in data for j in range(layout.ep)]
    raise ValueError(f"unknown group kind {kind!r}: expected one of {list(KINDS)}")


def first_group(layout, kind: str) -> list[int]:
    """`group_ranks(layout, kind)[0]`, the group holding rank 0, without listing the others (the planner reads only
    that one: `llmtrain.plan.estimate.group_spread`)."""
    degrees = {"dp": layout.dp, "pp": layout.pp, "sharding": layout.sharding, "cp": layout.cp, "tp": layout.tp}
    grid = grid_order(layout.order)
    stride, step = {}, 1
    for axis in reversed(grid):
        stride[axis] = step
        step *= degrees[axis]

    def members(axes: tuple) -> list[int]:  # the group of `axes` whose other coordinates are all 0
        return [sum(c * stride[a] for a, c in zip(axes, inner)) for inner in product(*(range(degrees[a]) for a in axes))]

    if kind in AXIS_KINDS:
        return members((kind,))
    data = members(("dp", "sharding"))
    if kind == "data":
        return data
    if kind == "ep":
        return data[:layout.ep]
    if kind == "edp":
        return data[::layout.ep]
    raise ValueError(f"unknown group kind {kind!r}: expected one of {list(KINDS)}")


@dataclass(frozen=True)
class StateSharding:
    """How the ZeRO stage splits one kind of parameter (dense, or routed experts) over the ranks holding it."""

    group: str
    """The group kind whose ranks split it ("sharding" for dense parameters, "edp" for experts)."""
    degree: int
    """How many ways (1: every rank of the group keeps all of it)."""
    optimizer: bool
    """Optimizer states (and fp32 master weights) split: ZeRO-1 and up."""
    gradients: bool
    """Gradients reduced to their owner only and freed elsewhere once the backward is over (dense: ZeRO-2 and up)."""
    parameters: bool
    """Parameter values sliced, gathered around their use: ZeRO-3."""


def state_sharding(layout, expert: bool) -> StateSharding:
    """Which group shards the optimizer states, gradients and parameters of dense parameters (`expert=False`) or
    routed experts (`expert=True`) under `layout.sharding_stage`.

    Dense parameters: the sharding group, `parallel.sharding` ways, as the stage says. Routed experts under ep > 1:
    the expert-data-parallel group (edp = dp x sharding / ep ranks holding the same experts) whenever ZeRO is on
    (sharding > 1), at every stage: each expert tensor's optimizer state on one rank of the group, and its gradient
    too once the backward is over (reduced to that rank and freed on the others: llmtrain/parallel/expert_states.py);
    their values are never sliced further (ep already divides them: a rank holds num_experts / ep experts whole,
    under ZeRO-3 too). Without ZeRO, or with edp = 1, every rank keeps its experts' states whole. Under ep = 1
    experts are dense parameters."""
    stage = layout.sharding_stage if layout.sharding > 1 else 0
    if expert and layout.ep > 1:
        degree = layout.edp if stage else 1
        return StateSharding("edp", degree, degree > 1, degree > 1, False)
    degree = layout.sharding
    return StateSharding("sharding", degree, degree > 1, degree > 1 and stage >= 2, degree > 1 and stage == 3)
