"""Layout-independent parameter initialisation, and loading full tensors by canonical name.

    python -m pytest tests/models -q
    init_parameters(canonical_parameters(model), cfg, seed=1234)

A parameter's initial value depends only on the seed and its canonical name
(`layers.3.mlp.up_proj.weight`): we draw the *full* logical tensor from a
generator seeded by (seed, name). What part of it a process keeps is not the
model's business: the caller passes `slices`, an object with
`full_shape(param)` (the logical shape of a possibly cut parameter) and
`local(full, param)` (the part this process holds). The default, `WHOLE`, is
one device; the parallel plan passes `llmtrain.parallel.slicing.TensorSlices`.
The same weights therefore come out under one process, tp2, pp4 or any mix,
which is what makes layout parity tests and reshardable checkpoints possible.

Rules (GPT-2 / Megatron): norm weights 1, every 1-D parameter (biases, norm
biases) 0, everything else N(0, init_std^2); output projections of the residual
branches (`tags.is_residual_out`) N(0, (init_std / sqrt(2 L))^2). LoRA factors
(`llmtrain.models.lora`): A uniform in +-1/sqrt(in), B zero.
"""
from __future__ import annotations

import hashlib
import math
from typing import Iterable

import numpy as np
import paddle

from llmtrain.contracts import tags
from llmtrain.models.config import ModelConfig


def name_rng(seed: int, name: str) -> np.random.Generator:
    """A generator that depends only on (seed, name)."""
    digest = hashlib.sha256(name.encode()).digest()
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, *words]))


class Whole:
    """Every parameter is its full logical tensor (one device)."""

    def full_shape(self, param: paddle.Tensor) -> list[int]:
        return list(param.shape)

    def local(self, full: np.ndarray, param: paddle.Tensor) -> np.ndarray:
        return full


WHOLE = Whole()


def initial_value(name: str, param: paddle.Tensor, cfg: ModelConfig, seed: int, shape=None) -> np.ndarray:
    """The initial value of parameter `name` at its full logical `shape` (default: the parameter's), fp32 numpy."""
    shape = list(param.shape) if shape is None else list(shape)
    rule = tags.init_rule(param)
    if rule == "ones":
        return np.ones(shape, dtype=np.float32)
    if rule == "zeros":  # LoRA B
        return np.zeros(shape, dtype=np.float32)
    if isinstance(rule, tuple) and rule[0] == "lora_a":  # LoRA A [in, r]: U(+-1/sqrt(in)), PaddleNLP's bound
        bound = 1.0 / math.sqrt(rule[1])
        return name_rng(seed, name).uniform(-bound, bound, shape).astype(np.float32)
    if len(shape) == 1:
        return np.zeros(shape, dtype=np.float32)
    std = cfg.init_std
    if tags.is_residual_out(param):
        std = std / math.sqrt(2.0 * cfg.num_layers)
    return name_rng(seed, name).standard_normal(shape, dtype=np.float32) * np.float32(std)


@paddle.no_grad()
def init_parameters(
    named_params: Iterable[tuple[str, paddle.Tensor]],
    cfg: ModelConfig,
    seed: int,
    slices=WHOLE,
) -> None:
    """Set every parameter from its (seed, canonical name) draw of the full tensor, cut by `slices`."""
    for name, param in named_params:
        value = slices.local(initial_value(name, param, cfg, seed, slices.full_shape(param)), param)
        if list(value.shape) != list(param.shape):
            raise ValueError(f"init of {name}: slice shape {list(value.shape)} != parameter shape {list(param.shape)}")
        param.set_value(paddle.to_tensor(value, dtype=param.dtype, place=param.place))


class StateMismatch(ValueError):
    """Checkpoint keys or shapes do not match the model; the message lists them all."""


@paddle.no_grad()
def load_full_state(
    named_params: Iterable[tuple[str, paddle.Tensor]],
    state,
    slices=WHOLE,
    source: str = "checkpoint",
) -> None:
    """Set parameters from full (unsplit) tensors keyed by canonical name, cut by `slices` (see the module doc).

    `state` maps canonical names to numpy arrays (or anything `np.asarray` takes).
    Missing keys and shape mismatches stop with the complete list; keys of the
    state that this rank does not hold are ignored here (under pipeline
    parallelism a rank holds only its stages) — callers check unexpected keys
    against the whole model (`expected_names`).
    """
    named_params = list(named_params)
    missing = [n for n, _ in named_params if n not in state]
    shaped = []
    for name, param in named_params:
        if name in state:
            want = slices.full_shape(param)
            have = list(np.shape(state[name]))
            if want != have:
                shaped.append(f"{name}: {source} has {have}, model needs {want}")
    if missing or shaped:
        lines = [f"{source} does not fit the model:"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {', '.join(missing)}")
        if shaped:
            lines.append(f"  mis-shaped ({len(shaped)}):\n    " + "\n    ".join(shaped))
        raise StateMismatch("\n".join(lines))
    for name, param in named_params:
        value = slices.local(np.asarray(state[name], dtype=np.float32), param)
        param.set_value(paddle.to_tensor(np.ascontiguousarray(value), dtype=param.dtype, place=param.place))


def expected_names(cfg: ModelConfig) -> list[str]:
    """Canonical parameter names of the whole model (every stage), in model order."""
    from llmtrain.models import build_model, shape_only

    with shape_only():
        model = build_model(cfg)
    from llmtrain.models.stages import canonical_parameters

    return [n for n, _ in canonical_parameters(model)]
