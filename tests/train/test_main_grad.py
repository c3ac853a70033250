"""Main-gradient training: fp32 `main_grad` buffers filled by gradient hooks, the optimizer stepping on them, the same
numbers as the default path in fp32.

    python -m pytest tests/train/test_main_grad.py -q
"""
from __future__ import annotations

import numpy as np
import paddle

from llmtrain.models import build_model
from llmtrain.models.stages import canonical_parameters
from llmtrain.train.amp import AmpPlan
from llmtrain.train.config import OptimConfig
from llmtrain.train.main_grad import attach_main_grad
from llmtrain.train.optim import build_optimizer


def _train(cfg, main_grad: bool, steps: int = 3, accum: int = 2):
    """Parameters after `steps` AdamW steps of `accum` micro-batches each (clip 1.0), and the last step's grads."""
    paddle.seed(7)
    model = build_model(cfg)
    named = canonical_parameters(model)
    optimizer, _ = build_optimizer(named, OptimConfig(lr=1e-2, warmup_steps=0, clip_grad=1.0), max_steps=steps)
    if main_grad:
        model, optimizer = attach_main_grad(model, optimizer, AmpPlan("none"))
    rng = np.random.RandomState(0)
    seen = {}
    for _ in range(steps):
        for _ in range(accum):
            ids = paddle.to_tensor(rng.randint(0, cfg.vocab_size, size=(2, 16)), dtype="int64")
            logits = model(ids)  # [2, 16, V]
            loss = paddle.nn.functional.cross_entropy(logits[:, :-1].reshape([-1, cfg.vocab_size]),
                                                      ids[:, 1:].reshape([-1])).mean() / accum
            loss.backward()
        seen = {n: (None if p.grad is None else p.grad.numpy().copy(),
                    None if getattr(p, "main_grad", None) is None else
                    (str(p.main_grad.dtype), p.main_grad.numpy().copy())) for n, p in named}
        optimizer.step()
        optimizer.clear_grad()
    return {n: p.numpy().copy() for n, p in named}, seen


def test_main_grad_trains_to_the_same_bits_in_fp32(tiny_llama):
    plain, plain_grads = _train(tiny_llama, main_grad=False)
    main, main_grads = _train(tiny_llama, main_grad=True)
    for name in plain:
        np.testing.assert_array_equal(main[name], plain[name], err_msg=name)
    for name, (grad, mg) in main_grads.items():  # the gradient lives in main_grad, fp32, accumulated over 2
        assert grad is None and mg is not None and mg[0] == "paddle.float32", name
        np.testing.assert_array_equal(mg[1], plain_grads[name][0], err_msg=name)

