"""The batched MoE dispatcher: equal to the old per-expert loop, and no host synchronisation in the step.

    python -m pytest tests/models/test_dispatch.py -q

The old loop (`tests/models/moe_loop.py`, one `nonzero` per expert) is the reference: outputs and every gradient
within 1e-6, dropless and with capacity drops. The host-sync counter (`tests/host_syncs.py`) runs a real moe-tiny
(composed from conf/) forward + backward: 1 synchronising call per MoE layer dropless (the capacity read), none
with a capacity factor, for 8 and 64 experts; the same counter run on the old loop must see more (it is honest).
"""
from __future__ import annotations

import numpy as np
import paddle
import pytest

from host_syncs import count_host_syncs
from llmtest import compose
from moe_loop import installed_loop, loop_forward
from llmtrain.config import to_config
from llmtrain.contracts.steps import mean_loss
from llmtrain.models import build_model
from llmtrain.models.config import ModelConfig
from llmtrain.models.dispatch import expert_slots
from llmtrain.models.experts import Experts
from llmtrain.models.moe import moe_layers
from llmtrain.models.router import route


def experts_cfg(**kw) -> ModelConfig:
    base = dict(name="m", hidden_size=16, num_layers=2, num_heads=2, ffn_hidden_size=24, vocab_size=64,
                activation="swiglu", bias=False, moe_num_experts=8, moe_top_k=2, moe_ffn_hidden_size=8)
    return ModelConfig(**{**base, **kw})


def outputs_and_grads(forward, layer, x, logits, factor):
    r = route(logits, layer_top_k(layer), capacity_factor=factor)
    y = forward(layer, x, r.index, r.weight)
    grads = paddle.grad((y * y).sum(), [x, logits, *layer.parameters()])
    return [y.numpy(), *(g.numpy() for g in grads)], r


def layer_top_k(layer) -> int:
    return 2 if layer.num_experts < 64 else 4


@pytest.mark.parametrize("experts,factor,extra", [
    (8, 0.0, {}), (64, 0.0, {}), (8, 0.75, {}), (64, 1.0, {}),
    (8, 0.0, {"fuse_ffn": "true", "fuse_swiglu": "true"}), (8, 0.5, {"activation": "gelu_tanh"}),
])
def test_dispatcher_equals_the_old_loop(experts, factor, extra):
    """Outputs and gradients (tokens, router logits through the weights, every stacked weight) within 1e-6; with 64
    experts and 24 tokens some experts get no token; with a capacity some choices are dropped."""
    cfg = experts_cfg(moe_num_experts=experts, moe_capacity_factor=factor, **extra)
    paddle.seed(experts)
    layer = Experts(cfg, experts)
    x = paddle.randn([24, 16])
    logits = paddle.randn([24, experts]) * 2
    x.stop_gradient = logits.stop_gradient = False
    want, r = outputs_and_grads(loop_forward, layer, x, logits, factor)
    got, _ = outputs_and_grads(Experts.forward, layer, x, logits, factor)
    for name, a, b in zip(["y", "dx", "dlogits", *(n for n, _ in layer.named_parameters())], got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=name)
    assert ((r.index.numpy() < 0).any()) == (factor > 0)
    if experts == 64:
        assert len(np.unique(r.index.numpy())) < 64  # experts without a token are in the buffer too


def test_a_dropped_choice_adds_nothing_whatever_its_weight():
    """index -1 drops a choice even when its weight is not 0 (Experts' contract), as the old loop did; a capacity
    also drops a caller's choice past an expert's C-th place instead of spilling it into the next expert's rows."""
    cfg = experts_cfg()
    paddle.seed(1)
    layer = Experts(cfg, 8)
    x = paddle.randn([12, 16])
    index = paddle.to_tensor(np.random.default_rng(3).integers(0, 8, (12, 2)), dtype="int64")
    index[2, 1], index[7, 0] = -1, -1
    weight = paddle.rand([12, 2])
    x.stop_gradient = weight.stop_gradient = False
    got, want = Experts.forward(layer, x, index, weight), loop_forward(layer, x, index, weight)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    for a, b in zip(paddle.grad(got.sum(), [x, weight]), paddle.grad(want.sum(), [x, weight])):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-6)
    crowded = paddle.zeros([4, 2], dtype="int64")  # 8 choices of expert 0, capacity 3: the last 5 dropped
    s = expert_slots(crowded, 3, capacity=3)
    assert s.slot.tolist() == [0, 1, 2] + [9] * 5 and s.kept.numpy().sum() == 3


def test_slots_are_the_capacity_queue():
    """Slot-major queue (every first choice before any second), expert-major rows, dropped choices in the trash row."""
    index = paddle.to_tensor([[0, 1], [0, 2], [1, 0], [2, -1]], dtype="int64")  # [T=4, k=2]
    s = expert_slots(index, 3, capacity=3)
    # queue of expert 0: t0.1st, t1.1st, t2.2nd; expert 1: t2.1st, t0.2nd; expert 2: t3.1st, t1.2nd
    assert s.slot.tolist() == [0, 1, 3, 6, 4, 7, 2, 9]  # [k T]: first choices of t0..t3, then second choices
    assert s.row.tolist() == [[0, 4], [1, 7], [3, 2], [6, 0]]
    assert s.source.tolist() == [0, 1, 2, 2, 0, 4, 3, 1, 4]  # the token in each buffer row; 4 = T: an empty row
    assert expert_slots(index, 3, capacity=None).capacity == 3  # dropless: the largest load


