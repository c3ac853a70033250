"""Runs that change over time: the LR after a resume, WSD continuation, the resume contract.

    python -m pytest tests/train/test_changing_runs.py -q

All runs are one process and a few steps of the tiny GPT; the runs of this module share
one `run_many` launch (several configs, one after another, in one process).
"""
from __future__ import annotations

import pytest

from llmtest import tiny_overrides
from launch import metrics, run_many

TOL = 1e-5


def _records(run_dir):
    return [r for r in metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    """{name: metrics records} of the module's runs (one launch, in order)."""
    out = tmp_path_factory.mktemp("changing")
    c = tiny_corpus

    def o(name, steps, *extra):
        return tiny_overrides(c, str(out / name), "gpt", steps=steps) + ["optim.warmup_steps=1", *extra]

    plan = [
        # the bug: 4 steps, checkpoint at 4, resumed with max_steps=8 (the schedule re-horizoned by choice)
        o("short", 4, "checkpoint.interval=4"),
        o("short", 8, "checkpoint.resume=auto"),
        o("fresh8", 8),
        # WSD: a 6-step run (decay over its last half, from step 3) continued from its stable-phase checkpoint
        # step_2 with max_steps=10 (decay from step 5) against an uninterrupted 10-step run
        o("wsd", 6, *WSD, "checkpoint.interval=2", "checkpoint.keep_last=0"),
        o("wsd", 10, *WSD, f"checkpoint.resume={out / 'wsd' / 'checkpoints' / 'step_2'}"),
        o("wsd10", 10, *WSD),
    ]
    run_many(plan, nproc=0, workdir=out)
    return {name: _records(out / name) for name in ("short", "fresh8", "wsd", "wsd10")}


WSD = ("optim.schedule=wsd", "optim.decay_fraction=0.5", "optim.decay_shape=1-sqrt")


def test_lr_after_resume_is_the_schedule_of_the_step(runs):
    """Issue 16's reproduction: steps 5-8 of the resumed run log the LR a fresh 8-step run logs."""
    fresh = {r["step"]: r["lr"] for r in runs["fresh8"]}
    resumed = {r["step"]: r["lr"] for r in runs["short"] if r["step"] > 4}
    assert sorted(resumed) == [5, 6, 7, 8]
    for s, lr in resumed.items():
        assert lr == pytest.approx(fresh[s], rel=1e-9, abs=1e-12), (s, lr, fresh[s])


def test_wsd_stable_checkpoint_continues_into_a_longer_run(runs):
    """A stable-phase WSD checkpoint continued with a longer max_steps equals the uninterrupted longer run."""
    ref = {r["step"]: r for r in runs["wsd10"]}
    got = [r for r in runs["wsd"] if r["step"] > 2]
    assert [r["step"] for r in got] == list(range(3, 11))
    for r in got:
        assert abs(r["loss"] - ref[r["step"]]["loss"]) <= TOL, (r["step"], r["loss"], ref[r["step"]]["loss"])
        assert r["lr"] == pytest.approx(ref[r["step"]]["lr"], rel=1e-9)
        assert r["tokens_total"] == ref[r["step"]]["tokens_total"]
    assert ref[5]["lr"] == pytest.approx(1e-3) and ref[10]["lr"] < ref[8]["lr"] < 1e-3  # stable, then decay
