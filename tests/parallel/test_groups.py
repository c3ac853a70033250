"""The parallel-group algebra: every group of a layout from its degrees and nesting, checked against fleet's own
topology and against the definitions of the expert groups.

    python -m pytest tests/parallel/test_groups.py -q
"""
from __future__ import annotations

import itertools
import random

import pytest
from paddle.distributed.fleet.base.topology import CommunicateTopology

from llmtrain.parallel.groups import AXIS_KINDS, KINDS, first_group
from llmtrain.parallel.layout import Layout
from llmtrain.parallel.strategy import FLEET_AXIS, Topology, build_strategy

FLEET_NAME = {"dp": "data", "pp": "pipe", "sharding": "sharding", "sep": "sep", "mp": "model"}
"""fleet's CommunicateTopology axis names (hybrid_configs `order` -> grid name, as fleet.init maps them)."""


def fleet_topology(layout: Layout) -> CommunicateTopology:
    """The grid fleet.init builds from our strategy for `layout` (its hybrid_configs order and degrees)."""
    strategy = build_strategy(layout, seed=0, on_cpu=True)
    configs, order = strategy.hybrid_configs, list(strategy.hybrid_parallel_order)
    return CommunicateTopology([FLEET_NAME[a] for a in order], [configs[f"{a}_degree"] for a in order])


def _layouts(seed: int, count: int):
    """`count` layouts with degrees in 1..3 (world <= 48) and a random permutation of the axes (cp listed or not)."""
    rng = random.Random(seed)
    for _ in range(count):
        d = {a: rng.choice((1, 2, 3)) for a in ("dp", "pp", "sharding", "cp", "tp")}
        order = ["dp", "pp", "sharding", "tp"] + (["cp"] if rng.random() < 0.5 else [])
        rng.shuffle(order)
        data = d["dp"] * d["sharding"]
        ep = rng.choice([k for k in range(1, data + 1) if data % k == 0])
        yield Layout(**d, ep=ep, order=tuple(order))


@pytest.mark.parametrize("seed", range(4))
def test_axis_groups_equal_fleets_communicate_topology(seed):
    """Every fleet kind, over 50 random degrees and orders per seed: the same groups, the same members' order, the
    same order of groups as `CommunicateTopology.get_comm_list` of the grid fleet.init builds from our strategy."""
    for layout in _layouts(seed, 50):
        fleet = fleet_topology(layout)
        for kind in AXIS_KINDS:
            assert layout.group_ranks(kind) == fleet.get_comm_list(FLEET_NAME[FLEET_AXIS[kind]]), (layout.order, kind)


def test_cp_sits_just_outside_tp_unless_ordered():
    assert Layout().grid == ("dp", "pp", "sharding", "cp", "tp")
    assert Layout(order=("tp", "dp", "pp", "sharding")).grid == ("cp", "tp", "dp", "pp", "sharding")
    assert Layout(order=("cp", "dp", "pp", "sharding", "tp")).grid == ("cp", "dp", "pp", "sharding", "tp")


@pytest.mark.parametrize("seed", range(4))
def test_expert_groups_tile_the_data_ranks(seed):
    """data = dp x sharding of one (pp, cp, tp) coordinate, data index = dp coordinate x sharding + sharding
    coordinate; ep = ep consecutive data indices; edp = the data indices equal mod ep. Each kind partitions the
    world, and an ep group meets each edp group of its data group in exactly one rank. `first_group` is the group
    holding rank 0."""
    for layout in _layouts(seed, 50):
        fleet = fleet_topology(layout)
        for kind in KINDS:
            groups = layout.group_ranks(kind)
            assert sorted(r for g in groups for r in g) == list(range(layout.world)), kind
            assert first_group(layout, kind) == groups[0], (kind, layout)  # the planner's shortcut
        size = {"data": layout.data_parallel, "ep": layout.ep, "edp": layout.edp}
        for kind, n in size.items():
            assert {len(g) for g in layout.group_ranks(kind)} == {n}, (kind, layout)
        for data in layout.group_ranks("data"):
            coords = [fleet.get_coord(r) for r in data]
            assert len({(c.pipe, c.sep, c.model) for c in coords}) == 1  # one (pp, cp, tp) coordinate
            assert [c.data * layout.sharding + c.sharding for c in coords] == list(range(layout.data_parallel))
            eps = [g for g in layout.group_ranks("ep") if g[0] in data]
            edps = [g for g in layout.group_ranks("edp") if g[0] in data]
            assert eps == [data[i:i + layout.ep] for i in range(0, len(data), layout.ep)]
            assert all(len(set(e) & set(d)) == 1 for e, d in itertools.product(eps, edps))


