"""Runs that change over time: the LR after a resume, WSD continuation, the resume contract.

    python -m pytest tests/train/test_changing_runs.py -q

All runs are one process and a few steps of the tiny GPT; the runs of this module share
one `run_many` launch (several configs, one after another, in one process).
"""
from __future__ import annotations

import pytest

from llmtest import tiny_overrides
from launch import metrics, run_launch, run_many

TOL = 1e-5


def _records(run_dir):
    return [r for r in metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    """{name: metrics records} of the module's runs (one launch, in order)."""
    out = tmp_path_factory.mktemp("changing")
    c = tiny_corpus

    def o(name, steps, *extra):
        # train.peak_tflops: skip the start-up matmul measurement (seconds per run on a busy machine)
        return tiny_overrides(c, str(out / name), "gpt", steps=steps) + ["optim.warmup_steps=1",
                                                                          "train.peak_tflops=1", *extra]

    short4, stable = out / "short" / "checkpoints" / "step_4", out / "wsd" / "checkpoints" / "step_2"
    plan = [
        # the bug: 4 steps, checkpoint at 4, resumed with max_steps=8 (the schedule re-horizoned by choice)
        o("short", 4, "checkpoint.interval=4"),
        o("short", 8, "checkpoint.resume=auto", "optim.on_resume=config"),
        o("fresh8", 8),
        # WSD: a 6-step run (decay over its last half, from step 3) continued from its stable-phase checkpoint
        # step_2 with max_steps=10 (decay from step 5) against an uninterrupted 10-step run
        o("wsd", 6, *WSD, "checkpoint.interval=2", "checkpoint.keep_last=0"),
        # a cool-down started from the stable checkpoint step_2: decay from step 2 to the end at 5 (no LR jump)
        o("cool", 5, *WSD, "optim.decay_fraction=null", "optim.decay_start_step=2", f"checkpoint.resume={stable}"),
        o("wsd", 10, *WSD, f"checkpoint.resume={stable}"),
        o("wsd10", 10, *WSD),
        # the checkpoint's schedule kept (its horizon 4: min_lr from there on) while the run goes on to 6
        o("keep", 6, f"checkpoint.resume={short4}", "optim.on_resume=checkpoint"),
        # honoured rows: global batch 8 -> 16, micro batch 2 -> 4, AMP none -> bf16 (fp32 on CPU, the O2 path) at
        # step 4, against a run with batch 16, micro 4 and bf16 from its start whose ramp-up gives it batch 8 for its
        # first 32 samples (4 steps). A constant LR (warmup 1) puts both on one LR whatever the schedule position.
        o("b8", 4, "optim.schedule=constant", "checkpoint.interval=4"),
        o("batch", 6, "optim.schedule=constant", *CHANGED, f"checkpoint.resume={out / 'b8' / 'checkpoints' / 'step_4'}"),
        o("changed", 6, "optim.schedule=constant", *CHANGED, "train.batch_rampup=[8,8,32]"),
    ]
    run_many(plan, nproc=0, workdir=out)
    got = {name: _records(out / name) for name in ("short", "fresh8", "wsd", "wsd10", "cool", "keep", "b8", "batch",
                                                  "changed")}
    got["out"] = out
    return got


CHANGED = ("train.global_batch_size=16", "train.micro_batch_size=4", "train.amp=bf16")
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


def test_cool_down_from_a_stable_checkpoint(runs):
    """optim.decay_start_step set at resume to the resume step: no LR jump (honoured by default), then decay."""
    lrs = [r["lr"] for r in runs["cool"] if r["step"] > 2]
    assert len(lrs) == 3
    assert lrs[0] == pytest.approx(1e-3) and lrs[0] > lrs[1] > lrs[2] > 3e-5


def test_extending_a_finished_run_recipes(runs):
    """A finished 4-step cosine run, raised to 8 with on_resume=config, continues (steps 1-8, one curve);
    with on_resume=checkpoint the checkpoint's schedule stays in force (min_lr after its horizon)."""
    assert [r["step"] for r in runs["short"]] == list(range(1, 9))
    keep = [r for r in runs["keep"] if r["step"] > 4]
    assert [r["step"] for r in keep] == [5, 6] and all(r["lr"] == pytest.approx(3e-5) for r in keep)


def test_batch_sizes_and_amp_change_at_resume_are_honoured(runs):
    """Global batch 8 -> 16, micro 2 -> 4, AMP none -> bf16 at a resume after step 4: the data continues from
    consumed_samples, and steps 5-6 equal those of a run that had batch 16, micro 4 and bf16 from its start (its
    ramp-up giving batch 8 for steps 1-4): losses and grad norms within 1e-5, token counts exact."""
    base, ref = {r["step"]: r for r in runs["b8"]}, {r["step"]: r for r in runs["changed"]}
    got = [r for r in runs["batch"] if r["step"] > 4]
    assert [r["step"] for r in got] == [5, 6] and [r["consumed_samples"] for r in got] == [48, 64]
    assert got[0]["tokens_total"] == base[4]["tokens_total"] + got[0]["tokens"]
    assert got[0]["tokens"] == 16 * 32  # 16 samples of 32 loss-bearing targets
    for s in (1, 2, 3, 4):  # the reference saw the same samples before the change
        assert abs(ref[s]["loss"] - base[s]["loss"]) <= TOL and ref[s]["tokens_total"] == base[s]["tokens_total"], s
    for r in got:
        want = ref[r["step"]]
        for key in ("loss", "grad_norm", "lr"):
            assert abs(r[key] - want[key]) <= TOL, (r["step"], key, r[key], want[key])
        for key in ("tokens", "tokens_total", "consumed_samples"):
            assert r[key] == want[key], (r["step"], key, r[key], want[key])


def test_schedule_change_refused_by_default_names_fields_and_values(runs, tiny_corpus):
    """The issue's scenario without optim.on_resume: exit 2, the fields, both values and both LRs named."""
    out = runs["out"]
    args = ["llmtrain/pretrain.py", *tiny_overrides(tiny_corpus, str(out / "refused"), "gpt", steps=8),
            "optim.warmup_steps=1", "train.peak_tflops=1", f"checkpoint.resume={out / 'short' / 'checkpoints' / 'step_4'}"]
    proc = run_launch(args, 0, out / "refused_log", expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert "train.max_steps=4 in the checkpoint, 8 now" in err, err[-3000:]
    assert "the LR of step 5" in err and "optim.on_resume=config" in err, err[-3000:]
    assert not (out / "refused" / "metrics.jsonl").exists()
