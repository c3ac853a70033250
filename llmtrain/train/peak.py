"""Peak FLOP/s of one device, the denominator of MFU.

    python -c "from llmtrain.train.peak import measure_cpu_matmul_peak as m; print(m() / 1e12)"

Configured value first (`train.peak_tflops`); else the datasheet dense bf16
peak of the planner's device profile that matches the GPU's name (llmtrain/plan/profiles/*.json, the one
table of peaks); else, on CPU, a measured fp32 matmul peak of this process (llmtrain.plan.measure: the best
of several 1024^3 matmuls, 2 n^3 FLOPs each). Unknown -> None (mfu null).
"""
from __future__ import annotations

from typing import Optional

import paddle

from llmtrain.plan.measure import cpu_matmul_peak as measure_cpu_matmul_peak
from llmtrain.plan.profile import datasheet_peak

__all__ = ["measure_cpu_matmul_peak", "peak_flops"]


def peak_flops(configured_tflops: Optional[float]) -> tuple[Optional[float], str]:
    """(peak FLOP/s or None, where it came from)."""
    if configured_tflops:
        return configured_tflops * 1e12, "config train.peak_tflops"
    device = paddle.get_device()
    if device.startswith("gpu"):
        name = paddle.device.cuda.get_device_name()  # GPU-ONLY(peak-table)
        found = datasheet_peak(name)
        if found is not None:
            return found[0], f"datasheet bf16 dense peak of {name} (plan profile {found[1]})"
        return None, f"unknown GPU {name!r}: set train.peak_tflops"
    if device == "cpu":
        return measure_cpu_matmul_peak(), "measured fp32 matmul peak (CPU)"
    return None, f"unknown device {device!r}: set train.peak_tflops"
