"""Test-side injection for tests/checkpoint/test_resume.py: a deliberately slow checkpoint writer.

    [{"call": "tests/checkpoint/slow_writer.py:install", "args": [2, 2.0]}, {"overrides": [...]}, ...]   # runs.json

Called in the launched process (tests/e2e/multirun_worker.py) before the runs: every rank's write of step `step`
(`CheckpointWriter.write`: shards, listing, manifest, rename) first sleeps `delay_s` seconds, wherever it runs (the
training thread for a synchronous save, the background writer for checkpoint.async_save=true). The time the
training thread spends in each `Checkpointer.save` is appended to `<run.dir>/save_pauses.<rank>.jsonl`.
"""
from __future__ import annotations

import json
import os
import time


def install(step: int, delay_s: float) -> None:
    from llmtrain.checkpoint.manager import Checkpointer
    from llmtrain.checkpoint.save import CheckpointWriter

    write, save = CheckpointWriter.write, Checkpointer.save

    def slow_write(self, snap):
        if snap.step == step:
            time.sleep(delay_s)
        return write(self, snap)

    def timed_save(self, at: int, tokens_total: int, **kwargs):  # kwargs: the step's health (divergence guard)
        t0 = time.perf_counter()
        path = save(self, at, tokens_total, **kwargs)
        pause = time.perf_counter() - t0
        with open(os.path.join(self.cfg.run.dir, f"save_pauses.{self.topo.rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": at, "pause_s": pause}) + "\n")
        return path

    CheckpointWriter.write, Checkpointer.save = slow_write, timed_save
