"""The planner's fast paths equal its slow ones, expert states are priced over their edp group, and a frontier MoE
ranking proposes pipeline and expert-parallel layouts in seconds.

    python -m pytest tests/plan/test_fast_planner.py -q
"""
from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

from llmtest import compose
from llmtrain.config import to_config


def _cfg(model, *extra):
    return to_config(compose([f"model={model}", *extra]))


@pytest.mark.parametrize("model,device,rc,layers,acc", [("moe-tiny", "cpu-here", "none", 2, 5),
                                                        ("llama-tiny", "h800", "full", 2, 9),
                                                        ("moe-tiny", "h800", "none", 2, 16)])
def test_fast_timeline_equals_kernel_by_kernel(model, device, rc, layers, acc):
    """A pipeline stage's step priced through the cached max-plus maps equals the kernel-by-kernel simulation."""
    from llmtrain.plan.devices import get_device
    from llmtrain.plan.estimate import rank_tensors
    from llmtrain.plan.kernels import MicroBatchSpec
    from llmtrain.plan.moe import MoEPlan
    from llmtrain.plan.timeline import StepSpec, step_compute

    cfg = _cfg(model, "model.vocab_size=2560").model
    dev = get_device(device, None)
    lay = SimpleNamespace(pp=2, pp_layers=(1, 1), tp=1, sharding=2, sharding_stage=1, dp=1, ep=1,
                          zero3_segment_size=2**20, virtual_pp=1, zero2_buffer_size=2**23)
    grads, owned = rank_tensors(cfg, lay, "bf16", 0)
    moe = MoEPlan(ep=2, link=(5e10, 1e-5)) if cfg.moe_num_experts else None
    spec = MicroBatchSpec(cfg, 2, 128, 1, None, dev.async_launch, dev.async_launch, rc, layers, True, False,
                          math_core=None, ce_core=None, moe=moe)
    slow = step_compute(dev, StepSpec(spec, acc, grads, owned, 1), fast=False)
    fast = step_compute(dev, StepSpec(spec, acc, grads, owned, 1), fast=True)
    for k in ("compute_s", "micro_batch_s", "host_s", "device_s"):
        assert fast[k] == pytest.approx(slow[k], rel=1e-9), k
    assert fast["kernels_per_step"] == slow["kernels_per_step"]
    assert fast["by_kind_s"] == pytest.approx(slow["by_kind_s"], rel=1e-9)


def test_expert_states_are_priced_over_edp():
    """moe-tiny on dp2 x sharding2: ep2 (edp 2) keeps each expert tensor's state on one rank of its edp pair, ep4
    (edp 1) on every rank; the dense states 1/sharding either way."""
    from llmtrain.parallel.layout import Layout
    from llmtrain.plan.memory import predict_ranks

    cfg = _cfg("moe-tiny", "model.vocab_size=2560").model
    opt = {}
    for ep in (1, 2, 4):
        ranks = predict_ranks(cfg, Layout(dp=2, sharding=2, sharding_stage=1, ep=ep), "none", "cpu")
        opt[ep] = sum(r["optimizer_numel"] for r in ranks)
    from llmtrain.plan.memory import param_specs

    experts = sum(s.numel for s in param_specs(cfg) if s.expert)
    # each expert tensor's two fp32 moments once over the job for ep4 (E/4 per rank) and ep2 (once per edp pair);
    # ep1: experts are dense parameters, once per sharding pair, so twice over dp2: 2 x 2 x experts more
    assert abs(opt[2] - opt[4]) < 0.01 * experts, (opt, experts)
    assert opt[1] - opt[4] == pytest.approx(2 * experts, rel=0.01), (opt, experts)


def test_frontier_ranking_proposes_pipeline_and_expert_layouts_fast():
    """deepseek-v3 on 256 x h800: fitting rows with pp > 1 and ep > 1, in under 60 s (the measured figure is in
    benchmarks/README.md)."""
    from llmtrain.plan.model import planned_model
    from llmtrain.plan.search import rank_layouts

    cfg = _cfg("deepseek-v3", "plan.device=h800", "plan.devices=256", "train.global_batch_size=4096",
               "data.seq_len=4096", "train.amp=bf16")
    start = time.process_time()
    rows = rank_layouts(cfg, planned_model(cfg))
    took = time.process_time() - start
    fitting = [r for r in rows if r["fits"]]
    assert any(r["pp"] > 1 and r["ep"] > 1 for r in fitting), [r["name"] for r in fitting[:5]]
    assert all(r["step_time_s"] is not None for r in fitting)
    assert took < 60, took


def test_measured_extra_launches_add_host_time_per_call():
    """A profile's `host.launches` (device kernels one call of an op class launches) and `host.extra_launch_s` add
    the host time of the launches beyond the first, in the kernel-by-kernel stream and the cached map alike."""
    import copy

    from llmtrain.plan.kernel_ops import mem
    from llmtrain.plan.profile import load_profile
    from llmtrain.plan.timeline import Stream

    base = load_profile("h100")
    prof = copy.copy(base)
    prof.__dict__ = {k: v for k, v in base.__dict__.items() if not k.startswith("_")}  # no shared memo
    prof.host = {**base.host, "launches": {"moe_topk4": 3}, "extra_launch_s": 5e-6}
    ks = [mem("moe_topk4", 4096 * 60), mem("add", 4096)]
    for fast in (False, True):
        st = Stream(prof, fast=fast)
        st.run(ks, False)
        assert st.host_total == pytest.approx(2 * base.host["fwd_op_s"] + 2 * 5e-6, rel=1e-12), fast
