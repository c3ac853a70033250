"""Paddle's fp16 loss scaler, read and repaired where Paddle 3.3.1 gets it wrong (GPU and CPU path alike).

    python -m pytest -q tests/train/test_guard_fast.py -k overflow
    scaler = loss_scaler(init_loss_scaling=2.0**15, incr_every_n_steps=1000, decr_every_n_nan_or_inf=1)
    found = overflow_flag(scaler)      # inside optimizer.step(): the bool [1] tensor the scaler's unscale set
    scale = loss_scale(scaler)         # the current loss scale (a host read)
    abandon_step(scaler)               # a step that raised inside scaler.step(): the next one unscales again
    keep_fp32_under_o2(layer)          # O2's decorate leaves this layer's own parameters fp32
    with fp32_region(): ...            # inside auto_cast: ops run in their inputs' dtypes (fp32 stays fp32)

What Paddle 3.3.1 does, read in `paddle/amp/grad_scaler.py` and `paddle/optimizer/optimizer.py`:
- `GradScaler.step(opt)` unscales the gradients (`_unscale`: `check_finite_and_unscale` sets the bool
  tensor `_found_inf`; fleet's and ZeRO's wrappers replace `_unscale` on the instance and all-reduce the
  flag over the job), hands the flag to the optimizer (`_set_auxiliary_var('found_inf')`) and ALWAYS calls
  `opt.step()`; the optimizer runs its gradient clip, then skips the update when the flag is set. So the
  clip sees the overflowing gradients: the divergence guard's gated clip reads the flag here
  (`overflow_flag`) to tell a loss-scale overflow from a divergence.
- `_unscale` marks the optimizer UNSCALED in `_optimizer_states`; only `update()` resets that. A step
  that raises between the two (the guard rejecting a step from inside the clip) leaves the next step
  skipping its unscale (gradients 2^15 times too large, the old flag reused): `abandon_step` resets it.
- `_update` prints `float(self._scale)` when it lowers the scale; `_scale` has shape [1], and with
  numpy >= 2 `float()` of a one-element array raises TypeError. `LossScaler._update` is the same
  counting without the print (the guard logs the overflow and the new scale).
On CPU the scaler disables itself in its constructor (it acts only on CUDA/XPU/custom places); the
tests force it on over fp32 math (tests/gpu_paths/test_amp_fp16.py).

fp32 islands under O2 (the MoE router and combine, `model.moe_router_dtype=fp32`), read in `paddle/amp/auto_cast.py`
and the eager auto-cast (`paddle/fluid/imperative/amp_utils.h`, `GetAmpDestDtype`):
- `decorate(level='O2')` casts every layer's own parameters (`Layer._to_impl(include_sublayers=False)`) unless
  `need_keep_fp32(layer)`: `layer._cast_to_low_precision` False (what `excluded_layers` sets, on the layer and all
  its sublayers; `keep_fp32_under_o2` sets it on one layer only), BatchNorm, or LayerNorm under fp16;
- inside `auto_cast(level='O2')` a white-listed op (`matmul`, `linear_v2`, ...) gets its inputs cast to the AMP
  dtype whatever their dtype, so an fp32 weight alone does not make an fp32 GEMM; `auto_cast(enable=False)` sets the
  tracer's level to O0 for its block (no cast at all) and restores it after. It also overwrites
  `amp_global_state().amp_dtype` (read by GradScaler's constructor) with its `dtype` argument without restoring
  it: `fp32_region` passes the current value.
"""
from __future__ import annotations

import contextlib
import sys
from collections import defaultdict

import paddle

from llmtrain.paddle_compat.version import require_tested_paddle


class LossScaler(paddle.amp.GradScaler):
    """Paddle's GradScaler with `_update` free of the `float()`-on-a-[1]-tensor TypeError (numpy >= 2)."""

    def _update(self):
        if not self._enable:
            return
        if self._cache_found_inf:  # the step overflowed: count it, lower the scale every decr_every_n of them
            self._incr_count = 0
            self._decr_count += 1
            if self._decr_count == self._decr_every_n_nan_or_inf:
                self._scale = self._scale * self._decr_ratio
                self._decr_count = 0
        else:  # a finite step: raise the scale after incr_every_n of them in a row
            self._decr_count = 0
            self._incr_count += 1
            if self._incr_count == self._incr_every_n_steps:
                self._scale = self._scale * self._incr_ratio
                self._incr_count = 0


def loss_scaler(**kwargs) -> LossScaler:
    """A dynamic loss scaler (keyword arguments of `paddle.amp.GradScaler`)."""
    require_tested_paddle()
    return LossScaler(**kwargs)


def scaler_active(scaler) -> bool:
    """True when `scaler` scales the loss (fp16 on a GPU, or forced on in a test); False for None or a disabled one."""
    return scaler is not None and bool(scaler.is_enable()) and bool(scaler.is_use_dynamic_loss_scaling())


def overflow_flag(scaler):
    """The bool [1] tensor `_unscale` set for this step (True: some gradient is inf/NaN), or None when inactive."""
    if not scaler_active(scaler):
        return None
    require_tested_paddle()
    return scaler._found_inf


def loss_scale(scaler):
    """The current loss scale as a float (one host read), or None when the scaler is inactive."""
    if not scaler_active(scaler):
        return None
    require_tested_paddle()
    return float(scaler._scale.numpy().reshape(-1)[0])


def abandon_step(scaler) -> None:
    """After a step that raised inside `scaler.step()` (before `update()`): forget the optimizers' UNSCALED/STEPPED
    marks so the next step unscales its own gradients; the scale and its counters stay."""
    if not scaler_active(scaler):
        return
    require_tested_paddle()
    from paddle.amp.grad_scaler import _refresh_optimizer_state

    scaler._optimizer_states = defaultdict(_refresh_optimizer_state)


def keep_fp32_under_o2(layer) -> None:
    """Make `paddle.amp.decorate(level='O2')` leave `layer`'s own parameters (not its sublayers') in fp32."""
    require_tested_paddle()
    layer._cast_to_low_precision = False


def fp32_region():
    """A block where AMP casts nothing (the tracer at O0): each op runs in its inputs' dtypes. Inside an O2/O1
    `auto_cast` it is `auto_cast(enable=False)` keeping the AMP dtype Paddle records globally; without AMP a no-op."""
    require_tested_paddle()
    from paddle.base.framework import _dygraph_tracer

    if _dygraph_tracer()._amp_level == paddle.base.core.AmpLevel.O0:
        return contextlib.nullcontext()
    amp_dtype = sys.modules["paddle.amp.auto_cast"].amp_global_state().amp_dtype
    return paddle.amp.auto_cast(enable=False, dtype=amp_dtype)
