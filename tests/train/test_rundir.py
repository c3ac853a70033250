"""A run directory belongs to one run; `checkpoint.resume` checked before any work (issue 38 §1, §4, §5).

    python -m pytest -q tests/train/test_rundir.py

One real 2-step gpt-tiny run (checkpoints step_0 and step_2) is made once; each test copies it and asks
`llmtrain.resolve` (in process) what a new command would do there, or runs the entry script once (the refusal
of a new run, exit status 2, the old run's files untouched).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from llmtest import REPO, compose, tiny_overrides
from llmtrain.config import ConfigError, to_config
from llmtrain.errors import RunFinished
from llmtrain.resolve import resolve


@pytest.fixture(scope="module")
def old_run(tiny_corpus, tmp_path_factory):
    from llmtrain.pretrain import pretrain

    run = tmp_path_factory.mktemp("rundir") / "old"
    pretrain(compose(tiny_overrides(tiny_corpus, str(run), "gpt", steps=2) + ["checkpoint.interval=2",
                                                                              "train.peak_tflops=1"]))
    assert sorted(os.listdir(run / "checkpoints")) == ["step_0", "step_2"]
    return run


def _copy(run, tmp_path):
    return shutil.copytree(run, tmp_path / "run")


def _resolve(corpus, run_dir, *extra, steps=2):
    """resolve() of the tiny gpt run's overrides (checkpoint.resume=none unless `extra` says otherwise)."""
    return resolve(to_config(compose(tiny_overrides(corpus, str(run_dir), "gpt", steps=steps)
                                     + ["train.peak_tflops=1", *extra])), world_size=1)


def _problems(corpus, run_dir, *extra, steps=2) -> str:
    with pytest.raises(ConfigError) as e:
        _resolve(corpus, run_dir, *extra, steps=steps)
    return str(e.value)


def _files(root) -> dict:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = (os.path.getsize(p), hashlib.sha256(open(p, "rb").read()).hexdigest())
    return out


