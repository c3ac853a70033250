"""`python -m llmtrain.plan --calibrate` measures cpu-here (kernel tables, one 2-process gloo launch); the planner uses it.

    python -m pytest tests/plan/test_calibrate.py -q
"""
from __future__ import annotations

import json

import pytest

from llmtest import compose
from llmtrain.config import to_config
from llmtrain.plan.calibrate import calibrate, fit_line
from llmtrain.plan.devices import get_device


def test_fit_line_recovers_alpha_beta():
    xs = [1e3, 1e5, 1e6, 4e6]
    c0, c1 = fit_line(xs, [2e-4 + x / 2e9 for x in xs])
    assert c0 == pytest.approx(2e-4) and c1 == pytest.approx(1 / 2e9)
    # a small latency under noise: an unanchored fit would give a negative intercept, this one stays positive
    c0, c1 = fit_line([4096, 262144, 1048576], [7.5e-5, 1.7e-4, 1.46e-3])
    assert c0 > 0 and c1 > 0


def test_gloo_fit_survives_a_slow_smallest_message():
    """Measured in one --quick calibration: gloo's 4 KiB all-reduce took 3.3 ms in every repeat, 1 MiB 0.7 ms, 4 MiB
    1.9 ms; the line through all three has a negative slope (the calibration used to stop there). The bandwidth
    comes from the larger sizes; the fit is positive."""
    from llmtrain.plan.calibrate import fit_gloo

    rows = [{"bytes": b, "all_reduce_s": a, "send_recv_s": p} for b, a, p in (
        (4096, 0.003259, 0.000130), (1048576, 0.000704, 0.000320), (4194304, 0.001942, 0.001556))]
    g = fit_gloo({"rows": rows, "busy": {"bytes": 4096, "mean_s": 0.004, "by_gap": []}})
    assert g["collective_bw"] == pytest.approx((4194304 - 1048576) / (0.001942 - 0.000704), rel=1e-6)
    assert g["collective_alpha"] > 0 and g["p2p_bw"] > 0


