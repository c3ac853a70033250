"""Communication-overlap knobs: the fleet strategy carries them, refused combinations stop before fleet.

    python -m pytest tests/parallel/test_overlap.py -q
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmtrain.config import ConfigError, compose_config, to_config
from llmtrain.parallel.config import ParallelConfig
from llmtrain.parallel.layout import Layout, layout_problems, resolve_layout
from llmtrain.parallel.overlap import FUSED, KNOBS, NOT_APPLIED_ON_CPU, apply_overlap, needs_main_grad
from llmtrain.parallel.strategy import build_strategy
from llmtrain.train.config import TrainConfig


PRESETS = {  # the degrees of conf/parallel/<name>.yaml (one file is composed through Hydra below)
    "dp4": dict(dp=4), "dp2pp2": dict(dp=2, pp=2), "tp2pp2": dict(tp=2, pp=2), "zero2": dict(sharding=2, sharding_stage=2),
    "tp2sharding2": dict(tp=2, sharding=2),
}


def _problems(preset, *overrides, world=None):
    """layout_problems for `+parallel=<preset> parallel.k=v ...` (global batch 8, micro-batch 1) on `world` processes
    (default: the product of the degrees)."""
    fields = dict(PRESETS[preset.removeprefix("+parallel=")], name=preset)
    for o in overrides:
        key, value = o.removeprefix("parallel.").split("=")
        fields[key] = value == "true" if value in ("true", "false") else int(value)
    if world is None:
        world = 1
        for k in ("dp", "tp", "pp", "sharding", "cp"):
            world *= fields.get(k, 1)
    return layout_problems(ParallelConfig(**fields), TrainConfig(global_batch_size=8, micro_batch_size=1), world)


def test_knobs_compose_through_hydra():
    cfg = to_config(compose_config(["model=llama-tiny", "+parallel=tp2sp", "parallel.pp_overlap_p2p_comm=true",
                                    "parallel.pp=2"]))
    p = cfg.parallel
    assert p.sequence_parallel and p.mp_async_allreduce and p.pp_overlap_p2p_comm and not p.sharding_split_param
    layout, problems = layout_problems(p, cfg.train, 4)
    assert problems == [] and layout.sequence_parallel and layout.mp_async_allreduce and layout.pp_overlap_p2p_comm


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
    assert apply_overlap(strategy, layout, on_cpu=True) == list(NOT_APPLIED_ON_CPU)
    for knob, (section, attr) in KNOBS.items():  # the fused-buffer knobs run on CPU over the stand-ins
        assert getattr(strategy.hybrid_configs[section], attr) is (knob in FUSED), knob
    assert apply_overlap(strategy, layout, on_cpu=False) == []
    for knob, (section, attr) in KNOBS.items():
        assert getattr(strategy.hybrid_configs[section], attr) is True, knob
    assert strategy.hybrid_configs["sharding_configs"].accumulate_steps == 3
    off = SimpleNamespace(grad_accum=3, **{k: False for k in KNOBS})  # a later run of the same process: all off
    assert apply_overlap(strategy, off, on_cpu=False) == []
    for knob, (section, attr) in KNOBS.items():
        assert getattr(strategy.hybrid_configs[section], attr) is False, knob


@pytest.mark.parametrize("overrides,expected", [
    (("+parallel=dp4", "parallel.mp_async_allreduce=true"), ["parallel.mp_async_allreduce=true with parallel.tp=1"]),
    (("+parallel=dp4", "parallel.pp_overlap_p2p_comm=true"), ["parallel.pp_overlap_p2p_comm=true with parallel.pp=1"]),
    (("+parallel=dp4", "parallel.dp_comm_overlap=true"),
     ["parallel.dp_comm_overlap=true with parallel.dp=4, parallel.tp=1, parallel.pp=1, parallel.sharding=1: fleet "
      "asserts dp > 1 and pp > 1"]),
    (("+parallel=dp2pp2", "parallel.dp_comm_overlap=true", "parallel.pp_sharding_comm_overlap=true"),
     ["parallel.dp_comm_overlap=true with parallel.pp_sharding_comm_overlap=true: fleet refuses both",
      "parallel.pp_sharding_comm_overlap=true with parallel.dp=2, parallel.tp=1, parallel.pp=2, parallel.sharding=1: "
      "fleet asserts sharding > 1 and pp > 1"]),
    (("+parallel=zero2", "parallel.dp=2", "parallel.sharding_comm_overlap=true"),
     ["parallel.sharding_comm_overlap=true with parallel.sharding=2, parallel.sharding_stage=2: an option of fleet's "
      "stage-1 sharding optimizer"]),
    (("+parallel=tp2sharding2", "parallel.sharding_split_param=true", "parallel.sharding_tensor_fusion=true"),
     ["parallel.sharding_split_param=true with parallel.sharding_tensor_fusion=true: split_param selects "
      "DygraphShardingOptimizerV2"]),
    (("+parallel=tp2sharding2", "parallel.tp=1", "parallel.dp=2", "parallel.ep=2", "parallel.sharding_tensor_fusion=true"),
     ["parallel.sharding_tensor_fusion=true with parallel.ep=2: fleet 3.3.1's V1 fuses every parameter"]),
    (("+parallel=tp2sharding2", "parallel.tp=1", "parallel.dp=2", "parallel.ep=2", "parallel.sharding_comm_overlap=true"),
     ["parallel.sharding_comm_overlap=true with parallel.ep=2: fleet 3.3.1's V1 comm overlap"]),  # no colour in V1
    (("+parallel=dp2pp2", "parallel.dp=1", "parallel.sharding=2", "parallel.ep=2", "parallel.sharding_split_param=true",
      "parallel.pp_sharding_comm_overlap=true"),
     ["parallel.pp_sharding_comm_overlap=true with parallel.ep=2: with sharding_split_param, fleet 3.3.1's V2 takes"]),
    (("+parallel=dp2pp2", "parallel.dp=1", "parallel.sharding=2", "parallel.cp=2", "parallel.sharding_split_param=true",
      "parallel.pp_sharding_comm_overlap=true"),
     ["parallel.pp_sharding_comm_overlap=true with parallel.cp=2: fleet 3.3.1 asserts 'sep parallel can not coexist"]),
    (("+parallel=dp2pp2", "parallel.dp=1", "parallel.sharding=2", "parallel.sharding_comm_overlap=true"),
     ["parallel.sharding_comm_overlap=true with parallel.pp=2: fleet asserts 'You should not use pipeline parallel "
      "and comm_overlap at the same time'"]),
])
def test_refused_combinations_name_fields_and_numbers(overrides, expected):
    layout, problems = _problems(*overrides)
    assert layout is None
    for line in expected:
        assert any(p.startswith(line) for p in problems), (line, problems)


@pytest.mark.parametrize("overrides,knobs", [
    (("+parallel=dp2pp2", "parallel.dp_comm_overlap=true"), ["dp_comm_overlap"]),
    (("+parallel=dp2pp2", "parallel.dp=1", "parallel.sharding=2", "parallel.pp_sharding_comm_overlap=true"),
     ["pp_sharding_comm_overlap"]),
    (("+parallel=dp2pp2", "parallel.dp=1", "parallel.sharding=2", "parallel.pp_sharding_comm_overlap=true",
      "parallel.sharding_split_param=true"), ["pp_sharding_comm_overlap", "sharding_split_param"]),
    (("+parallel=zero2", "parallel.dp=2", "parallel.sharding_stage=1", "parallel.sharding_split_param=true"),
     ["sharding_split_param"]),
    (("+parallel=zero2", "parallel.dp=2", "parallel.sharding_stage=1", "parallel.sharding_split_param=true",
      "parallel.sharding_comm_overlap=true"), ["sharding_comm_overlap", "sharding_split_param"]),
    (("+parallel=tp2sharding2", "parallel.sharding_split_param=true", "parallel.sharding_comm_overlap=true",
      "parallel.sequence_parallel=true"), ["sharding_comm_overlap", "sharding_split_param"]),
    (("+parallel=tp2sharding2", "parallel.sharding_tensor_fusion=true"), ["sharding_tensor_fusion"]),
    (("+parallel=tp2sharding2", "parallel.tp=1", "parallel.sharding_tensor_fusion=true", "parallel.pp=2"),
     ["sharding_tensor_fusion"]),
    (("+parallel=tp2sharding2", "parallel.sharding_comm_overlap=true"), ["sharding_comm_overlap"]),
    (("+parallel=tp2sharding2", "parallel.sharding_tensor_fusion=true", "parallel.sharding_comm_overlap=true"),
     ["sharding_tensor_fusion", "sharding_comm_overlap"]),
    (("+parallel=tp2sharding2", "parallel.tp=1", "parallel.dp=2", "parallel.ep=2", "parallel.sharding_split_param=true"),
     ["sharding_split_param"]),
    (("+parallel=tp2sharding2", "parallel.tp=1", "parallel.dp=2", "parallel.ep=2", "parallel.sharding_split_param=true",
      "parallel.sharding_comm_overlap=true"), ["sharding_comm_overlap", "sharding_split_param"]),
    (("+parallel=tp2sharding2", "parallel.tp=1", "parallel.cp=2", "parallel.sharding_split_param=true",
      "parallel.sharding_comm_overlap=true"), ["sharding_comm_overlap", "sharding_split_param"]),
    (("+parallel=dp2pp2", "parallel.dp=1", "parallel.sharding=2", "parallel.ep=2", "parallel.sharding_split_param=true"),
     ["sharding_split_param"]),  # the experts' V2 buckets under pp (tests/parallel/test_parity.py sharding2pp2)
    (("+parallel=dp2pp2", "parallel.dp=1", "parallel.sharding=2", "parallel.cp=2", "parallel.sharding_split_param=true"),
     ["sharding_split_param"]),  # V2 under cp x pp (8 processes)
    (("+parallel=tp2sharding2", "parallel.tp=1", "parallel.cp=2", "parallel.sharding_tensor_fusion=true",
      "parallel.sharding_comm_overlap=true"), ["sharding_tensor_fusion", "sharding_comm_overlap"]),  # V1 under cp
    (("+parallel=dp2pp2", "parallel.cp=2", "parallel.dp_comm_overlap=true"), ["dp_comm_overlap"]),  # x cp after fleet
    (("+parallel=dp2pp2", "parallel.ep=2", "parallel.dp_comm_overlap=true"), ["dp_comm_overlap"]),  # experts kept out
    (("+parallel=dp2pp2", "parallel.dp=1", "parallel.sharding=2", "parallel.ep=2", "parallel.pp_sharding_comm_overlap=true"),
     ["pp_sharding_comm_overlap"]),  # V1: the experts kept out of the pipeline's sharding buckets
])
def test_fused_buffer_knobs_are_accepted_and_need_main_grad(overrides, knobs):
    layout, problems = _problems(*overrides)
    assert problems == [] and all(getattr(layout, k) for k in knobs)
    assert needs_main_grad(layout)
    hc = build_strategy(layout, seed=1, on_cpu=True).hybrid_configs  # applied on CPU too (fused_comm stand-ins)
    for k in knobs:
        section, attr = KNOBS[k]
        assert getattr(hc[section], attr) is True, k
    assert not needs_main_grad(_problems("+parallel=dp2pp2")[0])


def test_main_grad_follows_the_knobs_and_refuses_what_is_not_built():
    from llmtrain.train.main_grad import main_grad_on, main_grad_problems

    v2 = ParallelConfig(sharding=2, sharding_split_param=True)
    layout, _ = layout_problems(v2, TrainConfig(global_batch_size=8), 2)
    assert main_grad_on(TrainConfig(), layout) and not main_grad_on(TrainConfig(main_grad=False), layout)
    assert not main_grad_on(TrainConfig(), Layout(dp=2)) and main_grad_on(TrainConfig(main_grad=True), Layout(dp=2))
    assert main_grad_problems(TrainConfig(), v2, lora=False) == []
    assert main_grad_problems(TrainConfig(main_grad=False), v2, lora=False)[0].startswith(
        "train.main_grad=false with parallel.sharding_split_param=true")
    assert main_grad_problems(TrainConfig(), v2, lora=True) == []  # V2 buckets hold the adapters only
    assert main_grad_problems(TrainConfig(main_grad=True), ParallelConfig(dp=2, pp=2), lora=True)[0].startswith(
        "train.main_grad (on) with finetune.lora.rank > 0: not built")  # no fused knob: not built
    # V1 without a fused knob reduces the adapters' main gradients over sharding (test_parity.py: llama_lora_mg)
    for one in (dict(sharding=2), dict(tp=2), dict(pp=2)):  # tested alone (test_parity.py: llama_lora_mg)
        assert main_grad_problems(TrainConfig(main_grad=True), ParallelConfig(**one), lora=True) == [], one
    assert main_grad_problems(TrainConfig(main_grad=True), ParallelConfig(sharding=2, pp=2), lora=True)  # untested
    for knob in (dict(sharding=2, sharding_tensor_fusion=True), dict(sharding=2, sharding_comm_overlap=True),
                 dict(dp=2, pp=2, dp_comm_overlap=True), dict(sharding=2, pp=2, pp_sharding_comm_overlap=True)):
        # fleet's V1 fused parameters and buckets and the pipeline's buckets hold the adapters alone (test_parity.py:
        # llama_lora_tf, llama_lora_dpov, llama_lora_ppov)
        assert main_grad_problems(TrainConfig(), ParallelConfig(**knob), lora=True) == [], knob
    assert "parallel.sharding_stage=3" in main_grad_problems(
        TrainConfig(main_grad=True), ParallelConfig(sharding=2, sharding_stage=3), lora=False)[0]
    assert main_grad_problems(TrainConfig(main_grad=True), ParallelConfig(sharding=2, sharding_stage=2), lora=False) == []
    assert "parallel.dp=2 alone" in main_grad_problems(TrainConfig(main_grad=True), ParallelConfig(dp=2), lora=False)[0]
    assert main_grad_problems(TrainConfig(main_grad=True), ParallelConfig(dp=2, sharding=2), lora=False) == []
    assert main_grad_problems(TrainConfig(main_grad=True), ParallelConfig(dp=2, sharding=2, sharding_stage=2),
                              lora=False) == []  # ZeRO-2 at dp > 1 (tests/parallel/test_expert_parity.py)
    assert "train.batch_rampup" in main_grad_problems(TrainConfig(batch_rampup=[2, 2, 16]), v2, lora=False)[0]
    tp_v2_sp = ParallelConfig(tp=2, sharding=2, sharding_split_param=True, sequence_parallel=True)
    assert main_grad_problems(TrainConfig(), tp_v2_sp, lora=False) == []  # V2 slices of tp pieces; sp hooks on main_grad
    assert "parallel.dp=2 alone" in main_grad_problems(TrainConfig(main_grad=True), ParallelConfig(dp=2, ep=2),
                                                       lora=False)[0]
    for ep_or_cp in (dict(dp=2, sharding=2, ep=2), dict(dp=2, sharding=2, ep=2, sharding_stage=2), dict(cp=2),
                     dict(dp=2, cp=2), dict(sharding=2, cp=2), dict(dp=2, pp=2, ep=2)):  # outside V2: the `_mg` runs
        assert main_grad_problems(TrainConfig(main_grad=True), ParallelConfig(**ep_or_cp), lora=False) == [], ep_or_cp
    ep_v2 = ParallelConfig(sharding=2, ep=2, sharding_split_param=True)  # the experts in V2 buckets of their own
    assert main_grad_problems(TrainConfig(), ep_v2, lora=False) == []
    assert main_grad_problems(TrainConfig(), ParallelConfig(sharding=2, cp=2, sharding_split_param=True), lora=False) == []
    assert main_grad_problems(TrainConfig(), ParallelConfig(sharding=2, sharding_stage=2), lora=False) == []
    pp_v2 = ParallelConfig(pp=2, sharding=2, sharding_split_param=True, pp_sharding_comm_overlap=True)
    assert main_grad_problems(TrainConfig(), pp_v2, lora=False, tied=False) == []
    assert "model.tie_embeddings=true under parallel.pp=2" in main_grad_problems(TrainConfig(), pp_v2, lora=False,
                                                                                 tied=True)[0]


def test_resolve_layout_raises_config_error():
    with pytest.raises(ConfigError, match=r"parallel.mp_async_allreduce=true with parallel.tp=1"):
        resolve_layout(ParallelConfig(dp=2, mp_async_allreduce=True), TrainConfig(global_batch_size=8), 2)


def test_sequence_parallel_needs_tp():
    layout, problems = _problems("+parallel=dp4", "parallel.sequence_parallel=true")
    assert problems == ["parallel.sequence_parallel=true with parallel.tp=1: sequence parallelism splits the "
                        "sequence across the tensor-parallel ranks; needs tp > 1"]
    layout, problems = _problems("+parallel=tp2pp2", "parallel.sequence_parallel=true")
    assert problems == [] and layout.sequence_parallel


def test_sequence_parallel_model_checks(tiny_llama):
    import dataclasses

    from llmtrain.parallel.sequence import sequence_parallel_problems

    par = ParallelConfig(tp=2, sequence_parallel=True)
    assert sequence_parallel_problems(par, tiny_llama, 64) == []
    assert sequence_parallel_problems(par, tiny_llama, 63) == [
        "parallel.sequence_parallel=true: data.seq_len=63 is not divisible by parallel.tp=2"]
    enc = dataclasses.replace(tiny_llama, family="encoder")
    assert sequence_parallel_problems(par, enc, 64) == [
        "parallel.sequence_parallel=true with model.family=encoder: implemented for the decoder only"]
    assert sequence_parallel_problems(ParallelConfig(tp=2), enc, 63) == []


def test_parallel_auto_keeps_the_knobs_that_apply():
    from llmtrain.plan.auto import _kept_knobs

    lines = []
    given = ParallelConfig(name="auto", sequence_parallel=True, mp_async_allreduce=True, pp_overlap_p2p_comm=True,
                           sharding_split_param=True)
    kept = _kept_knobs(given, {"tp": 2, "pp": 1}, lines.append)
    assert kept == {"sequence_parallel": True, "mp_async_allreduce": True, "sharding_split_param": True}
    assert lines == ["parallel=auto: parallel.pp_overlap_p2p_comm=true dropped: the chosen layout has pp=1"]