def test_expert_groups_of_named_layouts():
    """ep = sharding is the sharding group and edp the dp group (experts out of the ZeRO-1 partition); with
    sharding = 1 ep cuts the dp ranks; dp2 x sharding2 with ep2 or ep4."""
    lay = Layout(dp=2, sharding=2, ep=2)
    assert lay.group_ranks("ep") == lay.group_ranks("sharding") == [[0, 1], [2, 3]]
    assert lay.group_ranks("edp") == lay.group_ranks("dp") == [[0, 2], [1, 3]]
    assert Layout(dp=2, sharding=2, ep=4).group_ranks("ep") == [[0, 1, 2, 3]]
    assert Layout(dp=2, sharding=2, ep=4).group_ranks("edp") == [[0], [1], [2], [3]]
    lay = Layout(dp=4, tp=2, ep=2)  # dp outer, tp inner: the data ranks of tp coordinate 0 are 0, 2, 4, 6
    assert lay.group_ranks("ep") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert lay.group_ranks("edp") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert (lay.edp, Layout(dp=8, sharding=32, ep=32).edp) == (2, 8)


def test_state_sharding_names_the_group_per_stage():
    """Dense parameters shard over the sharding group, routed experts over the expert-data-parallel group (their
    values never beyond ep; their gradients reduced to the state's owner at every stage); no ZeRO, no sharding;
    ep = 1: experts are dense parameters."""
    for stage, want in ((1, (True, False, False)), (2, (True, True, False)), (3, (True, True, True))):
        lay = Layout(dp=8, sharding=32, ep=32, sharding_stage=stage)
        dense, expert = lay.state_sharding(expert=False), lay.state_sharding(expert=True)
        assert (dense.group, dense.degree, (dense.optimizer, dense.gradients, dense.parameters)) == ("sharding", 32, want)
        assert (expert.group, expert.degree, (expert.optimizer, expert.gradients, expert.parameters)) == \
            ("edp", 8, (True, True, False))
    plain = Layout(dp=256, ep=32).state_sharding(expert=True)
    assert (plain.degree, plain.optimizer) == (1, False)
    assert Layout(sharding=4, ep=4).state_sharding(expert=True).degree == 1  # edp = 1: each rank its own experts
    assert Layout(sharding=4, sharding_stage=3).state_sharding(expert=True).parameters


def test_a_topology_reads_its_groups_from_the_layout():
    """Rank 5 of dp2 x sharding2 x tp2 with ep2: every kind's members and index, no process group without one."""
    lay = Layout(dp=2, sharding=2, tp=2, ep=2)
    topo = Topology(rank=5, world=8, layout=lay)
    assert topo.members() == {"dp": [1, 5], "pp": [5], "sharding": [5, 7], "cp": [5], "tp": [4, 5],
                              "data": [1, 3, 5, 7], "ep": [5, 7], "edp": [1, 5]}
    assert (topo.data_rank, topo.dp_rank, topo.sharding_rank, topo.tp_rank, topo.ep_rank) == (2, 1, 0, 1, 0)
    assert topo.group("ep") is None and topo.data_group() == []
    single = Topology(rank=1, world=2)  # a stand-in of one rank's layout: index 0 of size 1 everywhere
    assert (single.data_rank, single.data_world, single.ep_rank) == (0, 1, 0)
