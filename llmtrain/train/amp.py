"""AMP O2 (bf16 / fp16 weights with fp32 master weights) through Paddle's own API.

    amp = AmpPlan.from_config(cfg.train.amp)
    model, optimizer = amp.decorate(model, optimizer)   # before fleet wraps them
    with amp.autocast(): loss = ...

On CPU Paddle's AMP is a no-op (auto_cast, decorate and GradScaler only act on
CUDA/XPU/custom places): the same calls run, in fp32, and one warning says so.
Tests therefore exercise the O2 code path on CPU; its numerics are GPU-only.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import paddle

from llmtrain.utils.log import log0

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass
class AmpPlan:
    mode: str = "none"
    """`none`, `bf16` or `fp16`."""

    @classmethod
    def from_config(cls, mode: str) -> "AmpPlan":
        if mode not in ("none", "bf16", "fp16"):
            raise ValueError(f"train.amp={mode!r}: expected 'none', 'bf16' or 'fp16'")
        plan = cls(mode)
        if plan.enabled and paddle.get_device() == "cpu":
            log0(f"train.amp={mode}: Paddle's AMP has no effect on CPU; the O2 code path runs in fp32")
        return plan

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def dtype(self) -> str:
        return DTYPES.get(self.mode, "float32")

    def decorate(self, model, optimizer):
        """Cast the model to the low-precision dtype (O2) and give the optimizer fp32 master weights."""
        if not self.enabled:
            return model, optimizer
        with _quiet():
            return paddle.amp.decorate(models=model, optimizers=optimizer, level="O2", dtype=self.dtype, master_weight=True)

    def autocast(self):
        if not self.enabled:
            return contextlib.nullcontext()
        return _QuietAutocast(self.dtype)

    def scaler(self):
        """A dynamic-loss-scaling GradScaler for fp16 (`llmtrain.paddle_compat.amp.LossScaler`); None for bf16 and fp32.

        It starts at 2^15, halves the scale at every overflowing step (whose update it skips) and doubles it after
        1000 finite steps in a row. On CPU Paddle disables it (it acts only on GPU places); what the divergence guard
        does with its overflows is in `llmtrain/train/anomaly.py` (a loss-scale overflow is the scaler's business)."""
        if self.mode != "fp16":
            return None
        from llmtrain.paddle_compat.amp import loss_scaler

        with _quiet():
            return loss_scaler(init_loss_scaling=2.0**15, incr_every_n_steps=1000, decr_every_n_nan_or_inf=1)  # GPU-ONLY(amp-fp16)


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only be enabled on.*")
        yield


class _QuietAutocast:
    """paddle.amp.auto_cast(level='O2') without its per-call CPU warning."""

    def __init__(self, dtype: str):
        self.dtype = dtype

    def __enter__(self):
        self._warn = _quiet()
        self._warn.__enter__()
        self._ctx = paddle.amp.auto_cast(enable=True, level="O2", dtype=self.dtype)
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        try:
            return self._ctx.__exit__(*exc)
        finally:
            self._warn.__exit__(None, None, None)
