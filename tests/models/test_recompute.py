"""Every recompute mode and module gives the forward and gradients of no recompute; MoE routing is kept; RNG kept.

    python -m pytest tests/models/test_recompute.py -q

One process, tiny models (GPT with LayerNorm and GeLU, Llama with RMSNorm and SwiGLU, moe-tiny cut to two blocks):
logits and every parameter gradient under each `train.recompute` mode and each `train.recompute_modules` entry equal
the run without recompute (1e-6); the recompute really happens (the bytes held after the forward fall,
`llmtrain.paddle_compat.host_memory`); a recomputed MoE block routes as its first run even when routing again
would choose other experts; a recomputed dropout draws the same mask.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from llmtrain.config import compose_config, to_config
from llmtrain.contracts.steps import mean_loss
from llmtrain.models import build_model
from llmtrain.models.init import init_parameters
from llmtrain.models.moe import moe_layers
from llmtrain.models.recompute import MODULES, Recompute, checkpointed, choose_blocks, parse_mode, recompute_from
from llmtrain.models.stages import canonical_parameters
from llmtrain.paddle_compat.host_memory import host_allocated_bytes

SETTINGS = [("full", ()), ("full_attn", ()), ("core_attn", ()), ("selective", ("mlp",)), ("selective", ("norm",)),
            ("core_attn", ("mlp", "norm"))]
MOE_SETTINGS = [("full", ()), ("selective", ("moe",)), ("selective", ("moe_act",)), ("selective", ("shared_experts",)),
                ("core_attn", ("moe_act", "norm"))]


def _moe_cfg():
    return to_config(compose_config(["model=moe-tiny", "model.num_layers=2", "model.vocab_size=256"])).model


def _step(cfg, rc, ids, labels, between=None):
    """(logits, {name: grad}, bytes held after the forward) of one training step under `rc`; `between(model)` runs
    after the forward, before the backward."""
    paddle.seed(0)
    model = build_model(cfg, recompute=rc)
    init_parameters(canonical_parameters(model), cfg, 7)
    model.train()
    before = host_allocated_bytes()
    logits = model(ids)
    loss = mean_loss(model.loss_fn(logits, (labels, paddle.ones(labels.shape, dtype="float32"))))
    held = host_allocated_bytes() - before
    if between is not None:
        between(model)
    loss.backward()
    return logits.numpy(), {n: p.grad.numpy() for n, p in canonical_parameters(model) if p.grad is not None}, held


def _data(cfg, b=2, s=16, seed=3):
    rng = np.random.default_rng(seed)
    return (paddle.to_tensor(rng.integers(0, cfg.vocab_size, (b, s))),
            paddle.to_tensor(rng.integers(0, cfg.vocab_size, (b, s))))


def _same(ref, got):
    np.testing.assert_allclose(got[0], ref[0], rtol=0, atol=1e-6)
    assert got[1].keys() == ref[1].keys()
    for name in ref[1]:
        np.testing.assert_allclose(got[1][name], ref[1][name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_every_mode_equals_no_recompute(family, tiny_gpt, tiny_llama):
    cfg = tiny_gpt if family == "gpt" else tiny_llama
    ids, labels = _data(cfg)
    ref = _step(cfg, False, ids, labels)
    for mode, modules in SETTINGS:
        got = _step(cfg, recompute_from(mode=mode, modules=modules), ids, labels)
        _same(ref, got)
        assert got[2] < ref[2], (mode, modules, got[2], ref[2])  # something was recomputed, not kept


def test_moe_modes_equal_no_recompute():
    cfg = _moe_cfg()
    ids, labels = _data(cfg)
    ref = _step(cfg, False, ids, labels)
    for mode, modules in MOE_SETTINGS:
        got = _step(cfg, recompute_from(mode=mode, modules=modules), ids, labels)
        _same(ref, got)
        assert got[2] < ref[2], (mode, modules, got[2], ref[2])


@pytest.mark.parametrize("mode,modules", [("full", ()), ("selective", ("moe",))])
def test_recomputed_moe_routes_as_its_first_run(mode, modules):
    """The expert bias moves between the forward and the backward (standing for any difference a second routing
    could see): routing again would choose other experts, the recomputed forward must still take the first choice."""
    cfg = _moe_cfg()
    ids, labels = _data(cfg)

    def shift(model):
        layer = moe_layers(model)[0]
        layer.expert_bias.set_value(paddle.to_tensor(np.linspace(-5, 5, cfg.moe_num_experts).astype("float32")))

    ref = _step(cfg, False, ids, labels, between=shift)
    got = _step(cfg, recompute_from(mode=mode, modules=modules), ids, labels, between=shift)
    _same(ref, got)
    # the shifted bias does change the choice: a recompute that routed again would have diverged
    model = build_model(cfg)
    init_parameters(canonical_parameters(model), cfg, 7)
    layer = moe_layers(model)[0]
    x = paddle.randn([32, cfg.hidden_size])
    before = layer.routing(x)[0].index.numpy()
    layer.expert_bias.set_value(paddle.to_tensor(np.linspace(-5, 5, cfg.moe_num_experts).astype("float32")))
    assert (layer.routing(x)[0].index.numpy() != before).any()


def test_recompute_keeps_the_random_state():
    """A recomputed dropout draws the same mask in the backward: gradients equal the plain run's."""
    paddle.seed(1)
    w = paddle.randn([8, 8])
    w.stop_gradient = False

    def f(x):
        return F.dropout(paddle.matmul(x, w), p=0.5, training=True).tanh()

    x = paddle.randn([4, 8])
    grads = []
    for fn, seed in ((f, 5), (checkpointed(f), 5), (f, 6)):
        paddle.seed(seed)
        fn(x).sum().backward()
        grads.append(w.grad.numpy().copy())
        w.clear_gradient()
    np.testing.assert_array_equal(grads[0], grads[1])
    assert not np.array_equal(grads[0], grads[2])  # another mask gives other gradients: the equality is the mask's


def test_modes_layers_and_messages():
    assert parse_mode(True) == parse_mode("true") == "full" and parse_mode(False) == parse_mode("False") == "none"
    with pytest.raises(ValueError, match="train.recompute='attention'.*full_attn"):
        parse_mode("attention")
    with pytest.raises(ValueError, match="unknown \\['mlps'\\]"):
        recompute_from(mode="selective", modules=["mlps"])
    with pytest.raises(ValueError, match="needs train.recompute_modules"):
        recompute_from(mode="selective")
    assert recompute_from(mode="none") == Recompute()
    assert recompute_from(mode="full", modules=["mlp"]).parts == {"block"}
    assert choose_blocks("all", [4]) is None
    assert choose_blocks("every:2", [3, 3]) == {0, 2, 3, 5}
    assert choose_blocks("first:2", [3, 1, 4]) == {0, 1, 3, 4, 5}
    with pytest.raises(ValueError, match="every:N"):
        choose_blocks("some:2", [4])
    rc = recompute_from(mode="core_attn", layers="first:1", blocks=[2, 2])
    assert rc.at(0) == rc.at(2) == {"core_attn"} and rc.at(1) == rc.at(3) == frozenset()
    assert set(MODULES) >= {"core_attn", "mlp", "moe", "moe_act", "norm"}


def test_recompute_layers_pick_blocks(tiny_llama):
    cfg = dataclasses.replace(tiny_llama, num_layers=4)
    model = build_model(cfg, recompute=recompute_from(mode="full", layers="every:2", blocks=[4]))
    assert [b.recompute for b in model.layers] == [True, False, True, False]
