"""The planner's MoE feed-forward, long-sequence attention and context parallelism (llmtrain/plan/moe.py,
kernels.py, profile.py, estimate.py), on synthetic profiles and the packaged h200 one.

    python -m pytest tests/plan/test_moe_long_cost.py -q
"""
from __future__ import annotations

import dataclasses
import math
import types

import pytest

from llmtest import compose
from llmtrain.config import to_config
from llmtrain.plan.kernels import MicroBatchSpec, attention_flops, micro_batch_kernels
from llmtrain.plan.moe import MoEPlan, capacity, exchange_seconds
from llmtrain.plan.profile import from_dict, load_profile
from llmtrain.plan.timeline import Stream

GB = 1e9


def _profile(rate=100e12, bw=1e12, host=10e-6, **extra) -> dict:
    return {"name": "synthetic", "peak_flops": rate, "memory_bytes": 80 * GB, "async_launch": True,
            "links": {"nvlink_bw": 100 * GB, "net_bw": 10 * GB, "nvlink_alpha": 5e-6, "net_alpha": 1e-5},
            "gemm": {"rows": [[m, n, k, rate] for m in (64, 65536) for n in (64, 65536) for k in (64, 65536)]},
            "attention": {"rows": [[32, 1024, 128, True, rate, rate], [32, 8192, 128, True, 2 * rate, 2 * rate]]},
            "memory_bound": {"fallback": "copy", "classes": {"copy": [[1e3, 1e-6], [1e9, 1e9 / bw]]}},
            "host": {"fwd_op_s": host, "bwd_op_s": host, "view_op_s": host / 4},
            "optimizer": {"per_tensor_s": 0.0, "per_elem_s": 0.0}, **extra}


def _moe(**over):
    cfg = to_config(compose(["model=qwen-moe-a2.7b", "model.vocab_size=32000", "model.num_layers=2"])).model
    return dataclasses.replace(cfg, **over)


def _kernels(cfg, plan=None, b=1, s=4096, **kw):
    mb = micro_batch_kernels(MicroBatchSpec(cfg, b, s, moe=plan, **kw))
    return mb.forward + mb.backward


