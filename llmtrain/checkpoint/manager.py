"""Atomic, verifiable, layout-free checkpoints: save, prune, resume.

    state = training_state(named_params, model, optimizer, scheduler, scaler, data)   # checkpoint/state.py
    ckpt = Checkpointer(cfg, layout, topo, state, tokenizer)
    state = ckpt.resume()            # newest complete checkpoint, any layout; skips corrupt ones
    ckpt.save(step, tokens_total)    # every rank writes its shard in parallel (async_save: in the background)
    ckpt.close()                     # end of run: the last background write is complete

Layout of `<run.dir>/checkpoints/step_<N>/`:
    rank_<r>.safetensors   this rank's tensors (see `shards.py` for the keys)
    rank_<r>.json          their metadata (global shape, split axis, offset)
    rank_<r>.rng           this rank's RNG states (our own pickle, inside the run dir)
    manifest.json          step, tokens, data state, LR schedule, layout, config,
                           tokenizer identity, and size + sha256 of every file
Atomicity: all ranks write into `.tmp-step_<N>-<nonce>`, fsync, rank 0 writes the
manifest last, fsyncs, and renames the directory (ranks meet through the shared
filesystem, not collectives: gloo's time out after ~30 s, a big save takes longer). A directory without a valid
manifest, with a missing or truncated file or a checksum mismatch is reported
and skipped, never loaded; old checkpoints are deleted only after a newer one
is complete. All ranks must see one filesystem (one node, or shared storage).
Health (`health.py`, the divergence guard): the manifest records the step's loss, grad norm and verdict; a
state holding NaN/inf is never written; pruning keeps the newest healthy checkpoint; resume=auto prefers it.

What is saved comes from components (`state.py`): the trained parameters and the
optimizer's accumulators as pieces of full tensors in each rank's shard, and the
schedule, the loss scaler and the data position as manifest entries. Loading reads
the manifest (the resume contract may refuse it), then the tensors, the optimizer
state, the manifest components and the RNG states, each in its own method. A save's
steps are methods too (`_write_shard`, `_after_rename`), so tests inject failures by
patching them from outside (a kill mid-save, before pruning, a failed write).
"""
from __future__ import annotations

import glob
import json
import os
import pickle
import random
import re
import shutil
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import paddle
import paddle.distributed as dist

from llmtrain.checkpoint.health import newest_healthy, resume_order, state_is_finite
from llmtrain.checkpoint.shards import HostBuffers, ShardIndex, collect_shard, is_split_like_param
from llmtrain.checkpoint.state import TrainingState
from llmtrain.models.init import load_full_state
from llmtrain.paddle_compat.optim import fresh_optimizer_entries, optimizer_state_dict
from llmtrain.paddle_compat.zero import stage3_slices, stage3_storage
from llmtrain.parallel.slicing import TensorSlices, local_slice
from llmtrain.utils.log import log0, log_all
from llmtrain.utils.files import sha256_file

FORMAT = "llmtrain-checkpoint-1"
STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class Snapshot:
    """One rank's part of a save, copied out of the training state (see `Checkpointer.snapshot`)."""

    step: int
    nonce: int
    final: str
    tmp: str
    tensors: dict
    meta: dict
    rng: dict
    manifest: Optional[dict]  # rank 0: everything but the file listing


@dataclass
class ResumeState:
    step: int = 0
    tokens_total: int = 0
    path: Optional[str] = None




def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _manifest_nonce(ckpt_dir: str):
    try:
        with open(os.path.join(ckpt_dir, "manifest.json")) as f:
            return json.load(f).get("save_nonce")
    except (OSError, ValueError):
        return None


