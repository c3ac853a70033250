"""Can the run write where it must? `run.dir`, its `checkpoints/` and room for one checkpoint, checked up front.

    python llmtrain/pretrain.py run.dir=/read-only/place      # exit 2 before any work, naming the directory
    problems = output_problems(cfg)                            # llmtrain.resolve, every rank, before any process group

Writability is tried, not inferred from permission bits: a probe file is created and removed in `run.dir` and
`checkpoints/` when they exist (else in the nearest existing parent, where they will be created), so a read-only
mount, a directory owned by another user or a path through a regular file is found before the first step.
A run that saves checkpoints needs room for one: its parameters and AdamW's two moments in fp32, plus fp32 master
weights under AMP (`checkpoint_bytes`); less free space on the checkpoints' filesystem than that is refused. A
save that fails later anyway (the disk filled meanwhile) stops the run cleanly (`llmtrain.errors.CheckpointSaveError`).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _probe(directory: str) -> Optional[str]:
    """None when a file can be created in `directory`, else why not."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".llmtrain-write-probe-")
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    os.close(fd)
    os.remove(name)
    return None


def checkpoint_bytes(cfg) -> int:
    """Bytes of one checkpoint of `cfg`'s run (resolved model): trained parameters x 12 (fp32 weights and two AdamW
    moments; 16 with AMP's fp32 master weights). Under LoRA the adapters alone are trained and saved."""
    from llmtrain.models.lora_targets import adapter_numel
    from llmtrain.models.size import parameter_count

    lora = cfg.finetune.lora
    trained = adapter_numel(cfg.model, lora) if lora.rank > 0 else parameter_count(cfg.model)
    return trained * (16 if cfg.train.amp != "none" else 12)


def output_problems(cfg, space: bool = True) -> list[str]:
    """Problems writing `cfg.run.dir` (and its checkpoints), each naming the directory and what would work; the free
    space for one checkpoint too when `space` (a model whose size can be computed)."""
    run_dir = cfg.run.dir
    ckpts = os.path.join(run_dir, "checkpoints")
    problems = []
    for path in (run_dir, ckpts):
        if os.path.exists(path) and not os.path.isdir(path):
            return [f"run.dir={run_dir}: {path} exists and is not a directory; choose another run.dir"]
    probes = [p for p in (run_dir, ckpts) if os.path.isdir(p)] or [_nearest_existing(run_dir)]
    if cfg.run.overwrite and os.path.isdir(run_dir):  # the old run is renamed beside it
        probes.append(os.path.dirname(os.path.abspath(run_dir)))
    for directory in probes:
        why = _probe(directory)
        if why is not None:
            made = "" if directory in (run_dir, ckpts) else f" (where run.dir={run_dir} would be created)"
            problems.append(f"run.dir={run_dir}: cannot write in {directory}{made}: {why}. Make it writable for this "
                            "user, or choose a run.dir on a writable filesystem")
    if problems or not space or (cfg.checkpoint.interval <= 0 and not cfg.checkpoint.save_final):
        return problems
    need = checkpoint_bytes(cfg)
    where = _nearest_existing(ckpts)
    free = shutil.disk_usage(where).free
    if free < need:
        problems.append(f"run.dir={run_dir}: {free / 1e9:.2f} GB free on the filesystem of {where}, one checkpoint of "
                        f"this model needs about {need / 1e9:.2f} GB (trained parameters x "
                        f"{16 if cfg.train.amp != 'none' else 12} bytes); free space there or choose a run.dir on a "
                        "larger filesystem")
    return problems
