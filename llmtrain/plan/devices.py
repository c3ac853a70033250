"""Device profiles of the planner: one set of constants per device, each with its source.

    python -m llmtrain.plan plan.device=h100 ...      # PROFILES["h100"]

Peaks are dense bf16 tensor-core FLOP/s from the vendor datasheets (no sparsity). Link
bandwidths are per device and per direction (the figure a ring collective's beta uses):
NVLink = the datasheet's total NVLink bandwidth / 2; the network = the node's HCAs / 8
(8 x 200 Gb/s HDR for A100/A800 systems = 25 GB/s per GPU, 8 x 400 Gb/s NDR for Hopper =
50 GB/s). alpha: per-message latency of NCCL (a few microseconds on NVLink, ~10 us across
IB). `efficiency` is the fraction of the peak a large bf16 GEMM-dominated transformer step
reaches in the compute part, one constant for every GPU profile (0.6: the order of the
best published MFUs once communication and bubbles are removed; Megatron-LM reports
~0.47-0.52 MFU end to end on H100); it is an assumption, not fitted per data point.
`framework_bytes` is the stated margin for the CUDA context, NCCL buffers and allocator
fragmentation. `cpu-here` is this machine: `python -m llmtrain.plan --calibrate` measures it
(llmtrain/plan/calibrate.py: fp32 matmul peak, gloo all-reduce and send/recv alpha-beta by least
squares, and the all-reduce latency between computing ranks, used as the collectives' alpha) into `plan.profile` (default work/cpu-here.json), which `get_device` then reads. Without that
file the peak is the fp32 matmul peak measured when the profile is read and the gloo figures (1 GB/s,
200 us) are ASSUMED.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Optional

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float
    """Dense FLOP/s of one device in the training dtype."""
    memory_bytes: float
    nvlink_bw: float
    """Bytes/s per direction between two devices of one node."""
    net_bw: float
    """Bytes/s per device per direction across nodes."""
    nvlink_alpha: float = 5e-6
    net_alpha: float = 10e-6
    efficiency: float = 0.6
    framework_bytes: float = 2.0 * GIB
    dtype_bytes: int = 2
    source: str = ""
    p2p_bw: Optional[float] = None
    """Bytes/s of one pipeline send/recv when measured apart from collectives (None: the link's bandwidth)."""
    p2p_alpha: Optional[float] = None
    """Seconds per pipeline send/recv message when measured (None: the link's alpha)."""


PROFILES = {
    "a100-40g": Device("a100-40g", 312e12, 40 * GIB, 300 * GB, 25 * GB,
                       source="NVIDIA A100 datasheet: 312 TFLOP/s bf16, 40 GB, NVLink 600 GB/s; HDR 200 Gb/s per GPU"),
    "a100-80g": Device("a100-80g", 312e12, 80 * GIB, 300 * GB, 25 * GB,
                       source="NVIDIA A100 datasheet: 312 TFLOP/s bf16, 80 GB, NVLink 600 GB/s; HDR 200 Gb/s per GPU"),
    "a800": Device("a800", 312e12, 80 * GIB, 200 * GB, 25 * GB,
                   source="NVIDIA A800 datasheet: 312 TFLOP/s bf16, 80 GB, NVLink 400 GB/s; HDR 200 Gb/s per GPU"),
    "h100": Device("h100", 989e12, 80 * GIB, 450 * GB, 50 * GB,
                   source="NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense, 80 GB, NVLink 900 GB/s; NDR 400 Gb/s per GPU"),
    "h800": Device("h800", 989e12, 80 * GIB, 200 * GB, 50 * GB,
                   source="NVIDIA H800 SXM: 989 TFLOP/s bf16 dense, 80 GB, NVLink 400 GB/s; NDR 400 Gb/s per GPU"),
    "h200": Device("h200", 989e12, 141 * GB, 450 * GB, 50 * GB,
                   source="NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense, 141 GB, NVLink 900 GB/s; NDR 400 Gb/s per GPU"),
    "h20": Device("h20", 148e12, 96 * GB, 450 * GB, 50 * GB,
                  source="NVIDIA H20: 148 TFLOP/s bf16 dense, 96 GB, NVLink 900 GB/s; NDR 400 Gb/s per GPU"),
    # this machine: fp32, gloo over loopback TCP; bandwidth/latency from one gloo all-reduce measurement
    "cpu-here": Device("cpu-here", 0.0, 8 * GIB, 1.0 * GB, 1.0 * GB, nvlink_alpha=200e-6, net_alpha=200e-6,
                       efficiency=0.5, framework_bytes=0.0, dtype_bytes=4,
                       source="peak: fp32 matmul measured at start-up (llmtrain.train.peak); gloo: assumed 1 GB/s, 200 us"),
}


def calibrated(dev: Device, path: str) -> Device:
    """`dev` with the figures `python -m llmtrain.plan --calibrate` wrote to `path` (calibrate.py)."""
    with open(path) as f:
        p = json.load(f)
    need = ("peak_flops", "collective_bw", "collective_alpha", "p2p_bw", "p2p_alpha")
    bad = [k for k in need if not isinstance(p.get(k), (int, float)) or p[k] <= 0]
    if bad:
        raise ValueError(f"{path}: calibrated profile lacks positive {bad}; run python -m llmtrain.plan --calibrate")
    alpha = p.get("collective_alpha_busy", p["collective_alpha"])  # between computing ranks (older files: quiet)
    return replace(dev, peak_flops=dev.peak_flops or float(p["peak_flops"]), nvlink_bw=p["collective_bw"],
                   net_bw=p["collective_bw"], nvlink_alpha=alpha, net_alpha=alpha,
                   p2p_bw=p["p2p_bw"], p2p_alpha=p["p2p_alpha"],
                   source=f"calibrated {p.get('measured_at', '?')} ({path}): fp32 matmul, gloo all-reduce and send/recv "
                          "alpha-beta measured on 2 processes")


def get_device(name: str, profile: Optional[str] = None) -> Device:
    """The profile `name`; for cpu-here, the calibrated figures in `profile` when that file exists."""
    if name not in PROFILES:
        raise ValueError(f"plan.device={name!r}: expected one of {sorted(PROFILES)}")
    dev = PROFILES[name]
    if name == "cpu-here" and profile and os.path.exists(profile):
        return calibrated(dev, profile)
    if dev.peak_flops == 0.0:  # cpu-here: the measured fp32 matmul peak of this process
        from llmtrain.train.peak import measure_cpu_matmul_peak

        dev = replace(dev, peak_flops=measure_cpu_matmul_peak())
    return dev
