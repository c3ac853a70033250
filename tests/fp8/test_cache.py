"""Each linear's FP8 weight quantised once per optimizer step (`train.fp8_weight_cache`): the same numbers.

    python -m pytest tests/fp8/test_cache.py -q

A tiny MoE model (attention, dense MLP, shared and routed experts: every kind of FP8 GEMM) trains 3 optimizer steps
of 2 micro-batches with and without `WeightCache`, driven through the step-hook calls the step loop makes, every
weight changed before the third step (a checkpoint load) and an evaluation after the last update; the losses,
weights and evaluation must be equal bit for bit, and the cache must quantise each weight once per step.
"""
from __future__ import annotations

import numpy as np
import paddle

from llmtest import compose
from llmtrain.config import to_config
from llmtrain.fp8.apply import apply_fp8
from llmtrain.fp8.cache import WeightCache


def _model(cache):
    from llmtrain.models import build_model
    from llmtrain.models.roles import Roles

    cfg = to_config(compose(["model=moe-tiny", "model.vocab_size=96", "model.num_layers=2"])).model
    paddle.seed(3)
    model = build_model(cfg, Roles())
    apply_fp8(model, "blockwise", cache=cache)
    return model


def _train(cache, steps=3, micro=2, load_at=2):
    """Losses, final weights and an evaluation's logits of a 3-step run (2 micro-batches each, AdamW)."""
    model = _model(cache)
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    rng = np.random.default_rng(0)
    hooks = [cache] if cache is not None else []
    losses = []
    for step in range(steps):
        if step == load_at:  # a checkpoint load between steps: every weight changes outside the step
            for p in model.parameters():
                p.set_value(p * 0.5)
        for h in hooks:
            h.before_step(micro)
        for _ in range(micro):
            ids = paddle.to_tensor(rng.integers(0, 96, (2, 16)))
            out = model(ids)
            logits = out[0] if isinstance(out, (tuple, list)) else out
            loss = (logits.astype("float32") ** 2).mean() / micro
            loss.backward()
            losses.append(float(loss))
        opt.step()
        opt.clear_grad()
        for h in hooks:
            h.after_step(None)
    with paddle.no_grad():
        for h in hooks:  # an evaluation after the last update
            stack = h.evaluation()
            stack.__enter__()
        logits = model(paddle.to_tensor(rng.integers(0, 96, (2, 16))))
        logits = logits[0] if isinstance(logits, (tuple, list)) else logits
        for h in hooks:
            stack.__exit__(None, None, None)
    return losses, {k: v.numpy() for k, v in model.state_dict().items()}, logits.numpy()


def test_the_cache_changes_no_number_and_quantises_once_per_step():
    ref_losses, ref_weights, ref_eval = _train(None)
    cache = WeightCache()
    losses, weights, evaluation = _train(cache)
    assert losses == ref_losses
    assert all((weights[k] == v).all() for k, v in ref_weights.items())
    np.testing.assert_array_equal(evaluation, ref_eval)
    from llmtrain.fp8.apply import fp8_layers

    model = _model(None)
    per_pass = sum(1 if kind == "linear" else (3 if layer.w_gate is not None else 2)
                   for _, layer, kind in fp8_layers(model))  # a linear's W; the experts' gate, up and down
    assert cache.made == per_pass * (3 + 1), (cache.made, per_pass)  # once a step, and once for the evaluation


def test_a_weight_that_is_no_parameter_is_not_cached():
    cache = WeightCache()
    w = paddle.randn([4, 4])
    made = []
    for _ in range(2):
        cache.get("fused", w * 1.0, "W", lambda: made.append(1))
    assert len(made) == 2 and cache.made == 0
