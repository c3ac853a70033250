"""After each rehearsal module: every line marked with its id ran inside one of its `reaches` blocks.

Checked only when this process ran every selected test of the module and each passed or was skipped (a `-k`
subset, a test split across xdist workers or an earlier failure would make a missing line no news)."""
from __future__ import annotations

import os

import pytest

from gpu_rehearsal import HITS, branch_of, markers

_PASSED: dict[str, set] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (report.when == "call" and report.passed) or report.skipped:  # a skipped test ran no marked line
        _PASSED.setdefault(str(item.path), set()).add(item.nodeid)


@pytest.fixture(scope="module", autouse=True)
def every_marked_line_reached(request):
    yield
    branch = branch_of(str(request.path))
    if branch is None:
        return
    selected = {i.nodeid for i in request.session.items if str(i.path) == str(request.path)}
    if not selected or not selected <= _PASSED.get(str(request.path), set()):
        return
    want = {(os.path.realpath(f), n) for f, n in markers().get(branch, [])}
    missed = sorted(want - HITS.get(branch, set()))
    assert not missed, (f"{request.path.name}: no `reaches('{branch}')` block ran these GPU-ONLY({branch}) lines: "
                        + ", ".join(f"{os.path.relpath(f)}:{n}" for f, n in missed))
