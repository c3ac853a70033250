"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr, or warmup-stable-decay.

    sched = WarmupDecay(cfg.optim, max_steps=100); sched.lr_at(10)
"""
from __future__ import annotations

import math

from paddle.optimizer.lr import LRScheduler

from llmtrain.train.config import OptimConfig


def horizon(cfg: OptimConfig, max_steps: int) -> int:
    """The step at which the LR reaches min_lr: optim.decay_steps, else train.max_steps."""
    return cfg.decay_steps if cfg.decay_steps is not None else max_steps


def wsd_decay_start(cfg: OptimConfig, max_steps: int) -> int:
    """WSD: the first step of the decay (optim.decay_start_step, else the horizon minus its decay fraction)."""
    if cfg.decay_start_step is not None:
        return cfg.decay_start_step
    end = horizon(cfg, max_steps)
    fraction = cfg.decay_fraction if cfg.decay_fraction is not None else 0.2
    return end - int(round(fraction * end))


def _shape(name: str, p: float) -> float:
    """Decay factor f(p), 1 at p=0 and 0 at p=1."""
    if name == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    if name == "linear":
        return 1.0 - p
    if name == "1-sqrt":
        return 1.0 - math.sqrt(p)
    raise ValueError(f"decay shape {name!r}: expected 'cosine', 'linear' or '1-sqrt'")


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate used by optimizer step `step` (0-based).

    Warmup: lr * (step + 1) / warmup_steps, so the first step already learns and
    step warmup_steps - 1 uses the peak (never more: under batch ramp-up `step` is a
    fractional position, and one in (warmup_steps - 1, warmup_steps) gets the peak). Then progress p in [0, 1] over
    [start, horizon] and lr = min_lr + (lr - min_lr) * f(p): for cosine/linear
    start = warmup_steps and f the cosine 0.5 (1 + cos(pi p)) or 1 - p; constant
    keeps lr; wsd keeps lr until start = `wsd_decay_start` and then f is
    `optim.decay_shape` (linear, cosine or 1 - sqrt(p)).
    """
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:  # capped: a fractional position (ramp-up) past W - 1
        return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)
    if cfg.schedule == "constant":
        return cfg.lr
    end = horizon(cfg, max_steps)
    if cfg.schedule == "wsd":
        start, shape = max(cfg.warmup_steps, wsd_decay_start(cfg, max_steps)), cfg.decay_shape
        if step < start:
            return cfg.lr
    elif cfg.schedule in ("cosine", "linear"):
        start, shape = cfg.warmup_steps, cfg.schedule
    else:
        raise ValueError(f"optim.schedule={cfg.schedule!r}: expected 'cosine', 'linear', 'constant' or 'wsd'")
    span = max(1, end - start)
    p = min(1.0, max(0.0, (step - start) / span))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * _shape(shape, p)


def schedule_problems(cfg: OptimConfig, max_steps: int) -> list[str]:
    """Config checks of the schedule fields, one line per problem with the numbers (for `resolve`)."""
    problems = []
    if cfg.decay_shape not in ("cosine", "linear", "1-sqrt"):
        problems.append(f"optim.decay_shape={cfg.decay_shape!r}: expected one of cosine, linear, 1-sqrt")
    if cfg.decay_fraction is not None and not 0.0 < cfg.decay_fraction <= 1.0:
        problems.append(f"optim.decay_fraction={cfg.decay_fraction}: must be in (0, 1]")
    if cfg.decay_fraction is not None and cfg.decay_start_step is not None:
        problems.append(f"optim.decay_fraction={cfg.decay_fraction} and optim.decay_start_step="
                        f"{cfg.decay_start_step}: give one of the two")
    if cfg.schedule != "wsd" and (cfg.decay_fraction is not None or cfg.decay_start_step is not None):
        problems.append(f"optim.decay_fraction/decay_start_step apply to optim.schedule=wsd, not {cfg.schedule!r}")
    if cfg.on_resume not in (None, "config", "checkpoint"):
        problems.append(f"optim.on_resume={cfg.on_resume!r}: expected null, config or checkpoint")
    end = horizon(cfg, max_steps)
    if cfg.decay_steps is not None and cfg.decay_steps <= 0:
        problems.append(f"optim.decay_steps={cfg.decay_steps}: must be > 0")
    if cfg.schedule == "wsd" and cfg.decay_start_step is not None and not 0 <= cfg.decay_start_step <= end:
        problems.append(f"optim.decay_start_step={cfg.decay_start_step}: must be in [0, {end}] (the horizon: "
                        f"{'optim.decay_steps' if cfg.decay_steps is not None else 'train.max_steps'}={end})")
    return problems


class WarmupDecay(LRScheduler):
    """Paddle scheduler wrapper around `lr_at`; `last_epoch` counts optimizer steps."""

    def __init__(self, cfg: OptimConfig, max_steps: int):
        self.cfg = cfg
        self.max_steps = max_steps
        super().__init__(learning_rate=cfg.lr, last_epoch=-1)

    def get_lr(self) -> float:
        return lr_at(self.last_epoch, self.cfg, self.max_steps)

    def in_force(self) -> dict:
        """{"optim": the schedule's optim fields, "max_steps": its horizon's max_steps} (for the manifest)."""
        import dataclasses

        return {"optim": {f.name: getattr(self.cfg, f.name) for f in dataclasses.fields(OptimConfig)},
                "max_steps": int(self.max_steps)}

    def resume_at(self, step: int) -> None:
        """Continue at optimizer step `step` (0-based: the next step to run) under this schedule.

        The LR is recomputed from the step and the schedule in force, never taken from
        a saved `last_lr` (which belongs to the schedule of the run that wrote it)."""
        self.last_epoch = step
        self.last_lr = self.get_lr()

    def follow_samples(self, consumed_samples: int, samples_per_step: int) -> None:
        """Batch ramp-up: put the schedule at ``consumed_samples / samples_per_step`` (a fractional step).

        Under `train.batch_rampup` the steps of the ramp are smaller than `train.global_batch_size`,
        so, as in Megatron (whose scheduler advances by the samples of each step, its warmup and
        decay counted in samples = iterations x the final global batch), the LR follows consumed
        samples: a step of half the final batch moves the schedule half a step. Called before each
        step with the samples consumed before it; `step()` afterwards is overwritten by the next call."""
        self.last_epoch = consumed_samples / samples_per_step
        self.last_lr = self.get_lr()
