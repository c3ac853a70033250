"""The FP8 GEMMs of a linear and of the stacked experts, which layers a recipe switches, and the FP8 health check.

    python -m pytest tests/fp8/test_linear.py -q

The GEMMs against numpy (tests/fp8_reference.py): forward y = Q(x) Q(W), backward dx = Q(dy) Q(W)ᵀ and
dW = Q(x, 128x1)ᵀ Q(dy, 128x1), each operand quantised by the numpy reference and the product taken in float64;
the quantised operands are equal bit for bit (tests/fp8/test_recipe.py), so what remains is the order of the fp32
sums of Paddle's matmul: 1e-5 relative to the output's scale.
"""
from __future__ import annotations

import numpy as np
import paddle
import pytest

from fp8_reference import ref_quantize
from llmtest import compose
from llmtrain.config import to_config
from llmtrain.fp8.apply import apply_fp8, fp8_layer_count, fp8_layers
from llmtrain.fp8.health import FP8Health
from llmtrain.fp8.linear import FP8Gemm
from llmtrain.fp8.recipe import RECIPES
from llmtrain.train.anomaly import AnomalousStep

TOL = 1e-5


def _deq(x, tile, fmt, pow2):
    return ref_quantize(x, tile, fmt, pow2)[2].astype(np.float64)


def _reference(x, w, dy, recipe):
    r = RECIPES[recipe]
    f, b = r.forward_format, r.backward_format
    y = _deq(x, r.activation, f, r.pow2) @ _deq(w, r.weight, f, r.pow2)
    dx = _deq(dy, r.activation, b, r.pow2) @ _deq(w, r.weight, f, r.pow2).T
    dw = _deq(x, r.wgrad, f, r.pow2).T @ _deq(dy, r.wgrad, b, r.pow2)
    return y, dx, dw


def _close(got, want, name):
    scale = max(np.abs(want).max(), 1e-30)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * scale, err_msg=name)


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_the_three_gemms_equal_the_numpy_reference(recipe):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, 100, 200)) * np.exp(rng.uniform(-3, 3, (3, 100, 200)))).astype(np.float32)
    w = (rng.standard_normal((200, 300)) * 0.05).astype(np.float32)
    dy = (rng.standard_normal((3, 100, 300)) * 1e-3).astype(np.float32)
    xt, wt = paddle.to_tensor(x, stop_gradient=False), paddle.to_tensor(w, stop_gradient=False)
    y = FP8Gemm(RECIPES[recipe], None, "t")(xt, wt)  # x [3, 100, 200] flattened to M = 300 tokens
    y.backward(paddle.to_tensor(dy))
    ry, rdx, rdw = _reference(x.reshape(300, 200), w, dy.reshape(300, 300), recipe)
    _close(y.numpy().reshape(300, 300), ry, "y")
    _close(xt.grad.numpy().reshape(300, 200), rdx, "dx")
    _close(wt.grad.numpy(), rdw, "dW")
    exact = x.reshape(300, 200).astype(np.float64) @ w
    assert np.abs(y.numpy().reshape(300, 300) - exact).max() > 1e-4 * np.abs(exact).max()  # it did quantise


def test_the_experts_gemm_quantises_each_expert_on_its_own():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((4, 50, 128)).astype(np.float32) * np.array([1e-2, 1, 10, 1e3], np.float32)[:, None, None]
    w = rng.standard_normal((4, 128, 96)).astype(np.float32) * 0.1
    dy = rng.standard_normal((4, 50, 96)).astype(np.float32)
    xt, wt = paddle.to_tensor(x, stop_gradient=False), paddle.to_tensor(w, stop_gradient=False)
    y = FP8Gemm(RECIPES["blockwise"], None, "experts").bmm(xt, wt)
    y.backward(paddle.to_tensor(dy))
    for e in range(4):
        ry, rdx, rdw = _reference(x[e], w[e], dy[e], "blockwise")
        _close(y.numpy()[e], ry, f"y[{e}]")
        _close(xt.grad.numpy()[e], rdx, f"dx[{e}]")
        _close(wt.grad.numpy()[e], rdw, f"dW[{e}]")


def _model(name: str, *extra):
    from llmtrain.models import build_model
    from llmtrain.models.roles import Roles

    cfg = to_config(compose([f"model={name}", "model.vocab_size=96", *extra])).model
    paddle.seed(3)
    return cfg, build_model(cfg, Roles())


