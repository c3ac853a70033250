"""The MoE layer's precision under AMP O2 on the GPU path: the router in fp32, the combine summed in fp32.

    python -m pytest tests/models/test_moe_precision.py -q

Paddle's AMP is a no-op on CPU, so these tests use `tests/amp_o2.py`: Paddle's real `auto_cast` and `decorate`
told that the CPU is a bf16-capable GPU, and the matmul kernel replaced by a stand-in that applies Paddle's own
auto-cast rule (`GetAmpDestDtype`) to the tracer state `auto_cast` set, records the dtype the GPU kernel would be
handed and computes as a bf16 GEMM would. On a real GPU (`gpu_acceptance.py`'s `moe_router_dtype` step) the same
tests run the real kernels and check the real dtypes.
"""
from __future__ import annotations

import contextlib

import numpy as np
import paddle
import pytest

from amp_o2 import bf16_capable_gpu, gemm_recorder
from llmtest import compose
from llmtrain.config import to_config
from llmtrain.models.moe import MoEFeedForward
from llmtrain.models.roles import Roles
from llmtrain.paddle_compat.kernels import on_gpu
from llmtrain.train.amp import AmpPlan

BF16 = AmpPlan.from_config("bf16")


def moe_layer(*overrides):
    cfg = to_config(compose(["model=moe-tiny", "model.vocab_size=64", *overrides])).model
    paddle.seed(3)
    return MoEFeedForward(cfg, Roles(), index=1)


def run_under_o2(layer, monkeypatch, tokens: int = 24):
    """Forward and backward of `layer` under llmtrain's AMP O2 bf16 region on the (real or rehearsed) GPU path (on a
    real GPU the layer is decorated first, as the trainer does): (x, the matmuls recorded)."""
    x = paddle.randn([1, tokens, layer.cfg.hidden_size])
    x.stop_gradient = False
    with bf16_capable_gpu(monkeypatch), gemm_recorder(monkeypatch) as gemms:
        if on_gpu():
            BF16.decorate(layer, None)
        with BF16.autocast():
            y = layer(x)
        y.astype("float32").square().sum().backward()
    layer.loss_terms.clear()
    return x, gemms


def routing_under(layer, x, monkeypatch, amp: bool):
    """(logits [T, E], chosen experts [T, k]) of `layer` for x, under the rehearsed O2 bf16 region or without AMP."""
    flat = x.reshape([-1, layer.cfg.hidden_size]).detach()
    with bf16_capable_gpu(monkeypatch), gemm_recorder(monkeypatch):
        with BF16.autocast() if amp else contextlib.nullcontext():
            r, _, _ = layer.routing(flat)
    layer.loss_terms.clear()
    return r.logits.numpy(), r.index.numpy()


def test_router_dtype_fp32_under_bf16_o2_on_the_gpu_path(monkeypatch):
    """The router GEMM gets fp32 operands and gives fp32 logits under AMP O2 bf16 (Megatron's
    moe_router_dtype=fp32), its weight's gradient is fp32, and the logits and choices equal those of a run
    without AMP exactly."""
    layer = moe_layer()
    x, gemms = run_under_o2(layer, monkeypatch)
    (router,) = gemms.of(layer.router.weight)
    assert (router.x, router.y, router.out) == (paddle.float32,) * 3, router
    assert layer.router.weight.grad.dtype == paddle.float32
    if not on_gpu():
        (logits, index), (want_logits, want_index) = (routing_under(layer, x, monkeypatch, amp) for amp in (1, 0))
        np.testing.assert_array_equal(logits, want_logits)
        np.testing.assert_array_equal(index, want_index)


def test_router_dtype_amp_is_a_bf16_router_and_the_checks_see_it(monkeypatch):
    """`model.moe_router_dtype=amp` (Megatron's unset value, llmtrain before fp32 routing) plants a bf16 router: the
    same instrument records bf16 operands and a bf16 result for its GEMM, bf16-rounded logits, and decorate casts
    its weight and the expert bias."""
    layer = moe_layer("model.moe_router_dtype=amp")
    x, gemms = run_under_o2(layer, monkeypatch)
    (router,) = gemms.of(layer.router.weight)
    assert router.out == paddle.bfloat16, router
    if not on_gpu():
        assert router.x == router.y == paddle.bfloat16, router
        logits, _ = routing_under(layer, x, monkeypatch, amp=True)
        want, _ = routing_under(layer, x, monkeypatch, amp=False)
        assert np.abs(logits - want).max() > 0, "the bf16 router's logits equal the fp32 ones"
        with bf16_capable_gpu(monkeypatch):
            BF16.decorate(layer, None)
    assert layer.router.weight.dtype == paddle.bfloat16 and layer.expert_bias.dtype == paddle.bfloat16


def _bf16_ulp(v: np.ndarray) -> np.ndarray:
    return np.exp2(np.floor(np.log2(np.abs(v))) - 7)


@pytest.mark.parametrize("fp32", [True, False], ids=["fp32", "amp"])
def test_the_combine_sums_bf16_expert_outputs_in_fp32_and_rounds_once(fp32):
    """bf16 expert outputs (as under O2): with fp32 (the default) every token's weighted sum of its k rows is the
    exact sum rounded once to bf16 (within half a bf16 ulp); with moe_router_dtype=amp the products are rounded to
    bf16 first and some sums miss by more."""
    from llmtrain.models.dispatch import combine, expert_slots

    paddle.seed(5)
    tokens, top_k, experts, hidden = 64, 6, 8, 32
    index = paddle.argsort(paddle.rand([tokens, experts]), axis=-1)[:, :top_k]  # [T, k] distinct experts
    slots = expert_slots(index, experts, capacity=None)
    y = paddle.randn([experts, slots.capacity, hidden]).astype("bfloat16")  # [E, C, h]
    weight = paddle.nn.functional.softmax(paddle.randn([tokens, top_k]), axis=-1)  # [T, k] fp32
    got = combine(y, slots, weight, fp32=fp32)
    assert got.dtype == paddle.bfloat16
    rows = y.astype("float32").numpy().reshape(-1, hidden)[slots.row.numpy()].astype(np.float64)  # [T, k, h]
    exact = (rows * weight.numpy().astype(np.float64)[:, :, None]).sum(1)  # [T, h]
    miss = np.abs(got.astype("float32").numpy() - exact) / _bf16_ulp(exact)
    if fp32:
        assert miss.max() <= 0.5 + 1e-3, miss.max()
    else:
        assert miss.max() > 0.5, miss.max()


def test_router_dtype_fp32_survives_o2_decorate(monkeypatch):
    """Paddle's O2 `decorate` (llmtrain's AmpPlan) casts the experts to bf16 and leaves the router weight and the
    expert bias fp32."""
    layer = moe_layer()
    with bf16_capable_gpu(monkeypatch):
        BF16.decorate(layer, None)
    dtypes = {n: p.dtype for n, p in layer.named_parameters()}
    assert dtypes.pop("router.weight") == paddle.float32 and dtypes.pop("expert_bias") == paddle.float32, dtypes
    assert set(dtypes.values()) == {paddle.bfloat16}, dtypes
