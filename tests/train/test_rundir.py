"""A run directory belongs to one run; `checkpoint.resume` checked before any work; nothing of an old run is lost.

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


def test_the_run_directory_keeps_the_log(old_run):
    """The log lines of rank 0 are in <run.dir>/llmtrain.log (the run directory had no log file), from resolve's (the
    export formats that hold the model, said before training) to the last step's."""
    text = (old_run / "llmtrain.log").read_text(encoding="utf-8")
    assert text.startswith("== ") and "step 2/2 | loss " in text, text[:2000]
    assert "model gpt-tiny: `python -m llmtrain.export` can write it as paddlenlp (PaddleNLP gpt)" in text, text[:3000]
    assert f"checkpoint saved: {old_run / 'checkpoints' / 'step_2'}" in text, text[-2000:]


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


def _log(fn):
    """(fn(), the `llmtrain` log lines it wrote)."""
    import logging

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("llmtrain").addHandler(handler)
    try:
        return fn(), said
    finally:
        logging.getLogger("llmtrain").removeHandler(handler)


def test_a_run_whose_checkpoints_are_all_damaged_is_refused_and_a_damaged_manifest_is_rebuilt(old_run, tiny_corpus,
                                                                                               tmp_path):
    """Every checkpoint damaged: the same command is refused before any work (it used to start over and replace
    them), naming the damage and the choices; a checkpoint whose files are intact but whose manifest is not is
    kept, and `python -m llmtrain.checkpoint.rebuild` makes it loadable again."""
    from llmtrain.checkpoint.rebuild import main as rebuild
    from llmtrain.checkpoint.verify import verify_files
    from llmtrain.train.rundir import claim_run_dir

    run = _copy(old_run, tmp_path)
    step0, step2 = run / "checkpoints" / "step_0", run / "checkpoints" / "step_2"
    with open(step2 / "rank_00000.safetensors", "r+b") as f:
        f.truncate(1000)
    (step0 / "manifest.json").write_text('{"format": "llmtrain-chec')
    before = _files(run)
    text = _problems(tiny_corpus, run, "checkpoint.resume=auto", steps=4)
    assert f"run.dir={run}: every checkpoint there is damaged, so checkpoint.resume=auto has nothing to continue and " \
           "nothing was changed: step_2 (" in text and "1000 bytes, manifest says" in text, text
    assert f"only the manifest is damaged; `python -m llmtrain.checkpoint.rebuild {step0}` rebuilds it" in text, text
    assert f"checkpoint.resume=none run.dir={run}-2" in text and f"run.overwrite=true to move the old run aside to " \
                                                                  f"{run}.old-1 (nothing is deleted)" in text, text
    assert _files(run) == before
    assert rebuild([str(step2), "--check"]) == 1  # its tensors are damaged: no manifest can help
    assert rebuild([str(step0)]) == 0 and not verify_files(str(step0))
    assert (step0 / "manifest.json.damaged-1").read_text() == '{"format": "llmtrain-chec'  # kept
    got = _resolve(tiny_corpus, run, "checkpoint.resume=auto", steps=4)
    assert got.run_dir.branch.later == [str(step2)]  # continues step 0; the damaged step 2 is set aside, not replaced
    _, said = _log(lambda: claim_run_dir(got))
    assert (run / "superseded" / "1" / "checkpoints" / "step_2").is_dir() and not step2.exists()
    assert "1000 bytes" in (run / "superseded" / "1" / "why.txt").read_text()
    assert any("step_2 (damaged)" in line and f"{run}/superseded/1/" in line for line in said), said


def test_checkpoints_that_fail_their_checksums_when_loaded_stop_the_run_instead_of_a_fresh_start(old_run, tiny_corpus,
                                                                                                  tmp_path):
    """A flipped bit passes the size check made up front and fails the sha256 check when loaded: with every
    checkpoint so damaged the run stops (status 2 from the entry script), writing no checkpoint."""
    from llmtrain.pretrain import pretrain

    run = _copy(old_run, tmp_path)
    for step in (0, 2):
        shard = run / "checkpoints" / f"step_{step}" / "rank_00000.safetensors"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"every checkpoint failed verification .*nothing was changed"):
        pretrain(compose(tiny_overrides(tiny_corpus, str(run), "gpt", steps=4)
                         + ["train.peak_tflops=1", "checkpoint.resume=auto", "optim.on_resume=config"]))
    assert sorted(os.listdir(run / "checkpoints")) == ["step_0", "step_2"]