def test_the_recipe_reaches_the_transformer_linears_and_experts_only():
    cfg, model = _model("moe-tiny")
    before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    ids = paddle.randint(0, 96, [2, 16])
    ref = model(ids).numpy()
    health = apply_fp8(model, "blockwise")
    names = sorted(n for n, _, _ in fp8_layers(model))
    # 4 blocks x (q, k, v, o); block 0's dense MLP (gate, up, down); blocks 1-3: shared expert (3) + routed experts
    assert fp8_layer_count(model) == len(names) == 4 * 4 + 3 + 3 * (3 + 1)
    assert not any(k in n for n in names for k in ("embed", "router", "norm", "lm_head", "proj.", "output"))
    assert sum(n.endswith(".experts") for n in names) == 3
    got = model(ids).numpy()
    rms = lambda a: float(np.sqrt((a.astype(np.float64) ** 2).mean()))  # noqa: E731
    # the same model computed in FP8: e4m3 keeps 3 mantissa bits (~2-3% rms error per quantised operand), a forward
    # chains ~7 quantised GEMMs per block over 4 untrained blocks and a few routing choices flip: 11% measured
    assert 0 < rms(got - ref) < 0.25 * rms(ref)
    after = model.state_dict()
    assert sorted(after) == sorted(before) and all((after[k].numpy() == v).all() for k, v in before.items())
    assert float(health.count()) == 0


def test_the_fused_projections_quantise_the_concatenated_weight():
    """model.fuse_qkv / fuse_ffn under FP8: one GEMM over [W_q W_k W_v] — the same numbers as FP8Gemm on the
    concatenation, and not those of three separately quantised GEMMs (their blocks differ)."""
    cfg, fused = _model("llama-tiny", "model.fuse_qkv=true")
    apply_fp8(fused, "blockwise")
    attn = fused.layers[0].attn if hasattr(fused, "layers") else None
    attn = attn or next(layer for name, layer in fused.named_sublayers() if name.endswith("attn"))
    x = paddle.randn([2, 8, cfg.hidden_size])
    q, k, v = attn.roles.column_linears(x, [attn.q_proj, attn.k_proj, attn.v_proj])
    w = paddle.concat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], axis=1)
    want = FP8Gemm(RECIPES["blockwise"], None, "qkv")(x, w).numpy()
    np.testing.assert_array_equal(paddle.concat([q, k, v], axis=-1).numpy(), want)


def test_a_nan_is_seen_before_the_cast_saturates_it():
    health = FP8Health()
    gemm = FP8Gemm(RECIPES["blockwise"], health, "layers.2.mlp.down_proj")
    x = paddle.randn([4, 256])
    x[1, 5] = float("nan")
    w = paddle.randn([256, 64]) * 0.05
    y = gemm(x, w)
    assert np.isfinite(y.numpy()).all()  # e4m3 turned the NaN into 448: the output alone would not show it
    assert float(health.count()) == 1 and health.offenders() == ["layers.2.mlp.down_proj:x"]
    health.before_step(1)
    assert float(health.count()) == 0


class _Peer:
    """A 2-rank job's all-reduce with the other rank's numbers scripted (`others(mine)`)."""

    def __init__(self, others):
        self.others, self.reduced = others, []

    def all_reduce_sum(self, t):
        mine = t.numpy()
        self.reduced.append(mine.copy())
        return paddle.to_tensor(mine + self.others(mine).astype(mine.dtype), dtype=t.dtype)


def test_the_guard_rejects_the_step_and_says_fp8():
    from llmtrain.parallel.strategy import Topology
    from llmtrain.train.anomaly import AnomalyConfig
    from llmtrain.train.anomaly_detect import Detector

    health = FP8Health()
    health.record(paddle.to_tensor([[1.0, float("inf")]]), "layers.0.attn.o_proj:dY")
    comm = _Peer(lambda mine: np.zeros_like(mine))
    det = Detector(AnomalyConfig(), Topology(rank=0, world=2), comm, lambda: paddle.to_tensor(2.0), None, health)
    with pytest.raises(AnomalousStep) as e:
        det.judge(paddle.to_tensor(1.0), step=7)
    assert len(comm.reduced[0]) == 7  # the count travels in the one all-reduce
    v = e.value.verdict
    assert v.kinds == ["nonfinite_fp8_amax"] and v.nonfinite and v.fp8_tiles == 1
    assert "FP8: non-finite amax" in str(e.value) and "layers.0.attn.o_proj:dY" in str(e.value)
    health.reset()  # a peer's count alone rejects the step too
    comm.others = lambda mine: np.asarray([2.0, 1, 0, 0, 0, 0, 3], dtype=mine.dtype)
    with pytest.raises(AnomalousStep) as e:
        det.judge(paddle.to_tensor(1.0), step=8)
    assert e.value.verdict.fp8_tiles == 3 and e.value.verdict.fp8_tensors == []


def test_refusals():
    from llmtrain.fp8.apply import fp8_problems

    assert fp8_problems("none", "none", gpu=False) == [] == fp8_problems("blockwise", "none", gpu=False)
    assert "expected one of none, blockwise, tensorwise" in fp8_problems("fp8", "none", gpu=False)[0]
    assert "tensorwise" in fp8_problems("tensorwise", "bf16", gpu=True)[0]
