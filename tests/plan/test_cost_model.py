"""The operator-level cost model: kernel enumeration, profile tables, host/device overlap, calibration's fitting,
and `+parallel=auto` choosing the micro-batch that measures fastest.

    python -m pytest tests/plan/test_cost_model.py -q
"""
from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest

from llmtest import compose
from llmtrain.config import to_config
from llmtrain.models.size import flops_parameters
from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels
from llmtrain.plan.profile import Curve, from_dict, load_profile
from llmtrain.plan.timeline import Stream

GB = 1e9


def _mbk(*args, **kw):
    """micro_batch_kernels of a MicroBatchSpec built from the old positional arguments."""
    return micro_batch_kernels(MicroBatchSpec(*args, **kw))


def _step(prof, cfg, b, s, t, m, gpu, flash, recompute, layers, first, last, grads, owned, sp=False, local_ranks=1):
    """timeline.step_compute from the old positional arguments (dtype and composite kernels as the profile)."""
    from llmtrain.plan.timeline import StepSpec, step_compute

    spec = MicroBatchSpec(cfg, b, s, t, None, gpu, flash, recompute, layers, first, last, sp, None, None)
    return step_compute(prof, StepSpec(spec, m, grads, owned, local_ranks))


def _synthetic(async_launch=True, host=10e-6, rate=100e12, bw=1e12) -> dict:
    """A profile whose every GEMM runs at `rate`, every memory-bound op at `bw` (1 us floor), `host` s per op."""
    return {"name": "synthetic", "peak_flops": rate, "memory_bytes": 80 * GB, "async_launch": async_launch,
            "tables_include_host": not async_launch,
            "links": {"nvlink_bw": 100 * GB, "net_bw": 10 * GB, "nvlink_alpha": 5e-6, "net_alpha": 1e-5},
            "gemm": {"rows": [[m, n, k, rate] for m in (64, 65536) for n in (64, 65536) for k in (64, 65536)]},
            "attention": {"rows": [[32, 1024, 128, True, rate, rate]]},
            "memory_bound": {"fallback": "copy", "classes": {"copy": [[1e3, 1e-6], [1e6, 1e-6 + 1e6 / bw],
                                                                      [1e9, 1e9 / bw]]}},
            "host": {"fwd_op_s": host, "bwd_op_s": host, "view_op_s": host / 4},
            "optimizer": {"per_tensor_s": 0.0, "per_elem_s": 0.0}}


def _llama(**over):
    cfg = to_config(compose(["model=tinyllama-1.1b", "model.vocab_size=32000"])).model
    import dataclasses

    return dataclasses.replace(cfg, **over)


def test_gemm_kernels_carry_the_model_flops():
    """Forward + input-grad + weight-grad GEMMs of a micro-batch = 6 x (matmul parameters) x tokens, per tp rank."""
    cfg = _llama(num_layers=2)
    b, s = 2, 256
    # tinyllama-1.1b's matmul weights, counted from its shape (h 2048, 32 heads of 64, 4 kv heads: kv width 256,
    # SwiGLU 5632, untied head over 32000): per block q and o h x h, k and v h x 256, gate, up and down h x 5632
    h, kv, f, vocab = 2048, 4 * 64, 5632, 32000
    matmul_weights = 2 * (2 * h * h + 2 * h * kv + 3 * h * f) + h * vocab
    assert matmul_weights == 153_616_384
    for tp in (1, 2):
        mb = _mbk(cfg, b, s, tp, 2, gpu=True, flash=True)
        gemm = sum(k.flops for k in mb.forward + mb.backward if k.kind == "gemm")
        assert gemm == pytest.approx(6 * matmul_weights * b * s / tp, rel=1e-9)  # 2 forward + 2 + 2 backward
    full = _mbk(cfg, b, s, 1, 2, gpu=True, flash=True, recompute="full")
    none = _mbk(cfg, b, s, 1, 2, gpu=True, flash=True)
    block_fwd = (len(none.forward) - len(_mbk(cfg, b, s, 1, 2, True, True, layers=0).forward)) // 2
    assert len(full.backward) == len(none.backward) + cfg.num_layers * block_fwd  # recompute's second forward


def test_gemm_layouts_are_the_ones_matmul_grad_runs():
    """A linear x @ W: forward "nn", input gradient dY @ Wᵀ "nt", weight gradient Xᵀ @ dY "tn" (Paddle's
    matmul_grad); the tied head x @ tableᵀ: forward "nt", dX = dY @ table "nn", d(table) [V, h] = dYᵀ @ X "tn"."""
    from llmtrain.plan.kernels import head_kernels

    cfg = _llama(num_layers=1)
    mb = _mbk(cfg, 2, 64, 1, 4, gpu=False, flash=False)
    for name, lay in (("fwd", "nn"), ("dgrad", "nt"), ("wgrad", "tn")):
        got = {k.layout for k in mb.forward + mb.backward if k.kind == "gemm" and k.op.endswith("." + name)}
        assert got == {lay}, (name, got)
    h, V, T = cfg.hidden_size, cfg.vocab_size, 2 * 64
    for tied, want in ((False, {"fwd": ("nn", (T, V, h)), "dgrad": ("nt", (T, h, V)), "wgrad": ("tn", (h, V, T))}),
                       (True, {"fwd": ("nt", (T, V, h)), "dgrad": ("nn", (T, h, V)), "wgrad": ("tn", (V, h, T))})):
        fwd, bwd = head_kernels(dataclasses.replace(cfg, tie_embeddings=tied), 2, 64, 1, 4, gpu=False)
        got = {k.op.split(".")[-1]: (k.layout, k.shape[:3]) for k in fwd + bwd if k.kind == "gemm"}
        assert got == want, (tied, got)


def test_fused_switches_change_the_kernels():
    on = _mbk(_llama(num_layers=1), 1, 128, 1, 2, gpu=True, flash=True)
    off = _mbk(_llama(num_layers=1, fuse_qkv="false", fuse_ffn="false", fuse_rope="false",
                                     fuse_swiglu="false", fuse_rms_norm="false"), 1, 128, 1, 2, gpu=True, flash=True)
    shapes = lambda mb: sorted(k.shape[:3] for k in mb.forward if k.kind == "gemm")  # noqa: E731
    assert (128, 2048 + 2 * 256, 2048) in shapes(on) and (128, 2048, 2048) in shapes(off)  # q|k|v as one GEMM
    assert len(off.forward) > len(on.forward) + 10  # unfused norm, RoPE, SwiGLU: more kernels


