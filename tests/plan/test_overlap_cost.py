"""The planner's exposed gradient communication follows the switched-on options: each knob flipped moves the figure
as llmtrain/plan/overlap.py says, with every input read from the row and the packaged profile (no pinned numbers).

    python -m pytest tests/plan/test_overlap_cost.py -q
"""
from __future__ import annotations

import functools
import math

import pytest

from types import SimpleNamespace

from llmtrain.config import compose_config, to_config
from llmtrain.parallel.config import ParallelConfig
from llmtrain.parallel.layout import resolve_layout
from llmtrain.plan.estimate import synced_gradient_elements, time_estimate
from llmtrain.plan.overlap import DATA_PARALLEL_BUCKET, MIB, PIPELINE_BUCKET, SHARDING_BUCKET
from llmtrain.plan.profile import load_profile
from llmtrain.train.config import TrainConfig

BASE = ["model=tinyllama-1.1b", "model.vocab_size=32000", "data.seq_len=2048", "train.amp=bf16",
        "train.micro_batch_size=1"]
PRESETS = {"dp4": {}, "dp2pp2": {"pp": 2}, "zero2": {"sharding_stage": 2}}
"""The degrees (beyond the overrides given) of the presets these tests start from, as ParallelConfig fields."""


@functools.lru_cache(maxsize=None)
def _model():
    return to_config(compose_config(BASE)).model  # one Hydra composition; the layouts are built directly


def _row(overrides, devices, dev="h100"):
    return _cached(tuple(overrides), devices, dev)


@functools.lru_cache(maxsize=None)
def _cached(overrides, devices, dev):
    """(model config, layout, time_estimate row) of `+parallel=<preset> parallel.k=v ... train.global_batch_size=G`."""
    from llmtrain.plan.stage_cost import with_pipeline_split

    fields, batch = {}, None
    for o in overrides:
        key, value = o.split("=")
        if key == "+parallel":
            fields.update(PRESETS[value])
        elif key == "train.global_batch_size":
            batch = int(value)
        else:
            fields[key.removeprefix("parallel.")] = value == "true" if value in ("true", "false") else int(value)
    cfg = SimpleNamespace(model=_model())
    prof = load_profile(dev)
    layout = resolve_layout(ParallelConfig(**fields), TrainConfig(global_batch_size=batch, micro_batch_size=1), devices)
    layout = with_pipeline_split(layout, cfg.model, prof, seq_len=2048)
    row = time_estimate(cfg.model, layout, 2048, False, prof, 8)  # the split it fills in is this one
    return cfg, layout, row


def _bucketed(comm, window, n):
    """The overlap model: the last bucket, or all of the sync the backward window does not hide."""
    return max(comm / n, comm - window * (n - 1) / n)


def _grad_bytes(cfg, layout, e):
    other, experts = synced_gradient_elements(cfg.model, layout)
    return (other + experts) * e


def _flip(base, knob, devices, axis, dev="h100"):
    """(row off, row on, sync off, sync on) of `base` without and with `parallel.<knob>=true`."""
    cfg, lay_off, off = _row(base, devices, dev)
    _, lay_on, on = _row(base + [f"parallel.{knob}=true"], devices, dev)
    return cfg, (lay_off, off, off["comm_syncs"][axis]), (lay_on, on, on["comm_syncs"][axis])


def _moves_only_by_the_sync(off, on):
    """Nothing but the gradient sync changed: the step differs by the exposed difference."""
    for key in ("compute_s", "tp_comm_s", "pp_p2p_s", "bubble_s"):
        assert on[key] == pytest.approx(off[key], rel=1e-12), key
    assert on["step_time_s"] - off["step_time_s"] == pytest.approx(on["dp_sharding_comm_s"] - off["dp_sharding_comm_s"],
                                                                    rel=1e-9, abs=1e-12)


