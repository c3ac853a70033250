"""Batch-size ramp-up (train.batch_rampup, Megatron's --rampup-batch-size): arithmetic, checks, dp2 and pp2 parity
and resumes in the middle of the ramp.

    python -m pytest tests/train/test_rampup.py -q

Launches: dp2 (10 steps, checkpoint at step 5), pp2 (10 steps through the ramp with 2, 4, 6, 8 micro-batches per
step, checkpoint and evaluation at steps 5 and 10; and dp2's step-5 checkpoint continued under pp2), one process (the
reference, and the dp2 and pp2 step-5 checkpoints continued).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from llmtest import tiny_overrides
from launch import metrics, run_many
from llmtrain.data.rampup import BatchRampup, rampup_problems
from llmtrain.data.sampler import StepSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from memory_checks import check_memory  # noqa: E402

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
    assert "expected three integers" in rampup_problems([4, 4], 16, 2, 1, 1)[0]
    assert not rampup_problems(RAMP, 16, 2, 2, 1)
    interleaved = rampup_problems(RAMP, 16, 2, 1, virtual_pp=2)
    assert len(interleaved) == 1 and "parallel.virtual_pp=2" in interleaved[0] and "interleaved" in interleaved[0]


def test_pipeline_micro_batch_count_refused_where_fleet_cannot_change_it():
    """`set_pipeline_micro_batches` refuses what is not a 1F1B pipeline and fleet's interleaved classes (their
    schedule class and assertions belong to the start-up count); an unchanged count is a no-op for every pipeline."""
    from paddle.distributed.fleet.meta_parallel import PipelineParallelWithInterleave, PipelineParallelWithInterleaveFthenB

    from llmtrain.paddle_compat.fleet import set_pipeline_micro_batches

    with pytest.raises(TypeError, match="is not fleet's PipelineParallel"):
        set_pipeline_micro_batches(object(), 4)
    for cls in (PipelineParallelWithInterleave, PipelineParallelWithInterleaveFthenB):
        pipe = object.__new__(cls)  # the class only: the check precedes any use of its state
        pipe.accumulate_steps = 8
        set_pipeline_micro_batches(pipe, 8)
        with pytest.raises(ValueError, match="accumulate_steps=8 at start-up"):
            set_pipeline_micro_batches(pipe, 4)
        assert pipe.accumulate_steps == 8


@pytest.fixture(scope="module")
def ramp_runs(tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("rampup")

    def o(name, *extra):
        return tiny_overrides(tiny_corpus, str(out / name), "gpt", steps=10) + [
            "train.global_batch_size=16", f"train.batch_rampup=[{','.join(map(str, RAMP))}]", "train.peak_tflops=1",
            *extra]

    step5 = {n: f"checkpoint.resume={out / n / 'checkpoints' / 'step_5'}" for n in ("dp2", "pp2")}
    saving = ("checkpoint.interval=5", "checkpoint.keep_last=0")
    evaluating = ("train.eval_interval=5", "train.eval_batches=4")  # pp2: after steps of 4 and 8 micro-batches
    run_many([o("dp2", "+parallel=dp2", *saving)], nproc=2, workdir=out / "w2")
    run_many([o("pp2", "+parallel=pp2", *saving, *evaluating), o("pp2_resumed", "+parallel=pp2", step5["dp2"])],
             nproc=2, workdir=out / "wpp")
    run_many([o("single", *evaluating), o("resumed", step5["dp2"]), o("resumed_pp2", step5["pp2"])], nproc=0,
             workdir=out / "w1")
    runs = {n: [r for r in metrics(out / n) if "loss" in r] for n in RESUMED | {"single": 1}}
    for n in ("pp2", "single"):
        runs[f"{n}_eval"] = [r for r in metrics(out / n) if "eval_loss" in r]
    with open(out / "pp2" / "memory.json") as f, open(out / "single" / "memory.json") as g:
        runs["pp2_memory"], runs["single_memory"] = json.load(f), json.load(g)
    return runs


RESUMED = {"dp2": 1, "pp2": 1, "resumed": 6, "pp2_resumed": 6, "resumed_pp2": 6}
"""Run -> its first step: dp2 and pp2 from scratch; dp2's step-5 checkpoint continued on one process and under pp2,
pp2's on one process."""