def _lora_entry(cfg):
    """Under LoRA the checkpoint stores the adapters alone: their settings and the pointer to the base
    (`model.init_from`, or the seed whose (seed, name) draws made it); None without LoRA."""
    lora = cfg.finetune.lora
    if lora.rank <= 0:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
            "target_modules": list(lora.target_modules), "merge": lora.merge,
            "base": {"init_from": cfg.model.init_from, "seed": cfg.seed}}


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every step_<N> directory under root, newest first."""
    out = []
    for path in glob.glob(os.path.join(root, "step_*")):
        m = STEP_DIR.match(os.path.basename(path))
        if m and os.path.isdir(path):
            out.append((int(m.group(1)), path))
    return sorted(out, reverse=True)


def verify_files(ckpt_dir: str, names: Optional[list[str]] = None) -> list[str]:
    """Problems with a checkpoint directory (empty list: complete and intact).

    Checks the manifest exists and parses, and for each listed file (all, or
    `names`) that it exists, has the recorded size and sha256."""
    manifest_path = os.path.join(ckpt_dir, "manifest.json")
    if not os.path.exists(manifest_path):
        return [f"{ckpt_dir}: no manifest.json (save did not finish)"]
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return [f"{manifest_path}: unreadable ({e})"]
    if manifest.get("format") != FORMAT:
        return [f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT!r}"]
    problems = []
    for name, info in manifest["files"].items():
        if names is not None and name not in names:
            continue
        path = os.path.join(ckpt_dir, name)
        if not os.path.exists(path):
            problems.append(f"{path}: missing")
        elif os.path.getsize(path) != info["size"]:
            problems.append(f"{path}: {os.path.getsize(path)} bytes, manifest says {info['size']} (truncated?)")
        elif sha256_file(path) != info["sha256"]:
            problems.append(f"{path}: sha256 mismatch")
    return problems


class Checkpointer:
    def __init__(self, cfg, layout, topo, state: TrainingState, tokenizer=None, on_manifest=None):
        """`state`: what a checkpoint holds (`llmtrain.checkpoint.state.training_state`). `on_manifest(manifest)`:
        called before a checkpoint's tensors are read (the resume contract); it may raise to refuse the resume and
        may change the scheduler's schedule."""
        self.on_manifest = on_manifest
        self.cfg = cfg
        self.layout = layout
        self.topo = topo
        self.state = state
        self.tokenizer = tokenizer
        self.root = os.path.join(cfg.run.dir, "checkpoints")
        self.last_saved_step = -1
        self.writer = None
        self.buffers = None  # async saves: host arrays reused by every save's copy (shards.HostBuffers)
        self.stalls: list[float] = []  # seconds the training thread spent in each save()
        if getattr(cfg.checkpoint, "async_save", False):
            from llmtrain.checkpoint.background import BackgroundWriter

            self.writer = BackgroundWriter(self.write)
            if paddle.get_device() == "cpu":  # on GPU the copy is .numpy() (device to host), no reused buffers
                self.buffers = HostBuffers()

    # ---- collectives (no-ops on one process) ----
    def _all_ok(self, ok: bool) -> bool:
        if self.topo.world == 1:
            return ok
        t = paddle.to_tensor([0 if ok else 1], dtype="int32")
        dist.all_reduce(t)  # sum of failures
        return int(t.item()) == 0

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.interval
        return every > 0 and step % every == 0

    # ---- save ----
    def _nonce(self) -> int:
        """A number every rank agrees on, naming this save (one quick collective at a step boundary)."""
        t = paddle.to_tensor([random.SystemRandom().randrange(1, 2**62) if self.topo.rank == 0 else 0], dtype="int64")
        if self.topo.world > 1:
            dist.broadcast(t, src=0)
        return int(t.numpy()[0])

    def _wait_for(self, what: str, ready, tmp: str) -> None:
        """Poll the shared filesystem until `ready()`; gloo collectives time out after ~30 s, a big save takes longer.
        Stops early if a rank left `rank_<r>.failed` in the save's temporary directory."""
        deadline = time.time() + 60 * self.cfg.checkpoint.timeout_minutes
        while not ready():
            failed = glob.glob(os.path.join(tmp, "rank_*.failed"))
            if failed:
                raise RuntimeError(f"checkpoint save: {what}: the write failed on "
                                   + ", ".join(f"{os.path.basename(p)[:-7]} ({open(p).read().strip()})" for p in failed))
            if time.time() > deadline:
                raise TimeoutError(f"checkpoint save: {what} not ready after checkpoint.timeout_minutes="
                                   f"{self.cfg.checkpoint.timeout_minutes}")
            time.sleep(0.05)

    def save(self, step: int, tokens_total: int, health: Optional[dict] = None) -> Optional[str]:
        """Write step_<step> atomically; returns its path (None: refused, the state is not finite).

        `health`: the divergence guard's verdict of the step, recorded in the manifest (`health.py`).

        With checkpoint.async_save the step pays only for `snapshot` (host copies of this
        rank's tensors, one broadcast of the save's nonce); the persistent background writer
        runs `write` while training goes on. The previous write is waited for first."""
        t0 = time.perf_counter()
        if self.writer is not None:
            self.writer.wait()  # the previous write (and its pruning) is complete, or its failure raises here
        t1 = time.perf_counter()
        snap = self.snapshot(step, tokens_total, health)
        if snap is None:  # divergence guard: a non-finite state is never written (every rank agreed)
            return None
        self.last_saved_step = step
        t2 = time.perf_counter()
        if self.writer is not None:
            self.writer.submit(snap)
            path = snap.final
        else:
            path = self.write(snap)
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        log_all(f"checkpoint step {step}: training paused {stall:.3f} s (waiting for the previous write {t1 - t0:.3f} s, "
                f"copying the state {t2 - t1:.3f} s{'' if self.writer else f', writing {stall - (t2 - t0):.3f} s'})")
        return path

    def prepare(self) -> None:
        """After the first optimizer step (the state's shapes are known): async saves on CPU allocate and touch
        their host buffers in the background, so the first save's copy does not pay for fresh memory."""
        if self.buffers is not None:
            self.buffers.reserve(HostBuffers.shapes(self.state.tensors, self.topo, self.layout))

    def wait(self) -> None:
        """Block until the background write (if any) is complete; raises if it failed."""
        if self.writer is not None:
            self.writer.wait()

    def close(self) -> None:
        """Wait for the last write and stop the background writer (end of run, SIGTERM)."""
        if self.writer is not None:
            self.writer.close()

    def snapshot(self, step: int, tokens_total: int, health: Optional[dict] = None) -> Optional[Snapshot]:
        """Everything a save writes, copied out of the training state (training thread; one broadcast and one
        all-reduce); None on every rank when any rank's copy holds NaN/inf (the save is refused)."""
        nonce = self._nonce()
        if self.buffers is not None:
            self.buffers.start()  # the previous write is complete (save() waited): its buffers are free again
        tensors, meta = collect_shard(self.state.tensors, self.topo, self.layout, self.buffers)  # numpy copies
        # divergence guard: never write a non-finite state (llmtrain/checkpoint/health.py)
        bad = state_is_finite(tensors)
        if bad:
            log_all(f"checkpoint step {step}: non-finite values in {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
        if not self._all_ok(not bad):
            log0(f"checkpoint step {step} NOT saved: the state holds NaN/inf; the existing checkpoints are kept")
            return None
        rng = {"paddle": paddle.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        manifest = self._manifest(step, tokens_total, {}) if self.topo.rank == 0 else None
        if manifest is not None:  # the step's loss, grad norm and verdict (divergence guard)
            manifest["health"] = health or {"status": "healthy", "loss": None, "grad_norm": None, "anomaly": []}
        return Snapshot(step, nonce, os.path.join(self.root, f"step_{step}"),
                        os.path.join(self.root, f".tmp-step_{step}-{nonce}"), tensors, meta, rng, manifest)

    def write(self, snap: Snapshot) -> str:
        """Write a snapshot as step_<N>, atomically (no collectives: safe on the background writer).

        Every rank writes its shard into `.tmp-step_<step>-<nonce>/` and, last, a
        `rank_<r>.files` listing (sizes, sha256); rank 0 waits for all listings, writes
        the manifest, renames the directory and prunes; the other ranks wait until the
        renamed directory's manifest carries this save's nonce. A rank whose write fails
        leaves `rank_<r>.failed` so the others stop waiting; the directory stays `.tmp-*`."""
        step, nonce, final, tmp = snap.step, snap.nonce, snap.final, snap.tmp
        rank = self.topo.rank
        try:
            self._write_shard(snap)
        except BaseException as e:
            try:
                with open(os.path.join(tmp, f"rank_{rank:05d}.failed"), "w") as f:
                    f.write(f"{type(e).__name__}: {e}\n")
            except OSError:
                pass
            raise
        if rank == 0:
            listings = [os.path.join(tmp, f"rank_{r:05d}.files") for r in range(self.topo.world)]
            self._wait_for(f"shards of {tmp}", lambda: all(os.path.exists(p) for p in listings), tmp)
            all_files = {}
            for listing in listings:
                with open(listing) as f:
                    all_files.update(json.load(f))
                os.remove(listing)
            manifest = dict(snap.manifest, files=all_files, save_nonce=nonce)
            _write_json(os.path.join(tmp, "manifest.json"), manifest)
            _fsync_dir(tmp)
            if os.path.exists(final):  # an older save of the same step (a resumed run redoing it)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._after_rename(step)
            log0(f"checkpoint saved: {final} ({sum(v['size'] for v in all_files.values()) / 1e6:.1f} MB)")
        else:
            self._wait_for(f"manifest of {final}", lambda: _manifest_nonce(final) == nonce, tmp)
        return final

    def _after_rename(self, step: int) -> None:
        """Rank 0, once step_<step> is complete: interrupted saves are superseded, older checkpoints pruned."""
        for stale in glob.glob(os.path.join(self.root, ".tmp-step_*")):
            shutil.rmtree(stale, ignore_errors=True)  # interrupted saves, superseded now
        self._prune(step)

    def _write_shard(self, snap: Snapshot) -> None:
        """This rank's tensors, metadata and RNG states into the save's temporary directory, then their listing."""
        from safetensors.numpy import save_file

        os.makedirs(snap.tmp, exist_ok=True)
        stem = os.path.join(snap.tmp, f"rank_{self.topo.rank:05d}")
        save_file(snap.tensors, stem + ".safetensors")
        _write_json(stem + ".json", {"rank": self.topo.rank, "tensors": snap.meta})
        with open(stem + ".rng", "wb") as f:  # our own pickle, read back only from inside the run directory
            pickle.dump(snap.rng, f)
        files = {}
        for ext in (".safetensors", ".json", ".rng"):
            path = stem + ext
            _fsync_file(path)
            files[os.path.basename(path)] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
        _write_json(stem + ".files.part", files)
        os.replace(stem + ".files.part", stem + ".files")  # the listing appears whole, and last

    def _manifest(self, step: int, tokens_total: int, files: dict) -> dict:
        from omegaconf import OmegaConf

        manifest = {
            "format": FORMAT,
            "step": step,
            "tokens_total": int(tokens_total),
        }
        for component in self.state.components:  # the schedule, the loss scaler, the data position
            manifest.update(component.state_dict())
        return manifest | {
            "layout": {k: getattr(self.layout, k) for k in ("dp", "tp", "pp", "sharding", "sharding_stage", "virtual_pp")},
            "world": self.topo.world,
            "model": OmegaConf.to_container(OmegaConf.structured(self.cfg.model)),
            "config": OmegaConf.to_yaml(OmegaConf.structured(self.cfg)),
            "tokenizer": self.tokenizer.identity() if self.tokenizer is not None else None,
            "lora": _lora_entry(self.cfg),
            "files": files,
        }

    def _prune(self, newest: int) -> None:
        keep = self.cfg.checkpoint.keep_last
        if keep <= 0:
            return
        complete = [(s, p) for s, p in list_checkpoints(self.root) if s <= newest and not verify_files(p, names=[])]
        protect = newest_healthy(complete)  # divergence guard: the newest healthy one survives any keep_last
        for s, path in complete[keep:]:
            if (s, path) == protect:
                log0(f"checkpoint kept beyond keep_last={keep}: {path} is the newest healthy one")
                continue
            shutil.rmtree(path, ignore_errors=True)
            log0(f"checkpoint deleted (keep_last={keep}): {path}")

    # ---- resume ----
    def _candidates(self) -> list[str]:
        how = self.cfg.checkpoint.resume
        if how == "none":
            return []
        if how == "auto":
            for tmp in glob.glob(os.path.join(self.root, ".tmp-step_*")):
                log0(f"ignoring incomplete checkpoint {tmp} (a save was interrupted)")
            ordered, notes = resume_order([p for _, p in list_checkpoints(self.root)])  # healthy ones first
            for note in notes:
                log0(note)
            return ordered
        if not os.path.isdir(how):
            raise FileNotFoundError(f"checkpoint.resume={how}: no such checkpoint directory")
        return [how]

    def _verify_shared(self, path: str) -> bool:
        """Every rank checks a share of the files; all agree on the verdict."""
        problems = verify_files(path, names=[])  # manifest only
        if not problems:
            with open(os.path.join(path, "manifest.json")) as f:
                names = sorted(json.load(f)["files"])
            mine = names[self.topo.rank :: self.topo.world]
            problems = verify_files(path, names=mine)
            if not problems:
                expected = {os.path.basename(p) for p in glob.glob(os.path.join(path, "rank_*"))}
                listed = set(names)
                if expected - listed and self.topo.rank == 0:
                    problems.append(f"{path}: files not in the manifest: {sorted(expected - listed)}")
        for p in problems:
            log_all(f"checkpoint problem: {p}")
        return self._all_ok(not problems)

    def resume(self) -> ResumeState:
        """Load the newest complete checkpoint (reporting and skipping bad ones); fresh state if none."""
        for path in self._candidates():
            if not self._verify_shared(path):
                if self.cfg.checkpoint.resume not in ("auto",):
                    raise RuntimeError(f"checkpoint.resume={path}: the checkpoint is incomplete or corrupt (see above)")
                log0(f"skipping corrupt or incomplete checkpoint {path}")
                continue
            return self.load(path)
        return ResumeState()

    def load(self, path: str) -> ResumeState:
        """Restore this rank from `path`: the manifest (and the resume contract), the parameters, the optimizer
        state, the manifest components (schedule, scaler, data position), the RNG states."""
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
        if self.on_manifest is not None:
            self.on_manifest(manifest)
        index = ShardIndex(path)
        try:
            self._load_parameters(index, path)
            self._load_optimizer(index, manifest)
        finally:
            index.close()
        for component in self.state.components:
            component.load_state_dict(manifest)
        self._load_rng(path, manifest)
        log0(
            f"resumed from {path}: step {manifest['step']}, {manifest['tokens_total']} tokens, "
            f"written under {manifest['layout']} (world {manifest['world']}), now {self.layout.name} (world {self.topo.world})"
        )
        self.last_saved_step = manifest["step"]
        return ResumeState(step=manifest["step"], tokens_total=manifest["tokens_total"], path=path)

    def _cut(self, full: np.ndarray, param, key: str, sliced: dict) -> np.ndarray:
        """This rank's part of a full tensor: a ZeRO-3 flat slice, a tp/ep piece, or the whole."""
        if not is_split_like_param(key):
            return full
        if param.name in sliced:
            start, end, padded = sliced[param.name]
            return np.pad(full.ravel(), (0, padded - full.size))[start:end]
        return local_slice(full, param, self.topo.tp_rank, self.layout.tp, self.topo.ep_rank, self.layout.ep)

    def _load_parameters(self, index: ShardIndex, path: str) -> None:
        """The trained parameters, cut for this layout (ZeRO-3 ones into their flat storage)."""
        t = self.state.tensors
        sliced = stage3_slices(t.model)  # ZeRO-3 parameters held as flat slices on this rank
        state = {}
        for name, _ in t.named_params:
            full = index.full(f"model/{name}")
            if full is not None:
                state[name] = full
        whole = [(n, p) for n, p in t.named_params if p.name not in sliced]
        load_full_state(whole, state, TensorSlices(self.topo.tp_rank, self.layout.tp, self.topo.ep_rank, self.layout.ep),
                        source=path)
        for name, param in t.named_params:
            if param.name in sliced:
                if name not in state or list(state[name].shape) != [int(x) for x in param.shape]:
                    raise ValueError(f"{path}: {name} missing or mis-shaped for the ZeRO-3 parameter {list(param.shape)}")
                value = self._cut(state[name], param, f"model/{name}", sliced)
                store = stage3_storage(param)
                store.set_value(paddle.to_tensor(value, dtype=store.dtype))

    def _load_optimizer(self, index: ShardIndex, manifest: dict) -> None:
        """Accumulators and master weights keyed by this run's optimizer variable names, cut for this layout."""
        t = self.state.tensors
        sliced = stage3_slices(t.model)
        accumulators, masters = {}, {}
        for name, param in t.named_params:
            var_name = stage3_storage(param).name if param.name in sliced else param.name
            for key in index.keys(f"optim/{name}/"):
                acc = key.rsplit("/", 1)[1]
                tensor = paddle.to_tensor(np.ascontiguousarray(self._cut(index.full(key), param, key, sliced)))
                if acc == "master":
                    masters[var_name] = tensor
                else:
                    accumulators.setdefault(var_name, {})[acc] = tensor
        state = optimizer_state_dict(accumulators, masters, manifest["scheduler"])
        # a checkpoint from before the first update (step 0) holds no optimizer state: fresh values (divergence guard)
        state.update(fresh_optimizer_entries(t.optimizer, state))
        t.optimizer.set_state_dict(state)

    def _load_rng(self, path: str, manifest: dict) -> None:
        """This rank's RNG states, when the checkpoint was written by as many ranks (else they start fresh)."""
        rng_path = os.path.join(path, f"rank_{self.topo.rank:05d}.rng")
        if manifest["world"] == self.topo.world and os.path.exists(rng_path):
            with open(rng_path, "rb") as f:
                rng = pickle.load(f)
            paddle.set_rng_state(rng["paddle"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
