"""Writing a checkpoint: the snapshot of a rank's state, then its atomic write as step_<N>.

    python -m pytest -q tests/checkpoint/test_write_edges.py
    writer = CheckpointWriter(cfg, layout, topo, state, comm, tokenizer)
    snap = writer.snapshot(step, tokens_total, health)   # training thread: host copies, one broadcast, one all-reduce
    writer.write(snap)                                     # no collectives: safe on the background writer

A save's steps are methods, so tests inject failures by patching them from outside (tests/faults/sitecustomize.py
patches `write_shard` and `after_complete`: a kill mid-save, before pruning, a failed write).

The write: every rank writes its shard into `.tmp-step_<N>-<nonce>/` (rank 0 also `state.json`, the manifest
without its file listing) and, last, a `rank_<r>.files` listing (sizes, sha256); rank 0 waits for all listings,
writes the manifest (every file, the listings included), fsyncs and publishes the directory
(`publish`), then prunes; the other ranks wait until step_<N>'s manifest carries this save's nonce. A rank whose
part fails leaves `rank_<r>.failed` (`rendezvous.py`) so the others stop waiting at once; the directory stays
`.tmp-*` and is never loaded. Publishing over an existing step_<N> (a run redoing a step after a rewind)
renames the old one aside, renames the new one in, then moves the old one to `<run.dir>/superseded/<k>/`: at
every moment one complete copy of the step is on disk (`listing.py` finds the aside copy if a crash falls between
the renames), and the replaced copy is kept.
"""
from __future__ import annotations

import functools
import json
import os
import pickle
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import paddle

from llmtrain.checkpoint.health import nonfinite_arrays
from llmtrain.checkpoint.listing import FORMAT, STATE_FILE, fsync_dir, fsync_file, set_aside, write_json
from llmtrain.checkpoint.prune import after_complete
from llmtrain.checkpoint.rendezvous import all_ok, manifest_nonce, mark_failed, save_nonce, wait_for
from llmtrain.checkpoint.shards import collect_shard
from llmtrain.utils.files import chmod_as_created, sha256_file
from llmtrain.utils.log import log0, log_all


@dataclass
class Snapshot:
    """One rank's part of a save, copied out of the training state (see `CheckpointWriter.snapshot`)."""

    step: int
    nonce: int
    final: str
    tmp: str
    tensors: dict
    meta: dict
    rng: dict
    manifest: Optional[dict]
    """Rank 0: everything but the file listing; None on the other ranks."""


def _lora_entry(cfg):
    """Under LoRA the checkpoint stores the adapters alone: their settings and the pointer to the base
    (`model.init_from`, or the seed whose (seed, name) draws made it); None without LoRA."""
    lora = cfg.finetune.lora
    if lora.rank <= 0:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
            "target_modules": list(lora.target_modules), "merge": lora.merge,
            "base": {"init_from": cfg.model.init_from, "seed": cfg.seed}}


def publish(tmp: str, final: str, nonce: int) -> None:
    """Rename the complete `tmp` to `final`; an existing `final` is renamed aside first (restored if the second
    rename fails) and moved to `<run.dir>/superseded/<k>/` last, so one complete copy of the step exists at every
    moment and the replaced one is never deleted."""
    root = os.path.dirname(final)
    aside = None
    if os.path.exists(final):  # an older save of the same step (a resumed or rewound run redoing it)
        aside = os.path.join(root, f".replaced-{os.path.basename(final)}-{nonce}")
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        if aside is not None and not os.path.exists(final):
            os.rename(aside, final)
        raise
    fsync_dir(root)
    if aside is not None:
        where = set_aside([aside], os.path.dirname(root), f"{os.path.basename(final)} was saved again (a run "
                          f"redoing the step after a rewind or a resume); this is the copy it replaced.")
        log0(f"{final} saved again: the copy it replaced is now {where}/checkpoints/{os.path.basename(final)}")


LAYOUT_FIELDS = ("dp", "tp", "pp", "sharding", "sharding_stage", "virtual_pp", "cp", "ep", "sequence_parallel")


def layout_entry(layout) -> dict:
    """The manifest's `layout`: every degree the layout's name is made of (`parallel.config.layout_tag` names a cp2
    checkpoint `cp2`, not `single`)."""
    return {k: getattr(layout, k) for k in LAYOUT_FIELDS} | {"pp_layers": list(layout.pp_layers)}  # the split it was
    # saved under (tensors are whole)


