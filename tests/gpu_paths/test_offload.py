"""CPU rehearsal of `GPU-ONLY(offload)` (llmtrain/paddle_compat/offload.py `to_host`, `to_device`): optimizer state
and a recomputed block's input go to pinned host memory and come back to the GPU, asynchronously when prefetched.

    python -m pytest tests/gpu_paths/test_offload.py -q

On CPU `kernels.on_gpu` is made true and `Tensor.pin_memory` / `Tensor.cuda` are replaced by stand-ins bound to the
installed methods' signatures (`checked`) whose references copy to new CPU storage (what a pinned copy and a
device copy are on a host with one memory). Training with the optimizer state offloaded and with every block's
input offloaded under full recompute must then equal training without offload exactly (copies change no value);
the stand-ins' calls show the directions and that the prefetch asked for a non-blocking copy. On a GPU no stand-in
is installed: the same runs check the real copies (the state then lives in `Place(gpu_pinned)` between steps).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import paddle

from gpu_rehearsal import ON_GPU, checked, reaches
from llmtrain.contracts.steps import mean_loss
from llmtrain.models import build_model
from llmtrain.models.init import init_parameters
from llmtrain.models.recompute import recompute_from
from llmtrain.models.stages import canonical_parameters
from llmtrain.paddle_compat import kernels
from llmtrain.paddle_compat.offload import OptimizerOffload


def _pin_reference(self, blocking=True):
    assert paddle.is_tensor(self) and isinstance(blocking, bool)
    return self._copy_to(paddle.CPUPlace(), True)


def _cuda_reference(self, device_id=None, blocking=True):
    assert device_id is None and isinstance(blocking, bool)
    return self._copy_to(paddle.CPUPlace(), True)


def _train(cfg, rc, offload_optimizer):
    paddle.seed(0)
    model = build_model(cfg, recompute=rc)
    init_parameters(canonical_parameters(model), cfg, 7)
    model.train()
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    off = OptimizerOffload(opt) if offload_optimizer else None
    rng = np.random.default_rng(3)
    losses = []
    for _ in range(2):
        ids = paddle.to_tensor(rng.integers(0, cfg.vocab_size, (2, 16)))
        labels = paddle.to_tensor(rng.integers(0, cfg.vocab_size, (2, 16)))
        loss = mean_loss(model.loss_fn(model(ids), (labels, paddle.ones(labels.shape, dtype="float32"))))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in canonical_parameters(model)}, off


def test_offload_through_pinned_memory_trains_the_same(tiny_llama, monkeypatch):
    from llmtrain.models.config import FUSE_SWITCHES

    # the CPU paths of the model itself (on_gpu is made true below only for the offload copies)
    cfg = dataclasses.replace(tiny_llama, num_layers=3, attention="math", **{k: "false" for k in FUSE_SWITCHES})
    ref_losses, ref_params, _ = _train(cfg, recompute_from(mode="full"), False)
    pin = cuda = None
    if not ON_GPU:
        monkeypatch.setattr(kernels, "on_gpu", lambda: True)
        pin = checked(paddle.Tensor.pin_memory, _pin_reference, ("self", "blocking"))
        cuda = checked(paddle.Tensor.cuda, _cuda_reference, ("self", "blocking"))
        monkeypatch.setattr(paddle.Tensor, "pin_memory", pin)
        monkeypatch.setattr(paddle.Tensor, "cuda", cuda)
    with reaches("offload"):
        losses, params, off = _train(cfg, recompute_from(mode="full", offload=True), True)
    assert losses == ref_losses
    for n in ref_params:
        np.testing.assert_array_equal(params[n], ref_params[n], err_msg=n)
    if ON_GPU:
        assert set(off.report()["optimizer_places"]) == {"Place(gpu_pinned)"}
        return
    assert off.report()["round_trips"] == 2 and off.report()["optimizer_host_bytes"] > 0
    # 3 blocks x 2 steps of block inputs + the optimizer state twice: every pinned copy blocking (the forward's)
    assert len(pin.calls) >= 6 and all(c["blocking"] for c in pin.calls)
    # the copies back: one per block and step, those started one block ahead non-blocking (2 of 3 per step)
    prefetched = [c for c in cuda.calls if not c["blocking"]]
    assert len(prefetched) == 4, [c["blocking"] for c in cuda.calls]
