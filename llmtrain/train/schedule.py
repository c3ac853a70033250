"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr.

    sched = WarmupDecay(cfg.optim, max_steps=100); sched.lr_at(10)
"""
from __future__ import annotations

import math

from paddle.optimizer.lr import LRScheduler

from llmtrain.train.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate used by optimizer step `step` (0-based).

    Warmup: lr * (step + 1) / warmup_steps, so the first step already learns and
    step warmup_steps - 1 uses the peak. Then progress p in [0, 1] over
    [warmup_steps, decay_steps] and lr = min_lr + (lr - min_lr) * f(p), f the
    cosine 0.5 (1 + cos(pi p)), linear 1 - p, or constant 1.
    """
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = cfg.decay_steps if cfg.decay_steps is not None else max_steps
    span = max(1, decay_steps - cfg.warmup_steps)
    p = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    if cfg.schedule == "cosine":
        f = 0.5 * (1.0 + math.cos(math.pi * p))
    elif cfg.schedule == "linear":
        f = 1.0 - p
    else:
        raise ValueError(f"optim.schedule={cfg.schedule!r}: expected 'cosine', 'linear' or 'constant'")
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * f


class WarmupDecay(LRScheduler):
    """Paddle scheduler wrapper around `lr_at`; `last_epoch` counts optimizer steps."""

    def __init__(self, cfg: OptimConfig, max_steps: int):
        self.cfg = cfg
        self.max_steps = max_steps
        super().__init__(learning_rate=cfg.lr, last_epoch=-1)

    def get_lr(self) -> float:
        return lr_at(self.last_epoch, self.cfg, self.max_steps)

    def resume_at(self, step: int) -> None:
        """Continue at optimizer step `step` (0-based: the next step to run) under this schedule.

        The LR is recomputed from the step and the schedule in force, never taken from
        a saved `last_lr` (which belongs to the schedule of the run that wrote it)."""
        self.last_epoch = step
        self.last_lr = self.get_lr()
