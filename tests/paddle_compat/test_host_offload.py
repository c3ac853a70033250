"""Offload: optimizer state on the host between steps and a recomputed block's input in host memory give the same
training as without; the bytes moved are counted.

    python -m pytest tests/paddle_compat/test_host_offload.py -q

On CPU host and device are one memory: the copies and the accounting run (the tensors really move to new storage),
no device memory is freed; scripts/gpu_acceptance.sh runs this file on a GPU, where the state must sit in pinned
host memory (`Place(gpu_pinned)`) between steps.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import pytest

from llmtrain.contracts.steps import mean_loss
from llmtrain.models import build_model
from llmtrain.models.init import init_parameters
from llmtrain.models.recompute import recompute_from
from llmtrain.models.stages import canonical_parameters
from llmtrain.paddle_compat.kernels import on_gpu
from llmtrain.paddle_compat.offload import OptimizerOffload


def _train(cfg, rc=False, offload_optimizer=False, steps=3, lora=None):
    paddle.seed(0)
    model = build_model(cfg, recompute=rc)
    init_parameters(canonical_parameters(model), cfg, 7)
    model.train()
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters(), multi_precision=True)
    off = OptimizerOffload(opt) if offload_optimizer else None
    rng = np.random.default_rng(3)
    losses, states = [], []
    for _ in range(steps):
        ids = paddle.to_tensor(rng.integers(0, cfg.vocab_size, (2, 16)))
        labels = paddle.to_tensor(rng.integers(0, cfg.vocab_size, (2, 16)))
        loss = mean_loss(model.loss_fn(model(ids), (labels, paddle.ones(labels.shape, dtype="float32"))))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        if off is not None:  # each state buffer kept referenced, so a later one cannot reuse its address
            held = {id(t): paddle.Tensor() for t in off.tensors()}
            for t in off.tensors():
                t._share_buffer_to(held[id(t)])
            states.append({id(t): (t.data_ptr(), held[id(t)]) for t in off.tensors()})
    params = {n: p.numpy() for n, p in canonical_parameters(model)}
    return losses, params, off, states


def test_optimizer_offload_trains_the_same_and_counts_the_state(tiny_llama):
    ref_losses, ref_params, _, _ = _train(tiny_llama)
    losses, params, off, states = _train(tiny_llama, offload_optimizer=True)
    assert losses == ref_losses
    for n in ref_params:
        np.testing.assert_array_equal(params[n], ref_params[n], err_msg=n)
    report = off.report()
    state = sum(int(t.numel()) * t.element_size() for t in off.tensors())
    n = sum(int(np.prod(p.shape)) for p in ref_params.values())
    assert state >= 2 * n * 4  # two Adam moments of every parameter, fp32
    assert report["optimizer_host_bytes"] == state and report["round_trips"] == 3
    assert all(states[0][k][0] != states[1][k][0] for k in states[0])  # every tensor really moved to new storage
    host = "gpu_pinned" if on_gpu() else "cpu"
    assert set(report["optimizer_places"]) == {f"Place({host})"}


def test_activation_offload_equals_full_recompute(tiny_llama):
    cfg = dataclasses.replace(tiny_llama, num_layers=3)
    ref_losses, ref_params, _, _ = _train(cfg, rc=recompute_from(mode="full"))
    losses, params, _, _ = _train(cfg, rc=recompute_from(mode="full", offload=True))
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-6)
    for n in ref_params:
        np.testing.assert_allclose(params[n], ref_params[n], rtol=1e-5, atol=1e-6, err_msg=n)


def test_activation_offload_needs_full_recompute():
    with pytest.raises(ValueError, match="needs train.recompute=full"):
        recompute_from(mode="core_attn", offload=True)
