"""The planner's FP8 GEMM times against H100 measurements at shapes it was not fitted on (within 10%).

    python -m pytest tests/plan/test_fp8_kernels.py -q

benchmarks/data/h100/fp8_gemm.json (torch._scaled_mm, e4m3 x e4m3 -> bf16, 16 LLM shapes per recipe) is split by
`llmtrain.plan.fp8.split_shapes` into every other shape: the fit sees one half, the bound is checked on the other.
The shipped coefficients (llmtrain/plan/profiles/fp8/h100.json) must be what that fit gives today.
"""
from __future__ import annotations

import json
import os

import pytest

from llmtest import REPO
from llmtrain.plan.fp8 import fit, held_out_error, load_fp8_model, split_shapes

DATA = os.path.join(REPO, "benchmarks", "data", "h100")
FP8_RECIPES = ("tensorwise", "rowwise", "blockwise_1x128_128x128", "blockwise_1x128_1x128")


def _tables():
    with open(os.path.join(DATA, "fp8_gemm.json")) as f, open(os.path.join(DATA, "fp8_quant.json")) as g:
        return json.load(f), json.load(g)


def test_fp8_gemm_times_within_10_percent_on_held_out_shapes():
    gemm, quant = _tables()
    model = fit(gemm, quant, "h100")
    fitted, held = split_shapes([r for r in gemm["rows"] if not r.get("invalid")])
    assert len(held) >= 7 and not fitted & held
    errors = held_out_error(model, gemm)
    for recipe in FP8_RECIPES:
        assert errors[recipe] <= 0.10, (recipe, errors[recipe])


def test_the_shipped_fit_is_todays_fit_and_fp8_is_faster_than_bf16():
    gemm, quant = _tables()
    shipped, fresh = load_fp8_model("h100"), fit(gemm, quant, "h100")
    for recipe, coef in fresh.gemm.items():
        assert shipped.gemm[recipe] == pytest.approx(coef, rel=1e-9), recipe
    for m, n, k in [(4096, 4096, 4096), (16384, 12288, 4096), (8192, 8192, 8192)]:
        bf16 = shipped.gemm_ms("bf16", m, n, k)
        for recipe, low, high in [("tensorwise", 1.6, 2.0), ("blockwise_1x128_128x128", 1.4, 1.8)]:
            assert low < bf16 / shipped.gemm_ms(recipe, m, n, k) < high, (recipe, m, n, k)
    assert 0 < shipped.quant_ms("1x128", 4096, 4096) < shipped.quant_ms("1x128", 16384, 4096)


def test_each_quantisation_is_priced_by_its_fastest_measured_implementation():
    gemm, quant = _tables()
    shipped = load_fp8_model("h100")
    rows = [r for r in quant["rows"] if "tile" in r and "ms" in r and not r.get("ceiling")]
    for tile, impl in shipped.quant_priced.items():
        assert shipped.quant_ms(tile, 4096, 4096) == shipped.quant_ms(tile, 4096, 4096, impl)
        mine = {(r["rows"], r["cols"]): r["ms"] for r in rows if r["tile"] == tile and r.get("impl", "eager") == impl}
        others = [r for r in rows if r["tile"] == tile and r.get("impl", "eager") != impl
                  and (r["rows"], r["cols"]) in mine]
        # measured, not only fitted: at every shape both were timed, the priced one was not slower (2% timing noise)
        assert all(mine[(r["rows"], r["cols"])] <= 1.02 * r["ms"] for r in others), (tile, impl)


