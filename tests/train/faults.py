"""Faults the divergence-guard tests inject into real training runs, from the test side (no switch in production code).

    {"call": "tests/train/faults.py:poison_grads", "args": [STEP, RANK]}   # a multirun entry before the run
    {"call": "tests/train/faults.py:clear"}                                # and one after it
    faults.spike(32, 300.0); ...; faults.clear()                           # or in-process

Each function patches the real classes for the runs that follow in this process (the
multirun worker runs every entry of a launch in the same processes, in order):
- `poison_grads(step, rank)`: on that global rank, the first loss computation of the `step`-th
  batch passes its logits through a layer whose backward returns NaN (the loss stays finite):
  a gradient corrupted once, as a faulty device would. A re-run of the step is clean.
- `poison_grads_from(step, rank)`: the same for every loss computation from the `step`-th batch on (under
  fp16: an overflow that persists).
- `drop_update(step)`: the `step`-th batch's optimizer update is not applied (AdamW.step returns at once; the
  LR schedule still advances): a run that never saw that step's update.
- `spike(sample, factor)`: the batch that starts at consumed-samples position `sample` has its logits
  multiplied by `factor` on every rank: a batch whose loss spikes (and whose gradients are huge).
- `skip_samples(start, end)`: the data jumps from `start` to `end`: a run that never saw those samples.
- `lr_from(step, lr)`: from the `step`-th optimizer step on, the learning rate is `lr` (a diverging LR).
"""
from __future__ import annotations

import os

import paddle

from llmtrain.data.loader import PretrainData
from llmtrain.models.loss import LMLoss
from llmtrain.train.schedule import WarmupDecay
from llmtrain.train.step import StepRunner

STATE_HOLDER = PretrainData  # runpy runs this file afresh for every call: originals and state live on a class
if not hasattr(STATE_HOLDER, "_fault_originals"):
    STATE_HOLDER._fault_originals = {"next_step": PretrainData.next_step, "forward": LMLoss.forward,
                                         "get_lr": WarmupDecay.get_lr,
                                         "evaluate": StepRunner.evaluate, "adamw_step": paddle.optimizer.AdamW.step}
_ORIG = STATE_HOLDER._fault_originals


def _state() -> dict:
    if not hasattr(STATE_HOLDER, "_fault_state"):
        STATE_HOLDER._fault_state = {}
    return STATE_HOLDER._fault_state


def _rank() -> int:
    return int(os.environ.get("PADDLE_TRAINER_ID", "0"))


class BadGrad(paddle.autograd.PyLayer):
    """Identity forward; the backward multiplies the gradient by `value` (NaN or inf): a corrupted gradient."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = float(value)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.value


def _track() -> dict:
    """Count batches and remember where the current one starts (PretrainData.next_step); once per `clear`."""
    st = _state()
    if st.get("tracking"):
        return st
    st.update(batches=0, batch_start=None, tracking=True)
    orig = _ORIG["next_step"]

    def next_step(self):
        skip = st.get("skip")
        if skip is not None and self.consumed_samples == skip[0]:
            self.load_state_dict(dict(self.state_dict(), consumed_samples=skip[1]))
        st["batches"] += 1
        st["batch_start"] = self.consumed_samples
        return orig(self)

    PretrainData.next_step = next_step
    orig_evaluate = _ORIG["evaluate"]

    def evaluate(self, micro_batches):  # faults fire on training batches only, never inside an evaluation
        st["evaluating"] = True
        try:
            return orig_evaluate(self, micro_batches)
        finally:
            st["evaluating"] = False

    StepRunner.evaluate = evaluate
    return st


def poison_grads(step: int, rank: int) -> None:
    st = _track()
    st["fired"] = False
    orig = LMLoss.forward  # faults compose: each wraps the forward in place

    def forward(self, logits, labels):
        if st["batches"] == int(step) and _rank() == int(rank) and not st["fired"] and not st.get("evaluating"):
            st["fired"] = True
            logits = BadGrad.apply(logits, float("nan"))
        return orig(self, logits, labels)

    LMLoss.forward = forward


def poison_grads_from(step: int, rank: int) -> None:
    st = _track()
    orig = LMLoss.forward

    def forward(self, logits, labels):
        if st["batches"] >= int(step) and _rank() == int(rank) and not st.get("evaluating"):
            logits = BadGrad.apply(logits, float("nan"))
        return orig(self, logits, labels)

    LMLoss.forward = forward


def drop_update(step: int) -> None:
    st = _track()
    orig = _ORIG["adamw_step"]

    def adamw_step(self):
        if st["batches"] == int(step):
            return None
        return orig(self)

    paddle.optimizer.AdamW.step = adamw_step


def spike(sample: int, factor: float) -> None:
    st = _track()
    orig = LMLoss.forward

    def forward(self, logits, labels):
        if st["batch_start"] == int(sample) and not st.get("evaluating"):
            logits = logits * float(factor)
        return orig(self, logits, labels)

    LMLoss.forward = forward


def skip_samples(start: int, end: int) -> None:
    _track()["skip"] = (int(start), int(end))


def lr_from(step: int, lr: float) -> None:
    orig = _ORIG["get_lr"]

    def get_lr(self):
        # the scheduler's last_epoch is the number of steps taken: step `step` runs at last_epoch == step - 1
        return float(lr) if self.last_epoch >= int(step) - 1 else orig(self)

    WarmupDecay.get_lr = get_lr


def clear() -> None:
    PretrainData.next_step = _ORIG["next_step"]
    LMLoss.forward = _ORIG["forward"]
    WarmupDecay.get_lr = _ORIG["get_lr"]
    StepRunner.evaluate = _ORIG["evaluate"]
    paddle.optimizer.AdamW.step = _ORIG["adamw_step"]
    _state().clear()
