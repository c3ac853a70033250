"""Atomic, verifiable, layout-free checkpoints: the one object the trainer and the divergence guard use.

    state = training_state(named_params, model, optimizer, scheduler, scaler, data)   # checkpoint/state.py
    ckpt = Checkpointer(cfg, layout, topo, state, tokenizer)
    state = ckpt.resume()            # newest complete checkpoint, any layout; skips corrupt ones
    ckpt.save(step, tokens_total)    # every rank writes its shard in parallel (async_save: in the background)
    ckpt.rewind_target(before)       # the divergence guard: the newest verified healthy checkpoint <= before
    ckpt.close()                     # end of run: the last background write is complete

Layout of `<run.dir>/checkpoints/step_<N>/`:
    rank_<r>.safetensors   this rank's tensors (see `shards.py` for the keys)
    rank_<r>.json          their metadata (global shape, split axis, offset)
    rank_<r>.rng           this rank's RNG states (our own pickle, inside the run dir)
    manifest.json          step, tokens, data state, LR schedule, layout, config, tokenizer identity, the
                           divergence guard's health and skipped windows, and size + sha256 of every file
All ranks must see one filesystem (one node, or shared storage). The jobs live in their own modules:
`save.py` (snapshot and atomic write), `rendezvous.py` (how the ranks of a save meet, failure markers),
`prune.py` (keep_last), `resume.py` (which checkpoint every rank loads), `verify.py` (complete and intact),
`restore.py` (slicing for this rank's layout), `listing.py` (the directory), `health.py` (the guard's verdicts).
What is saved comes from components (`state.py`): the trained parameters and the optimizer's accumulators as
pieces of full tensors in each rank's shard; the schedule, the loss scaler, the data position and the skipped
windows as manifest entries. Loading reads the manifest (the resume contract may refuse it), then the tensors,
the manifest components and the RNG states.
"""
from __future__ import annotations

import contextlib
import glob
import os
import time
from dataclasses import dataclass
from typing import Optional

import paddle

from llmtrain.checkpoint.background import CheckpointWriteError
from llmtrain.checkpoint.health import newest_healthy
from llmtrain.checkpoint.listing import SUPERSEDED, amend_manifest, list_checkpoints, read_manifest, set_aside
from llmtrain.checkpoint.restore import LayoutRestorer
from llmtrain.checkpoint.resume import CheckpointChooser
from llmtrain.checkpoint.save import CheckpointWriter
from llmtrain.checkpoint.shards import HostBuffers
from llmtrain.checkpoint.state import TrainingState
from llmtrain.checkpoint.verify import verify_files
from llmtrain.errors import CheckpointSaveError, ConfigError
from llmtrain.parallel.config import layout_tag
from llmtrain.parallel.job_comm import JobComm
from llmtrain.utils.log import log0, log_all


@dataclass
class ResumeState:
    """Where a run starts: the loaded checkpoint's step and token count (0 and None for a fresh run)."""

    step: int = 0
    tokens_total: int = 0
    path: Optional[str] = None