def test_expert_gemms_are_the_padded_buffer():
    """The experts' bmm FLOPs are 6 x E x C x (3 h f) with C the capacity (capacity mode) or imbalance x T k / E
    (dropless), batched over the E / ep local experts serving ep x C rows each."""
    for factor, imbalance in ((1.25, 1.0), (0.0, 1.7)):
        cfg = _moe(moe_capacity_factor=factor)
        for ep in (1, 4):
            plan = MoEPlan(ep=ep, imbalance=imbalance, link=(100 * GB, 5e-6))
            ks = [k for k in _kernels(cfg, plan) if k.kind == "gemm" and k.op.startswith("expert.")]
            C = capacity(cfg, 4096, plan)
            assert C == math.ceil((factor or imbalance) * 4096 * cfg.moe_top_k / cfg.moe_num_experts)
            h, f, E = cfg.hidden_size, cfg.expert_ffn_size(), cfg.moe_num_experts
            assert sum(k.flops for k in ks) == pytest.approx(cfg.num_layers * 6 * E * C * 3 * h * f, rel=1e-12)
            assert {k.shape[3] for k in ks} == {E // ep}  # batch = local experts
            assert {k.shape[0] for k in ks if k.op.endswith(("gate_up", "down", "dgrad"))} == {ep * C}


def test_dropless_reads_the_host_once_per_layer_and_waits():
    """Dropless: one `sync` kernel per MoE layer (capacity mode: none); in the stream the host waits there for
    the device, so a device-bound forward gets no further ahead of it."""
    for factor, syncs in ((0.0, 1), (1.25, 0)):
        ks = _kernels(_moe(moe_capacity_factor=factor))
        assert sum(k.kind == "sync" for k in ks) == syncs * 2
    from llmtrain.plan.kernels import Kernel, mem

    prof = from_dict(_profile())
    st = Stream(prof)
    st.run([mem("copy", 1e9)], backward=False)  # 1 ms of device work, 10 us of host
    assert st.device > st.host
    st.run([Kernel("sync", "host_read")], backward=False)
    assert st.host >= st.device


def test_expert_parallel_exchanges_are_in_the_stream():
    """ep > 1: four exchanges of the [E, C, h] buffer per MoE layer and micro-batch, each priced by
    exchange_seconds (all-to-all: (ep-1)/ep of the bytes; all-gather: ep-1 times them)."""
    cfg = _moe(moe_capacity_factor=1.25)
    plan = MoEPlan(ep=4, link=(50 * GB, 1e-5))
    comm = [k for k in _kernels(cfg, plan) if k.kind == "comm"]
    nbytes = cfg.moe_num_experts * capacity(cfg, 4096, plan) * cfg.hidden_size * 2
    assert len(comm) == 4 * cfg.num_layers
    assert all(k.shape[0] == pytest.approx(0.75 * nbytes / 50e9 + 3e-5) for k in comm)
    gather = MoEPlan(ep=4, link=(50 * GB, 1e-5), dispatcher="allgather")
    assert exchange_seconds(nbytes, gather) == pytest.approx(3 * nbytes / 50e9 + 3e-5)
    assert not [k for k in _kernels(cfg, MoEPlan()) if k.kind == "comm"]


def test_dispatch_is_the_final_op_sequence():
    """MOE-FORMULATION a593f33: the forward gathers the E C buffer rows (no index_add of the k T choices); the
    backward index_adds them into [T + 1, h] once, priced between the 20%- and 60%-empty tables by the buffer's
    empty share; every cumsum over axis 0 is Paddle's transpose, scan along the rows, transpose back (route()'s
    and the experts': two per layer with a capacity, one dropless)."""
    from llmtrain.plan.timeline import kernel_seconds

    for factor, imbalance, scans in ((1.25, 1.0, 2), (0.0, 2.5, 1)):
        cfg = _moe(moe_capacity_factor=factor)
        plan = MoEPlan(imbalance=imbalance)
        mb = micro_batch_kernels(MicroBatchSpec(cfg, 1, 4096, moe=plan))
        h, T, k, E = cfg.hidden_size, 4096, cfg.moe_top_k, cfg.moe_num_experts
        EC = E * capacity(cfg, T, plan)
        fwd = [x for x in mb.forward if x.op.startswith("moe_")]
        assert not [x for x in fwd if "index_add" in x.op]
        assert [x.numel for x in fwd if x.op == "moe_gather_rows"] == [EC * h, k * T * h] * cfg.num_layers
        assert [x.op for x in fwd].count("moe_cumsum_emajor") == scans * cfg.num_layers
        assert [x.op for x in fwd].count("moe_t_copy_i64") == 2 * scans * cfg.num_layers
        inv = [x for x in mb.backward if x.op == "moe_index_add_inv"]
        assert len(inv) == cfg.num_layers and {x.numel for x in inv} == {EC * h}
        empty = 1 - k * T / EC  # 20% at C = 1.25 T k / E, 60% at 2.5
        assert inv[0].shape == ("moe_index_add_inv60", pytest.approx((empty - 0.2) / 0.4, abs=1e-3))
    classes = {"copy": [[1e3, 1e-6], [1e9, 1e-3]], "moe_index_add_inv": [[1e3, 1e-6], [1e9, 1.0]],
               "moe_index_add_inv60": [[1e3, 1e-6], [1e9, 3.0]]}
    prof = from_dict(_profile(memory_bound={"fallback": "copy", "classes": classes}))
    assert kernel_seconds(prof, inv[0]) == pytest.approx((1 - inv[0].shape[1]) * prof.mem_seconds(
        "moe_index_add_inv", inv[0].numel) + inv[0].shape[1] * prof.mem_seconds("moe_index_add_inv60", inv[0].numel))


def test_long_attention_is_priced_from_the_measured_rate():
    """Past the attention table's longest sequence the rate comes from `attention_long`: its own rows exactly,
    linear in log seq between them, flat beyond the longest; within the table nothing changes."""
    rate = 100e12
    long_rows = [[32, s, 128, True, 32, r, r] for s, r in ((8192, 2 * rate), (32768, 3 * rate), (65536, 4 * rate))]
    base, long = from_dict(_profile(rate)), from_dict(_profile(rate, attention_long={"rows": long_rows}))
    fl = lambda s: attention_flops(32, s, 128, True)  # noqa: E731
    for s in (1024, 4096, 8192):
        assert long.attention_seconds(32, s, 128, True, fl(s), False) == base.attention_seconds(32, s, 128, True, fl(s), False)
    assert long.attention_seconds(32, 32768, 128, True, fl(32768), False) == pytest.approx(fl(32768) / (3 * rate))
    assert long.attention_seconds(32, 131072, 128, True, fl(131072), True) == pytest.approx(fl(131072) / (4 * rate))
    mid = fl(16384) / long.attention_seconds(32, 16384, 128, True, fl(16384), False)
    assert mid == pytest.approx(2.5 * rate)  # halfway in log seq between 8k and 32k


def test_batched_gemm_table():
    rows = [[8, 1024, 4096, 2048, "nn", 500e12], [8, 4096, 4096, 2048, "nn", 700e12]]
    prof = from_dict(_profile(bmm={"rows": rows}))
    fl = lambda m: 2.0 * 8 * m * 4096 * 2048  # noqa: E731
    assert prof.gemm_seconds(1024, 4096, 2048, 8) == pytest.approx(fl(1024) / 500e12)
    assert fl(2048) / prof.gemm_seconds(2048, 4096, 2048, 8) == pytest.approx(math.sqrt(500e12 * 700e12))  # log-log
    assert prof.gemm_seconds(16384, 4096, 2048, 8) == pytest.approx(fl(16384) / 700e12)  # the longest's rate
    assert prof.gemm_seconds(1024, 4096, 2048, 8, "nt") == pytest.approx(fl(1024) / 100e12)  # no row: `gemm`


def test_cp_shrinks_positions_and_attention_work():
    """A cp rank's blocks see s/cp positions, its attention does 1/cp of the causal work, its activations 1/cp."""
    from llmtrain.plan.estimate import memory_estimate

    cfg = to_config(compose(["model=tinyllama-1.1b", "model.vocab_size=32000"])).model
    one, four = (micro_batch_kernels(MicroBatchSpec(cfg, 1, 32768, cp=c)) for c in (1, 4))
    attn = lambda mb: sum(k.flops for k in mb.forward if k.kind == "attn_fwd")  # noqa: E731
    assert attn(four) == pytest.approx(attn(one) / 4)
    gemm = lambda mb: sum(k.flops for k in mb.forward if k.kind == "gemm")  # noqa: E731
    assert gemm(four) == pytest.approx(gemm(one) / 4)
    from llmtrain.parallel.layout import resolve_layout

    c = to_config(compose(["model=tinyllama-1.1b", "model.vocab_size=32000", "+parallel=dp2", "parallel.dp=1"]))
    lay = resolve_layout(c.parallel, c.train, 1)
    acts = [memory_estimate(cfg, types.SimpleNamespace(**{**vars(lay), "cp": cp}), 32768, "none", "bf16", "gpu", 2,
                            True, 0)["activations"] for cp in (1, 4)]
    assert acts[1] == pytest.approx(acts[0] / 4, rel=0.02)


def test_cp_exchanges():
    """ring: exposed only where a step's transfer outlasts its block's attention; allgather / a2a: not overlapped,
    their bytes over the link."""
    from llmtrain.plan.estimate import _ring, cp_comm_s

    cfg = to_config(compose(["model=tinyllama-1.1b", "model.vocab_size=32000"])).model
    prof = load_profile("h200")
    lay = lambda comm: types.SimpleNamespace(cp=4, cp_comm=comm, tp=1, pp=1, micro_batch=1, grad_accum=1)  # noqa: E731
    stride = {"cp": 1}
    ring = cp_comm_s(cfg, lay("ring"), 65536, "none", prof, 8, stride)
    assert ring == 0.0  # 16k-token blocks: NVLink carries k, v faster than flash attends over them
    d, kv = cfg.attn_head_dim(), cfg.kv_heads() * cfg.attn_head_dim()
    chunk = 2 * 16384 * kv * 2
    ag = cp_comm_s(cfg, lay("allgather"), 65536, "none", prof, 8, stride)
    assert ag == pytest.approx(cfg.num_layers * 2 * _ring(4 * chunk, 4, prof.nvlink_bw, prof.nvlink_alpha, 1.0))
    a2a = cp_comm_s(cfg, lay("a2a"), 65536, "none", prof, 8, stride)
    nbytes = 16384 * (2 * cfg.num_heads * d + 2 * kv) * 2
    assert a2a == pytest.approx(cfg.num_layers * 2 * (0.75 * nbytes / prof.nvlink_bw + 12 * prof.nvlink_alpha))
    slow = dataclasses.replace(prof, nvlink_bw=1e9)  # a slow link: the ring's transfers are exposed
    assert cp_comm_s(cfg, lay("ring"), 65536, "none", slow, 8, stride) > 0


def test_cp_ring_on_a_cpu_profile_hides_nothing():
    """On CPU gloo's send/recv block and the ring's blocks are math kernels (a CPU profile has no flash rows): the
    ring is priced whole, its cp - 1 steps' transfers exposed, where it used to fail on the missing flash rows."""
    from llmtrain.plan.estimate import _link, cp_comm_s

    cfg = to_config(compose(["model=llama-tiny", "model.vocab_size=256"])).model
    prof = load_profile("cpu-here")
    lay = types.SimpleNamespace(cp=2, cp_comm="ring", tp=1, pp=1, micro_batch=2, grad_accum=1)
    got = cp_comm_s(cfg, lay, 256, "none", prof, 2, {"cp": 1}, flash=False)
    chunk = 2 * 2 * 128 * cfg.kv_heads() * cfg.attn_head_dim() * prof.dtype_bytes
    bw, alpha = _link(2, prof, 2)
    assert got == pytest.approx(cfg.num_layers * ((chunk / bw + alpha) + (2 * chunk / bw + alpha)))


def test_auto_takes_cp_only_when_nothing_else_fits(monkeypatch):
    """+parallel=auto: 448k tokens of a tinyllama-1.1b with one kv head on 2 x h200 fit only under cp2 with full
    recompute (tp2 needs the kv heads divisible; sharding2 holds the whole sequence), ring or all-gather (a2a
    needs the kv heads divisible by cp); at 4k no cp layout is ranked at all. (At 384k one rank's logits peak, 119 GiB,
    fits beside offloaded activations and optimizer state since a re-running block is no longer added to it.)"""
    import paddle

    from llmtrain.plan.auto import choose_layout
    from llmtrain.plan.model import planned_model
    from llmtrain.plan.search import rank_layouts

    over = ["model=tinyllama-1.1b", "model.vocab_size=32000", "model.num_kv_heads=1", "train.global_batch_size=2",
            "plan.devices=2", "plan.device=h200"]
    cfg = to_config(compose(over + ["data.seq_len=458752"]))
    rows = rank_layouts(cfg, planned_model(cfg))
    fits = [r for r in rows if r["fits"]]
    assert fits and {(r["cp"], r["cp_comm"], r["recompute"]) for r in fits} == {(2, "ring", "full"), (2, "allgather", "full")}
    assert not [r for r in rows if r["cp_comm"] == "a2a" and r["cp"] > 1]
    short = to_config(compose(over + ["data.seq_len=4096"]))
    assert {r["cp"] for r in rank_layouts(short, planned_model(short))} == {1}
    monkeypatch.setattr(paddle, "get_device", lambda: "gpu:0")  # choose_layout plans plan.device on a GPU
    auto = to_config(compose(over + ["data.seq_len=458752", "+parallel=auto"]))
    chosen = choose_layout(auto, world_size=2, log=lambda _: None)
    assert (chosen.parallel.cp, chosen.parallel.cp_comm, chosen.train.recompute) == (2, fits[0]["cp_comm"], "full")
