"""The CPU rehearsal of the GPU-only branch `amp-fp16` (fp16 AMP O2 with Paddle's GradScaler, `llmtrain/train/amp.py`).

    {"call": "tests/gpu_paths/amp_fp16_rehearsal.py:force_scaler"}      # a run_many entry before the fp16 runs
    scaler = forced_loss_scaler()                                       # in-process (tests/train/fake_job.py)

On CPU Paddle disables its GradScaler in the constructor (it acts only on CUDA/XPU/custom places), so CI never
runs the fp16 loss-scaling path. The rehearsal keeps everything real except that question: the constructor of
llmtrain's scaler (`paddle_compat.amp.LossScaler`, a GradScaler) is told the place is a GPU, so the real
scaling, unscaling, `found_inf` handling, optimizer skip and scale updates run over fp32 math (AMP O2's casts
stay a no-op on CPU). In fp32 math a power-of-two loss scale is exact, so a scaled run must equal an unscaled one.
"""
from __future__ import annotations


def forced_loss_scaler(**kwargs):
    """`llmtrain.paddle_compat.amp.LossScaler` forced on over CPU math, with llmtrain's settings unless overridden."""
    from paddle.amp import grad_scaler

    from llmtrain.paddle_compat.amp import loss_scaler

    settings = dict(init_loss_scaling=2.0**15, incr_every_n_steps=1000, decr_every_n_nan_or_inf=1) | kwargs
    real = grad_scaler._dygraph_tracer
    grad_scaler._dygraph_tracer = gpu_tracer
    try:
        scaler = loss_scaler(**settings)
    finally:
        grad_scaler._dygraph_tracer = real
    assert scaler.is_enable()
    return scaler


def force_scaler() -> None:
    """In this (launched) process, `train.amp=fp16` runs get a forced-on scaler from `AmpPlan.scaler`, built with
    the settings llmtrain passes (the real method runs; only Paddle's place check is answered as a GPU's)."""
    from paddle.amp import grad_scaler

    from llmtrain.train.amp import AmpPlan

    if getattr(AmpPlan, "_rehearsal_original", None) is None:
        AmpPlan._rehearsal_original = AmpPlan.scaler

    def scaler(self):
        real = grad_scaler._dygraph_tracer
        grad_scaler._dygraph_tracer = gpu_tracer
        try:
            out = AmpPlan._rehearsal_original(self)
        finally:
            grad_scaler._dygraph_tracer = real
        assert out is None or out.is_enable()
        return out

    AmpPlan.scaler = scaler


def gpu_tracer():
    """A stand-in for Paddle's tracer whose expected place says GPU (what GradScaler's constructor asks)."""

    class _GpuPlace:
        def is_gpu_place(self):
            return True

        def is_xpu_place(self):
            return False

        def is_custom_place(self):
            return False

    class _Tracer:
        _expected_place = _GpuPlace()

    return _Tracer()


def unforce_scaler() -> None:
    from llmtrain.train.amp import AmpPlan

    if getattr(AmpPlan, "_rehearsal_original", None) is not None:
        AmpPlan.scaler = AmpPlan._rehearsal_original
        AmpPlan._rehearsal_original = None


def stop_run(overrides: list) -> None:
    """A run through the entry's own handling (`run_entry`): a Diverged run prints its message and exits 5."""
    from llmtrain.config import compose_config
    from llmtrain.pretrain import pretrain
    from llmtrain.train.entry import run_entry

    run_entry(pretrain, compose_config(overrides))