def test_profile_tables_interpolate():
    c = Curve.of([[1e3, 1e-6], [1e6, 2e-6], [1e9, 1e-3]])
    assert c.seconds(10) == pytest.approx(1e-6)  # below the table: the launch floor
    assert c.seconds(1e6) == pytest.approx(2e-6)
    assert c.seconds(2e9) == pytest.approx(2e-3)  # above: the largest size's bandwidth
    assert 2e-6 < c.seconds(1e7) < 1e-3
    raw = _synthetic()
    raw["gemm"]["rows"].append([4096, 4096, 4096, 500e12])
    p = from_dict(raw)
    assert p.gemm_seconds(4096, 4096, 4096) == pytest.approx(2 * 4096**3 / 500e12)  # an exact shape is its own rate
    assert 2 * 4000**3 / 500e12 < p.gemm_seconds(4000, 4000, 4000) < 2 * 4000**3 / 100e12


def test_math_attention_core_is_one_measured_composite_on_a_cpu_profile():
    """A profile with `attention_math` rows prices the math attention core (views, strided matmuls, mask, softmax)
    as one kernel per pass at the rate measured for its (batch·heads, seq, head_dim); without them (every GPU
    profile) the core stays its batched GEMMs and memory-bound ops."""
    from llmtrain.plan.kernels import attention_flops
    from llmtrain.plan.timeline import step_compute

    cfg = _llama(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=4, ffn_hidden_size=512, attention="math")
    base = _synthetic(async_launch=False, host=0.0)
    rate = 1e9  # far slower than the synthetic GEMMs (100 TFLOP/s): the composite must dominate
    math = dict(base, attention_math={"fwd": [[bh, s, d, rate] for bh in (1, 64) for s in (16, 1024) for d in (8, 128)],
                                      "bwd": [[bh, s, d, rate / 2] for bh in (1, 64) for s in (16, 1024) for d in (8, 128)]})
    args = (cfg, 2, 64, 1, 1, False, False, "none", 2, True, True, [(10, 4)], [(10, 4)])
    with_core, without = _step(from_dict(math), *args), _step(from_dict(base), *args)
    fl = 2 * (2 * 4) * 64 * 64 * 64 * 2  # q kᵀ and p v: 2·s²·d FLOPs each, for batch 2 x 4 heads of 64, seq 64
    assert attention_flops(2 * 4, 64, 64, False) == fl
    # backward: dp = do vᵀ, dv = pᵀ do, dq = ds k, dk = dsᵀ q, four products of the forward's size (2x its FLOPs)
    core = 2 * (fl / rate + 2 * fl / (rate / 2))  # two blocks, forward and backward
    assert with_core["by_kind_s"]["attention"] == pytest.approx(core)
    assert "attention" not in without["by_kind_s"]
    assert with_core["compute_s"] > without["compute_s"] + 0.9 * core
    mb = _mbk(cfg, 2, 64, 1, 4, False, False, math_core=True)
    assert [k.op for k in mb.forward if k.kind == "attn_fwd"] == ["math", "math"]
    assert not [k for k in _mbk(cfg, 2, 64, 1, 4, False, False).forward if k.kind.startswith("attn")]


def test_shared_host_slowdown_is_the_slowest_process():
    """Processes of one job meet at every collective, so the `shared_host` factor is the slowest process's call
    over the call alone (here 1.3x), not the typical process's (1.1x); each round's ratio, then their median."""
    from llmtrain.plan.measure import shared_host_rows

    alone = (10e-3, 9e-3)  # (median wall-clock call, median thread-CPU call)
    rounds = {("gemm", 256): [(alone, [(9e-3, 9e-3), (13e-3, 12e-3)]),   # slowest 1.3x (mean 1.1x)
                              (alone, [(13e-3, 12e-3), (9e-3, 9e-3)]),   # the other process slowest: 1.3x
                              (alone, [(20e-3, 18e-3), (9e-3, 9e-3)])]}  # a burst: 2x, not the median round
    (row,) = shared_host_rows(rounds)
    assert row["slowdown"] == pytest.approx(1.3)
    assert row["cpu_time_slowdown"] == pytest.approx(12 / 9)
    assert row["together_s"] == pytest.approx(13e-3) and row["alone_s"] == pytest.approx(10e-3)


def test_shared_host_slowdown_applies_to_multi_process_layouts_only(tmp_path):
    """A CPU profile's measured `shared_host` factors slow a rank's GEMMs and memory-bound kernels when the layout
    puts 2 processes on the host (dp2 on one CPU machine), not one process alone; GPU profiles have no table."""
    from llmtrain.config import to_config
    from llmtrain.plan.__main__ import plan
    from llmtrain.plan.timeline import step_compute

    cfg = _llama(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=4, ffn_hidden_size=512)
    base = _synthetic(async_launch=False, host=0.0)
    shared = dict(base, shared_host={"ranks": 2, "rows": [{"kind": "gemm", "size": 2, "slowdown": 1.5},
                                                          {"kind": "gemm", "size": 2**20, "slowdown": 1.5},
                                                          {"kind": "memory_bound", "size": 2**4, "slowdown": 2.0},
                                                          {"kind": "memory_bound", "size": 2**30, "slowdown": 2.0}]})
    args = (cfg, 2, 64, 1, 2, False, False, "none", 2, True, True, [(10, 4)], [(10, 4)])
    one, two = _step(from_dict(shared), *args, local_ranks=1), _step(from_dict(shared), *args, local_ranks=2)
    assert one["compute_s"] == pytest.approx(_step(from_dict(base), *args, local_ranks=2)["compute_s"])
    assert two["by_kind_s"]["gemm"] == pytest.approx(1.5 * one["by_kind_s"]["gemm"])
    assert two["by_kind_s"]["mem"] == pytest.approx(2.0 * one["by_kind_s"]["mem"])
    assert not load_profile("h200").shared_host_slowdown(8)
    from llmtrain.plan.profile import slowdown_at

    curve = [(0.0, 0.0), (4.0, 2.0)]  # factor 1 at 1 element, e**2 at e**4: log-log between, clamped outside
    assert slowdown_at(curve, 0.5) == 1.0 and slowdown_at(curve, math.exp(8)) == pytest.approx(math.exp(2))
    assert slowdown_at(curve, math.exp(2)) == pytest.approx(math.exp(1))
    # through the planner: dp2 on the packaged cpu-here differs from the same profile without the table (slower
    # or faster as its factors were measured above or below 1), one
    # process does not
    prof = load_profile("cpu-here")
    assert prof.shared_host is not None  # the packaged profile carries the table
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({k: v for k, v in prof.raw.items() if k != "shared_host"}))
    common = ["model=gpt-tiny", "model.vocab_size=2560", "train.global_batch_size=8", "train.micro_batch_size=2",
              "plan.device=cpu-here"]
    rows = {(layout, path): plan(to_config(compose(common + extra + [f"plan.profile={path}"])))[0]["compute_s"]
            for layout, extra in (("single", ["plan.devices=1", "+parallel=dp2", "parallel.dp=1"]),
                                  ("dp2", ["plan.devices=2", "+parallel=dp2"])) for path in ("null", plain)}
    assert rows[("single", "null")] == pytest.approx(rows[("single", plain)])
    if max(abs(r["slowdown"] - 1) for r in prof.shared_host["rows"]) > 0.01:  # a measured table moves dp2
        assert rows[("dp2", "null")] != pytest.approx(rows[("dp2", plain)], rel=1e-3)


