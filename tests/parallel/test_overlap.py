"""Communication-overlap knobs: the fleet strategy carries them, refused combinations stop before fleet.

    python -m pytest tests/parallel/test_overlap.py -q
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmtrain.config import ConfigError, compose_config, to_config
from llmtrain.parallel.layout import Layout, layout_problems, resolve_layout
from llmtrain.parallel.overlap import KNOBS, apply_overlap
from llmtrain.parallel.strategy import build_strategy


def _problems(*overrides, world=4):
    cfg = to_config(compose_config(["model=llama-tiny", "train.global_batch_size=8", "train.micro_batch_size=1",
                                    *overrides]))
    return layout_problems(cfg.parallel, cfg.train, world)


def test_accepted_knobs_reach_the_strategy_on_gpu_and_not_on_cpu():
    layout, problems = _problems("+parallel=tp2pp2", "parallel.mp_async_allreduce=true",
                                 "parallel.pp_overlap_p2p_comm=true", "parallel.pp_enable_timer=true")
    assert problems == []
    assert layout.mp_async_allreduce and layout.pp_overlap_p2p_comm and layout.pp_enable_timer
    hc = build_strategy(layout, seed=1, on_cpu=False).hybrid_configs
    assert hc["mp_configs"].mp_async_allreduce is True
    assert hc["pp_configs"].overlap_p2p_comm is True and hc["pp_configs"].enable_timer is True
    assert hc["mp_degree"] == 2 and hc["pp_degree"] == 2
    hc = build_strategy(layout, seed=1, on_cpu=True).hybrid_configs  # gloo: logged, not applied
    assert not hc["mp_configs"].mp_async_allreduce and not hc["pp_configs"].overlap_p2p_comm
    assert not hc["pp_configs"].enable_timer
    plain = build_strategy(Layout(tp=2, pp=2), seed=1, on_cpu=False).hybrid_configs
    assert not plain["mp_configs"].mp_async_allreduce and not plain["pp_configs"].overlap_p2p_comm


def test_every_knob_maps_to_a_fleet_field():
    """The mapping of every knob, the refused ones included, names a real field of fleet's strategy."""
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1}
    layout = SimpleNamespace(grad_accum=3, **{k: True for k in KNOBS})
    assert apply_overlap(strategy, layout, on_cpu=True) == list(KNOBS)
    assert apply_overlap(strategy, layout, on_cpu=False) == []
    for knob, (section, attr) in KNOBS.items():
        assert getattr(strategy.hybrid_configs[section], attr) is True, knob
    assert strategy.hybrid_configs["sharding_configs"].accumulate_steps == 3


@pytest.mark.parametrize("overrides,expected", [
    (("+parallel=dp4", "parallel.mp_async_allreduce=true"), ["parallel.mp_async_allreduce=true with parallel.tp=1"]),
    (("+parallel=dp4", "parallel.pp_overlap_p2p_comm=true"), ["parallel.pp_overlap_p2p_comm=true with parallel.pp=1"]),
    (("+parallel=dp4", "parallel.dp_comm_overlap=true"),
     ["parallel.dp_comm_overlap=true with parallel.dp=4, parallel.tp=1, parallel.pp=1, parallel.sharding=1: fleet "
      "asserts dp > 1 and pp > 1", "parallel.dp_comm_overlap=true: not supported here: fleet 3.3.1"]),
    (("+parallel=dp2pp2", "parallel.dp_comm_overlap=true", "parallel.pp_sharding_comm_overlap=true"),
     ["parallel.dp_comm_overlap=true with parallel.pp_sharding_comm_overlap=true: fleet refuses both",
      "parallel.pp_sharding_comm_overlap=true with parallel.dp=2, parallel.tp=1, parallel.pp=2, parallel.sharding=1: "
      "fleet asserts sharding > 1 and pp > 1"]),
    (("+parallel=zero2", "parallel.dp=2", "parallel.sharding_comm_overlap=true"),
     ["parallel.sharding_comm_overlap=true with parallel.sharding=2, parallel.sharding_stage=2: an option of fleet's "
      "stage-1 sharding optimizer"]),
    (("+parallel=tp2sharding2", "parallel.sharding_split_param=true", "parallel.sharding_tensor_fusion=true"),
     ["parallel.sharding_split_param=true with parallel.sharding_tensor_fusion=true: split_param selects "
      "DygraphShardingOptimizerV2", "parallel.sharding_split_param=true: not supported here yet",
      "parallel.sharding_tensor_fusion=true: not supported here yet"]),
    (("+parallel=dp2pp2", "parallel.dp=1", "parallel.sharding=2", "parallel.sharding_comm_overlap=true"),
     ["parallel.sharding_comm_overlap=true with parallel.pp=2: fleet asserts 'You should not use pipeline parallel "
      "and comm_overlap at the same time'"]),
])
def test_refused_combinations_name_fields_and_numbers(overrides, expected):
    layout, problems = _problems(*overrides)
    assert layout is None
    for line in expected:
        assert any(p.startswith(line) for p in problems), (line, problems)


def test_resolve_layout_raises_config_error():
    cfg = to_config(compose_config(["model=llama-tiny", "+parallel=dp2", "parallel.mp_async_allreduce=true"]))
    with pytest.raises(ConfigError, match=r"parallel.mp_async_allreduce=true with parallel.tp=1"):
        resolve_layout(cfg.parallel, cfg.train, 2)