def test_dp_comm_overlap_under_pp_hides_the_all_reduce_behind_the_last_backward():
    base = ["+parallel=dp2pp2", "parallel.dp=8", "train.global_batch_size=64"]
    cfg, (lay0, off, s0), (lay1, on, s1) = _flip(base, "dp_comm_overlap", 16, "dp")
    # off: fleet all-reduces after the pipeline's backward, tensor by tensor: all of it exposed
    assert not s0["overlapped"] and s0["exposed_s"] == s0["comm_s"] and s0["option"] == "dp_comm_overlap"
    # on: fp32 main gradients in 128 MiB buckets issued from the last backward
    grad = _grad_bytes(cfg, lay1, 4)
    assert s1["overlapped"] and s1["bucket_bytes"] == PIPELINE_BUCKET
    assert s1["buckets"] == math.ceil(grad / PIPELINE_BUCKET) > 1
    assert s1["exposed_s"] == pytest.approx(_bucketed(s1["comm_s"], s1["window_s"], s1["buckets"]))
    assert s1["comm_s"] > s0["comm_s"]  # fp32 instead of bf16 gradients: more bytes ...
    assert s1["exposed_s"] < s0["exposed_s"]  # ... yet less of them waited for
    _moves_only_by_the_sync(off, on)


def test_sharding_split_param_and_its_overlap():
    base = ["+parallel=zero2", "parallel.sharding=8", "parallel.sharding_stage=1", "train.global_batch_size=16"]
    cfg, (_, v1, s1), (lay2, v2, s2) = _flip(base, "sharding_split_param", 8, "sharding")
    assert s1["kind"] == "reduce" and not s1["overlapped"] and s1["exposed_s"] == s1["comm_s"]
    assert s2["kind"] == "reduce-scatter" and not s2["overlapped"] and s2["exposed_s"] == s2["comm_s"]
    assert s2["bucket_bytes"] == SHARDING_BUCKET and s2["buckets"] == math.ceil(_grad_bytes(cfg, lay2, 4) / SHARDING_BUCKET)
    _moves_only_by_the_sync(v1, v2)
    # the overlap knob: the same buckets, issued from the backward
    _, _, ov = _row(base + ["parallel.sharding_split_param=true", "parallel.sharding_comm_overlap=true"], 8)
    s3 = ov["comm_syncs"]["sharding"]
    assert s3["overlapped"] and s3["comm_s"] == pytest.approx(s2["comm_s"]) and s3["buckets"] == s2["buckets"]
    assert s3["exposed_s"] == pytest.approx(_bucketed(s3["comm_s"], s3["window_s"], s3["buckets"]))
    assert s3["exposed_s"] < s2["exposed_s"]
    _moves_only_by_the_sync(v2, ov)
    # smaller buckets: more of them, the last (always exposed) smaller
    _, lay4, small = _row(base + ["parallel.sharding_split_param=true", "parallel.sharding_comm_overlap=true",
                                  "parallel.sharding_comm_buffer_mb=16"], 8)
    s4 = small["comm_syncs"]["sharding"]
    assert s4["bucket_bytes"] == 16 * MIB and s4["buckets"] == math.ceil(_grad_bytes(cfg, lay4, 4) / (16 * MIB))
    assert s4["exposed_s"] == pytest.approx(_bucketed(s4["comm_s"], s4["window_s"], s4["buckets"]))
    assert s4["buckets"] > s3["buckets"] and s4["exposed_s"] <= s3["exposed_s"]


def test_sharding_tensor_fusion_and_its_overlap():
    """V1 with tensor fusion reduces fp32 buckets of comm_buffer_size_MB to their owners instead of each tensor;
    with sharding_comm_overlap they are issued from the backward."""
    base = ["+parallel=zero2", "parallel.sharding=8", "parallel.sharding_stage=1", "train.global_batch_size=16"]
    cfg, (_, v1, s1), (lay2, tf, s2) = _flip(base, "sharding_tensor_fusion", 8, "sharding")
    assert s1["kind"] == s2["kind"] == "reduce" and s1["bucket_bytes"] == 0 and not s2["overlapped"]
    assert s2["bucket_bytes"] == SHARDING_BUCKET and s2["buckets"] == math.ceil(_grad_bytes(cfg, lay2, 4) / SHARDING_BUCKET)
    assert s2["exposed_s"] == s2["comm_s"] and s2["option"] == "sharding_comm_overlap"
    _moves_only_by_the_sync(v1, tf)
    _, _, ov = _row(base + ["parallel.sharding_tensor_fusion=true", "parallel.sharding_comm_overlap=true"], 8)
    s3 = ov["comm_syncs"]["sharding"]
    assert s3["overlapped"] and s3["comm_s"] == pytest.approx(s2["comm_s"]) and s3["buckets"] == s2["buckets"]
    assert s3["exposed_s"] == pytest.approx(_bucketed(s3["comm_s"], s3["window_s"], s3["buckets"]))
    assert s3["exposed_s"] < s2["exposed_s"]
    _moves_only_by_the_sync(tf, ov)
    _, _, ov1 = _row(base + ["parallel.sharding_comm_overlap=true"], 8)  # V1 overlap without fused parameters: the same buckets
    assert ov1["comm_syncs"]["sharding"] == s3


