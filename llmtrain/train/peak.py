"""Peak FLOP/s of one device, the denominator of MFU.

    python -c "from llmtrain.train.peak import measure_cpu_matmul_peak as m; print(m() / 1e12)"

Configured value first (`train.peak_tflops`); else the datasheet dense bf16
peak for known GPUs; else, on CPU, a measured fp32 matmul peak of this process
(the best of several 1024^3 matmuls, 2 n^3 FLOPs each). Unknown -> None (mfu null).
"""
from __future__ import annotations

import time
from typing import Optional

import paddle

# dense bf16 tensor-core peaks, FLOP/s (vendor datasheets, without sparsity)
GPU_PEAKS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12}


def measure_cpu_matmul_peak(n: int = 1024, repeats: int = 5) -> float:
    """Best observed fp32 FLOP/s of an n x n x n matmul on this process's threads."""
    a = paddle.randn([n, n], dtype="float32")
    b = paddle.randn([n, n], dtype="float32")
    paddle.matmul(a, b)  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        c = paddle.matmul(a, b)
        float(c[0, 0])
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def peak_flops(configured_tflops: Optional[float]) -> tuple[Optional[float], str]:
    """(peak FLOP/s or None, where it came from)."""
    if configured_tflops:
        return configured_tflops * 1e12, "config train.peak_tflops"
    device = paddle.get_device()
    if device.startswith("gpu"):
        name = paddle.device.cuda.get_device_name()
        for key, value in GPU_PEAKS.items():
            if key in name:
                return value, f"datasheet bf16 dense peak of {name}"
        return None, f"unknown GPU {name!r}: set train.peak_tflops"
    if device == "cpu":
        return measure_cpu_matmul_peak(), "measured fp32 matmul peak (CPU)"
    return None, f"unknown device {device!r}: set train.peak_tflops"
