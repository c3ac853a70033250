"""The suite's xdist schedule (tests/xdist_schedule.py): e2e modules are one unit, the heavy units go first.

    python -m pytest tests/test_xdist_schedule.py -q
"""
import os

from xdist_schedule import HEAVY, order, unit


def test_e2e_modules_are_one_unit_and_heavy_units_go_first():
    ids = ["tests/a/test_x.py::t1", "tests/e2e/test_b.py::t", "tests/parallel/test_parity.py::p[dp2]",
           "tests/a/test_x.py::t2", "tests/e2e/test_a.py::t", "tests/parallel/test_parity.py::p[tp2]"]
    assert unit("tests/e2e/test_b.py::t") == unit("tests/e2e/test_a.py::t") == "tests/e2e"
    assert order(ids) == ["tests/parallel/test_parity.py::p[dp2]", "tests/parallel/test_parity.py::p[tp2]",
                          "tests/e2e/test_b.py::t", "tests/e2e/test_a.py::t",
                          "tests/a/test_x.py::t1", "tests/a/test_x.py::t2"]


def test_every_heavy_unit_exists():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert all(os.path.exists(os.path.join(root, u)) for u in HEAVY), [u for u in HEAVY if not os.path.exists(os.path.join(root, u))]
