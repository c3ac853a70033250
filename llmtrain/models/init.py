"""Layout-independent parameter initialisation.

    init_parameters(named_params, cfg, seed=1234, tp_rank=0, tp_degree=1)

A parameter's initial value depends only on the seed and its canonical name
(`layers.3.mlp.up_proj.weight`): we draw the *full* logical tensor from a
generator seeded by (seed, name), then keep this rank's slice along the axis
the role factory recorded in `param.llm_split_axis`. The same weights therefore
come out under one process, tp2, pp4 or any mix, which is what makes layout
parity tests and reshardable checkpoints possible.

Rules (GPT-2 / Megatron): norm weights 1, every 1-D parameter (biases, norm
biases) 0, everything else N(0, init_std^2); output projections of the residual
branches (`llm_residual_out`) N(0, (init_std / sqrt(2 L))^2).
"""
from __future__ import annotations

import hashlib
import math
from typing import Iterable

import numpy as np
import paddle

from llmtrain.models.config import ModelConfig


def name_rng(seed: int, name: str) -> np.random.Generator:
    """A generator that depends only on (seed, name)."""
    digest = hashlib.sha256(name.encode()).digest()
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, *words]))


def full_shape(param: paddle.Tensor, tp_degree: int) -> list[int]:
    """Logical (unsplit) shape of a possibly tp-split parameter."""
    shape = list(param.shape)
    axis = getattr(param, "llm_split_axis", None)
    if axis is not None:
        shape[axis] *= tp_degree
    return shape


def local_slice(full: np.ndarray, param: paddle.Tensor, tp_rank: int, tp_degree: int) -> np.ndarray:
    """This rank's contiguous chunk of `full` along the split axis (fleet's layout)."""
    axis = getattr(param, "llm_split_axis", None)
    if axis is None or tp_degree == 1:
        return full
    size = full.shape[axis] // tp_degree
    index = [slice(None)] * full.ndim
    index[axis] = slice(tp_rank * size, (tp_rank + 1) * size)
    return full[tuple(index)]


def initial_value(name: str, param: paddle.Tensor, cfg: ModelConfig, seed: int, tp_degree: int) -> np.ndarray:
    """The full-shape initial value of parameter `name` (fp32 numpy)."""
    shape = full_shape(param, tp_degree)
    if getattr(param, "llm_init", None) == "ones":
        return np.ones(shape, dtype=np.float32)
    if len(shape) == 1:
        return np.zeros(shape, dtype=np.float32)
    std = cfg.init_std
    if getattr(param, "llm_residual_out", False):
        std = std / math.sqrt(2.0 * cfg.num_layers)
    return name_rng(seed, name).standard_normal(shape, dtype=np.float32) * np.float32(std)


@paddle.no_grad()
def init_parameters(
    named_params: Iterable[tuple[str, paddle.Tensor]],
    cfg: ModelConfig,
    seed: int,
    tp_rank: int = 0,
    tp_degree: int = 1,
) -> None:
    """Set every parameter from its (seed, canonical name) draw, sliced for this tp rank."""
    for name, param in named_params:
        value = local_slice(initial_value(name, param, cfg, seed, tp_degree), param, tp_rank, tp_degree)
        if list(value.shape) != list(param.shape):
            raise ValueError(f"init of {name}: slice shape {list(value.shape)} != parameter shape {list(param.shape)}")
        param.set_value(paddle.to_tensor(value, dtype=param.dtype, place=param.place))


class StateMismatch(ValueError):
    """Checkpoint keys or shapes do not match the model; the message lists them all."""


@paddle.no_grad()
def load_full_state(
    named_params: Iterable[tuple[str, paddle.Tensor]],
    state,
    tp_rank: int = 0,
    tp_degree: int = 1,
    source: str = "checkpoint",
) -> None:
    """Set parameters from full (unsplit) tensors keyed by canonical name, slicing for this tp rank.

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
            want = full_shape(param, tp_degree)
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
        value = local_slice(np.asarray(state[name], dtype=np.float32), param, tp_rank, tp_degree)
        param.set_value(paddle.to_tensor(np.ascontiguousarray(value), dtype=param.dtype, place=param.place))


def expected_names(cfg: ModelConfig) -> list[str]:
    """Canonical parameter names of the whole model (every stage), in model order."""
    from llmtrain.models import build_model

    with paddle.LazyGuard():
        model = build_model(cfg)
    from llmtrain.models.decoder import canonical_parameters

    return [n for n, _ in canonical_parameters(model)]
