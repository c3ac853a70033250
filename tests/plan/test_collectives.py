"""Alpha-beta fitting of collectives (`llmtrain.plan.collectives.fit`), pure numpy.

    python -m pytest tests/plan/test_collectives.py -q

The measuring half runs over gloo inside the dp2 parity launch (tests/plan/collectives_check.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from llmtrain.plan.collectives import COLLECTIVES, bus_factor, fit, fit_alpha_beta, links, ring_steps

SIZES = [4096 * 4**i for i in range(10)]  # 4 KiB .. 1 GiB


def ring_time(coll, n, nbytes, alpha_step, bw):
    """A ring's time, written out here (not through the module): steps * alpha_step + factor * bytes / bw."""
    factor, steps = {"all_reduce": (2 * (n - 1) / n, 2 * (n - 1)), "send_recv": (1.0, 1)}.get(coll, ((n - 1) / n, n - 1))
    return steps * alpha_step + factor * nbytes / bw


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("coll", COLLECTIVES)
def test_fit_recovers_the_bus_bandwidth_and_latency_of_a_ring(coll, n):
    rng = np.random.default_rng(n)
    times = [ring_time(coll, n, b, 6e-6, 350e9) * (1 + 0.01 * rng.standard_normal()) for b in SIZES]
    f = fit_alpha_beta(SIZES, times, coll, n)
    assert f["bus_bw"] == pytest.approx(350e9, rel=0.03)  # the bus bandwidth, not bytes / time
    assert f["alpha_per_step_s"] == pytest.approx(6e-6, rel=0.05)
    assert f["alpha_s"] == pytest.approx(ring_time(coll, n, 0, 6e-6, 1.0), rel=0.05)
    assert f["max_rel_err"] < 0.05 and (f["collective"], f["world"], f["points"]) == (coll, n, len(SIZES))


def test_ring_factors():
    assert [bus_factor("all_reduce", n) for n in (2, 4, 8)] == [1.0, 1.5, 1.75]
    assert [bus_factor(c, 4) for c in ("reduce_scatter", "all_gather", "all_to_all", "send_recv")] == [.75] * 3 + [1]
    assert [ring_steps("all_reduce", 8), ring_steps("all_gather", 8), ring_steps("send_recv", 8)] == [14, 7, 1]
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("gossip", 2)


def test_fit_groups_rows_and_gives_the_planner_links():
    rows = [{"collective": c, "world": n, "bytes": b, "seconds": ring_time(c, n, b, 5e-6, 200e9 if c == "send_recv" else 300e9)}
            for c in ("all_reduce", "send_recv") for n in (2, 8) for b in SIZES]
    rows.append({"collective": "all_to_all", "world": 2, "unsupported": "gloo"})
    fits = fit(rows)
    assert [(f["collective"], f["world"]) for f in fits] == [("all_reduce", 2), ("all_reduce", 8), ("send_recv", 2),
                                                            ("send_recv", 8)]
    got = links(fits)
    assert got["nvlink_bw"] == pytest.approx(300e9, rel=1e-6) and got["nvlink_alpha"] == pytest.approx(5e-6, rel=1e-4)
    assert got["p2p_bw"] == pytest.approx(200e9, rel=1e-6) and got["p2p_alpha"] == pytest.approx(5e-6, rel=1e-4)


def test_noise_that_drives_alpha_negative_keeps_it_at_zero():
    f = fit_alpha_beta([4096, 1 << 20, 1 << 24], [1e-6, 1.1e-3, 1.7e-2], "send_recv", 2)
    assert f["alpha_s"] == 0.0 and f["bus_bw"] > 0


def test_times_that_do_not_grow_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="not slower"):
        fit_alpha_beta([4096, 1 << 20], [2e-3, 1e-3], "all_reduce", 2)
    with pytest.raises(ValueError, match="distinct message sizes"):
        fit_alpha_beta([4096, 4096], [1e-3, 1e-3], "all_reduce", 2)
