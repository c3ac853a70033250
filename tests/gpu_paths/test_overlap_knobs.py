"""GPU-only branch `overlap-knobs`: on a GPU the accepted `parallel.*` overlap knobs are set on fleet's strategy.

    python -m pytest tests/gpu_paths/test_overlap_knobs.py -q

`apply_overlap` (llmtrain/parallel/overlap.py) sets `mp_async_allreduce`, `pp_overlap_p2p_comm` and
`pp_enable_timer` on `fleet.DistributedStrategy().hybrid_configs[...]` on a GPU and nothing on CPU. The rehearsal
builds the real strategy for a composed tp2 x pp2 layout with `on_cpu=False`: fleet's protobuf config refuses a
field it does not have (AttributeError), each knob must come out on, and each attribute must be one fleet's own
code reads (paddle/distributed/fleet/meta_parallel and layers, Paddle 3.3.1) rather than a field it only stores.
Nothing GPU-specific runs here; on a GPU the `tput_dp*tp2*` acceptance runs use the knobs for real.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import paddle.distributed.fleet as fleet_pkg

from gpu_rehearsal import reaches
from llmtrain.config import compose_config, to_config
from llmtrain.parallel.layout import layout_problems
from llmtrain.parallel.overlap import KNOBS
from llmtrain.parallel.strategy import build_strategy

ACCEPTED = ("mp_async_allreduce", "pp_overlap_p2p_comm", "pp_enable_timer")
FLEET = Path(fleet_pkg.__file__).parent


def _layout(*knobs):
    cfg = to_config(compose_config(["+parallel=tp2pp2", *(f"parallel.{k}=true" for k in knobs)]))
    layout, problems = layout_problems(cfg.parallel, cfg.train, 4)
    assert problems == [], problems
    return layout


def test_gpu_strategy_carries_every_accepted_knob():
    layout = _layout(*ACCEPTED)
    with reaches("overlap-knobs"):
        strategy = build_strategy(layout, seed=7, on_cpu=False)
    for knob in ACCEPTED:
        section, attr = KNOBS[knob]
        assert getattr(strategy.hybrid_configs[section], attr) is True, knob
    off = build_strategy(dataclasses.replace(layout, **{k: False for k in ACCEPTED}), seed=7, on_cpu=False)
    assert not any(getattr(off.hybrid_configs[KNOBS[k][0]], KNOBS[k][1]) for k in ACCEPTED)
    cpu = build_strategy(layout, seed=7, on_cpu=True)  # CPU: accepted, logged, not applied
    assert not any(getattr(cpu.hybrid_configs[KNOBS[k][0]], KNOBS[k][1]) for k in ACCEPTED)


def test_every_knob_is_a_field_fleet_reads():
    sources = "\n".join(p.read_text(encoding="utf-8") for sub in ("meta_parallel", "layers", "meta_optimizers")
                        for p in (FLEET / sub).rglob("*.py"))
    for knob, (section, attr) in KNOBS.items():
        assert re.search(rf"\.{attr}\b|\[\s*['\"]{attr}['\"]\s*\]", sources), (knob, section, attr)
