"""Graceful stop on SIGTERM / SIGINT: finish the step, save, exit 0.

    stop = StopRequest().install(); ...; if stop.agreed(world): save and break

The flag is combined over all ranks each step (one tiny all-reduce), so every
rank stops after the same step even if only some received the signal.
"""
from __future__ import annotations

import signal

import paddle
import paddle.distributed as dist

from llmtrain.utils.log import log_all


class StopRequest:
    def __init__(self):
        self.requested = False
        self.signal_name = None

    def install(self) -> "StopRequest":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
            log_all(f"{self.signal_name} received: finishing this step, saving a checkpoint, then exiting")
        self.requested = True

    def agreed(self, world: int) -> bool:
        """True on every rank if any rank was asked to stop."""
        if world == 1:
            return self.requested
        t = paddle.to_tensor([1 if self.requested else 0], dtype="int32")
        dist.all_reduce(t)
        self.requested = int(t.item()) > 0
        return self.requested