def moe_tiny(experts: int, factor: float, *extra: str):
    cfg = to_config(compose(["model=moe-tiny", f"model.moe_num_experts={experts}",
                             f"model.moe_capacity_factor={factor}", "model.vocab_size=512", *extra])).model
    paddle.seed(0)
    return build_model(cfg)


def step_syncs(model, ids) -> list:
    """Synchronising calls of one training forward + backward (the loss function included)."""
    labels = (ids, paddle.ones(ids.shape))
    with count_host_syncs() as syncs:
        mean_loss(model.loss_fn(model(ids), labels)).backward()
    return syncs.calls


@pytest.mark.parametrize("experts", [8, 64])
def test_a_step_makes_at_most_one_host_sync_per_moe_layer(experts):
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 512, (2, 64)), dtype="int64")
    for factor, per_layer in ((0.0, 1), (1.25, 0)):
        model = moe_tiny(experts, factor)
        layers = len(moe_layers(model))
        assert layers == 3
        calls = step_syncs(model, ids)
        assert len(calls) == per_layer * layers, calls
        assert all(where.endswith("llmtrain/models/dispatch.py:" + where.rsplit(":", 1)[1]) for _, where in calls)
    with installed_loop():  # the counter is honest: the old loop's per-expert nonzero is seen
        old = step_syncs(model, ids)
    assert sum(name == "paddle.nonzero" for name, _ in old) == experts * layers  # one per expert and layer
    assert len(old) > layers


def test_the_counter_sees_each_kind_of_read():
    t = paddle.to_tensor([1.0, 0.0, 2.0])
    reads = [lambda: float(t[0]), lambda: t.numpy(), lambda: t.tolist(), lambda: bool(t[0] > 0),
             lambda: paddle.nonzero(t), lambda: t[t > 0], lambda: paddle.masked_select(t, t > 0),
             lambda: paddle.where(t > 0), lambda: int(t.sum())]
    for read in reads:
        with count_host_syncs() as syncs:
            read()
        assert syncs.total == 1, syncs.calls
    with count_host_syncs() as syncs:
        paddle.where(t > 0, t, -t) + paddle.cumsum(t, 0)[None]  # device-only ops
    assert syncs.total == 0


def test_routing_statistics_are_read_once_per_step(monkeypatch):
    """Two micro-batches' loads, drops and losses stay on the device until finish_step, which reads them once and
    returns the metrics computed here from what route() and moe_loss() returned for each micro-batch."""
    from llmtrain.models import moe

    model = moe_tiny(8, 1.0)
    seen = {"routes": [], "losses": []}

    def recording(fn, key):
        def wrapper(*a, **kw):
            out = fn(*a, **kw)
            seen[key].append(out)
            return out
        return wrapper

    monkeypatch.setattr(moe, "route", recording(moe.route, "routes"))
    monkeypatch.setattr(moe, "moe_loss", recording(moe.moe_loss, "losses"))
    rng = np.random.default_rng(1)
    for _ in range(2):
        ids = paddle.to_tensor(rng.integers(0, 512, (2, 64)), dtype="int64")
        mean_loss(model.loss_fn(model(ids), (ids, paddle.ones([2, 64])))).backward()
    routes = seen["routes"]  # micro-batch 1's three layers, then micro-batch 2's
    counts = [routes[i].counts.numpy() + routes[i + 3].counts.numpy() for i in range(3)]
    dropped = sum(float(r.dropped) for r in routes)
    choices = sum(r.index.size for r in routes)
    aux = np.mean([float(a) for _, a, _ in seen["losses"]])
    z = np.mean([float(b) for _, _, b in seen["losses"]])
    with count_host_syncs() as syncs:
        metrics = model.loss_fn.stats.finish_step()
    assert syncs.total == 1, syncs.calls
    assert metrics["moe_load_max_mean"] == pytest.approx([c.max() / c.mean() for c in counts], rel=1e-7)
    assert metrics["moe_dropped_frac"] == pytest.approx(dropped / choices, rel=1e-12) and dropped > 0
    assert metrics["moe_aux_loss"] == pytest.approx(aux, rel=1e-7)
    assert metrics["moe_z_loss"] == pytest.approx(z, rel=1e-7)
    assert all(layer.step_sums is None for layer in moe_layers(model)) and model.loss_fn.stats.losses == 0


def test_routing_statistics_are_read_only_on_logged_steps():
    """With a device-side reduction (the trainer's, `StepRecord.reduce_device`), a step whose record is not written
    (train.log_interval) reads nothing on the host and still moves the expert bias, on the device, from that step's
    loads; the next logged step reads its own step once (the metrics of a step, as before)."""
    model = moe_tiny(8, 1.0, "model.moe_bias_update_rate=0.01")
    stats, layers = model.loss_fn.stats, moe_layers(model)
    rng = np.random.default_rng(2)
    loads = []
    for logged in (False, True):
        ids = paddle.to_tensor(rng.integers(0, 512, (2, 64)), dtype="int64")
        mean_loss(model.loss_fn(model(ids), (ids, paddle.ones([2, 64])))).backward()
        loads.append([layer.step_counts.numpy().astype("float32") for layer in layers])
        before = [layer.expert_bias.numpy().copy() for layer in layers]
        with count_host_syncs() as syncs:
            metrics = stats.finish_step(read=logged, reduce_device=lambda t: t)
        assert syncs.total == int(logged), syncs.calls
        for layer, b, c in zip(layers, before, loads[-1]):
            np.testing.assert_array_equal(layer.expert_bias.numpy(), b + 0.01 * np.sign(c.mean() - c))
        assert (metrics == {}) != logged
    assert metrics["moe_load_max_mean"] == pytest.approx([c.max() / c.mean() for c in loads[1]], rel=1e-7)
