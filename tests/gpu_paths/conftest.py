"""After each rehearsal module: on CPU it ran (not every test skipped), and every line marked with its id ran
inside one of its `reaches` blocks.

The check runs in the teardown of the module's last test (a hook, not a fixture: a module whose tests are all
skipped sets up no fixture, and that is the case it must catch), and only when this process ran every selected
test of the module and each passed or was skipped (a `-k` subset, a test split across xdist workers or an earlier
failure would make a missing line no news). `gpu_rehearsal.module_problems` says what is missing."""
from __future__ import annotations

import pytest

from gpu_rehearsal import HITS, ON_GPU, branch_of, markers, module_problems

_RAN: dict[str, set] = {}
"""Rehearsal file -> node ids whose call passed."""
_SKIPPED: dict[str, set] = {}
"""Rehearsal file -> node ids skipped (at setup or inside the test)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.passed:
        _RAN.setdefault(str(item.path), set()).add(item.nodeid)
    elif report.skipped:
        _SKIPPED.setdefault(str(item.path), set()).add(item.nodeid)


def pytest_runtest_teardown(item, nextitem):
    path = str(item.path)
    branch = branch_of(path)
    if branch is None or (nextitem is not None and str(nextitem.path) == path):
        return
    selected = {i.nodeid for i in item.session.items if str(i.path) == path}
    ran, skipped = _RAN.get(path, set()), _SKIPPED.get(path, set())
    if not selected <= ran | skipped:
        return
    problems = module_problems(item.path.name, branch, markers().get(branch, []), HITS.get(branch, set()),
                               ran=len(ran), on_gpu=ON_GPU)
    assert not problems, "\n".join(problems)
