"""AdamW with decoupled weight decay (none on norms and biases) and the warmup/decay schedule.

    optimizer, scheduler = build_optimizer(canonical_params, cfg.optim, max_steps, multi_precision)
"""
from __future__ import annotations

import paddle

from llmtrain.train.clip import GlobalNormClip
from llmtrain.train.config import OptimConfig
from llmtrain.train.schedule import WarmupDecay


def decays(canonical_name: str, param) -> bool:
    """Weight decay applies to matrices and embedding tables, never to 1-D norms and biases."""
    return len(param.shape) >= 2


def _unsliced(var_name: str) -> str:
    """Paddle's ZeRO-3 hands the optimizer flat slices named "slice@<parameter name>"."""
    return var_name[len("slice@"):] if var_name.startswith("slice@") else var_name


def build_optimizer(named_params, cfg: OptimConfig, max_steps: int, multi_precision: bool = False):
    """AdamW over all parameters in one group (so clipping sees one global norm).

    Decay is selected per parameter through `apply_decay_param_fun` rather than
    parameter groups: Paddle clips each parameter group by its own norm.
    """
    if cfg.name != "adamw":
        raise ValueError(f"optim.name={cfg.name!r}: only 'adamw' is supported")
    named_params = list(named_params)
    decay_names = {p.name for n, p in named_params if decays(n, p)}
    scheduler = WarmupDecay(cfg, max_steps)
    optimizer = paddle.optimizer.AdamW(
        learning_rate=scheduler,
        beta1=cfg.beta1,
        beta2=cfg.beta2,
        epsilon=cfg.eps,
        parameters=[p for _, p in named_params],
        weight_decay=cfg.weight_decay,
        apply_decay_param_fun=lambda name: _unsliced(name) in decay_names,
        grad_clip=GlobalNormClip(cfg.clip_grad),
        multi_precision=multi_precision,
    )
    return optimizer, scheduler
