"""Mixture-of-Experts routing and layer against hand-written numpy references (one process, no ranks).

    python -m pytest tests/models/test_moe.py -q
"""
from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from llmtrain.models import build_model
from llmtrain.models.config import ModelConfig
from llmtrain.models.stages import canonical_parameters
from llmtrain.models.init import init_parameters
from llmtrain.models.dispatch import capacity
from llmtrain.models.moe import MoEFeedForward, attach_balancing_losses, aux_loss, moe_layers, update_bias, z_loss
from llmtrain.models.router import route
from llmtrain.models.roles import Roles
from llmtrain.models.size import flops_parameters, parameter_count
from llmtrain.contracts.steps import mean_loss


def moe_cfg(**kw) -> ModelConfig:
    base = dict(name="t-moe", hidden_size=16, num_layers=3, num_heads=2, num_kv_heads=2, ffn_hidden_size=24,
                vocab_size=64, max_position_embeddings=32, position="rope", norm="rmsnorm", activation="swiglu",
                bias=False, tie_embeddings=False, moe_num_experts=6, moe_top_k=2, moe_ffn_hidden_size=8,
                moe_num_shared_experts=1, moe_first_dense_layers=1, moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001)
    base.update(kw)
    return ModelConfig(**base)


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference_route(logits, k, kind, norm, bias=None, factor=0.0):
    """Token by token: scores, top-k on biased scores, weights, then the capacity queue (first choices first)."""
    t, e = logits.shape
    scores = np_softmax(logits) if kind == "softmax" else 1 / (1 + np.exp(-logits))
    choose = scores + (0 if bias is None else bias)
    index = np.argsort(-choose, axis=-1, kind="stable")[:, :k]
    weight = np.take_along_axis(scores, index, -1)
    if norm:
        weight = weight / weight.sum(-1, keepdims=True)
    dropped = 0
    if factor > 0:
        cap = math.ceil(factor * t * k / e)
        fill = np.zeros(e, int)
        for slot in range(k):
            for tok in range(t):
                ex = index[tok, slot]
                if fill[ex] < cap:
                    fill[ex] += 1
                else:
                    index[tok, slot], weight[tok, slot] = -1, 0.0
                    dropped += 1
    return index, weight, dropped


