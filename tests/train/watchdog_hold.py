"""Test-side injection for tests/train/test_watchdog.py: rank 0 stops after a step where only the watchdog can end it.

    [{"call": "tests/train/watchdog_hold.py:install", "args": [5, "/tmp/held"]}, {"overrides": [...]}]   # runs.json

Called in the launched process (tests/e2e/multirun_worker.py) before the run: after step `step`, rank 0's
training thread writes `marker` and sleeps for good, outside any collective and any gloo call (so neither a
connection reset nor gloo's timeout can end it); its watchdog thread keeps running.
"""
from __future__ import annotations

import time


def install(step: int, marker: str) -> None:
    from llmtrain.train.watchdog import Watchdog

    progress = Watchdog.progress

    def hold_after(self, done: int) -> None:
        progress(self, done)
        if self.topo.rank == 0 and done == step:
            with open(marker, "w") as f:
                f.write(str(done))
            while True:  # only another thread (the watchdog's os._exit) can end this process now
                time.sleep(3600)

    Watchdog.progress = hold_after
