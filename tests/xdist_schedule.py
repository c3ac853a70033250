"""How scripts/test.sh's two pytest-xdist workers share the suite: whole work units, the longest first.

    python -m pytest -q tests -n 2 --dist loadscope      # conftest.py installs this scheduler for loadscope

A work unit is one test module, except that every module of tests/e2e/ is one unit: they share one launch per
layout (tests/e2e/shared_launch.py), which the first of them to run on a worker starts for every module that
joined it, so two workers holding e2e modules would each run the same launches. Units go out longest first (the
classic longest-processing-time order for two machines), by `HEAVY` below; the rest follow in collection order.
xdist's own order (most tests first) started the 400-second parity module late and left one worker idle at the
end. The scope comes from overriding LoadScopeScheduling's private `_split_scope`: the public route (each test
marked `xdist_group(unit)`, `--dist loadgroup --no-loadscope-reorder`) does not group under pytest 9.2 with xdist
3.8 (tried 2026-12-07: four tests of one group went two to each worker; xdist writes the group into `item._nodeid`,
which pytest 9.2's node ids no longer read: pytest-dev/pytest-xdist#1386, open).
"""
from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

HEAVY = [
    "tests/parallel/test_parity.py",          # ~390 s on 2 quiet cores (2026-12-03, --durations)
    "tests/e2e",                              # ~300 s: the shared tp2 / pp2 / dp2 launches and their checks
    "tests/checkpoint/test_resume.py",        # ~280 s
    "tests/parallel/test_context_parity.py",  # ~170 s
    "tests/test_docs.py",                     # ~80 s of static checks + one drawn docs block run for real (20-120 s)
    "tests/train/test_anomaly.py",            # ~90 s (2026-12-07, --durations, load ~9): three one-process runs
    "tests/train/test_lora.py",               # ~75 s (the same run; test_rampup 61 s, test_changing_runs 58 s)
    "tests/train/test_rampup.py",
    "tests/train/test_watchdog.py",
    "tests/paddle_compat/test_cpu_pp.py",
    "tests/train/test_changing_runs.py",
    "tests/deploy/test_prometheus_server.py",
    "tests/paddle_compat/test_cpu_tp.py",
    "tests/paddle_compat/test_cpu_multinode.py",
    "tests/deploy/test_k8s_manifests.py",
    "tests/plan/test_calibrate.py",
    "tests/parallel/test_expert_parity.py",   # ~35 s: one 4-process launch (2026-12-06, load ~3)
]
"""Work units by measured duration, longest first."""


def unit(nodeid: str) -> str:
    """The work unit of a test id: its module, or `tests/e2e` for any module there."""
    module = nodeid.split("::", 1)[0]
    return "tests/e2e" if module.startswith("tests/e2e/") else module


def order(nodeids: list[str]) -> list[str]:
    """Test ids regrouped by unit, the `HEAVY` units first in that order, then the others in collection order;
    within a unit the collection order is kept."""
    rank = {u: i for i, u in enumerate(HEAVY)}
    first_seen: dict[str, int] = {}
    for i, n in enumerate(nodeids):
        first_seen.setdefault(unit(n), i)
    key = {u: (rank.get(u, len(HEAVY)), pos) for u, pos in first_seen.items()}
    return sorted(nodeids, key=lambda n: key[unit(n)])  # stable: within a unit, collection order


class UnitScheduling(LoadScopeScheduling):
    """xdist's loadscope with `unit` as the scope and the collection order (already `order`ed) kept."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        config.option.loadscopereorder = False  # conftest.py's pytest_collection_modifyitems ordered the units

    def _split_scope(self, nodeid: str) -> str:
        return unit(nodeid)