def test_pp_sharding_comm_overlap():
    base = ["+parallel=dp2pp2", "parallel.dp=1", "parallel.sharding=8", "train.global_batch_size=64"]
    cfg, (_, off, s0), (lay1, on, s1) = _flip(base, "pp_sharding_comm_overlap", 16, "sharding")
    assert not s0["overlapped"] and s0["exposed_s"] == s0["comm_s"]
    assert s1["overlapped"] and s1["buckets"] == math.ceil(_grad_bytes(cfg, lay1, 4) / PIPELINE_BUCKET)
    assert s1["exposed_s"] == pytest.approx(_bucketed(s1["comm_s"], s1["window_s"], s1["buckets"]))
    assert s1["exposed_s"] < s0["exposed_s"]
    _moves_only_by_the_sync(off, on)


def test_data_parallel_overlaps_its_own_buckets_and_a_cpu_overlaps_nothing():
    cfg, lay, row = _row(["+parallel=dp4", "parallel.dp=8", "train.global_batch_size=16"], 8)
    s = row["comm_syncs"]["dp"]
    assert s["overlapped"] and s["bucket_bytes"] == DATA_PARALLEL_BUCKET
    e = load_profile("h100").dtype_bytes  # gradients in the parameters' dtype: no main_grad without a fused knob
    assert s["buckets"] == math.ceil(_grad_bytes(cfg, lay, e) / DATA_PARALLEL_BUCKET)
    assert s["exposed_s"] == pytest.approx(_bucketed(s["comm_s"], s["window_s"], s["buckets"]))
    # a CPU runs gloo in the training thread: the knob changes the bytes, never the exposure
    base = ["+parallel=dp2pp2", "parallel.dp=8", "train.global_batch_size=64"]
    _, (_, _, c0), (_, _, c1) = _flip(base, "dp_comm_overlap", 16, "dp", dev="cpu-here")
    assert not c0["overlapped"] and not c1["overlapped"]
    assert c0["exposed_s"] == c0["comm_s"] and c1["exposed_s"] == c1["comm_s"]


