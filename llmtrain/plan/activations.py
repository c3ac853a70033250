"""Measured activation memory: bytes saved for backward by one forward, per transformer block (CPU).

    python -m pytest tests/plan/test_activations.py -q -s        # measured vs `estimate.layer_activation_bytes`
    per_layer = saved_bytes_per_layer(model_cfg, batch=2, seq=256)

Counts every tensor autograd saves during a forward (`paddle.autograd.saved_tensors_hooks`),
distinct storage once, parameters excluded; the difference between a 2-block and a 1-block
model of the same config is one block's share. Paddle allows one pair of these hooks at a
time and its non-reentrant recompute uses them itself, so recompute is not measurable this way.
"""
from __future__ import annotations

import dataclasses


def saved_bytes(model, input_ids) -> int:
    """Bytes of the distinct non-parameter tensors saved for backward by model(input_ids)."""
    import paddle

    params = {p.data_ptr() for p in model.parameters()}
    seen: dict = {}
    alive = []  # keep every packed tensor alive, so no storage address is reused during the forward

    def pack(t):
        alive.append(t)
        if t.data_ptr() not in params:
            seen[(t.data_ptr(), tuple(t.shape), str(t.dtype))] = int(t.numel()) * t.element_size()
        return t

    with paddle.autograd.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids)
    return sum(seen.values())


def saved_bytes_per_layer(model_cfg, batch: int, seq: int, seed: int = 0, dtype: str = "float32") -> int:
    """Saved-for-backward bytes of one block: a 2-block model minus a 1-block model, input [batch, seq].
    `dtype`: every parameter cast to it first (a compute dtype other than fp32; CPU has no bf16 matmul)."""
    import paddle

    from llmtrain.models import build_model

    paddle.seed(seed)
    ids = paddle.randint(0, model_cfg.vocab_size, [batch, seq])
    got = []
    for n in (1, 2):
        model = build_model(dataclasses.replace(model_cfg, num_layers=n))
        if dtype != "float32":
            model.to(dtype=dtype)
        got.append(saved_bytes(model, ids))
    return got[1] - got[0]


def held_bytes_per_layer(model_cfg, batch: int, seq: int, recompute: bool, seed: int = 0) -> int:
    """Host bytes one block still holds after the forward (2-block minus 1-block model), input [batch, seq]."""
    import paddle

    from llmtrain.models import build_model
    from llmtrain.paddle_compat.host_memory import host_allocated_bytes, no_collection

    paddle.seed(seed)
    ids = paddle.randint(0, model_cfg.vocab_size, [batch, seq])
    got = []
    for n in (1, 2):
        model = build_model(dataclasses.replace(model_cfg, num_layers=n), recompute=recompute)
        model.train()
        with no_collection():
            before = host_allocated_bytes()
            out = model(ids)  # the graph keeps what backward needs; nothing else of the forward survives
            got.append(host_allocated_bytes() - before)
        del out
    return got[1] - got[0]