def test_resuming_an_older_checkpoint_sets_the_later_checkpoints_and_metrics_aside(old_run, tiny_corpus, tmp_path):
    """A resume from step 0 of a run holding step 2 used to redo steps 1-2 over step_2 and cut metrics.jsonl back;
    now step_2 and the records of steps 1-2 move to <run.dir>/superseded/1/, said in the log."""
    import json

    from llmtrain.train.rundir import claim_run_dir

    run = _copy(old_run, tmp_path)
    old_step2 = _files(run / "checkpoints" / "step_2")
    got = _resolve(tiny_corpus, run, f"checkpoint.resume={run / 'checkpoints' / 'step_0'}")
    _, said = _log(lambda: claim_run_dir(got))
    aside = run / "superseded" / "1"
    assert os.listdir(run / "checkpoints") == ["step_0"] and _files(aside / "checkpoints" / "step_2") == old_step2
    steps = [json.loads(line)["step"] for line in open(aside / "metrics.jsonl")]
    assert steps == [1, 2] and all(json.loads(line)["step"] <= 0 for line in open(run / "metrics.jsonl"))
    assert (aside / "config.yaml").exists() and "resumed from step 0" in (aside / "why.txt").read_text()
    assert f"resuming from step 0: the later checkpoints (step_2) and the metrics of steps 1-2 are now in {aside}/ " \
           "(nothing deleted)" in said, said


def _read_only(path):
    """Make a directory unwritable for this process (chmod; root ignores it, so chattr +i as root too)."""
    os.chmod(path, 0o555)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    try:
        open(os.path.join(path, ".probe"), "w").close()
    except OSError:
        return
    os.remove(os.path.join(path, ".probe"))
    pytest.skip(f"cannot make {path} read-only here (chmod ignored and no chattr)")


def _writable_again(path):
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    os.chmod(path, 0o755)


def test_an_unwritable_run_dir_or_checkpoints_dir_or_a_full_disk_is_refused_up_front(old_run, tiny_corpus, tmp_path):
    """A read-only checkpoints/ used to train every step and lose the run at the final save; a run.dir that cannot
    be created gave a traceback. Now both are refused before any work, as is a disk without room for one
    checkpoint of the model."""
    from llmtrain.train.writable import checkpoint_bytes, output_problems

    (tmp_path / "a-file").write_text("")
    text = _problems(tiny_corpus, tmp_path / "a-file" / "run")
    assert f"run.dir={tmp_path / 'a-file' / 'run'}: cannot write in {tmp_path / 'a-file'} (where run.dir=" in text, text
    run = _copy(old_run, tmp_path)
    _read_only(run / "checkpoints")
    try:
        text = _problems(tiny_corpus, run, "checkpoint.resume=auto", steps=4)
    finally:
        _writable_again(run / "checkpoints")
    assert f"run.dir={run}: cannot write in {run / 'checkpoints'}: PermissionError" in text, text
    assert "choose a run.dir on a writable filesystem" in text
    huge = to_config(compose(["model=deepseek-v3", f"run.dir={tmp_path / 'big'}"]))
    assert checkpoint_bytes(huge) > shutil.disk_usage(tmp_path).free  # 671e9 parameters x 12 bytes
    (problem,) = output_problems(huge)
    assert problem.startswith(f"run.dir={tmp_path / 'big'}: ") and "GB free on the filesystem of" in problem, problem
    assert "one checkpoint of this model needs about" in problem and "free space there or choose a run.dir" in problem


def test_a_save_that_fails_mid_run_stops_the_run_with_the_last_good_checkpoint_intact(tiny_corpus, tmp_path,
                                                                                      monkeypatch):
    """The disk fills during the run (an OSError injected into step 4's write): the run stops with a
    CheckpointSaveError (status 6 from the entry script) naming the cause and the intact step_2."""
    import errno

    from llmtrain.checkpoint.save import CheckpointWriter
    from llmtrain.checkpoint.verify import verify_files
    from llmtrain.errors import CheckpointSaveError
    from llmtrain.pretrain import pretrain

    real = CheckpointWriter.write_shard

    def full_at_step_4(self, snap):
        if snap.step == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, snap)

    monkeypatch.setattr(CheckpointWriter, "write_shard", full_at_step_4)
    run = tmp_path / "run"
    with pytest.raises(CheckpointSaveError) as e:
        pretrain(compose(tiny_overrides(tiny_corpus, str(run), "gpt", steps=6)
                         + ["checkpoint.interval=2", "train.peak_tflops=1"]))
    assert str(e.value) == (
        f"checkpoint step 4 could not be written (OSError: [Errno 28] No space left on device); the run stopped there "
        f"and nothing of that save was published. The newest complete checkpoint is {run / 'checkpoints' / 'step_2'} "
        f"(step 2), intact; fix the cause (free space or permissions under {run / 'checkpoints'}) and run the same "
        "command again to continue from it")
    assert sorted(os.listdir(run / "checkpoints"))[-2:] == ["step_0", "step_2"]
    assert not verify_files(str(run / "checkpoints" / "step_2"))


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
