"""Bytes Paddle's host (CPU) allocator has handed out right now: `paddle.base.core.host_memory_stat_current_value`.

    from llmtrain.paddle_compat.host_memory import host_allocated_bytes, host_peak_bytes
    before = host_allocated_bytes(); out = model(ids); held = host_allocated_bytes() - before
    with host_peak_bytes() as peak: pipe.train_batch(...)      # peak.bytes above the start

Paddle 3.3.1 keeps per-device "Allocated" counters for host memory as for GPU memory, but exposes the host
one only through `paddle.base.core` (no public `paddle.device` function reads it). The planner's CPU
activation checks (llmtrain/plan/activations.py) read it where saved-tensor hooks cannot be used: under
non-reentrant recompute, which installs its own hooks (Paddle allows one pair at a time), and inside fleet's
pipeline schedule, where the peak counter (`host_memory_stat_peak_value`, reset by
`host_memory_stat_reset_peak_value`) shows how many micro-batches a stage holds.
"""
from __future__ import annotations

import contextlib
import gc

from llmtrain.paddle_compat.version import require_tested_paddle


@contextlib.contextmanager
def no_collection():
    """`with no_collection(): before = ...; out = model(ids); held = ... - before`: Python's cyclic collector runs
    once before the block and not inside it, so tensors of earlier work that a collection would free inside the
    window cannot move an allocator-counter difference (host or GPU). Measured without it: in a dp2 launch that
    trains several runs in one process, one rank's bytes held for the backward read 16.6 MB off (17.4 MB for
    0.79 MB), a collection of an earlier run's tensors falling inside the forward."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def host_allocated_bytes() -> int:
    """Bytes currently allocated by Paddle on the host (device 0's counter)."""
    require_tested_paddle()
    from paddle.base import core

    return int(core.host_memory_stat_current_value("Allocated", 0))


class host_peak_bytes:
    """`with host_peak_bytes() as peak: ...` -> `peak.bytes`: the host allocator's peak during the block, above
    what was allocated when it began (Paddle's "Allocated" peak counter, reset on entry)."""

    def __enter__(self):
        require_tested_paddle()
        from paddle.base import core

        core.host_memory_stat_reset_peak_value("Allocated", 0)
        self._start = host_allocated_bytes()
        self.bytes = 0
        return self

    def __exit__(self, *exc):
        from paddle.base import core

        self.bytes = int(core.host_memory_stat_peak_value("Allocated", 0)) - self._start
        return False