def test_cpu_timing_is_a_typical_call_not_the_fastest(monkeypatch):
    """measure.timeit on a CPU: the median of three back-to-back runs' mean call, the definition the GPU tables use
    and what a step's sum of ops sees; the fastest of the repeats would under-price an op whose calls vary."""
    import types

    from llmtrain.plan import measure

    now = [0.0]  # a simulated clock: sleep-based timing overshoots on a loaded CI machine
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    calls = iter(range(1000))

    def alternating():  # 1 ms, 3 ms, 1 ms, 3 ms, ...: a typical call is 2 ms, the fastest 1 ms
        now[0] += 3e-3 if next(calls) % 2 else 1e-3

    t = measure.timeit(alternating, reps=6, warmup=0)
    assert t == pytest.approx(2e-3), t


def test_host_bound_and_device_bound_streams():
    """Micro-batch 1 of a small model: the GPU waits for the host; a large one: the host runs ahead."""
    slow_host = from_dict(_synthetic(host=200e-6))
    cfg = _llama(num_layers=2)
    small = _mbk(cfg, 1, 128, 1, 2, gpu=True, flash=True)
    st = Stream(slow_host)
    st.run(small.forward, False)
    st.run(small.backward, True)
    assert st.elapsed == pytest.approx(st.host_total, rel=0.05) and st.device_total < 0.5 * st.host_total
    big = _mbk(cfg, 16, 2048, 1, 2, gpu=True, flash=True)
    st = Stream(slow_host)
    st.run(big.forward, False)
    st.run(big.backward, True)
    assert st.elapsed == pytest.approx(st.device_total, rel=0.05) and st.host_total < 0.5 * st.device_total
    # a CPU profile runs ops where they are dispatched: host and device add up
    cpu = from_dict(_synthetic(async_launch=False, host=50e-6))
    st = Stream(cpu)
    st.run(small.forward, False)
    assert st.elapsed == pytest.approx(st.host_total + st.device_total)


def test_gpu_profiles_are_data_with_provenance():
    for name in ("a100-80g", "h100", "h200"):
        p = load_profile(name)
        assert p.source and p.raw.get("links", {}).get("source")
        assert p.async_launch and p.gemm.rows and p.attn_rows
    scaled = load_profile("a100-80g").raw
    assert "datasheet" in scaled["scale"]["why"] and scaled["scaled_from"] == "h200"
    for name in ("a100-40g", "a100-80g", "a800", "h100", "h20", "h200", "h800", "l40s"):  # offload is priced on each
        assert load_profile(name).host_bw, name


def test_calibration_measures_and_fits_this_cpu(tmp_path):
    """--calibrate's tables (quick sizes) fit into a profile whose lookups return the measurements."""
    from llmtrain.plan.calibrate import QUICK, cpu_base, measure_tables
    from llmtrain.plan.fit import fit_profile

    sizes = dict(QUICK, gemm_sizes=(16, 256), mem_sizes=(2**8, 2**14), optimizer=((2, 2**8), (8, 2**8), (2, 2**14)))
    raw = measure_tables(sizes)
    gloo = {"collective_bw": 1e9, "collective_alpha_busy": 1e-3, "p2p_bw": 1e9, "p2p_alpha": 1e-4}
    prof = fit_profile(raw, cpu_base(1e10, gloo, 0.0), split_layouts=True)
    (tmp_path / "p.json").write_text(json.dumps(prof))
    p = from_dict(json.loads((tmp_path / "p.json").read_text()))
    for lay in ("nn", "nt", "tn"):  # each layout's measurement, looked up in its own table
        r = [x for x in raw["gemm"] if x["layout"] == lay][-1]
        assert p.gemm_seconds(r["m"], r["n"], r["k"], 1, lay) == pytest.approx(r["seconds"])
    for op in ("add", "vocab_parallel_ce", "vocab_parallel_ce_bwd"):  # the last two: tp's CPU loss, timed whole
        row = [x for x in raw["memory_bound"] if x["op"] == op][-1]
        assert p.mem_seconds(op, row["numel"]) == pytest.approx(row["seconds"])
    from llmtrain.plan.kernels import attention_flops

    a = raw["attention_math"][-1]  # the math attention core: measured, looked up as measured
    bh, s, d = a["batch"] * a["heads"], a["seq"], a["head_dim"]
    fl = attention_flops(bh, s, d, False)
    assert p.math_attention_seconds(bh, s, d, fl, False) == pytest.approx(a["fwd_s"])
    assert p.math_attention_seconds(bh, s, d, 2 * fl, True) == pytest.approx(a["bwd_s"])
    assert p.host["fwd_op_s"] >= 0 and p.optimizer["per_tensor_s"] + p.optimizer["per_elem_s"] > 0
    assert not p.async_launch and p.tables_include_host