class CheckpointWriter:
    """Snapshots and writes this rank's part of each save (rank 0 also the manifest, the rename, the pruning)."""

    def __init__(self, cfg, layout, topo, state, comm, tokenizer=None, buffers=None):
        self.cfg, self.layout, self.topo, self.state, self.comm = cfg, layout, topo, state, comm
        self.tokenizer, self.buffers = tokenizer, buffers
        self.root = os.path.join(cfg.run.dir, "checkpoints")

    def snapshot(self, step: int, tokens_total: int, health: Optional[dict] = None) -> Optional[Snapshot]:
        """Everything a save writes, copied out of the training state (training thread; one broadcast and one
        all-reduce); None on every rank when any rank's copy holds NaN/inf (the save is refused)."""
        nonce = save_nonce(self.comm, self.topo.rank)
        if self.buffers is not None:
            self.buffers.start()  # the previous write is complete (save() waited): its buffers are free again
        tensors, meta = collect_shard(self.state.tensors, self.topo, self.layout, self.buffers)  # numpy copies
        bad = nonfinite_arrays(tensors)  # divergence guard: never write a non-finite state (health.py)
        if bad:
            log_all(f"checkpoint step {step}: non-finite values in {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
        if not all_ok(self.comm, not bad):
            log0(f"checkpoint step {step} NOT saved: the state holds NaN/inf; the existing checkpoints are kept")
            return None
        rng = {"paddle": paddle.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        manifest = self.manifest(step, tokens_total) if self.topo.rank == 0 else None
        if manifest is not None:  # the step's loss, grad norm and verdict (divergence guard)
            manifest["health"] = health or {"status": "healthy", "loss": None, "grad_norm": None, "anomaly": []}
        return Snapshot(step, nonce, os.path.join(self.root, f"step_{step}"),
                        os.path.join(self.root, f".tmp-step_{step}-{nonce}"), tensors, meta, rng, manifest)

    def write(self, snap: Snapshot) -> str:
        """Write a snapshot as step_<N>, atomically; returns its path."""
        rank = self.topo.rank
        try:
            self.write_shard(snap)
            if rank == 0:
                self._complete(snap)
        except BaseException as e:
            mark_failed(snap.tmp, rank, e)  # the ranks waiting on this save see it at their next poll
            raise
        if rank == 0:
            self.after_complete(snap.step)
        else:
            wait_for(f"manifest of {snap.final}", lambda: manifest_nonce(snap.final) == snap.nonce, snap.tmp,
                     self.cfg.checkpoint.timeout_minutes)
        return snap.final

    def _complete(self, snap: Snapshot) -> None:
        """Rank 0: every rank's listing, then the manifest, then the directory published as step_<N>."""
        listings = [os.path.join(snap.tmp, f"rank_{r:05d}.files") for r in range(self.topo.world)]
        wait_for(f"shards of {snap.tmp}", lambda: all(os.path.exists(p) for p in listings), snap.tmp,
                 self.cfg.checkpoint.timeout_minutes)
        all_files = {}
        for listing in listings:  # kept in the checkpoint: they let `rebuild.py` restore a damaged manifest
            with open(listing) as f:
                all_files.update(json.load(f))
            all_files[os.path.basename(listing)] = {"size": os.path.getsize(listing), "sha256": sha256_file(listing)}
        self.write_manifest(snap.tmp, dict(snap.manifest, files=all_files, save_nonce=snap.nonce))
        fsync_dir(snap.tmp)
        publish(snap.tmp, snap.final, snap.nonce)
        log0(f"checkpoint saved: {snap.final} ({sum(v['size'] for v in all_files.values()) / 1e6:.1f} MB)")

    def write_manifest(self, tmp: str, manifest: dict) -> None:
        """Rank 0: manifest.json of the save, written last."""
        write_json(os.path.join(tmp, "manifest.json"), manifest)

    def after_complete(self, step: int) -> None:
        """Rank 0, once step_<step> is complete: interrupted saves are superseded, older checkpoints pruned."""
        after_complete(self.root, step, self.cfg.checkpoint.keep_last)

    def write_shard(self, snap: Snapshot) -> None:
        """This rank's tensors, metadata and RNG states into the save's temporary directory, then their listing."""
        from safetensors.numpy import save_file

        os.makedirs(snap.tmp, exist_ok=True)
        stem = os.path.join(snap.tmp, f"rank_{self.topo.rank:05d}")
        save_file(snap.tensors, stem + ".safetensors")
        chmod_as_created(stem + ".safetensors")  # save_file creates it 0600
        write_json(stem + ".json", {"rank": self.topo.rank, "tensors": snap.meta})
        with open(stem + ".rng", "wb") as f:  # our own pickle, read back only from inside the run directory
            pickle.dump(snap.rng, f)
        paths = [stem + ext for ext in (".safetensors", ".json", ".rng")]
        if snap.manifest is not None:  # rank 0: the manifest but its file listing, a copy `rebuild.py` can use
            write_json(os.path.join(snap.tmp, STATE_FILE), dict(snap.manifest, save_nonce=snap.nonce))
            paths.append(os.path.join(snap.tmp, STATE_FILE))
        files = {}
        for path in paths:
            fsync_file(path)
            files[os.path.basename(path)] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
        write_json(stem + ".files.part", files)
        os.replace(stem + ".files.part", stem + ".files")  # the listing appears whole, and last

    @functools.cached_property
    def _config_entries(self) -> dict:
        """The manifest's `model` and `config` (the resolved config is frozen: built once per run, not per save)."""
        from omegaconf import OmegaConf

        return {"model": OmegaConf.to_container(OmegaConf.structured(self.cfg.model)),
                "config": OmegaConf.to_yaml(OmegaConf.structured(self.cfg))}

    def manifest(self, step: int, tokens_total: int) -> dict:
        """Rank 0's manifest of a save, without its file listing."""
        manifest = {"format": FORMAT, "step": step, "tokens_total": int(tokens_total)}
        for component in self.state.components:  # the schedule, the loss scaler, the data position, skip windows
            manifest.update(component.state_dict())
        return manifest | {
            "layout": layout_entry(self.layout),
            "world": self.topo.world,
            **self._config_entries,
            "tokenizer": self.tokenizer.identity() if self.tokenizer is not None else None,
            "lora": _lora_entry(self.cfg),
            "files": {},
        }