@pytest.mark.parametrize("kind,norm", [("softmax", True), ("softmax", False), ("sigmoid", True), ("sigmoid", False)])
def test_topk_choice_and_weights_match_the_reference(kind, norm):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((20, 6)).astype(np.float32) * 2
    bias = rng.standard_normal(6).astype(np.float32) * 0.3
    r = route(paddle.to_tensor(logits), 2, kind, norm, paddle.to_tensor(bias))
    index, weight, _ = reference_route(logits, 2, kind, norm, bias)
    # the same set of experts per token (ties do not occur with random logits) and the same weights in that order
    np.testing.assert_array_equal(np.sort(r.index.numpy(), -1), np.sort(index, -1))
    order_got, order_ref = np.argsort(r.index.numpy(), -1), np.argsort(index, -1)
    np.testing.assert_allclose(np.take_along_axis(r.weight.numpy(), order_got, -1),
                               np.take_along_axis(weight, order_ref, -1), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(r.counts.numpy(), np.bincount(index.ravel(), minlength=6))
    # the bias chooses but does not weigh: without it another expert wins for some tokens
    plain = route(paddle.to_tensor(logits), 2, kind, norm)
    assert (np.sort(plain.index.numpy(), -1) != np.sort(index, -1)).any()


def test_capacity_drops_exactly_the_overflow():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((16, 4)).astype(np.float32)
    logits[:, 0] += 3.0  # almost every token's first choice is expert 0
    factor = 1.0
    r = route(paddle.to_tensor(logits), 2, "softmax", True, capacity_factor=factor)
    index, weight, dropped = reference_route(logits, 2, "softmax", True, factor=factor)
    np.testing.assert_array_equal(r.index.numpy(), index)
    np.testing.assert_allclose(r.weight.numpy(), weight, rtol=1e-6, atol=1e-7)
    cap = capacity(16, 2, 4, factor)
    assert cap == 8
    kept = np.bincount(index[index >= 0].ravel(), minlength=4)
    want = np.bincount(reference_route(logits, 2, "softmax", True)[0].ravel(), minlength=4)
    assert (kept == np.minimum(want, cap)).all()
    assert float(r.dropped) == dropped == (want - np.minimum(want, cap)).sum() > 0
    # dropless keeps every choice
    assert float(route(paddle.to_tensor(logits), 2).dropped) == 0


def test_aux_and_z_loss_values():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((12, 5)).astype(np.float32)
    r = route(paddle.to_tensor(logits), 2, "softmax", True)
    probs = np_softmax(logits)
    index, _, _ = reference_route(logits, 2, "softmax", True)
    f = np.array([(index == i).sum() for i in range(5)]) / 12
    assert float(aux_loss(r)) == pytest.approx(5 * (f * probs.mean(0)).sum(), rel=1e-6)
    lse = np.log(np.exp(logits).sum(-1))
    assert float(z_loss(r)) == pytest.approx((lse ** 2).mean(), rel=1e-6)
    balanced = route(paddle.zeros([12, 4]) + paddle.to_tensor(np.eye(4, dtype=np.float32)[np.arange(12) % 4] * 1e-3), 2)
    assert float(aux_loss(balanced)) == pytest.approx(2.0, rel=1e-3)  # balanced: top_k


def test_aux_loss_free_bias_moves_load_toward_balance():
    rng = np.random.default_rng(3)
    logits = paddle.to_tensor(rng.standard_normal((256, 8)).astype(np.float32) * 0.5
                              + np.linspace(1.0, 0.0, 8, dtype=np.float32))  # skewed toward low experts
    bias = paddle.zeros([8])
    imbalance = []
    for _ in range(40):
        r = route(logits, 2, "sigmoid", True, bias)
        imbalance.append(float(r.counts.max() / r.counts.mean()))
        update_bias(bias, r.counts, 0.01)
    assert imbalance[0] > 1.8
    assert imbalance[-1] < 1.25 and max(imbalance[-5:]) < imbalance[0] - 0.5
    assert bias.stop_gradient


def reference_moe(layer: MoEFeedForward, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Token by token: y = shared(x) + sum over kept choices of w * SwiGLU expert(x)."""
    silu = lambda a: a / (1 + np.exp(-a))
    wr = layer.router.weight.numpy()
    wg, wu, wd = (getattr(layer.experts, n).numpy() for n in ("w_gate", "w_up", "w_down"))
    sh = layer.shared
    index, weight, _ = reference_route(x @ wr, cfg.moe_top_k, cfg.moe_router, cfg.moe_norm_topk,
                                       factor=cfg.moe_capacity_factor)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        out[t] = (silu(x[t] @ sh.gate_proj.weight.numpy()) * (x[t] @ sh.up_proj.weight.numpy())) @ sh.down_proj.weight.numpy()
        for e, w in zip(index[t], weight[t]):
            if e >= 0:
                out[t] += w * cfg.moe_routed_scale * ((silu(x[t] @ wg[e]) * (x[t] @ wu[e])) @ wd[e])
    return out


@pytest.mark.parametrize("factor", [0.0, 0.75])
def test_moe_layer_matches_a_token_by_token_reference(factor):
    cfg = moe_cfg(moe_capacity_factor=factor, moe_routed_scale=1.5)
    model = build_model(cfg)
    init_parameters(canonical_parameters(model), cfg, seed=5)
    layer = moe_layers(model)[0]
    x = np.random.default_rng(4).standard_normal((2, 10, 16)).astype(np.float32)
    y = layer(paddle.to_tensor(x)).numpy().reshape(20, 16)
    np.testing.assert_allclose(y, reference_moe(layer, x.reshape(20, 16), cfg), rtol=1e-5, atol=1e-6)
    if factor:
        assert float(layer.step_dropped) > 0


def test_balancing_losses_enter_the_training_loss_and_reach_the_router():
    cfg = moe_cfg(moe_aux_loss_coef=0.5, moe_z_loss_coef=0.1)
    model = build_model(cfg)
    named = canonical_parameters(model)
    init_parameters(named, cfg, seed=6)
    ids = paddle.to_tensor(np.random.default_rng(5).integers(0, 64, (2, 12)), dtype="int64")
    labels = (ids, paddle.ones([2, 12]))
    lm = mean_loss(model.loss_fn.lm_loss(model(ids), labels))
    [layer.loss_terms.clear() for layer in moe_layers(model)]
    logits = model(ids)
    terms = [t for layer in moe_layers(model) for t in layer.loss_terms]
    aux = np.mean([6 * float((f * p).sum()) for (f, p), _ in terms])  # per layer E * sum f P, averaged
    z = np.mean([float(b) for _, b in terms])
    assert len(terms) == 2  # layers 1 and 2 (layer 0 dense)
    loss = mean_loss(model.loss_fn(logits, labels))
    assert float(loss) == pytest.approx(float(lm) + 0.5 * aux + 0.1 * z, rel=1e-6)
    loss.backward()
    router = dict(named)["layers.1.mlp.router.weight"]
    assert router.grad is not None and float(router.grad.abs().sum()) > 0
    assert dict(named)["layers.1.mlp.expert_bias"].grad is None  # kept out of the gradient
    model.eval()  # evaluation reports the LM loss alone
    assert float(mean_loss(model.loss_fn(model(ids), labels))) == pytest.approx(float(lm), rel=1e-6)


def test_attached_balancing_losses_give_the_gradients_of_the_training_loss():
    """What pipeline parallelism runs (the last stage's loss function sees the LM loss only): each MoE layer feeds
    its share of the balancing loss to the backward through its output with the gradient 1 / micro-batches. Two
    micro-batches on one device give every parameter the gradient of sum (LM + coefficients x balancing) / 2, and the
    per-layer aux and z sums the logged means are made of."""
    cfg = moe_cfg(moe_aux_loss_coef=0.5, moe_z_loss_coef=0.1)
    rng = np.random.default_rng(7)
    batches = [paddle.to_tensor(rng.integers(0, 64, (2, 12)), dtype="int64") for _ in range(2)]
    grads, logged = [], []
    for attached in (False, True):
        model = build_model(cfg)
        named = canonical_parameters(model)
        init_parameters(named, cfg, seed=9)
        if attached:
            attach_balancing_losses(moe_layers(model), 0.5)
        for ids in batches:
            labels = (ids, paddle.ones([2, 12]))
            loss_fn = model.loss_fn.lm_loss if attached else model.loss_fn
            (mean_loss(loss_fn(model(ids), labels)) / 2).backward()
        grads.append({n: p.grad.numpy() for n, p in named if p.grad is not None})
        stats = model.loss_fn.stats
        layers = moe_layers(model)
        logged.append((sum(float(x.step_aux) for x in layers) / 2, sum(float(x.step_z) for x in layers) / 2) if attached
                      else (stats.aux_sum, stats.z_sum))
    assert grads[0].keys() == grads[1].keys() and "layers.2.mlp.router.weight" in grads[0]
    for name, want in grads[0].items():
        np.testing.assert_allclose(grads[1][name], want, rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(logged[1], logged[0], rtol=1e-6)
    assert logged[0][0] > 0 and logged[0][1] > 0
    without = build_model(cfg)  # a control: the LM loss alone gives the router another gradient
    init_parameters(canonical_parameters(without), cfg, seed=9)
    for ids in batches:
        (mean_loss(without.loss_fn.lm_loss(without(ids), (ids, paddle.ones([2, 12])))) / 2).backward()
    router = dict(canonical_parameters(without))["layers.2.mlp.router.weight"].grad.numpy()
    assert np.abs(router - grads[0]["layers.2.mlp.router.weight"]).max() > 1e-4


@pytest.mark.parametrize("attached", [False, True])
def test_recompute_records_each_forward_once_and_keeps_the_gradients(attached):
    """`train.recompute` re-runs every block in the backward: the MoE layers run the same ops again (so the
    recomputed activations line up) but record nothing, so losses, loads, dropped choices and every gradient equal
    the run without recompute, for the balancing losses in the loss function and attached (pipeline) alike."""
    cfg = moe_cfg(moe_aux_loss_coef=0.5, moe_z_loss_coef=0.1, moe_capacity_factor=1.0)
    rng = np.random.default_rng(8)
    batches = [paddle.to_tensor(rng.integers(0, 64, (2, 12)), dtype="int64") for _ in range(2)]
    runs = []
    for recompute in (False, True):
        model = build_model(cfg, recompute=recompute)
        named = canonical_parameters(model)
        init_parameters(named, cfg, seed=10)
        layers = moe_layers(model)
        if attached:
            attach_balancing_losses(layers, 0.5)
        losses = []
        for ids in batches:
            loss_fn = model.loss_fn.lm_loss if attached else model.loss_fn
            loss = mean_loss(loss_fn(model(ids), (ids, paddle.ones([2, 12]))))
            (loss / 2).backward()
            losses.append(float(loss))
        stats = model.loss_fn.stats
        recorded = [stats.losses, stats.aux_sum, stats.z_sum] + [
            x for layer in layers for x in (*layer.step_sums.tolist(), layer.step_choices, len(layer.loss_terms))]
        runs.append((losses, recorded, {n: p.grad.numpy() for n, p in named if p.grad is not None}))
    (loss0, rec0, grads0), (loss1, rec1, grads1) = runs
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    np.testing.assert_allclose(rec1, rec0, rtol=1e-6)
    assert rec0[0] == (0 if attached else 2) and sum(float(layer.step_dropped) for layer in moe_layers(model)) > 0
    assert grads0.keys() == grads1.keys()
    for name, want in grads0.items():
        np.testing.assert_allclose(grads1[name], want, rtol=1e-5, atol=1e-7, err_msg=name)


def test_parameter_counts_all_and_active():
    cfg = moe_cfg()
    model = build_model(cfg)
    held = sum(int(np.prod(p.shape)) for _, p in canonical_parameters(model))
    assert parameter_count(cfg) == held
    # active: per MoE layer, (E - k) routed experts and the bias do not act on a token
    per_expert = 3 * 16 * 8
    inactive = 2 * ((6 - 2) * per_expert + 6)
    assert flops_parameters(cfg) == parameter_count(cfg) - inactive - 64 * 16  # input word table excluded
    assert Roles().experts(cfg).w_up.shape == [6, 16, 8]


def test_pooled_aux_loss_is_one_loss_over_all_layers_choices():
    """moe_aux_loss_scope=model: PaddleNLP's Mixtral form, E * sum_i f_i P_i over the concatenated router logits."""
    cfg = moe_cfg(moe_aux_loss_scope="model", moe_aux_loss_coef=1.0, moe_z_loss_coef=0.0, moe_num_shared_experts=0)
    model = build_model(cfg)
    init_parameters(canonical_parameters(model), cfg, seed=8)
    x = np.random.default_rng(6).standard_normal((2, 10, 16)).astype(np.float32)
    logits = []
    for layer in moe_layers(model):
        logits.append(x.reshape(20, 16) @ layer.router.weight.numpy())
        layer(paddle.to_tensor(x))
    every = np.concatenate(logits)  # [L T, E]
    index, _, _ = reference_route(every, 2, "softmax", True)
    f = np.array([(index == i).sum() for i in range(6)]) / every.shape[0]
    want = 6 * (f * np_softmax(every).mean(0)).sum()
    from llmtrain.models.moe import moe_loss

    extra, aux, _ = moe_loss(moe_layers(model), cfg)
    assert float(aux) == pytest.approx(want, rel=1e-6) and float(extra) == pytest.approx(want, rel=1e-6)