def test_fp8_weight_copies_are_counted_per_micro_batch_in_flight_or_for_the_step_when_cached():
    """train.fp8 adds, per rank, one byte (plus a 128x128 block's scale) per element of each linear's tp-local weight
    per micro-batch in flight; under full recompute only the re-running block's. Llama-7B: 32 blocks of 4096 x
    (3 x 4096 + 4096) attention and 3 x 4096 x 11008 MLP weights."""
    from llmtrain.config import to_config
    from llmtrain.plan.estimate import fp8_weight_bytes, memory_estimate
    from llmtrain.parallel.layout import layout_problems
    from llmtest import compose

    cfg = to_config(compose(["model=llama-7b", "+parallel=tp2", "train.global_batch_size=4", "data.seq_len=512"]))
    layout, problems = layout_problems(cfg.parallel, cfg.train, 2)
    assert not problems
    per_block = 4096 * 4 * 4096 / 2 + 3 * 4096 * 11008 / 2  # q, k, v, o and gate, up, down, halved by tp2
    assert fp8_weight_bytes(cfg.model, layout) == [pytest.approx(per_block * (1 + 4 / 128**2))] * 32

    def activations(recompute, fp8):
        return memory_estimate(cfg.model, layout, 512, recompute, "bf16", "gpu", 2, True, 0.0, fp8=fp8)["activations"]

    assert activations("none", True) - activations("none", False) == pytest.approx(32 * per_block * (1 + 4 / 128**2), abs=2)
    assert activations("full", True) - activations("full", False) == pytest.approx(per_block * (1 + 4 / 128**2), abs=2)
    # train.fp8_weight_cache: every weight's copies (GPU blockwise: W and Wᵀ) for the whole step, whatever the
    # recompute mode and the micro-batches in flight; a part-recompute mode takes the same path
    for mode in ("none", "full", "core_attn"):
        cached = memory_estimate(cfg.model, layout, 512, mode, "bf16", "gpu", 2, True, 0.0, fp8=True,
                                 fp8_cached_copies=2)["activations"]
        assert cached - activations(mode, False) == pytest.approx(2 * 32 * per_block * (1 + 4 / 128**2), abs=2)


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_cached_weights_are_priced_once_per_step(recipe):
    """train.fp8_weight_cache: a micro-batch's FP8 GEMMs no longer price the weight's quantisation, the step prices
    it once (blockwise: Wᵀ for every forward, W for every dgrad; tensorwise: one W per linear): over 8 micro-batches
    the device works 8 x saved - once less; a host-bound step (a small model) is no faster, a device-bound one is."""
    from llmtrain.config import to_config
    from llmtrain.plan.fp8 import with_fp8
    from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels
    from llmtrain.plan.profile import load_profile
    from llmtrain.plan.timeline import StepSpec, kernel_seconds, step_compute
    from llmtest import compose

    dev = load_profile("h100")
    cached, every = with_fp8(dev, recipe), with_fp8(dev, recipe, weight_cache=False)
    for model, b, bound in (("model=moe-tiny", 1, "host"), ("model=llama-7b", 2, "device")):
        cfg = to_config(compose([model, "model.vocab_size=32000", "model.hidden_size=1024", "model.num_layers=4",
                                 "model.moe_ffn_hidden_size=512", "model.ffn_hidden_size=2816"]
                                if bound == "host" else [model, "model.num_layers=2"])).model
        spec = MicroBatchSpec(cfg, b=b, s=4096 if bound == "device" else 2048, e=2)
        mb = micro_batch_kernels(spec)
        saved = sum(kernel_seconds(every, k) - kernel_seconds(cached, k) for k in mb.forward + mb.backward)
        once = cached.fp8.weight_seconds(mb.forward, mb.backward)
        assert once > 0 and every.fp8.weight_seconds(mb.forward, mb.backward) == 0
        assert once == pytest.approx(saved if recipe == "blockwise" else saved / 2, rel=1e-9)
        got = {n: step_compute(d, StepSpec(spec, micro_batches=8)) for n, d in (("cached", cached), ("every", every))}
        assert got["cached"]["by_kind_s"]["fp8_weights"] == pytest.approx(once, rel=1e-9)
        assert got["every"]["device_s"] - got["cached"]["device_s"] == pytest.approx(8 * saved - once, rel=1e-6)
        gain = got["every"]["compute_s"] - got["cached"]["compute_s"]
        assert gain >= 0 and (gain > 0.5 * (8 * saved - once) if bound == "device" else True), (model, gain, once)


def test_the_ranking_prices_the_weight_cache_setting():
    """`train.fp8_weight_cache=false` reaches the ranking's FP8 pricing: every micro-batch quantises the weights
    again, so the same FP8 rows take longer than with the cache (the default) where the device bounds the step."""
    from llmtrain.config import to_config
    from llmtrain.plan.model import planned_model
    from llmtrain.plan.search import rank_layouts
    from llmtest import compose

    base = ["model=llama-7b", "model.num_layers=2", "plan.devices=2", "plan.device=h100", "train.fp8=blockwise",
            "train.amp=bf16", "train.global_batch_size=16", "data.seq_len=4096"]
    got = {}
    for flag in ("true", "false"):
        cfg = to_config(compose([*base, f"train.fp8_weight_cache={flag}"]))
        got[flag] = {(r["name"], r["micro_batch"], r["recompute"], r["offload_optimizer"], r["offload_activations"],
                      tuple(r["pp_layers"]), tuple(sorted(r["knobs"]))): r["step_time_s"]
                     for r in rank_layouts(cfg, planned_model(cfg)) if r["fits"]}
    assert got["true"] and got["true"].keys() == got["false"].keys()
    assert all(got["false"][k] >= got["true"][k] for k in got["true"])
    assert any(got["false"][k] > got["true"][k] * 1.001 for k in got["true"])
