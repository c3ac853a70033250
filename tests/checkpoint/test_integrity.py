"""Incomplete or corrupt checkpoints are reported and skipped, never loaded; keep_last prunes only after success."""
from __future__ import annotations

import os
import shutil

import pytest

from llmtest import compose, tiny_overrides
from llmtrain.checkpoint.listing import list_checkpoints
from llmtrain.checkpoint.verify import verify_files
from llmtrain.config import ConfigError


@pytest.fixture(scope="module")
def three_checkpoints(tiny_corpus, tmp_path_factory):
    from llmtrain.pretrain import pretrain

    run = tmp_path_factory.mktemp("integ") / "run"
    pretrain(compose(tiny_overrides(tiny_corpus, str(run), "gpt", steps=6)
                     + ["checkpoint.interval=2", "checkpoint.keep_last=0"]))
    return run


@pytest.fixture
def llm_log():
    """Messages of the `llmtrain` logger during the test."""
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    logger = logging.getLogger("llmtrain")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing_shard", "no_manifest"])
def test_damaged_newest_is_skipped(three_checkpoints, tiny_corpus, tmp_path, damage, llm_log):
    from llmtrain.pretrain import pretrain

    run = _copy(three_checkpoints, tmp_path / "run")
    newest = run / "checkpoints" / "step_6"
    shard = newest / "rank_00000.safetensors"
    if damage == "truncate":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "missing_shard":
        shard.unlink()
    else:
        (newest / "manifest.json").unlink()
    assert verify_files(str(newest))
    last = pretrain(compose(tiny_overrides(tiny_corpus, str(run), "gpt", steps=7)
                               + ["checkpoint.resume=auto", "optim.on_resume=config"]))  # 6 -> 7: schedule re-horizoned
    err = "\n".join(llm_log)
    found_up_front = damage != "flip"  # sizes and manifests are checked before any work; a flipped bit when loaded
    assert ("skipping damaged step_6" if found_up_front else "skipping corrupt or incomplete checkpoint") in err, err
    assert ("only the manifest is damaged; `python -m llmtrain.checkpoint.rebuild" in err) == (damage == "no_manifest")
    assert "resumed from" in err and "step_4" in err
    assert last["step"] == 7
    kept = [p for p in (run / "superseded").glob("*/checkpoints/step_6")]  # the damaged one: set aside, kept
    assert len(kept) == 1 and verify_files(str(kept[0])), kept
    import json

    moved = run / "superseded" / ("metrics-of-redone-steps.jsonl" if damage == "flip" else "1/metrics.jsonl")
    assert [json.loads(line)["step"] for line in open(moved)] == [5, 6]  # the records of the redone steps, kept


def test_keep_last_prunes_after_a_complete_save(three_checkpoints, tiny_corpus, tmp_path):
    from llmtrain.pretrain import pretrain

    run = _copy(three_checkpoints, tmp_path / "run")
    pretrain(compose(tiny_overrides(tiny_corpus, str(run), "gpt", steps=8)
                     + ["checkpoint.resume=auto", "checkpoint.interval=2", "checkpoint.keep_last=2",
                        "optim.on_resume=config"]))  # a finished 6-step run extended to 8
    assert [s for s, _ in list_checkpoints(str(run / "checkpoints"))] == [8, 6]


def test_explicit_resume_of_a_corrupt_checkpoint_stops(three_checkpoints, tiny_corpus, tmp_path):
    from llmtrain.pretrain import pretrain

    run = _copy(three_checkpoints, tmp_path / "run")
    (run / "checkpoints" / "step_4" / "rank_00000.json").write_text("{}")
    with pytest.raises(ConfigError, match="incomplete or corrupt"):  # found by resolve, before any work
        pretrain(compose(tiny_overrides(tiny_corpus, str(run), "gpt", steps=8)
                         + [f"checkpoint.resume={run / 'checkpoints' / 'step_4'}"]))