def test_a_new_run_into_a_directory_holding_another_run_exits_2_and_leaves_it_intact(old_run, tiny_corpus, tmp_path):
    """checkpoint.resume=none (the quickstart's old setting) used to keep the old checkpoints and truncate
    metrics.jsonl; now: status 2 before any work, the two ways out named, every old file as it was."""
    run = _copy(old_run, tmp_path)
    before = _files(run)
    proc = subprocess.run([sys.executable, "llmtrain/pretrain.py", *tiny_overrides(tiny_corpus, str(run), "llama",
                                                                                   steps=5)],
                          cwd=REPO, capture_output=True, text=True, timeout=180, env=_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert f"run.dir={run} holds another run's checkpoints (step_2, step_0; the newest is step 2 of run" in err, err
    assert f"run.dir={run}-2" in err and f"run.overwrite=true to move the old run aside to {run}.old-1" in err, err
    assert "Traceback" not in err and "layout single: dp=1" not in err  # refused before the trainer started
    assert _files(run) == before


def test_a_config_that_cannot_continue_the_run_is_refused_up_front_with_the_overrides(old_run, tiny_corpus, tmp_path):
    """checkpoint.resume=auto with another model shape (or the README's model=llama-tiny in a gpt-tiny run's
    directory): refused at resolve, naming what to set to continue it and how to start a new run instead."""
    run = _copy(old_run, tmp_path)
    text = _problems(tiny_corpus, run, "checkpoint.resume=auto", "model.hidden_size=64", steps=4)
    assert f"run.dir={run} holds a run this configuration cannot continue" in text, text
    assert "model.hidden_size=32 in the checkpoint, 64 now: refused" in text, text
    assert "to continue this run: model.hidden_size=32" in text and f"run.dir={run}-2" in text, text
    assert "run.overwrite=true" in text
    llama = _problems(tiny_corpus, run, "checkpoint.resume=auto", "model=llama-tiny", steps=4)
    assert "model.position='learned' in the checkpoint, 'rope' now: refused" in llama, llama
    # the same config continues it, naming the run and the step it reads; at train.max_steps it says it is done
    resumed = _resolve(tiny_corpus, run, "checkpoint.resume=auto", steps=4)
    assert resumed.cfg.checkpoint.resume == "auto"
    assert resumed.run_dir.notes == [f"continuing step 2 of run gpt-tiny-single (model gpt-tiny, layout single, "
                                     f"512 tokens) from {run / 'checkpoints' / 'step_2'}"]
    with pytest.raises(RunFinished, match=r"nothing to train: .* already at train.max_steps=2\. To train on, raise "
                                          r"train.max_steps"):
        _resolve(tiny_corpus, run, "checkpoint.resume=auto", steps=2)


def test_resume_takes_a_run_directory_and_refuses_missing_or_corrupt_ones(old_run, tiny_corpus, tmp_path):
    """checkpoint.resume=<run dir> means its newest complete checkpoint (as export and generate read it), not
    "no manifest.json"; a missing, incomplete or truncated checkpoint is a config problem with the path."""
    run = _copy(old_run, tmp_path)
    got = _resolve(tiny_corpus, tmp_path / "new", f"checkpoint.resume={run}", steps=4)
    assert got.cfg.checkpoint.resume == str(run / "checkpoints" / "step_2")
    assert f"checkpoint.resume={run}: a run directory; its newest complete checkpoint is" in got.run_dir.notes[0]
    assert _resolve(tiny_corpus, tmp_path / "new", f"checkpoint.resume={run / 'checkpoints'}",
                    steps=4).cfg.checkpoint.resume == str(run / "checkpoints" / "step_2")
    missing = _problems(tiny_corpus, tmp_path / "new", f"checkpoint.resume={tmp_path / 'nope'}")
    assert f"checkpoint.resume={tmp_path / 'nope'}: no such directory" in missing
    step2 = run / "checkpoints" / "step_2"
    shard = step2 / "rank_00000.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    text = _problems(tiny_corpus, tmp_path / "new", f"checkpoint.resume={step2}")
    assert f"checkpoint.resume={step2} is incomplete or corrupt: {shard}:" in text and "truncated" in text, text
    (run / "checkpoints" / "step_0" / "manifest.json").unlink()
    text = _problems(tiny_corpus, tmp_path / "new", f"checkpoint.resume={run}")
    assert f"checkpoint.resume={run}: no complete checkpoint" in text and "no manifest.json" in text, text


def test_overwrite_moves_the_old_run_aside_and_nothing_mixes(old_run, tiny_corpus, tmp_path):
    """run.overwrite=true: a new run, the old one renamed to <run.dir>.old-1 whole; a checkpoint from elsewhere
    continued into a directory holding a run is refused (the two would mix), unless the directory is new."""
    from llmtrain.train.rundir import claim_run_dir

    run = _copy(old_run, tmp_path)
    before = _files(run)
    other = tmp_path / "other"
    text = _problems(tiny_corpus, run, f"checkpoint.resume={old_run}", steps=4)
    assert f"run.dir={run} holds a run (step_2, step_0) and checkpoint.resume={old_run} continues a checkpoint" in text
    inside = _problems(tiny_corpus, run, f"checkpoint.resume={run / 'checkpoints' / 'step_2'}", "run.overwrite=true")
    assert "the checkpoint is inside" in inside
    got = _resolve(tiny_corpus, run, "run.overwrite=true", "checkpoint.resume=auto")
    assert got.cfg.checkpoint.resume == "none" and got.run_dir.move_aside == f"{run}.old-1"
    claim_run_dir(got)
    assert os.listdir(run) == [] and _files(f"{run}.old-1") == before
    shutil.copytree(old_run, other)
    assert _resolve(tiny_corpus, other, "run.overwrite=true").run_dir.move_aside == f"{other}.old-1"


def test_export_and_generate_name_the_run_and_step_they_read(old_run, tmp_path, capsys):
    """...and `generate --model missing/` is one message with status 2, not an 18-line traceback."""
    import logging

    from llmtrain.export import main as export
    from llmtrain.generate import main as generate

    what = "step 2 of run gpt-tiny-single (model gpt-tiny, layout single, 512 tokens)"
    assert export(["--checkpoint", str(old_run), "--output", str(tmp_path / "out"), "--safetensors"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"exported {what}: {old_run / 'checkpoints' / 'step_2'} -> "), out
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("llmtrain").addHandler(handler)
    try:
        assert generate(["--model", str(old_run), "--ids", "5,6", "--max-new-tokens", "1"]) == 0
    finally:
        logging.getLogger("llmtrain").removeHandler(handler)
    assert f"generate: reading {what} from {old_run / 'checkpoints' / 'step_2'}" in said, said
    capsys.readouterr()
    assert generate(["--model", str(tmp_path / "missing"), "--ids", "5"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"generate: --model {tmp_path / 'missing'}: no such directory (give a step_<N> or run " \
                          "directory of ours, or a PaddleNLP model directory)", err


def _env():
    from launch import env

    e = env()
    e.pop("HYDRA_FULL_ERROR", None)
    return e
