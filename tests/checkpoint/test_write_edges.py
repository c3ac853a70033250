"""The edges of a checkpoint write, in one process: a rank 0 that fails late, and replacing an existing step.

    python -m pytest -q tests/checkpoint/test_write_edges.py

Two ranks of one save are played in one process (tests/train/fake_job.py: rank 1 fed rank 0's broadcast of the
save's nonce). Rank 0 failing while it writes the manifest or renames the directory leaves `rank_00000.failed`,
and rank 1, waiting for the manifest, raises at its next poll naming rank 0 and the error (not after
checkpoint.timeout_minutes). Saving a step that exists already (a run redoing it) renames the old one aside,
the new one in, then moves the old to `superseded/`: checked after every rename that a complete copy of the step
is on disk; a crash between the renames leaves the aside copy, which is found, loaded and renamed back.
"""
from __future__ import annotations

import os
import stat
import shutil
import time

import pytest

from train.fake_job import GuardRig, ScriptedComm  # tests/train (no package: a namespace import)
from llmtrain.checkpoint import save as save_module
from llmtrain.checkpoint.listing import list_checkpoints, read_manifest
from llmtrain.checkpoint.prune import remove_superseded
from llmtrain.checkpoint.verify import verify_files
from llmtrain.errors import CheckpointSaveError
from llmtrain.utils.files import current_umask


@pytest.mark.parametrize("fails_at", ["manifest", "rename"])
def test_rank_0_failing_late_stops_rank_1_at_once(tiny_gpt, tmp_path, monkeypatch, fails_at):
    rank0 = GuardRig(tmp_path, tiny_gpt, comm=ScriptedComm(rank=0, world=2))
    snap0 = rank0.ckpt.files.snapshot(1, 0)
    rank1 = GuardRig(tmp_path, tiny_gpt, comm=ScriptedComm(rank=1, world=2, broadcasts=rank0.comm.sent))
    snap1 = rank1.ckpt.files.snapshot(1, 0)
    assert snap0.tmp == snap1.tmp
    rank1.cfg.checkpoint.timeout_minutes = 0.5  # without the marker: a TimeoutError after 30 s
    rank1.ckpt.files.write_shard(snap1)  # rank 1's listing is there: rank 0 goes on to the manifest

    def broken(*args, **kwargs):
        raise OSError(f"injected: {fails_at} failed")

    if fails_at == "manifest":
        monkeypatch.setattr(rank0.ckpt.files, "write_manifest", broken)
    else:
        monkeypatch.setattr(save_module, "publish", broken)
    with pytest.raises(OSError, match="injected"):
        rank0.ckpt.files.write(snap0)
    assert os.path.exists(os.path.join(snap0.tmp, "rank_00000.failed"))
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=rf"the write failed on rank_00000 \(OSError: injected: {fails_at} failed\)"):
        rank1.ckpt.files.write(snap1)
    assert time.perf_counter() - t0 < 5  # seen at once, not after timeout_minutes
    assert list_checkpoints(rank0.ckpt.root) == []  # never published


def test_replacing_a_step_always_leaves_a_complete_copy(tiny_gpt, tmp_path, monkeypatch):
    rig = GuardRig(tmp_path, tiny_gpt)
    rig.step()
    rig.save()
    old = read_manifest(rig.checkpoint(1))["save_nonce"]
    modes = {f: stat.S_IMODE(os.stat(os.path.join(rig.checkpoint(1), f)).st_mode) for f in os.listdir(rig.checkpoint(1))}
    assert set(modes.values()) == {0o666 & ~current_umask()}, modes  # the shard's safetensors too (save_file: 0600)
    checks = []

    def complete_step_1():
        found = [p for s, p in list_checkpoints(rig.ckpt.root) if s == 1 and not verify_files(p)]
        checks.append(bool(found))

    def watched(real):
        def call(*args, **kwargs):
            complete_step_1()
            out = real(*args, **kwargs)
            complete_step_1()
            return out
        return call

    monkeypatch.setattr(os, "rename", watched(os.rename))
    monkeypatch.setattr(shutil, "rmtree", watched(shutil.rmtree))
    rig.save()  # step 1 again
    assert len(checks) >= 6 and all(checks), checks  # aside, in, delete (and the stale sweep): always a copy
    assert read_manifest(rig.checkpoint(1))["save_nonce"] != old
    assert [os.path.basename(p) for _, p in list_checkpoints(rig.ckpt.root)] == ["step_1"]
    replaced = os.path.join(os.path.dirname(rig.ckpt.root), "superseded", "1", "checkpoints", "step_1")
    assert read_manifest(replaced)["save_nonce"] == old and not verify_files(replaced)  # kept, not deleted


def test_a_crash_between_the_renames_leaves_a_loadable_aside_copy(tiny_gpt, tmp_path, monkeypatch):
    rig = GuardRig(tmp_path, tiny_gpt)
    rig.step()
    rig.save()
    nonce = read_manifest(rig.checkpoint(1))["save_nonce"]
    aside = os.path.join(rig.ckpt.root, ".replaced-step_1-77")
    os.rename(rig.checkpoint(1), aside)  # where a crash after the first rename of a replacement leaves it
    assert list_checkpoints(rig.ckpt.root) == [(1, aside)]
    assert rig.ckpt.rewind_target(5) == (1, aside)
    remove_superseded(rig.ckpt.root)  # the next completed save: renamed back
    assert list_checkpoints(rig.ckpt.root) == [(1, rig.checkpoint(1))]
    assert read_manifest(rig.checkpoint(1))["save_nonce"] == nonce

    def second_rename_fails(tmp, final, nonce):  # the rename in fails: the old copy is put back
        real = os.rename

        def rename(a, b):
            if a == tmp:
                raise OSError("injected: rename in failed")
            return real(a, b)

        monkeypatch.setattr(os, "rename", rename)
        try:
            publish(tmp, final, nonce)
        finally:
            monkeypatch.setattr(os, "rename", real)

    publish = save_module.publish
    monkeypatch.setattr(save_module, "publish", second_rename_fails)
    with pytest.raises(CheckpointSaveError, match=r"rename in failed\); the run stopped there .* The newest complete "
                                                  r"checkpoint is .*step_1 \(step 1\), intact"):
        rig.save()
    assert read_manifest(rig.checkpoint(1))["save_nonce"] == nonce and not verify_files(rig.checkpoint(1))


@pytest.mark.parametrize("preset,tag", [("cp2", "cp2"), ("tp2cp2", "tp2cp2sp"), ("ep2", "dp2ep2"), ("dp2tp2", "dp2tp2")])
def test_a_checkpoint_names_its_layout_with_every_degree(preset, tag):
    """A cp2 run's checkpoints used to call their layout "single" (the manifest held no cp): what export, generate
    and a resume say comes from the manifest's layout entry, named as the run directory is."""
    from llmtrain.checkpoint.reader import describe_manifest
    from llmtrain.checkpoint.save import layout_entry
    from llmtrain.config import default_preset, preset_config
    from llmtrain.parallel.config import layout_tag
    from llmtrain.parallel.layout import layout_problems

    parallel = preset_config("parallel", preset)
    layout, problems = layout_problems(parallel, default_preset("train"), parallel.world())
    assert not problems, problems
    entry = layout_entry(layout)
    assert layout_tag(entry) == layout_tag(parallel) == tag
    assert describe_manifest({"step": 3, "layout": entry, "model": {"name": "m"}}).startswith(
        f"step 3 of run ? (model m, layout {tag},")