class Checkpointer:
    """Saves, resumes and reloads this rank's part of the training state (every rank holds one, all call alike)."""

    def __init__(self, cfg, layout, topo, state: TrainingState, tokenizer=None, on_manifest=None, comm=None):
        """`state`: what a checkpoint holds (`llmtrain.checkpoint.state.training_state`). `on_manifest(manifest)`:
        called before a checkpoint's tensors are read (the resume contract); it may raise to refuse the resume and
        may change the scheduler's schedule. `comm`: the job's collectives (default `JobComm(topo.world)`)."""
        self.cfg, self.layout, self.topo, self.state = cfg, layout, topo, state
        self.on_manifest = on_manifest
        self.comm = comm or JobComm(topo.world)
        self.root = os.path.join(cfg.run.dir, "checkpoints")
        self.last_saved_step = -1
        self.stalls: list[float] = []  # seconds the training thread spent in each save()
        self.writer = None
        buffers = None  # async saves: host arrays reused by every save's copy (shards.HostBuffers)
        if getattr(cfg.checkpoint, "async_save", False):
            from llmtrain.checkpoint.background import BackgroundWriter

            if paddle.get_device() == "cpu":
                buffers = HostBuffers()
            else:  # each tensor's .numpy() is the device-to-host copy, into an array it owns: no reused host buffers
                buffers = None  # GPU-ONLY(async-save-device-copy)
        self.files = CheckpointWriter(cfg, layout, topo, state, self.comm, tokenizer, buffers)
        if getattr(cfg.checkpoint, "async_save", False):
            self.writer = BackgroundWriter(self.files.write)
        self.chooser = CheckpointChooser(self.root, topo, self.comm)
        self.restorer = LayoutRestorer(layout, topo, state)

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.interval
        return every > 0 and step % every == 0

    # ---- save ----
    def save(self, step: int, tokens_total: int, health: Optional[dict] = None) -> Optional[str]:
        """Write step_<step> atomically; returns its path (None: refused, the state is not finite).

        `health`: the divergence guard's verdict of the step, recorded in the manifest (`health.py`).

        With checkpoint.async_save the step pays only for the snapshot (host copies of this
        rank's tensors, one broadcast of the save's nonce); the persistent background writer
        writes it while training goes on. The previous write is waited for first."""
        t0 = time.perf_counter()
        self.wait()  # the previous write (and its pruning) is complete, or its failure raises here
        t1 = time.perf_counter()
        snap = self.files.snapshot(step, tokens_total, health)
        if snap is None:  # divergence guard: a non-finite state is never written (every rank agreed)
            return None
        self.last_saved_step = step
        t2 = time.perf_counter()
        if self.writer is not None:
            self.writer.submit(snap)
            path = snap.final
        else:
            with self._stop_on_failure(step):
                path = self.files.write(snap)
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        log_all(f"checkpoint step {step}: training paused {stall:.3f} s (waiting for the previous write {t1 - t0:.3f} s, "
                f"copying the state {t2 - t1:.3f} s{'' if self.writer else f', writing {stall - (t2 - t0):.3f} s'})")
        return path

    def prepare(self) -> None:
        """After the first optimizer step (the state's shapes are known): async saves on CPU allocate and touch
        their host buffers in the background, so the first save's copy does not pay for fresh memory."""
        if self.files.buffers is not None:
            self.files.buffers.reserve(HostBuffers.shapes(self.state.tensors, self.topo, self.layout))

    def wait(self) -> None:
        """Block until the background write (if any) is complete; raises CheckpointSaveError if it failed."""
        if self.writer is not None:
            with self._stop_on_failure(self.last_saved_step):
                self.writer.wait()

    def close(self) -> None:
        """Wait for the last write and stop the background writer (end of run, SIGTERM)."""
        if self.writer is not None:
            with self._stop_on_failure(self.last_saved_step):
                self.writer.close()

    @contextlib.contextmanager
    def _stop_on_failure(self, step: int):
        """A failed write (this rank's files, another rank's marker, a timeout) becomes a CheckpointSaveError naming
        the cause and the newest complete checkpoint, which the atomic write left intact."""
        try:
            yield
        except Exception as e:  # noqa: BLE001  (any failure of the write stops the run the same way)
            cause = e.__cause__ if isinstance(e, CheckpointWriteError) and e.__cause__ is not None else e
            good = next(((s, p) for s, p in list_checkpoints(self.root) if not verify_files(p, names=[])), None)
            raise CheckpointSaveError(
                f"checkpoint step {step} could not be written ({type(cause).__name__}: {cause}); the run stopped "
                f"there and nothing of that save was published. The newest complete checkpoint is "
                + (f"{good[1]} (step {good[0]}), intact" if good else "none")
                + f"; fix the cause (free space or permissions under {self.root}) and run the same command again to "
                "continue" + (" from it" if good else "")) from e

    # ---- resume and reload ----
    def resume(self) -> ResumeState:
        """Load the newest complete checkpoint (reporting and skipping bad ones); fresh state if none."""
        how = self.cfg.checkpoint.resume
        if how == "none":
            return ResumeState()
        if how != "auto" and not os.path.isdir(how):
            raise FileNotFoundError(f"checkpoint.resume={how}: no such checkpoint directory")

        failed = []

        def skipped(path):
            if how != "auto":
                raise ConfigError([f"checkpoint.resume={path}: the checkpoint is incomplete or corrupt (see above); "
                                   "nothing was changed"])
            failed.append(path)
            log0(f"skipping corrupt or incomplete checkpoint {path} (kept; the run continues from an older one)")

        found = self.chooser.first_verified(self.chooser.resume_candidates(how), on_failure=skipped)
        if found is None and failed:  # never a fresh start over damaged checkpoints: they would be replaced
            raise ConfigError([f"{self.root}: every checkpoint failed verification ({', '.join(failed)}; see above), "
                               "so there is nothing to continue and nothing was changed. Start a new run in another "
                               "run.dir, or run.overwrite=true to move this one aside (nothing is deleted)"])
        if found is not None and failed:  # older than planned: the later ones are set aside, as at a branch
            self._set_later_aside(found[0], failed)
        return ResumeState() if found is None else self.load(found[1])

    def _set_later_aside(self, step: int, failed: list) -> None:
        """Rank 0 moves the checkpoints after `step` to `<run.dir>/superseded/<k>/`; every rank waits for it (the
        listings read next must agree)."""
        later = [p for s, p in list_checkpoints(self.root) if s > step]
        if self.topo.rank == 0 and later:
            where = set_aside(later, os.path.dirname(self.root),
                              f"The run resumed from step {step}: these later checkpoints were set aside ("
                              f"{', '.join(failed)} failed verification, see the log).")
            log0(f"resuming from step {step}: the later checkpoints are now in {where}/checkpoints (nothing deleted)")
        self.comm.broadcast_ints([len(later)] if self.topo.rank == 0 else None)

    def rewind_target(self, before: int) -> Optional[tuple[int, str]]:
        """(step, path) of the newest healthy checkpoint at or before step `before` that every rank verified, rank
        0's choice on every rank (a failing one is reported and the next older healthy one tried); None if none."""
        return self.chooser.first_verified(
            self.chooser.rewind_candidates(before),
            on_failure=lambda p: log0(f"rewind: {p} is incomplete or corrupt (see above); trying the next older "
                                      f"healthy checkpoint"))

    def load(self, path: str) -> ResumeState:
        """Restore this rank from `path`: the manifest (and the resume contract), the parameters, the optimizer
        state, the manifest components (schedule, scaler, data position, skipped windows), the RNG states."""
        manifest = read_manifest(path)
        if manifest is None:
            raise FileNotFoundError(f"{path}: no readable manifest.json")
        if self.on_manifest is not None:
            self.on_manifest(manifest)
        self.restorer.tensors(path, manifest)
        for component in self.state.components:
            component.load_state_dict(manifest)
        self.restorer.rng(path, manifest)
        log0(
            f"resumed from {path}: step {manifest['step']}, {manifest['tokens_total']} tokens, "
            f"written under {layout_tag(manifest['layout'])} (world {manifest['world']}), now {self.layout.name} "
            f"(world {self.topo.world})"
        )
        self.last_saved_step = manifest["step"]
        return ResumeState(step=manifest["step"], tokens_total=manifest["tokens_total"], path=path)

    # ---- what the manifests say ----
    def newest_healthy(self) -> Optional[tuple[int, str]]:
        """(step, path) of the newest checkpoint whose manifest says healthy (this rank's listing: for messages)."""
        return newest_healthy(list_checkpoints(self.root))

    def recorded(self, key: str) -> list:
        """The value of `key` in every readable manifest of the run directory, its checkpoints newest first, then
        those set aside under `superseded/` (absent keys left out). Read at resume, when no save is in flight, so
        every rank reads the same files."""
        out = []
        aside = glob.glob(os.path.join(os.path.dirname(self.root), SUPERSEDED, "*", "checkpoints", "step_*"))
        for path in [p for _, p in list_checkpoints(self.root)] + sorted(aside):  # set-aside lines of steps too
            m = read_manifest(path)
            if m is not None and m.get(key) is not None:
                out.append(m[key])
        return out

    def amend_manifest(self, path: str, entries: dict) -> None:
        """Rank 0 merges `entries` into the manifest of the complete checkpoint `path` (atomically); other ranks
        do nothing."""
        if self.topo.rank == 0:
            amend_manifest(path, entries)