@pytest.mark.slow
def test_calibration_writes_a_profile_the_planner_reads(tmp_path, capfd):
    out = tmp_path / "cpu-here.json"
    calibrate(str(out), quick=True)
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("calibrate [")]
    assert [line.split("]")[0] for line in said] == [f"calibrate [{k}/4" for k in (1, 2, 3, 4)], said  # progress
    assert said[-1].startswith(f"calibrate [4/4] writing {out} (") and said[-1].endswith(" s so far)"), said
    p = json.loads(out.read_text())
    g = p["gloo"]
    for k in ("collective_bw", "collective_alpha", "collective_alpha_busy", "p2p_bw", "p2p_alpha"):
        assert isinstance(g[k], float) and g[k] > 0, (k, g[k])
    assert g["collective_alpha_busy"] >= g["collective_alpha"] and g["busy_all_reduce"]["calls"] == 30
    assert all(r["all_reduce_s"] > 0 and r["send_recv_s"] > 0 for r in g["measurements"])
    # the busy all-reduce at six compute gaps, ascending: four matmuls, then one and five MLP passes (a
    # micro-batch's autograd work) between the calls
    gaps = [gap for gap, _ in g["alpha_by_gap"]]
    assert len(gaps) == 6 and gaps == sorted(gaps) and gaps[-1] > 100 * gaps[0]
    mlp = [r for r in g["busy_all_reduce"]["by_gap"] if "mlp_passes" in r]
    assert [r["mlp_passes"] for r in mlp] == [1, 5] and mlp[1]["gap_s"] > 3 * mlp[0]["gap_s"]
    assert p["peak_flops"] > 0 and p["gemm"]["rows"] and p["memory_bound"]["classes"] and p["host"]["fwd_op_s"] >= 0

    dev = get_device("cpu-here", str(out))
    assert (dev.nvlink_bw, dev.net_alpha, dev.p2p_alpha) == (g["collective_bw"], g["collective_alpha_busy"], g["p2p_alpha"])
    assert "calibrate" in dev.source and dev.alpha_by_gap == sorted(tuple(r) for r in g["alpha_by_gap"])
    # back-to-back reduce and broadcast (fleet's stage-1 optimizer: one per tensor each way), measured per call
    assert g["reduce_call_s"] > 0 and g["broadcast_call_s"] > 0
    assert (dev.reduce_call_s, dev.broadcast_call_s) == (g["reduce_call_s"], g["broadcast_call_s"])

    from llmtrain.plan.__main__ import plan

    common = ["model=gpt-tiny", "model.vocab_size=2560", "train.global_batch_size=8", "train.micro_batch_size=2",
              "plan.devices=2", "plan.device=cpu-here", "+parallel=dp2"]
    row = plan(to_config(compose(common + [f"plan.profile={out}"])))[0]
    s1 = [o if o != "+parallel=dp2" else "+parallel=sharding2" for o in common]
    row_s1 = plan(to_config(compose(s1 + [f"plan.profile={out}"])))[0]
    slow_calls = dict(p, links=dict(p["links"], reduce_call_s=p["links"]["reduce_call_s"] + 1e-3,
                                    broadcast_call_s=p["links"]["broadcast_call_s"] + 1e-3))
    (tmp_path / "slow_calls.json").write_text(json.dumps(slow_calls))
    row_s1_slow = plan(to_config(compose(s1 + [f"plan.profile={tmp_path / 'slow_calls.json'}"])))[0]
    tensors = 4 * 16 + 4  # gpt-tiny (tied): 16 per block (q, k, v, o, 2 FFN linears and 2 norms, each weight and bias),
    # the word and position tables, the final norm: 68, the reduces per step counted in a sharding2 run
    assert row_s1_slow["step_time_s"] - row_s1["step_time_s"] == pytest.approx(2 * (tensors - 1) * 1e-3, rel=1e-6)
    slower = dict(p, links=dict(p["links"], nvlink_bw=p["links"]["nvlink_bw"] / 100))  # the file drives the plan
    (tmp_path / "slow.json").write_text(json.dumps(slower))
    row_slow = plan(to_config(compose(common + [f"plan.profile={tmp_path / 'slow.json'}"])))[0]
    assert row_slow["step_time_s"] > row["step_time_s"] > 0
    # every shape timed as A @ B, A @ Bᵀ and Aᵀ @ B: the gradients' GEMMs are priced from their own layouts' tables
    assert sorted(p["gemm_layouts"]) == ["nt", "tn"]
    assert all([r[:3] for r in p["gemm_layouts"][lay]["rows"]] == [r[:3] for r in p["gemm"]["rows"]] for lay in ("nt", "tn"))
    slower = lambda t: {"rows": [[m, n, k, r / 10] for m, n, k, r in t["rows"]]}  # noqa: E731
    slow_gemm = dict(p, gemm=slower(p["gemm"]), gemm_layouts={lay: slower(t) for lay, t in p["gemm_layouts"].items()})
    (tmp_path / "slow_gemm.json").write_text(json.dumps(slow_gemm))
    row_gemm = plan(to_config(compose(common + [f"plan.profile={tmp_path / 'slow_gemm.json'}"])))[0]
    assert row_gemm["compute_s"] > 2 * row["compute_s"]  # the measured GEMM tables, not a constant, price compute
    slow_tn = dict(p, gemm_layouts=dict(p["gemm_layouts"], tn=slower(p["gemm_layouts"]["tn"])))
    (tmp_path / "slow_tn.json").write_text(json.dumps(slow_tn))
    row_tn = plan(to_config(compose(common + [f"plan.profile={tmp_path / 'slow_tn.json'}"])))[0]
    assert row_tn["compute_s"] > 1.3 * row["compute_s"]  # the weight gradients (Xᵀ @ dY) alone, 10x slower

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({k: v for k, v in p.items() if k != "gemm"}))
    with pytest.raises(ValueError, match="kernel tables"):
        get_device("cpu-here", str(bad))