def test_rampup_dp2_pp2_equal_one_process_and_resume_mid_ramp(ramp_runs):
    """dp2 and pp2 (2, 4, 6, 8 micro-batches per pipeline call) through the ramp, and the step-5 checkpoints (mid-ramp)
    continued across layouts, equal one process: loss and grad norm per step, token and sample counts exact."""
    ref = ramp_runs["single"]
    assert [r["consumed_samples"] for r in ref] == CONSUMED
    assert [r["tokens"] for r in ref] == [(b - a) * 32 for a, b in zip([0] + CONSUMED, CONSUMED)]
    assert ref[-1]["tokens_total"] == CONSUMED[-1] * 32
    for name, first in RESUMED.items():
        got = ramp_runs[name]
        assert [r["step"] for r in got] == list(range(first, 11)), name
        for r in got:
            e = ref[r["step"] - 1]
            for k in ("loss", "grad_norm"):
                assert abs(r[k] - e[k]) <= 1e-5, (name, r["step"], k, r[k], e[k])
            for k in ("tokens", "tokens_total", "consumed_samples"):
                assert r[k] == e[k], (name, r["step"], k, r[k], e[k])
    got, want = ramp_runs["pp2_eval"], ramp_runs["single_eval"]  # the pipeline's count is reset for evaluation
    assert [r["step"] for r in got] == [r["step"] for r in want] == [5, 10]
    for r, e in zip(got, want):
        assert abs(r["eval_loss"] - e["eval_loss"]) <= 1e-5 and r["eval_tokens"] == e["eval_tokens"], (r, e)


def test_rampup_pp2_ranks_hold_their_stage(ramp_runs):
    """Each pp2 rank holds its stage only (a pipeline that fell back to replication fails here)."""
    check_memory(ramp_runs["pp2_memory"], ramp_runs["single_memory"], "pp2", tied=True)


def test_lr_follows_consumed_samples_through_the_ramp(ramp_runs, tiny_corpus):
    """Each step's LR is the schedule's at (samples consumed before it) / train.global_batch_size, on every layout."""
    from llmtest import compose
    from llmtrain.config import to_config
    from llmtrain.train.schedule import lr_at

    cfg = to_config(compose(tiny_overrides(tiny_corpus, "/tmp/unused", "gpt", steps=10)))
    before = [0] + CONSUMED[:-1]
    want = [lr_at(c / 16, cfg.optim, 10) for c in before]
    assert want[1] != lr_at(1, cfg.optim, 10)  # the ramp's small steps move the schedule less than a step
    assert max(want) == cfg.optim.lr  # position 1.5 of the 2-step warmup: the peak, not above it
    for name in ("single", *RESUMED):
        for r in ramp_runs[name]:
            assert abs(r["lr"] - want[r["step"] - 1]) <= 1e-12 * max(1.0, want[r["step"] - 1]), (name, r["step"])


def test_resolve_lists_rampup_problems(tiny_corpus):
    from llmtest import compose
    from llmtrain.config import ConfigError, to_config
    from llmtrain.resolve import resolve

    def problems(*extra):
        cfg = to_config(compose(tiny_overrides(tiny_corpus, "/tmp/unused", "gpt") + [
            "model.num_layers=8", "train.global_batch_size=32", *extra]))
        with pytest.raises(ConfigError) as e:
            resolve(cfg, world_size=4)
        return str(e.value)

    text = problems("+parallel=dp2pp2", "train.batch_rampup=[6,4,48]")
    assert "train.batch_rampup=[6, 4, 48]: START 6 is not a multiple of micro batch x data-parallel ranks" in text
    assert "parallel.pp" not in text and "virtual_pp" not in text  # a 1F1B pipeline ramps
    assert "parallel.virtual_pp=2" in problems("+parallel=pp4v2", "train.batch_rampup=[16,8,48]")
    moe = problems("+parallel=pp2", "model=moe-tiny", "train.batch_rampup=[16,8,48]")
    assert "train.batch_rampup with model.moe_num_experts=" in moe and "parallel.pp=2" in moe
