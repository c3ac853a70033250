"""What building a model hands the trainer, and how a plan takes part in every training step.

    python -m pytest tests/train/test_accumulation.py -q
    built = build_local_model(cfg.model, layout, topo)      # llmtrain.parallel.build -> BuiltModel
    runner = StepRunner(..., hooks=built.hooks)             # the loop calls the hooks; it knows no model family

The training loop is the same for every model family and layout. What differs (an MoE
model's routing statistics and bias update, the pipeline's balancing-loss scaling and
its switch to token sums for evaluation, ZeRO-3 cutting frozen weights back to slices)
is a `StepHook` the model or the plan registers in `BuiltModel.hooks`. A step runs:

    hook.before_step(micro_batches)                 every hook, before the first forward
    forward + backward of every micro-batch
    hook.before_update(UpdateCheck)                 every hook, after the last backward
    optimizer step, scheduler step
    hook.after_step(StepRecord)                     every hook: metrics, the logged loss
    with hook.evaluation(): ...                     around an evaluation pass

Under pipeline parallelism fleet's schedule runs forward, backward and the optimizer
step in one call, so `before_update` is not called there; every other method is. No hook
can veto an update: a decision on some ranks only would leave the others waiting in the
step's collectives. Whether a step's update is applied is decided by the divergence guard,
from numbers all ranks reduce together (`llmtrain/train/anomaly.py`).

The loss functions a `BuiltModel` carries return `(loss_sum, tokens)` (fp32 scalar
tensors: the sum of per-token losses over loss-bearing positions, and their count);
the caller divides (`mean_loss`) or sums over batches (evaluation).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


def mean_loss(terms):
    """`(loss_sum, tokens)` -> loss_sum / max(tokens, 1): the mean token loss of one micro-batch (fp32 scalar)."""
    import paddle

    loss_sum, tokens = terms
    return loss_sum / paddle.clip(tokens, min=1.0)


@dataclass
class UpdateCheck:
    """What a hook sees after the step's last backward, before the optimizer update (flat models only)."""

    loss: Any
    """Mean loss of this rank's micro-batches of the step (fp32 scalar tensor; not averaged over data ranks)."""
    micro_batches: int
    """Micro-batches this rank ran in the step."""


@dataclass
class StepRecord:
    """What a hook sees after a step; a hook may replace `loss` and add to `metrics`."""

    step: int
    """The step just completed (1-based)."""
    loss: Any
    """The step's loss as it will be logged (fp32 scalar tensor)."""
    grad_norm: Any
    """Global gradient norm before clipping (None when the clip did not run)."""
    tokens: int
    """Loss-bearing target tokens this rank consumed in the step."""
    reduce_sum: Callable[[list], list]
    """Sums a list of floats over the data-parallel ranks (a collective: every rank calls it the same times)."""
    metrics: dict = field(default_factory=dict)
    """Extra metrics of the step, written beside the loss (metrics.jsonl)."""
    logged: bool = True
    """Whether this step's record is written (`train.log_interval`): on other steps the metrics are dropped, so a
    hook need not read the device for them."""
    reduce_device: Optional[Callable[[Any], Any]] = None
    """Sums a tensor over the data-parallel ranks on the device (a collective, no host read; None: not offered)."""


class StepHook:
    """One participant in every training step. Subclass and override what you need; each method is optional."""

    def before_step(self, micro_batches: int) -> None:
        """Before the step's first forward, with this rank's micro-batch count (it varies under batch ramp-up)."""

    def before_update(self, check: UpdateCheck) -> None:
        """After the last backward, before the optimizer update (flat models)."""

    def after_step(self, record: StepRecord) -> None:
        """After the update: add metrics to `record.metrics`, or replace `record.loss` (the logged loss)."""

    def evaluation(self):
        """A context manager entered around an evaluation pass."""
        return contextlib.nullcontext()


@dataclass
class BuiltModel:
    """This rank's model as the layout built it: what the trainer needs, returned rather than hung on layers."""

    core: Any
    """The unwrapped model, or this rank's pipeline stage(s) as a `PipelineLayer`; its parameters are ours."""
    loss_fn: Optional[Callable]
    """(logits, (labels, loss_mask)) -> (loss_sum, tokens) for flat models; None under pipeline parallelism (the
    PipelineLayer owns the loss)."""
    pipeline: bool = False
    """True when `core` is a `PipelineLayer` (fleet's schedule runs the step)."""
    hooks: list = field(default_factory=list)
    """`StepHook`s of the model and the plan, called by the step loop in order."""
    inputs: Optional[Callable[[dict], dict]] = None
    """This rank's part of a micro-batch of whole samples (numpy {key: [m, s]} -> the same keys, cut), applied by the
    step loop after counting tokens; None: the whole micro-batch (context parallelism: its sequence chunks)."""
    report: Optional[Callable[[], dict]] = None
    """What the plan did and held on this rank beyond parameters (memory.json's per-rank "context" entry), or None."""


@contextlib.contextmanager
def evaluating(hooks):
    """Enter every hook's `evaluation()` context for the duration."""
    with contextlib.ExitStack() as stack:
        for hook in hooks:
            stack.enter_context(hook.evaluation())
        yield
