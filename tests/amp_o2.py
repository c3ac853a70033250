"""Paddle's AMP on a "GPU" that is the CPU: the real `auto_cast`/`decorate` decisions, observable in CPU tests.

    from amp_o2 import bf16_capable_gpu, gemm_recorder
    with bf16_capable_gpu(monkeypatch), gemm_recorder(monkeypatch) as gemms:
        with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):
            y = layer(x)
    gemms.of(layer.router.weight)      # [Gemm(x, y, out dtypes)] of the matmuls that took that weight

On CPU Paddle's AMP does nothing: `auto_cast` and `decorate` refuse a CPU place (they warn and leave the level at
O0), and the C++ auto-cast never casts a CPU tensor (`GetDtypeWithPlace` in paddle/fluid/imperative/amp_utils.h
sends every op on a CPU tensor to fp32). So no CPU test sees which GEMM a GPU would run in bf16. This module keeps
Paddle's own Python decisions and replaces only what the CPU cannot answer:

- `bf16_capable_gpu`: `paddle.amp`'s tracer reports a GPU place and the device says it has bf16 (the checks of
  `amp_guard` and `amp_decorate`), so the real `auto_cast(level="O2", dtype="bfloat16")` sets the tracer's level,
  dtype and op lists exactly as on a GPU, `auto_cast(enable=False)` sets O0 inside it, and the real `decorate`
  casts the parameters it would cast on a GPU (it casts them on the CPU; `Layer._cast_to_low_precision` and
  `excluded_layers` are honoured as on a GPU). `paddle.is_compiled_with_cuda` answers True, so
  `paddle.nn.functional.linear` takes its GPU branch (`_C_ops.matmul`, a white-listed op, where the CPU build calls
  `_C_ops.linear`). `llmtrain.paddle_compat.kernels.on_gpu()` stays False (the device is still "cpu").
- `gemm_recorder`: `paddle._C_ops.matmul` (the kernel behind `paddle.matmul` and, on a CUDA build, bias-free
  `F.linear`) replaced by a stand-in that asks `amp_dest_dtype` — Paddle's `GetAmpDestDtype` for a GPU tensor,
  written from paddle/fluid/imperative/amp_utils.h (3.x) — which dtype the GPU kernel would be handed, records it,
  and computes what a bf16 GEMM computes: inputs rounded to bf16, products summed in fp32, the output rounded to
  bf16 (returned as fp32 values: CPU Paddle 3.3.1 has no bf16 matmul, and the ops after it must run). On a real GPU
  (`on_gpu()`) nothing is emulated: the real op runs and the dtype of its output is recorded.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import paddle


class _GpuPlace:
    def is_gpu_place(self):
        return True

    def is_xpu_place(self):
        return False

    def is_custom_place(self):
        return False


class _GpuTracer:
    """The real dygraph tracer, except that its expected place says GPU (what `amp_guard`/`amp_decorate` check)."""

    def __init__(self, real):
        object.__setattr__(self, "_real", real)

    @property
    def _expected_place(self):
        return _GpuPlace()

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __setattr__(self, name, value):
        setattr(self._real, name, value)


def _auto_cast_module():
    import paddle.amp  # noqa: F401  (`paddle.amp.auto_cast` is the function; the module is in sys.modules)

    return sys.modules["paddle.amp.auto_cast"]


@contextlib.contextmanager
def bf16_capable_gpu(monkeypatch):
    """While active, Paddle's AMP entry points treat this CPU process as a bf16-capable CUDA GPU (module docstring)."""
    module = _auto_cast_module()
    real = module._dygraph_tracer
    with monkeypatch.context() as m:
        m.setattr(module, "_dygraph_tracer", lambda: _GpuTracer(real()))
        m.setattr(module, "_is_gpu_bfloat16_supported", lambda: True)
        m.setattr(paddle, "is_compiled_with_cuda", lambda: True)
        yield


def amp_dest_dtype(op: str, inputs) -> paddle.dtype | None:
    """The dtype Paddle's eager auto-cast gives the floating inputs of `op` on a GPU under the tracer's current AMP
    state (None: O0, nothing is cast). Paddle 3.x `GetAmpDestDtype`: at O2 `use_promote` is the tracer's (True
    under `auto_cast`), elsewhere True; with promotion a white-listed op runs in the AMP dtype, a black-listed one in
    fp32, any other in fp32 if one input is fp32, else in the AMP dtype (OD: fp32); without promotion only the black
    list keeps fp32."""
    from paddle.base.framework import _dygraph_tracer

    tracer = _dygraph_tracer()
    level = tracer._amp_level
    if level == paddle.base.core.AmpLevel.O0:
        return None
    amp = paddle.bfloat16 if tracer._amp_dtype == "bfloat16" else paddle.float16
    white, black = tracer._get_amp_op_list()
    promote = tracer._use_promote if level == paddle.base.core.AmpLevel.O2 else True
    if not promote:
        return paddle.float32 if op in black else amp
    if op in white:
        return amp
    if op in black or level == paddle.base.core.AmpLevel.OD:
        return paddle.float32
    return paddle.float32 if any(t.dtype == paddle.float32 for t in inputs) else amp


@dataclass
class Gemm:
    """One matmul as the GPU kernel gets it."""

    weight: str
    """Name of its second operand (a parameter's name, or a temporary's)."""
    x: paddle.dtype
    y: paddle.dtype
    out: paddle.dtype


class Gemms(list):
    def of(self, weight) -> list[Gemm]:
        """The recorded matmuls whose second operand was `weight` (a parameter)."""
        return [g for g in self if g.weight == weight.name]


def _rounded(t, dtype):
    return t if dtype in (None, t.dtype) else t.astype(dtype).astype(t.dtype)


@contextlib.contextmanager
def gemm_recorder(monkeypatch):
    """Record every `_C_ops.matmul` in the block as the GPU kernel would receive it (module docstring)."""
    from llmtrain.paddle_compat.kernels import on_gpu

    real = paddle._C_ops.matmul
    gemms = Gemms()
    gpu = on_gpu()

    def matmul(x, y, *transpose):
        if len(transpose) not in (0, 2) or not all(isinstance(t, bool) for t in transpose):
            raise TypeError(f"_C_ops.matmul(x, y[, transpose_x, transpose_y]): got {len(transpose) + 2} arguments")
        if gpu:  # the real kernel: its output dtype is the dtype it ran in
            out = real(x, y, *transpose)
            gemms.append(Gemm(y.name, out.dtype, out.dtype, out.dtype))
            return out
        dtype = amp_dest_dtype("matmul", [x, y])
        gemms.append(Gemm(y.name, dtype or x.dtype, dtype or y.dtype, dtype or x.dtype))
        return _rounded(real(_rounded(x, dtype), _rounded(y, dtype), *transpose), dtype)

    with monkeypatch.context() as m:
        m.setattr(paddle._C_ops, "matmul", matmul)
        yield gemms