def _measure_step(cfg, mb: int, global_batch: int, steps: int = 3, s: int = 128) -> float:
    """Fastest seconds of a training step (forward, backward of global_batch / mb micro-batches, AdamW) in-process."""
    import paddle

    from llmtrain.contracts.steps import mean_loss
    from llmtrain.models import build_model

    paddle.seed(0)
    model = build_model(cfg)
    opt = paddle.optimizer.AdamW(1e-4, parameters=model.parameters())
    ids = paddle.randint(0, cfg.vocab_size, [mb, s])
    mask = paddle.ones([mb, s])
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        for _ in range(global_batch // mb):
            loss = mean_loss(model.loss_fn(model(ids), (ids, mask)))
            loss.backward()
        opt.step()
        opt.clear_grad()
        float(loss)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def test_auto_picks_the_micro_batch_that_measures_fastest():
    """A small GPT (h 64, seq 16), global batch 8 on one CPU process (the packaged cpu-here profile): every op's
    dispatch costs the same whatever the micro-batch, so 8 micro-batches of 1 are host-bound and slow; the
    planner predicts it and `auto` picks the micro-batch that measures faster (8 against 1)."""
    from llmtrain.plan.auto import choose_layout

    over = ["model=gpt-tiny", "model.vocab_size=256", "model.hidden_size=64", "model.ffn_hidden_size=256",
            "data.seq_len=16", "train.global_batch_size=8", "plan.profile=null"]
    lines = []
    chosen = choose_layout(to_config(compose(over + ["+parallel=auto"])), world_size=1, log=lines.append)
    model = to_config(compose(over)).model
    # the fastest of 8 steps each (a step is 15-35 ms here): a moment of load on a shared host cannot flip the order
    measured = {mb: _measure_step(model, mb, 8, steps=8, s=16) for mb in (1, 8)}
    fastest = min(measured, key=measured.get)
    assert chosen.train.micro_batch_size == fastest, (measured, lines)


def test_loop_constants_and_recompute_forward_host_time():
    """The host block's `micro_batch_s` (per micro-batch) and `step_s` (per step) are added to a step, on a CPU
    serially; under full recompute the block's forward run again inside the backward costs `fwd_op_s` per op."""
    from llmtrain.plan.timeline import step_compute

    cfg = _llama(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=4, ffn_hidden_size=512)
    args = (cfg, 1, 64, 1, 4, False, False, "none", 2, True, True, [(10, 4)], [(10, 4)])
    base = _synthetic(async_launch=False, host=50e-6)
    t0 = _step(from_dict(base), *args)["compute_s"]
    loop = dict(base, host=dict(base["host"], micro_batch_s=0.25, step_s=1.0))
    assert _step(from_dict(loop), *args)["compute_s"] == pytest.approx(t0 + 4 * 0.25 + 1.0)
    # recompute: forward ops replayed in the backward dispatch at the forward's host cost
    mb = _mbk(cfg, 1, 64, 1, 4, False, False, "full", 2)
    replayed = [k for ks, n, *prefix in mb.backward_segments if prefix for _ in range(n) for k in ks[:prefix[0]]]
    assert replayed
    cheap_fwd = dict(base, host=dict(base["host"], fwd_op_s=0.0, view_op_s=0.0))
    st = Stream(from_dict(cheap_fwd))
    st.run_segments(mb.backward_segments, True)
    n_bwd = sum(k.kind != "view" for k in mb.backward) - sum(k.kind != "view" for k in replayed)
    assert st.host_total == pytest.approx(n_bwd * 50e-6)


def test_fit_loop_recovers_the_loop_constants(tiny_gpt):
    """calibrate.fit_loop: rows made of the profile's own prediction plus known loop constants give them back."""
    import dataclasses

    from llmtrain.plan.calibrate import _predict_loop_row, fit_loop

    prof = _synthetic(async_launch=False, host=5e-6)
    rows = []
    for layers in (1, 4):
        for m in (1, 4):
            model = dataclasses.asdict(dataclasses.replace(tiny_gpt, num_layers=layers))
            r = {"model": model, "layers": layers, "micro_batches": m, "micro_batch": 1, "seq": 16}
            pred, ops = _predict_loop_row(prof, r)
            r["seconds"] = pred + 2e-3 + m * 1e-3 + m * ops * 3e-6
            rows.append(r)
    got = fit_loop(prof, rows)
    assert (got["step_s"], got["micro_batch_s"], got["op_s"]) == pytest.approx((2e-3, 1e-3, 3e-6), rel=1e-6)
    for r in rows:  # a loop slower than its kernels by nothing gives zeros, never negative constants
        r["seconds"] = _predict_loop_row(prof, r)[0]
    assert all(abs(fit_loop(prof, rows)[k]) < 1e-9 for k in ("step_s", "micro_batch_s", "op_s"))


def test_h200_host_block_comes_from_the_model_code_path_table():
    """The packaged h200 profile's host times are host_model.json's (the twin's code path at tiny shapes), not
    the tiny-op loops': refitting from benchmarks/data/h200 (bare views' host seconds from the H100 call that measured
    them, parts at the H200 host's eager `mul`) gives the packaged figures."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    data = root / "benchmarks" / "data" / "h200"
    spec = importlib.util.spec_from_file_location("fit_h200", root / "benchmarks" / "fit_h200.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    raw_host = json.loads((data / "host.json").read_text())
    views = json.loads((root / "benchmarks" / "data" / "h100" / "launches" / "launches.json").read_text())
    host = fit.host_from_model(json.loads((data / "host_model.json").read_text()), raw_host,
                               fit.bare_view_s(views), fit.bare_part_s(raw_host))
    packaged = load_profile("h200").host
    for k in ("fwd_op_s", "bwd_op_s", "view_op_s", "part_fwd_s", "part_bwd_s", "micro_batch_s", "step_s"):
        assert packaged[k] == pytest.approx(host[k], rel=1e-9), k
    assert "host_model.json" in packaged["source"]
    assert packaged["fwd_op_s"] > 1.5 * packaged["tiny_op_loop"]["fwd_op_s"]  # the code path costs more per op


def test_gpu_optimizer_queues_behind_the_backward():
    """On an async-launch device nothing synchronises before the optimizer (the twin's and Paddle's steps sync
    once, at their end): the AdamW update's host dispatch hides behind a device-bound backward, and its device
    work follows the backward's; on a CPU the update still runs after the backward, host and device added."""
    from llmtrain.plan.timeline import step_compute

    cfg = _llama(num_layers=2)
    owned = [(10**6, 4)] * 10
    args = (cfg, 16, 2048, 1, 1, True, True, "none", 2, True, True, owned, owned)
    base = dict(_synthetic(host=10e-6), optimizer={"per_tensor_s": 0.0, "per_elem_s": 0.0, "includes_clip": True})
    fb = _step(from_dict(base), *args)
    assert fb["compute_s"] == pytest.approx(fb["device_s"], rel=1e-3) and fb["host_s"] < 0.2 * fb["device_s"]
    opt = dict(base, optimizer={"per_tensor_s": 1e-3, "per_elem_s": 1e-9, "includes_clip": True})
    got = _step(from_dict(opt), *args)
    assert got["compute_s"] == pytest.approx(fb["compute_s"] + 10 * 1e-3, rel=1e-6)  # only its device time adds
    assert got["by_kind_s"]["optimizer"] == pytest.approx(10 * 1e-3)
    cpu = dict(_synthetic(async_launch=False, host=10e-6), optimizer=opt["optimizer"])
    args_cpu = (cfg, 1, 64, 1, 1, False, False, "none", 2, True, True, owned, owned)
    t0 = _step(from_dict(dict(cpu, optimizer=base["optimizer"])), *args_cpu)["compute_s"]
    assert _step(from_dict(cpu), *args_cpu)["compute_s"] == pytest.approx(t0 + 10 * 1e-3 + 10 * 1e-3)


def test_gpu_gradient_sums_and_accumulation_cost_a_bare_launch():
    """On the GPU path every backward adds each parameter's gradient into its zeroed buffer (every micro-batch,
    the first too) and sums the two gradients of each residual stream input: kernels launched by the autograd
    engine at the profile's bare `launch_op_s`, not a backward node's `bwd_op_s` (both seen in the H200 profile:
    one add_ per parameter and two [b, s, h] add_ per block)."""
    from llmtrain.plan.timeline import step_compute

    cfg = _llama(num_layers=2)
    gpu = _mbk(cfg, 1, 128, 1, 2, gpu=True, flash=True)
    cpu = _mbk(cfg, 1, 128, 1, 2, gpu=False, flash=False)
    sums = [k for k in gpu.backward if k.host == "launch"]
    assert len(sums) == 2 * cfg.num_layers and all(k.op == "add" and k.numel == 128 * cfg.hidden_size for k in sums)
    assert not [k for k in cpu.backward if k.host == "launch"]
    owned = [(1000, 2)] * 7
    args = (cfg, 1, 128, 1, 3, True, True, "none", 2, True, True, owned, owned)
    raw = dict(_synthetic(host=10e-6), optimizer={"per_tensor_s": 0.0, "per_elem_s": 0.0, "includes_clip": True})
    slow = dict(raw, host=dict(raw["host"], launch_op_s=1e-3))
    a, b = _step(from_dict(raw), *args), _step(from_dict(slow), *args)
    launches = 3 * (2 * cfg.num_layers + len(owned))  # per micro-batch: residual sums + one add per parameter
    assert b["host_s"] - a["host_s"] == pytest.approx(launches * (1e-3 - 10e-6), rel=1e-6)
    assert b["kernels_per_step"] == a["kernels_per_step"]


@pytest.mark.parametrize("fused", ["true", "false"])
def test_sequence_parallel_kernels(fused):
    """Under sequence parallelism (tp 4) the norms, residual adds and row linears' bias work on T/tp positions
    (llmtrain/parallel/sequence.py), the column linears keep the gathered T: GEMM FLOPs unchanged, the
    [s, b] <-> [b, s] transposes added at every column output and row input; the tp traffic equals plain tp's
    (an all-gather + a reduce-scatter per all-reduce replaced, fused or not)."""
    from llmtrain.plan.estimate import column_inputs
    from llmtrain.plan.kernels import block_kernels

    cfg = _llama(num_layers=1, bias=True, fuse_qkv=fused, fuse_ffn=fused, fuse_rms_norm="true")
    b, s, t, h = 2, 256, 4, cfg.hidden_size
    T = b * s
    plain, sp = (block_kernels(cfg, b, s, t, 2, True, True, flag) for flag in (False, True))
    flops = [sum(k.flops for k in f + bw if k.kind == "gemm") for f, bw in (plain, sp)]
    assert flops[0] == flops[1] > 0
    def numels(ks, op):
        return sorted(k.numel for k in ks if k.kind == "mem" and k.op == op)
    for i, op in ((0, "rmsnorm"), (1, "rmsnorm_bwd")):
        assert numels(plain[i], op) == [T * h] * 2 and numels(sp[i], op) == [T // t * h] * 2
    # residual adds and the o/down bias adds on T/tp rows; column biases (q|k|v, gate|up) on T rows
    pa, sa = numels(plain[0], "add"), numels(sp[0], "add")
    assert pa.count(T * h) == 4 and sa.count(T * h) == 0 and sa.count(T // t * h) == pa.count(T // t * h) + 4
    q, f = cfg.num_heads * cfg.attn_head_dim() // t, cfg.ffn_hidden_size // t
    kv = cfg.kv_heads() * cfg.attn_head_dim() // t
    edges = [q + 2 * kv, q, 2 * f, f] if fused == "true" else [q, kv, kv, q, f, f, f]
    assert len(numels(sp[0], "copy")) - len(numels(plain[0], "copy")) == len(edges)
    assert sum(numels(sp[0], "copy")) - sum(numels(plain[0], "copy")) == T * sum(edges)

    from llmtrain.config import to_config as _to
    from llmtrain.plan.estimate import time_estimate
    from llmtrain.plan.profile import load_profile as _load

    dev = _load("h200")
    over = ["model=tinyllama-1.1b", "model.vocab_size=32000", "+parallel=tp2", "parallel.tp=4", f"model.fuse_qkv={fused}", f"model.fuse_ffn={fused}",
            "data.seq_len=2048", "train.global_batch_size=4", "train.micro_batch_size=1"]
    from llmtrain.parallel.layout import resolve_layout

    lay = {}
    for flag in ("false", "true"):
        c = _to(compose(over + [f"parallel.sequence_parallel={flag}"]))
        lay[flag] = time_estimate(c.model, resolve_layout(c.parallel, c.train, 4), 2048, False, dev, 8)["tp_comm_s"]
    cols = column_inputs(c.model, True)
    ratio = lay["true"] / lay["false"]
    # per block: plain 2 + cols all-reduces; sp (cols + 2) all-gathers + (cols + 2) reduce-scatters = cols + 2
    assert cols == (2 if fused == "true" else 5)
    assert ratio == pytest.approx(1.0, rel=0.02)


def test_multi_rail_network_bandwidth():
    """Across nodes a collective's bus bandwidth is one GPU's network share times the group's members per node
    (each GPU has its port; NCCL runs a channel per local member), capped by NVLink; a group with one member
    per node, and a point-to-point pair, get one port."""
    from llmtrain.plan.estimate import _link

    dev = from_dict(_synthetic())  # nvlink 100 GB/s, net 10 GB/s
    assert _link(8, dev, 8, 1) == (100 * GB, 5e-6)  # inside a node
    assert _link(64, dev, 8, 1)[0] == pytest.approx(80 * GB)  # 8 per node
    assert _link(96, dev, 8, 2)[0] == pytest.approx(40 * GB)  # 4 per node (tp 2 innermost)
    assert _link(8 * 48, dev, 8, 8)[0] == pytest.approx(10 * GB)  # one per node
    assert _link(16, dev, 8)[0] == pytest.approx(10 * GB)  # a pair
    dev.net_bw = 30 * GB
    assert _link(64, dev, 8, 1)[0] == pytest.approx(100 * GB)  # capped by NVLink


def test_cpu_tensor_parallel_cross_entropy_is_the_stand_ins_ops():
    """Under tp on a CPU the loss is llmtrain's stand-in for fleet's fused c_softmax_with_cross_entropy
    (paddle_compat/cpu_backend/mp_ops.py): 5 forward and 7 backward passes over this rank's [T, V/tp] logits, not
    the fused composite row; on a GPU (and without tp) the composite."""
    from llmtrain.plan.kernels import head_kernels

    cfg = to_config(compose(["model=gpt-tiny", "model.vocab_size=16000"])).model
    b, s, t = 2, 128, 2
    n = b * s * cfg.vocab_size // t
    for gpu, tp, composite in ((False, 2, False), (True, 2, True), (False, 1, True)):
        f, bw = head_kernels(cfg, b, s, tp, 4, gpu)
        ops = [(k.op, k.numel) for k in f + bw if k.kind == "mem"]
        full = cfg.vocab_size // tp * b * s
        if composite:
            assert ("cross_entropy", full) in ops and ("cross_entropy_bwd", full) in ops
        else:
            assert not any(op.startswith("cross_entropy") for op, _ in ops)
            assert sum(1 for k in f if k.kind == "mem" and k.numel == n) == 5
            assert sum(1 for k in bw if k.kind == "mem" and k.numel == n) == 7
    # a calibrated CPU profile times the stand-in's own functions: one composite kernel each way, priced from
    # the profile's `vocab_parallel_ce` rows through the timeline
    f, bw = head_kernels(cfg, b, s, t, 4, False, ce_core=True)
    assert [k.op for k in f + bw if k.kind == "mem" and k.numel == n] == ["vocab_parallel_ce", "vocab_parallel_ce_bwd"]
    from llmtrain.plan.timeline import step_compute

    base = _synthetic(async_launch=False, host=0.0)
    slow = dict(base, memory_bound={"fallback": "copy", "classes": dict(
        base["memory_bound"]["classes"], vocab_parallel_ce=[[1e3, 0.5], [1e9, 0.5]],
        vocab_parallel_ce_bwd=[[1e3, 0.25], [1e9, 0.25]])})
    args = (cfg, b, s, t, 1, False, False, "none", 1, True, True, [(10, 4)], [(10, 4)])
    assert _step(from_dict(slow), *args)["compute_s"] == pytest.approx(
        _step(from_dict(base), *args)["compute_s"] + 0.75, rel=0.02)


def test_collective_wait_grows_with_the_compute_between_meetings():
    """A CPU profile's `alpha_by_gap` (calibrate's busy all-reduces at several compute gaps) prices each tp
    all-reduce at the alpha for the compute between two of them, interpolated in log(gap); without the table the
    link's alpha stays (every GPU profile)."""
    from llmtrain.parallel.layout import resolve_layout
    from llmtrain.plan.estimate import time_estimate

    prof = from_dict(dict(_synthetic(), links=dict(_synthetic()["links"], alpha_by_gap=[[1e-3, 1e-3], [1e-1, 5e-3]])))
    assert prof.alpha_at(1e-4, 0) == 1e-3 and prof.alpha_at(1.0, 0) == 5e-3
    assert prof.alpha_at(1e-2, 0) == pytest.approx(3e-3)  # halfway in log(gap)
    assert from_dict(_synthetic()).alpha_at(1e-2, 7.0) == 7.0
    c = to_config(compose(["model=gpt-tiny", "model.vocab_size=2560", "+parallel=tp2", "train.global_batch_size=2",
                           "train.micro_batch_size=1"]))
    cfg, lay = c.model, resolve_layout(c.parallel, c.train, 2)
    with_t = time_estimate(cfg, lay, 128, False, prof, 8)
    plain = time_estimate(cfg, lay, 128, False, from_dict(_synthetic()), 8)
    assert with_t["compute_s"] == pytest.approx(plain["compute_s"])
    assert with_t["tp_comm_s"] > plain["tp_comm_s"] + 2 * 2 * 1e-3 * 10  # >= 10 calls at >= 1 ms more alpha


GPT_TINY_PARAMS = {"word": 2560 * 128, "position": 1024 * 128, "final_norm": 2 * 128,
                   "block": 4 * (128 * 128 + 128) + 2 * 2 * 128 + (128 * 512 + 512) + (512 * 128 + 128)}
"""gpt-tiny's parameters at vocabulary 2560, counted from its shape (h 128, 4 layers, FFN 512, 1024 positions, biases,
LayerNorms, tied head): per block q, k, v, o with biases, two LayerNorms, the FFN's two linears with biases."""
GPT_TINY_2560_ALL = GPT_TINY_PARAMS["word"] + GPT_TINY_PARAMS["position"] + 4 * GPT_TINY_PARAMS["block"] \
    + GPT_TINY_PARAMS["final_norm"]
GPT_TINY_2560_CHARGED = GPT_TINY_2560_ALL - GPT_TINY_PARAMS["position"]
"""The 6N parameters of the FLOPs (`flops_parameters`): every parameter but the position table; the gradient
traffic moves all of them (test_gradient_traffic_counts_every_parameter)."""


def test_gpt_tiny_parameter_count():
    from llmtrain.models.size import parameter_count

    c = to_config(compose(["model=gpt-tiny", "model.vocab_size=2560"]))
    assert (GPT_TINY_2560_ALL, GPT_TINY_2560_CHARGED) == (1_252_096, 1_121_024)
    assert parameter_count(c.model) == GPT_TINY_2560_ALL and flops_parameters(c.model) == GPT_TINY_2560_CHARGED


def test_gradient_traffic_counts_every_parameter():
    from llmtrain.parallel.layout import resolve_layout
    from llmtrain.plan.estimate import time_estimate

    prof = from_dict(_synthetic(async_launch=False))
    c = to_config(compose(["model=gpt-tiny", "model.vocab_size=2560", "+parallel=dp2", "train.global_batch_size=2",
                           "train.micro_batch_size=1"]))
    est = time_estimate(c.model, resolve_layout(c.parallel, c.train, 2), 128, False, prof, 8)
    # a ring all-reduce over 2 ranks moves 2 (n - 1) / n = 1 x the buffer over the link, plus its latencies
    moved = est["dp_sharding_comm_s"] - 2 * prof.nvlink_alpha
    assert moved == pytest.approx(GPT_TINY_2560_ALL * prof.dtype_bytes / prof.nvlink_bw, rel=1e-6)


def test_moe_gradient_traffic_counts_every_expert():
    """An MoE model's dp all-reduce carries every expert's gradient (not the top-k active ones of the FLOPs) and the
    word table; under ep2 the experts' half sums over the expert-data-parallel group (dp / ep ranks: none here)."""
    from llmtrain.models.size import parameter_count
    from llmtrain.parallel.layout import resolve_layout
    from llmtrain.plan.estimate import time_estimate
    from llmtrain.plan.memory import param_specs

    prof = from_dict(_synthetic(async_launch=False))
    over = ["model=moe-tiny", "model.vocab_size=2560", "train.global_batch_size=2", "train.micro_batch_size=1"]
    c = to_config(compose(over + ["+parallel=dp2"]))
    trainable = [x for x in param_specs(c.model) if x.trainable and not x.frozen]  # not the routers' expert_bias
    n_all = sum(math.prod(x.shape) for x in trainable)
    assert parameter_count(c.model) - n_all == 3 * c.model.moe_num_experts  # three MoE layers' expert_bias
    assert n_all > flops_parameters(c.model) + c.model.vocab_size * c.model.hidden_size  # inactive experts, the table
    est = time_estimate(c.model, resolve_layout(c.parallel, c.train, 2), 64, False, prof, 8)
    assert est["dp_sharding_comm_s"] - 2 * prof.nvlink_alpha == pytest.approx(n_all * prof.dtype_bytes / prof.nvlink_bw)
    c = to_config(compose(over + ["+parallel=dp2", "parallel.ep=2"]))
    est = time_estimate(c.model, resolve_layout(c.parallel, c.train, 2), 64, False, prof, 8)
    dense = sum(math.prod(x.shape) for x in trainable if not x.expert)
    assert est["dp_sharding_comm_s"] - 2 * prof.nvlink_alpha == pytest.approx(dense * prof.dtype_bytes / prof.nvlink_bw)


def test_zero2_meets_once_a_micro_batch_at_that_gap():
    """ZeRO-2 (Paddle's GroupShardedStage2) reduces every micro-batch's gradients to their owners, one reduce per
    owner's storage (B/bw together) after the micro-batch's forward and backward, then broadcasts the updated
    parameters (B/bw) right after the optimizer: each extra micro-batch adds one meeting, and the reduce's wait
    is read at the micro-batch's compute, not at the step's."""
    from llmtrain.parallel.layout import resolve_layout
    from llmtrain.plan.estimate import time_estimate

    def comm(accum, gap_table):
        base = _synthetic(async_launch=False)  # a CPU profile: nothing overlaps the collectives
        prof = from_dict(dict(base, links=dict(base["links"], alpha_by_gap=gap_table)))
        c = to_config(compose(["model=gpt-tiny", "model.vocab_size=2560", "+parallel=zero2",
                               f"train.global_batch_size={2 * accum}", "train.micro_batch_size=1"]))
        cfg, lay = c.model, resolve_layout(c.parallel, c.train, 2)
        est = time_estimate(cfg, lay, 128, False, prof, 8)
        return est["dp_sharding_comm_s"], GPT_TINY_2560_ALL * prof.dtype_bytes / prof.nvlink_bw, est["compute_s"]

    a = 2e-3
    for accum in (1, 2, 4):  # a flat wait: (accum + 1) transfers of B, 2 x accum + 1 alphas
        got, b_over_bw, _ = comm(accum, [[1e-6, a], [1e3, a]])
        assert got == pytest.approx((accum + 1) * b_over_bw + (2 * accum + 1) * a, rel=1e-9), accum
    # a wait that grows with the gap: read at one micro-batch's compute (accum 4: a quarter of the step's)
    _, _, step = comm(4, [[1e-6, a], [1e3, a]])
    grows = [[step / 8, 0.0], [step / 2, 1.0]]  # 0 below an eighth of the step, 1 s at half of it
    got, b_over_bw, _ = comm(4, grows)
    assert 5 * b_over_bw < got < 5 * b_over_bw + 8 * 0.5 + 1.0  # micro-batches' waits well below 1 s each


def test_sharded_optimizer_is_priced_at_the_busiest_owner():
    """ZeRO-1/2 partition whole tensors as fleet does (greedy, the largest first under ZeRO-1, in order under
    ZeRO-2); the step waits for the owner with the most to update. The timed share is that owner's tensors: the
    optimizer elements memory.py predicts for the busiest sharding rank (exact on every CI layout), not every
    other tensor (which put gpt-tiny's 2M-element embedding and half the rest on one rank)."""
    from llmtrain.parallel.layout import resolve_layout
    from llmtrain.plan.estimate import rank_tensors
    from llmtrain.plan.memory import predict_ranks

    for par in ("sharding2", "zero2"):
        c = to_config(compose(["model=gpt-tiny", "model.vocab_size=16000", f"+parallel={par}"]))
        cfg, lay = c.model, resolve_layout(c.parallel, c.train, 2)
        grads, owned = rank_tensors(cfg, lay, "none", 0)
        per_rank = [r["optimizer_numel"] for r in predict_ranks(cfg, lay)]
        held = lambda tensors: sum(2 * n + 2 for n, _ in tensors)  # noqa: E731  AdamW's two moments + two pows, fp32
        assert held(owned) == max(per_rank), (par, held(owned), per_rank)
        # by hand: the tied 16000 x 128 table alone is larger than the other 67 tensors together (924,416
        # elements), so the busiest owner holds it alone: 2 x 2,048,000 + 2
        assert max(per_rank) == 2 * 16000 * 128 + 2 == 4_096_002, per_rank
        assert len(owned) < len(grads) and held(owned) < held(grads)


def test_training_loop_meetings_are_priced():
    """Every step of a job of more than one rank meets in the loop itself: the divergence guard's verdict and the
    stop agreement over the whole job, the metrics' sums over each data-parallel group. Tiny messages: latency
    only, 2·ceil(log2 n) alphas each; one process has none."""
    from llmtrain.parallel.layout import resolve_layout
    from llmtrain.plan.estimate import time_estimate

    prof = from_dict(_synthetic(async_launch=False))
    a = prof.nvlink_alpha
    # alphas per step, counted by hand: guard verdict + stop agreement over the job, then one metrics sum per data
    # group; a meeting of 2 ranks costs 2 alphas (one step each way), of 4 ranks 4 (two tree levels each way)
    for par, devices, alphas in (("dp2", 2, 2 + 2 + 2), ("tp2", 2, 2 + 2), ("pp2", 2, 2 + 2),
                                 ("zero2", 2, 2 + 2 + 2), ("sharding2 parallel.dp=2", 4, 4 + 4 + 2 + 2),
                                 ("dp4", 4, 4 + 4 + 4)):
        name, *extra = par.split()
        c = to_config(compose(["model=gpt-tiny", "model.vocab_size=2560", f"+parallel={name}", *extra,
                               "train.global_batch_size=8", "train.micro_batch_size=1"]))
        est = time_estimate(c.model, resolve_layout(c.parallel, c.train, devices), 128, False, prof, 8)
        assert est["loop_comm_s"] == pytest.approx(alphas * a, rel=1e-12), par
        parts = ("compute_s", "dp_sharding_comm_s", "tp_comm_s", "pp_p2p_s", "bubble_s", "loop_comm_s")
        assert est["step_time_s"] == pytest.approx(sum(est[k] for k in parts), rel=1e-12), par
    c = to_config(compose(["model=gpt-tiny", "model.vocab_size=2560", "train.micro_batch_size=1"]))
    one = time_estimate(c.model, resolve_layout(c.parallel, c.train, 1), 128, False, prof, 8)
    assert one["loop_comm_s"] == 0.0


def test_pipeline_bubble_is_the_other_stages_share():
    """1F1B's fill and drain run one micro-batch of every stage but the slowest: with the LM head on the last
    stage (a large vocabulary) the bubble is the first stage's share, less than the textbook (p-1)/m of the
    slowest stage's compute; with equal stages it is the textbook figure."""
    from llmtrain.parallel.layout import resolve_layout
    from llmtrain.plan.estimate import time_estimate

    dev = from_dict(_synthetic(host=0.0, rate=1e12))  # device-bound: the stages' kernels decide
    for vocab, heavy_head in ((64000, True), (256, False)):
        c = to_config(compose(["model=gpt-tiny", f"model.vocab_size={vocab}", "+parallel=pp2",
                               "train.global_batch_size=8", "train.micro_batch_size=1"]))
        lay = resolve_layout(c.parallel, c.train, 2)
        est = time_estimate(c.model, lay, 128, False, dev, 8)
        textbook = (lay.pp - 1) / lay.grad_accum * est["compute_s"]
        if heavy_head:
            assert est["bubble_s"] < 0.8 * textbook
        else:
            assert est["bubble_s"] == pytest.approx(textbook, rel=0.15)


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_every_pipeline_stage_is_priced(schedule):
    """A middle stage holding the most blocks is the bottleneck (not taken as the lighter end stage), and the
    fill/bubble is every other stage's share: against each stage priced on its own (step_compute)."""
    from llmtrain.parallel.layout import resolve_layout
    from llmtrain.parallel.pp_split import stage_blocks
    from llmtrain.plan.estimate import compute_estimate, rank_tensors
    from llmtrain.plan.timeline import StepSpec, step_compute

    dev = from_dict(_synthetic(host=0.0, rate=1e12))  # device-bound: the stages' kernels decide
    dpv = schedule == "dualpipev"
    split = "[1,1,1,1,1,5,1,1]" if dpv else "[1,9,1,1]"  # DualPipeV: stage 2 holds chunks 2 and 5
    c = to_config(compose(["model=gpt-tiny", "model.num_layers=12", "model.vocab_size=256", "+parallel=custom",
                           "parallel.pp=4", f"parallel.pp_layers={split}", "train.global_batch_size=8",
                           "train.micro_batch_size=1"]
                          + (["parallel.pp_schedule=dualpipev", "parallel.virtual_pp=2"] if dpv else [])))
    lay = resolve_layout(c.parallel, c.train, 4)
    got = compute_estimate(c.model, lay, 128, "none", dev, False, "none")
    each = []
    for st in range(4):  # the reference: every stage priced on its own, nothing shared
        blocks = list(stage_blocks(lay.pp_layers, 4, st, dpv))
        grads, owned = rank_tensors(c.model, lay, "none", st)
        spec = MicroBatchSpec(c.model, 1, 128, 1, None, True, False, "none", len(blocks), st == 0,
                              st == (0 if dpv else 3), first_layer=blocks[0],
                              block_ids=tuple(blocks) if dpv else None)
        each.append(step_compute(dev, StepSpec(spec, lay.grad_accum, grads, owned, 1))["compute_s"])
    heavy = 2 if dpv else 1
    assert max(each) == each[heavy] > 1.5 * max(each[0], each[3])  # the middle stage is the bottleneck
    assert got["compute_s"] == pytest.approx(each[heavy], rel=1e-12)
    assert got["other_stages_s"] == pytest.approx(sum(each) - each[heavy], rel=1e-12)
