"""Keep freed host memory in the process, as a caching allocator does on a GPU (CPU runs only).

    from llmtrain.paddle_compat.cpu_backend.host_allocator import keep_freed_memory
    keep_freed_memory()        # once per process, before the first large tensor; True if applied

Why: on a GPU, Paddle's auto-growth allocator keeps freed device memory and hands it to the next tensor. On a
CPU, Paddle 3.3.1 allocates each tensor with the C library's allocator and frees it straight back, and glibc
gives large freed blocks back to the OS (blocks above its mmap threshold are unmapped on free; the threshold
and the heap-trim threshold move with the sizes freed before), so a new tensor of such a size takes one page
fault per 4 KiB page the first time it is written (the kernel zeroes each page). Measured on this project's
2-core CI machine, one thread, `x - y`: over [512, 4096] fp32, 7.5 ms with 2049 faults per call vs 1.2 ms with
none; over [4096, 4096], 52 ms vs 12 ms; while [256, 8000] (not much smaller) took no faults with the defaults.
A gpt-tiny step (vocabulary 16000, seq 128, micro-batch 2; two interleaved rounds) took 0.85 / 1.13 s with the
defaults and 0.77 / 0.89 s with this, under tp2 1.20 / 0.99 s and 0.94 / 0.84 s. Which sizes fault depends on
the sizes freed before, so CPU step times, and the planner's CPU calibration of the same ops, moved by tens of
percent for no reason in the model.

What it does: `mallopt(M_MMAP_MAX, 0)` (no block comes from mmap: every request is served from the heap and its
free list) and `mallopt(M_TRIM_THRESHOLD, 1 GiB)` (the heap's top is not returned to the OS until a GiB is free
there). The process then holds its peak heap until it exits, as GPU training holds its peak device memory.
Called by `init_distributed` for every CPU run (one process or many) and by the planner's `--calibrate` on a CPU
(in every process it measures in), so the kernels it times and the runs it predicts see the same allocator.
Not glibc (musl, macOS): nothing is changed and it returns False. The GPU path never calls it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 1 << 30
"""Free bytes at the heap's top before glibc gives them back to the OS (1 GiB: a training step's working set
comes and goes well inside it)."""

_APPLIED = False


def keep_freed_memory() -> bool:
    """Apply the settings above once per process; True if applied (now or earlier), False where glibc is absent."""
    global _APPLIED
    if _APPLIED:
        return True
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # mallopt returns 1 on success, 0 on error
    _APPLIED = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _APPLIED
