"""Batch-size ramp-up (train.batch_rampup, Megatron's --rampup-batch-size): arithmetic, checks, dp2 parity and a
resume in the middle of the ramp.

    python -m pytest tests/train/test_rampup.py -q
"""
from __future__ import annotations

import pytest

from llmtest import tiny_overrides
from launch import metrics, run_many
from llmtrain.data.rampup import BatchRampup, rampup_problems
from llmtrain.data.sampler import StepSampler

RAMP = [4, 4, 48]  # start 4, +4 every 48/3 = 16 consumed samples, up to train.global_batch_size=16
CONSUMED = [4, 8, 12, 16, 24, 32, 44, 56, 72, 88]  # after each of the 10 steps


def test_batch_at_follows_megatron_arithmetic():
    r = BatchRampup(*RAMP, final=16)
    c, seen = 0, []
    for _ in range(10):
        c += r.batch_at(c)
        seen.append(c)
    assert seen == CONSUMED
    assert BatchRampup(16, 4, 48, final=16).batch_at(0) == 16  # nothing to ramp


def test_sampler_steps_follow_the_ramp_on_any_layout():
    """The union over data ranks of a step's ids is the same consecutive block, whatever dp and micro batch."""
    ramp = BatchRampup(*RAMP, final=16)
    for m, world in ((2, 1), (2, 2), (1, 4)):
        samplers = [StepSampler(16, m, r, world) for r in range(world)]
        for s in samplers:
            s.rampup = ramp
        c = 0
        for _ in range(10):
            ids = sorted(int(i) for s in samplers for i in s.rank_ids(c).ravel())
            assert ids == list(range(c, c + ramp.batch_at(c))), (m, world, c)
            c += ramp.batch_at(c)


def test_rampup_problems_name_the_numbers():
    text = "\n".join(rampup_problems([6, 4, 48], 16, 2, 2, 2))
    assert "START 6 is not a multiple of micro batch x data-parallel ranks = 2 x 2 = 4" in text
    assert "16 - START 6 = 10 is not a multiple of INCREMENT 4" in text
    assert "parallel.pp=2" in text
    assert "expected three integers" in rampup_problems([4, 4], 16, 2, 1, 1)[0]
    assert not rampup_problems(RAMP, 16, 2, 2, 1)


@pytest.fixture(scope="module")
def ramp_runs(tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("rampup")

    def o(name, *extra):
        return tiny_overrides(tiny_corpus, str(out / name), "gpt", steps=10) + [
            "train.global_batch_size=16", f"train.batch_rampup=[{','.join(map(str, RAMP))}]", "train.peak_tflops=1",
            *extra]

    run_many([o("dp2", "+parallel=dp2", "checkpoint.interval=5", "checkpoint.keep_last=0")], nproc=2,
             workdir=out / "w2")
    run_many([o("single"), o("resumed", f"checkpoint.resume={out / 'dp2' / 'checkpoints' / 'step_5'}")], nproc=0,
             workdir=out / "w1")
    return {n: [r for r in metrics(out / n) if "loss" in r] for n in ("dp2", "single", "resumed")}


def test_rampup_dp2_equals_one_process_and_resumes_mid_ramp(ramp_runs):
    """dp2 through the ramp and a one-process continuation of its step-5 checkpoint (mid-ramp) equal one process."""
    ref = ramp_runs["single"]
    assert [r["consumed_samples"] for r in ref] == CONSUMED
    assert [r["tokens"] for r in ref] == [(b - a) * 32 for a, b in zip([0] + CONSUMED, CONSUMED)]
    assert ref[-1]["tokens_total"] == CONSUMED[-1] * 32
    for name, first in (("dp2", 1), ("resumed", 6)):
        got = ramp_runs[name]
        assert [r["step"] for r in got] == list(range(first, 11)), name
        for r in got:
            e = ref[r["step"] - 1]
            assert abs(r["loss"] - e["loss"]) <= 1e-5, (name, r["step"], r["loss"], e["loss"])
            for k in ("tokens", "tokens_total", "consumed_samples"):
                assert r[k] == e[k], (name, r["step"], k, r[k], e[k])


def test_lr_follows_consumed_samples_through_the_ramp(ramp_runs, tiny_corpus):
    """Each step's LR is the schedule's at (samples consumed before it) / train.global_batch_size, on every layout."""
    from llmtest import compose
    from llmtrain.config import to_config
    from llmtrain.train.schedule import lr_at

    cfg = to_config(compose(tiny_overrides(tiny_corpus, "/tmp/unused", "gpt", steps=10)))
    before = [0] + CONSUMED[:-1]
    want = [lr_at(c / 16, cfg.optim, 10) for c in before]
    assert want[1] != lr_at(1, cfg.optim, 10)  # the ramp's small steps move the schedule less than a step
    for name in ("single", "dp2", "resumed"):
        for r in ramp_runs[name]:
            assert abs(r["lr"] - want[r["step"] - 1]) <= 1e-12 * max(1.0, want[r["step"] - 1]), (name, r["step"])


def test_resolve_lists_rampup_problems(tiny_corpus):
    from llmtest import compose
    from llmtrain.config import ConfigError, to_config
    from llmtrain.train.resolve import resolve

    cfg = to_config(compose(tiny_overrides(tiny_corpus, "/tmp/unused", "gpt") + [
        "+parallel=dp2pp2", "train.global_batch_size=16", "train.batch_rampup=[6,4,48]"]))
    with pytest.raises(ConfigError) as e:
        resolve(cfg, world_size=4)
    text = str(e.value)
    assert "train.batch_rampup=[6, 4, 48]: START 6 is not a multiple of micro batch x data-parallel ranks" in text
    assert "parallel.pp=2" in text
