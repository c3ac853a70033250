"""Warmup + cosine / linear / constant schedule."""
from __future__ import annotations

import math

import pytest

from llmtrain.train.config import OptimConfig
from llmtrain.train.schedule import WarmupDecay, lr_at


def test_warmup_then_cosine_to_min():
    c = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, schedule="cosine")
    assert [lr_at(s, c, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, c, 14) == pytest.approx(1.0)
    assert lr_at(9, c, 14) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, c, 14) == pytest.approx(0.1)
    assert lr_at(100, c, 14) == pytest.approx(0.1)


def test_fractional_warmup_position_never_exceeds_the_peak():
    """Batch ramp-up evaluates the schedule at consumed samples / global batch: position 1.5 of a 2-step warmup is
    the peak, not 1.25 x the peak (seen in the ramp-up runs' logged lr before the cap)."""
    c = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=2, schedule="cosine")
    assert lr_at(0.5, c, 10) == pytest.approx(0.75) and lr_at(1.5, c, 10) == 1.0
    assert max(lr_at(x / 8, c, 10) for x in range(80)) == 1.0


def test_linear_and_constant_and_decay_steps():
    lin = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="linear", decay_steps=10)
    assert lr_at(5, lin, 1000) == pytest.approx(0.5)
    const = OptimConfig(lr=0.3, warmup_steps=2, schedule="constant")
    assert lr_at(50, const, 10) == 0.3


def test_paddle_scheduler_follows_lr_at():
    c = OptimConfig(lr=2.0, min_lr=0.2, warmup_steps=3)
    s = WarmupDecay(c, max_steps=10)
    seen = []
    for _ in range(12):
        seen.append(s.get_lr())
        s.step()
    assert seen == pytest.approx([lr_at(i, c, 10) for i in range(12)])


def test_resume_at_recomputes_the_lr_of_the_step_under_the_schedule_in_force():
    """A loaded `last_lr` from another schedule (here: its end, min_lr) never survives resume_at."""
    c = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=1)
    s = WarmupDecay(c, max_steps=8)
    s.set_state_dict({"last_epoch": 4, "last_lr": 0.1})  # what a finished 4-step run saved
    s.resume_at(4)
    assert s.get_lr() == s.last_lr == pytest.approx(lr_at(4, c, 8))


def test_wsd_stable_then_decay_shapes():
    from llmtrain.train.schedule import wsd_decay_start

    base = dict(lr=1.0, min_lr=0.1, warmup_steps=2, schedule="wsd")
    c = OptimConfig(**base, decay_fraction=0.25, decay_shape="linear")
    assert wsd_decay_start(c, 20) == 15
    assert [lr_at(s, c, 20) for s in (0, 1, 2, 14, 15)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert lr_at(20, c, 20) == pytest.approx(0.1) and lr_at(17, c, 20) == pytest.approx(0.1 + 0.9 * 0.6)
    sq = OptimConfig(**base, decay_start_step=10, decay_shape="1-sqrt")
    assert lr_at(14, sq, 20) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.4)))
    cos = OptimConfig(**base, decay_start_step=10, decay_shape="cosine")
    assert lr_at(15, cos, 20) == pytest.approx(0.55)
    # a longer horizon leaves every stable step's LR unchanged: a stable checkpoint extends seamlessly
    assert all(lr_at(s, c, 20) == lr_at(s, c, 100) for s in range(15))


def test_schedule_problems_name_fields_and_numbers():
    from llmtrain.train.schedule import schedule_problems

    bad = OptimConfig(schedule="wsd", decay_fraction=1.5, decay_start_step=30, decay_shape="sqrt")
    text = "\n".join(schedule_problems(bad, 20))
    for part in ("optim.decay_shape='sqrt'", "optim.decay_fraction=1.5: must be in (0, 1]", "give one of the two",
                 "optim.decay_start_step=30: must be in [0, 20]"):
        assert part in text, text
    assert schedule_problems(OptimConfig(decay_fraction=0.2), 20)  # cosine with a WSD field