def test_experts_under_v2_reduce_scatter_their_own_buckets_over_edp():
    """Under ep > 1 the routed experts' sync is its own ("edp"): V1 reduces each expert tensor to its edp owner after
    the backward (exposed); stage-1 V2 reduce-scatters their own fp32 buckets over edp (fewer bytes over each link,
    not overlapped), and with sharding_comm_overlap issues them from the backward (less waited for). The figures are
    read from the rows and the model's expert elements, nothing pinned."""
    from llmtrain.plan.estimate import _ring, group_spread

    cfg = SimpleNamespace(model=to_config(compose_config(["model=qwen3-30b-a3b", "data.seq_len=2048", "train.amp=bf16",
                                                          "train.micro_batch_size=1"])).model)
    prof = load_profile("h100")

    def row(**knobs):
        layout = resolve_layout(ParallelConfig(sharding=8, ep=2, **knobs),
                                TrainConfig(global_batch_size=16, micro_batch_size=1), 8)
        return layout, time_estimate(cfg.model, layout, 2048, False, prof, 8)

    _, v1 = row()
    lay2, v2 = row(sharding_split_param=True)
    lay3, ov = row(sharding_split_param=True, sharding_comm_overlap=True)
    e1, e2, e3 = (r["comm_syncs"]["edp"] for r in (v1, v2, ov))
    assert e1["kind"] == "expert" and not e1["overlapped"] and e1["exposed_s"] == e1["comm_s"]
    _, experts = synced_gradient_elements(cfg.model, lay2)
    edp = lay2.data_parallel // lay2.ep
    assert edp == 4 and experts > 0
    local, nodes = group_spread(lay2, "edp", 8)
    assert nodes == 1
    # one ring reduce-scatter of the experts' fp32 gradients over edp, in buckets of sharding_comm_buffer_mb
    assert e2["kind"] == "reduce-scatter" and not e2["overlapped"] and e2["option"] == "sharding_comm_overlap"
    assert e2["comm_s"] == pytest.approx(_ring(experts * 4, edp, prof.nvlink_bw, prof.nvlink_alpha, factor=1.0))
    assert e2["bucket_bytes"] == SHARDING_BUCKET and e2["buckets"] == math.ceil(experts * 4 / SHARDING_BUCKET) > 1
    assert e2["exposed_s"] == e2["comm_s"]
    assert e3["overlapped"] and e3["comm_s"] == pytest.approx(e2["comm_s"]) and e3["buckets"] == e2["buckets"]
    assert e3["exposed_s"] == pytest.approx(_bucketed(e3["comm_s"], e3["window_s"], e3["buckets"]))
    assert e3["exposed_s"] < e2["exposed_s"]
    # the overlap knob moves the dense sync and the experts' by exactly what the model says, nothing else
    d2, d3 = v2["comm_syncs"]["sharding"], ov["comm_syncs"]["sharding"]
    assert ov["dp_sharding_comm_s"] - v2["dp_sharding_comm_s"] == pytest.approx(
        (d3["exposed_s"] - d2["exposed_s"]) + (e3["exposed_s"] - e2["exposed_s"]), rel=1e-9)
    _moves_only_by_the_sync(v2, ov)


def test_v2_under_cp_overlaps_the_sharding_reduce_scatter_and_leaves_the_cp_sum_exposed():
    """Under cp the gradients are also summed over dp x cp, by fleet's optimizer after the backward (never from the
    backward): switching V2's overlap on hides the sharding reduce-scatter's buckets and leaves that sum exposed."""
    base = ["+parallel=zero2", "parallel.sharding=4", "parallel.sharding_stage=1", "parallel.cp=2",
            "parallel.sharding_split_param=true", "train.global_batch_size=16"]
    cfg, (_, off, s0), (lay1, on, s1) = _flip(base, "sharding_comm_overlap", 8, "sharding")
    assert not s0["overlapped"] and s1["overlapped"] and s1["buckets"] == s0["buckets"] > 1
    assert s1["exposed_s"] == pytest.approx(_bucketed(s1["comm_s"], s1["window_s"], s1["buckets"]))
    assert s1["exposed_s"] < s0["exposed_s"]
    d0, d1 = off["comm_syncs"]["dp"], on["comm_syncs"]["dp"]  # the cp sum (dp = 1): fp32, exposed either way
    assert not d0["overlapped"] and not d1["overlapped"] and d1 == d0 and d1["exposed_s"] == d1["comm_s"] > 0
    _moves_only_by_the_sync(off, on)


def test_tensor_fusion_under_pp_reduces_its_buckets_after_the_backward():
    """V1 tensor fusion under pp: one reduce per fused bucket of parallel.sharding_comm_buffer_mb instead of one per
    tensor, after the pipeline's backward (exposed)."""
    base = ["+parallel=dp2pp2", "parallel.dp=1", "parallel.sharding=8", "train.global_batch_size=64"]
    cfg, (_, off, s0), (lay1, on, s1) = _flip(base, "sharding_tensor_fusion", 16, "sharding")
    assert s0["bucket_bytes"] == 0 and s0["kind"] == s1["kind"] == "reduce"
    assert not s1["overlapped"] and s1["exposed_s"] == s1["comm_s"] and s1["bucket_bytes"] == SHARDING_BUCKET
    assert s1["buckets"] == math.ceil(_grad_bytes(cfg, lay1, 4) / SHARDING_BUCKET) < s0["buckets"]
    _, _, small = _row(base + ["parallel.sharding_tensor_fusion=true", "parallel.sharding_comm_buffer_mb=16"], 16)
    assert small["comm_syncs"]["sharding"]["bucket_bytes"] == 16 * MIB
