"""Fault injection for the checkpoint tests, from outside the production code.

    env = fault_env(LLMTRAIN_FAULT_KILL_IN_SAVE="4")     # tests/launch.py: puts this folder on PYTHONPATH

Python imports `sitecustomize` at start-up from PYTHONPATH, so every process of a launched
job (launcher, workers, supervisor) runs this file. When `llmtrain.checkpoint.save` is
imported it patches `CheckpointWriter` (`llmtrain.checkpoint.save`) according to these variables:
- LLMTRAIN_FAULT_KILL_IN_SAVE=<step>: rank 0 SIGKILLs itself right after writing its shard of
  that step (shards written, no manifest): what a node failure during a save leaves behind;
- LLMTRAIN_FAULT_KILL_BEFORE_PRUNE=<step>: rank 0 SIGKILLs itself right after that step's
  checkpoint is renamed complete, before older ones are pruned;
- LLMTRAIN_FAULT_WRITE_ERROR=<step>:<rank>: that rank's write of that step raises OSError
  (a full disk).
With checkpoint.async_save they fire on the background writer. The two kills fire on the
first attempt of `scripts/supervise.py` only (LLMTRAIN_ATTEMPT=0), so the relaunch can finish.
"""
import importlib.abc
import os
import signal
import sys

TARGET = "llmtrain.checkpoint.save"
FAULTS = ("LLMTRAIN_FAULT_KILL_IN_SAVE", "LLMTRAIN_FAULT_KILL_BEFORE_PRUNE", "LLMTRAIN_FAULT_WRITE_ERROR")


def _first_attempt_at(name: str, step: int) -> bool:
    return os.environ.get(name) == str(step) and os.environ.get("LLMTRAIN_ATTEMPT", "0") == "0"


def _install(module) -> None:
    cls = module.CheckpointWriter
    write_shard, after_complete = cls.write_shard, cls.after_complete

    def _write_shard(self, snap):
        fail = os.environ.get("LLMTRAIN_FAULT_WRITE_ERROR")
        if fail == f"{snap.step}:{self.topo.rank}":
            os.makedirs(snap.tmp, exist_ok=True)  # where the failing rank leaves its rank_<r>.failed
            raise OSError(f"LLMTRAIN_FAULT_WRITE_ERROR={fail}: injected write failure")
        write_shard(self, snap)
        if self.topo.rank == 0 and _first_attempt_at("LLMTRAIN_FAULT_KILL_IN_SAVE", snap.step):
            os.kill(os.getpid(), signal.SIGKILL)

    def _after_complete(self, step):
        if _first_attempt_at("LLMTRAIN_FAULT_KILL_BEFORE_PRUNE", step):
            os.kill(os.getpid(), signal.SIGKILL)
        after_complete(self, step)

    cls.write_shard, cls.after_complete = _write_shard, _after_complete


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the checkpoint manager through the other finders and patches it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _install(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if any(os.environ.get(f) for f in FAULTS):
    sys.meta_path.insert(0, _PatchOnImport())
