"""Collectives measured over gloo by `llmtrain.plan.collectives`, inside the dp2 parity launch (no launch of its own).

    python -m pytest tests/parallel/test_parity.py -k dp2 -q      # runs `measure` in the launch, then `check`

`measure(out)` runs in both launched processes (fleet already initialised by the launch's earlier runs);
`check(out)` reads what rank 0 wrote. `measure` itself raises when a collective delivers wrong data (each timed
call is re-run once on known values), so a collective that does nothing cannot pass.
"""
from __future__ import annotations

import json
from pathlib import Path

SIZES = (4096, 1 << 22, 1 << 24)  # bytes: a small message and two large ones (the slope stands above gloo's noise)


def measure(out: str) -> None:
    import paddle.distributed as dist

    from llmtrain.plan.collectives import fit, measure as measure_collectives

    rows = measure_collectives(SIZES, reps=3)
    if dist.get_rank() == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "collectives.json").write_text(json.dumps({"rows": rows, "fits": fit(rows)}))


def check(out) -> dict:
    """The measured rows and fits of a 2-process gloo job; returns {collective: (alpha_s, bus_bw)}."""
    got = json.loads((Path(out) / "collectives.json").read_text())
    rows = got["rows"]
    measured = {(r["collective"], r["bytes"]): r["seconds"] for r in rows if "seconds" in r}
    for coll in ("all_reduce", "all_gather", "send_recv"):
        for size in SIZES:
            assert measured.get((coll, size), 0) > 0, (coll, size, rows)
    assert {r["collective"] for r in rows if r.get("unsupported") == "gloo"} == {"reduce_scatter", "all_to_all"}, rows
    assert all(r["world"] == 2 for r in rows), rows
    fits = {f["collective"]: f for f in got["fits"]}
    assert set(fits) == {"all_reduce", "all_gather", "send_recv"}, fits
    for f in fits.values():
        assert f["bus_bw"] > 0 and f["alpha_s"] >= 0 and f["points"] == len(SIZES), f
    return {c: (f["alpha_s"], f["bus_bw"]) for c, f in fits.items()}
