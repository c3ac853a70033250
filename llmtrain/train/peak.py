"""Peak FLOP/s of one device, the denominator of MFU.

    python -c "from llmtrain.train.peak import measure_cpu_matmul_peak as m; print(m() / 1e12)"
    peak, source = peak_flops(cfg.train.peak_tflops)

Configured value first (`train.peak_tflops`); else the datasheet dense bf16
peak of the planner's device profile that matches the GPU's name (llmtrain/plan/profiles/*.json, the one
table of peaks); else, on CPU, a measured fp32 matmul peak (llmtrain.plan.measure: the best of several 1024^3
matmuls, 2 n^3 FLOPs each), measured once per machine and cached (`cache_path()`, keyed by the CPU model, its
core count, the OpenMP/MKL thread settings and Paddle's version), so that MFU of the same work is comparable
between runs on one machine (measured at every start it moved 46-73% with the host's load). A run whose MFU
exceeds 1 measures again once and keeps (and caches) the higher value (`remeasure_cpu_peak`). Unknown -> None
(mfu null). MFU on CPU is not comparable across machines.
"""
from __future__ import annotations

import json
import os
import platform
import time
from typing import Callable, Optional

import paddle

from llmtrain.plan.measure import cpu_matmul_peak as measure_cpu_matmul_peak
from llmtrain.plan.profile import datasheet_peak

__all__ = ["cache_path", "cached_cpu_peak", "measure_cpu_matmul_peak", "peak_flops", "remeasure_cpu_peak"]


def cache_path() -> str:
    """$LLMTRAIN_CACHE_DIR/cpu-matmul-peak.json, else under $XDG_CACHE_HOME (default ~/.cache)/llmtrain."""
    base = os.environ.get("LLMTRAIN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmtrain")
    return os.path.join(base, "cpu-matmul-peak.json")


def machine_key() -> str:
    """What a CPU matmul peak depends on: the CPU model, logical cores, thread settings, Paddle's version."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    threads = ",".join(f"{v}={os.environ.get(v, 'unset')}" for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))
    return f"{model} | {os.cpu_count()} cpus | {threads} | paddle {paddle.__version__}"


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            table = json.load(f)
        return table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(path: str, key: str, flops: float) -> bool:
    """Write `flops` for `key` (atomically, beside the other machines' entries); False if the cache is not writable."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        table = _read(path)
        table[key] = {"flops": flops, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def cached_cpu_peak(measure: Callable[[], float] = measure_cpu_matmul_peak) -> tuple[float, str]:
    """(this machine's cached fp32 matmul peak, where it came from); measured and cached on the first call."""
    path, key = cache_path(), machine_key()
    entry = _read(path).get(key)
    if entry and entry.get("flops", 0) > 0:
        return float(entry["flops"]), (f"fp32 matmul peak of this machine, measured {entry.get('measured')}, cached in "
                                       f"{path}; delete it to measure again")
    flops = measure()
    if _store(path, key, flops):
        return flops, f"fp32 matmul peak of this machine, measured now, cached in {path}"
    return flops, f"fp32 matmul peak measured now ({path} not writable: measured again at every start)"


def remeasure_cpu_peak(measure: Callable[[], float] = measure_cpu_matmul_peak) -> float:
    """Measure again (MFU came out above 1: the cached peak was measured under load); cache it if higher."""
    new = measure()
    path, key = cache_path(), machine_key()
    entry = _read(path).get(key) or {}
    if new > entry.get("flops", 0):
        _store(path, key, new)
    return new


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
        return cached_cpu_peak()
    return None, f"unknown device {device!r}: set train.peak_tflops"
