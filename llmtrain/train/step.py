"""One optimizer step over this rank's micro-batches: accumulate, clip, update.

    runner = StepRunner(model, loss_fn, optimizer, scheduler, clip, amp, pipeline=False, hooks=built.hooks)
    out = runner.run(micro_batches)     # StepOutput(loss, tokens, grad_norm)
    record = runner.finish(step, out, reduce_sum)      # the step hooks' metrics and logged loss

The model family and the plan take part only through their step hooks
(`llmtrain.contracts.steps.StepHook`: before the step, before the update, after
the step, around an evaluation). Flat models (one device, dp, tp, sharding): each
micro-batch's mean token loss (the loss function's sum / count) is divided by the
number of micro-batches and back-propagated; under
`paddle.DataParallel` all but the last micro-batch run inside `no_sync()`, so
gradients are all-reduced once per step. Pipeline models: the micro-batches are
concatenated and handed to `PipelineParallel.train_batch`, whose schedule runs
them as its own micro-batches and steps the optimizer and scheduler itself. Their
count is set before every call (`set_pipeline_micro_batches`): grad_accum, or under
`train.batch_rampup` the step's own count.

fp16: the loss is multiplied by the loss scale before the backward and the scaler
steps the optimizer (`GradScaler.step`: unscale, then the optimizer skips the update
of an overflowing step) and lowers or raises the scale (`update`). A step that raises
inside (the divergence guard rejecting it from the clip) leaves the scaler ready for
the next step (`paddle_compat.amp.abandon_step`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import paddle

from llmtrain.contracts.steps import StepRecord, UpdateCheck, evaluating, mean_loss
from llmtrain.paddle_compat.fleet import set_pipeline_micro_batches
from llmtrain.paddle_compat.host_memory import no_collection
from llmtrain.train.amp import AmpPlan


@dataclass
class StepOutput:
    loss: paddle.Tensor
    """Mean loss of this rank's micro-batches (fp32 scalar tensor; not yet averaged over data ranks)."""
    tokens: int
    """Loss-bearing target tokens this rank consumed in the step (sum of loss_mask)."""
    positions: int
    """Input positions this rank processed (micro x seq x accum): what model FLOPs scale with."""
    grad_norm: Optional[paddle.Tensor]
    """Global gradient norm before clipping (over all ranks and groups); None when the clip did not run."""
    anomaly: Optional[Any] = None
    """The divergence guard's verdict when it rejected the step (`llmtrain.train.anomaly.Verdict`), else None."""


def to_tensors(mb: dict):
    """numpy micro-batch -> (input_ids [m, s] int64, (labels [m, s] int64, loss_mask [m, s] fp32))."""
    ids = paddle.to_tensor(mb["input_ids"], dtype="int64")
    labels = paddle.to_tensor(mb["labels"], dtype="int64")
    mask = paddle.to_tensor(mb["loss_mask"], dtype="float32")
    return ids, (labels, mask)


def allocated_bytes() -> int:
    """Bytes Paddle's allocator holds now on this process's device (host counter on CPU)."""
    if paddle.get_device() == "cpu":
        from llmtrain.paddle_compat.host_memory import host_allocated_bytes

        return host_allocated_bytes()
    return int(paddle.device.cuda.memory_allocated())


def packing_inputs(mb: dict) -> dict:
    """Packed SFT micro-batches: {position_ids, segment_ids} [m, s] int64 for the model; {} otherwise."""
    return {k: paddle.to_tensor(mb[k], dtype="int64") for k in ("position_ids", "segment_ids") if k in mb}


def pipeline_inputs(micro_batches: list[dict]):
    """The micro-batches concatenated for a pipeline: (first stage's input, (labels, loss_mask)); the input is the
    ids [n m, s], or (ids, position_ids[, segment_ids]) when the batches carry positions (the stages pass them on)."""
    batch = {k: np.concatenate([mb[k] for mb in micro_batches]) for k in micro_batches[0]
             if k in ("input_ids", "labels", "loss_mask", "position_ids", "segment_ids")}
    ids, labels = to_tensors(batch)
    extra = packing_inputs(batch)
    if extra:
        ids = (ids, extra["position_ids"], *([extra["segment_ids"]] if "segment_ids" in extra else []))
    return ids, labels


@contextlib.contextmanager
def _scaler_step(scaler):
    """Around the scaler's step: if it raises (a rejected step), the next step unscales its own gradients."""
    try:
        yield
    except BaseException:
        from llmtrain.paddle_compat.amp import abandon_step

        abandon_step(scaler)
        raise


class StepRunner:
    def __init__(self, model, loss_fn, optimizer, scheduler, clip, amp: AmpPlan, pipeline: bool = False, scaler=None,
                 accumulate_steps: int = 1, hooks=(), inputs=None):
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.clip = clip
        self.amp = amp
        self.pipeline = pipeline
        self.scaler = scaler
        self.can_skip_sync = isinstance(model, paddle.DataParallel)
        self.accumulate_steps = int(accumulate_steps)
        """The pipeline's micro-batches per evaluation call (train.grad_accum; fleet's `pipeline_configs.accumulate_steps`)."""
        self.activation_bytes = None
        """Bytes one micro-batch's forward left allocated for its backward (activations and logits): the last
        micro-batch of the first flat step (after the first, which also fills one-time caches such as RoPE tables;
        with one micro-batch a step, that one), by `allocated_bytes`; None under pp (fleet's schedule runs the
        forwards) or before."""
        self.inputs = inputs or (lambda mb: mb)
        """This rank's part of a micro-batch (`BuiltModel.inputs`: context parallelism's sequence chunks), applied
        after the tokens are counted from the whole micro-batch."""
        self.hooks = list(hooks)
        """The model's and the plan's `StepHook`s (`BuiltModel.hooks`). `before_update` is not called under pp (the
        pipeline steps the optimizer itself)."""

    def run(self, micro_batches: list[dict]) -> StepOutput:
        tokens = int(sum(float(np.asarray(mb["loss_mask"]).sum()) for mb in micro_batches))
        positions = int(sum(np.asarray(mb["input_ids"]).size for mb in micro_batches))
        for hook in self.hooks:
            hook.before_step(len(micro_batches))
        self.clip.last_norm = None  # set by the clip inside the optimizer step
        if self.pipeline:
            loss = self._run_pipeline(micro_batches)
        else:
            loss = self._run_flat(micro_batches)
        return StepOutput(loss=loss, tokens=tokens, positions=positions, grad_norm=self.clip.last_norm)

    def finish(self, step: int, out: StepOutput, reduce_sum, logged: bool = True, reduce_device=None) -> StepRecord:
        """After the step: every hook's `after_step` (metrics such as MoE routing statistics; the logged loss);
        `logged`: the step writes a record; `reduce_device`: a device-side sum over the data ranks (StepRecord)."""
        record = StepRecord(step=step, loss=out.loss, grad_norm=out.grad_norm, tokens=out.tokens,
                            reduce_sum=reduce_sum, logged=logged, reduce_device=reduce_device)
        for hook in self.hooks:
            hook.after_step(record)
        return record

    def _run_flat(self, micro_batches):
        self.model.train()
        n = len(micro_batches)
        losses = []
        for i, mb in enumerate(micro_batches):
            mb = self.inputs(mb)
            ids, labels = to_tensors(mb)
            skip_sync = self.can_skip_sync and i < n - 1
            with self.model.no_sync() if skip_sync else contextlib.nullcontext():
                measure = self.activation_bytes is None and i == n - 1
                with no_collection() if measure else contextlib.nullcontext():  # no earlier garbage freed inside
                    before = allocated_bytes() if measure else None
                    with self.amp.autocast():
                        logits = self.model(ids, **packing_inputs(mb))  # [m, s, V/tp]
                        loss = mean_loss(self.loss_fn(logits, labels))  # fp32 scalar
                    if measure:
                        self.activation_bytes = allocated_bytes() - before
                scaled = loss / n
                if self.scaler is not None:
                    scaled = self.scaler.scale(scaled)
                scaled.backward()
            losses.append(loss.detach())
        self.step_losses = losses  # divergence guard: read by its check inside optimizer.step() (anomaly.py)
        loss = paddle.stack(losses).mean()
        check = UpdateCheck(loss=loss, micro_batches=n)
        for hook in self.hooks:
            hook.before_update(check)
        if self.scaler is not None:
            with _scaler_step(self.scaler):
                self.scaler.step(self.optimizer)  # unscale; the optimizer skips an overflowing step's update
                self.scaler.update()  # the loss scale: lowered after an overflow
        else:
            self.optimizer.step()
        self.optimizer.clear_grad()
        self.scheduler.step()
        return loss

    def _run_pipeline(self, micro_batches):
        # [accum * m, s] each: the pipeline cuts them back into its accumulate_steps micro-batches
        ids, labels = pipeline_inputs([self.inputs(mb) for mb in micro_batches])
        set_pipeline_micro_batches(self.model, len(micro_batches))  # varies per step under batch ramp-up
        with self.amp.autocast(), _scaler_step(self.scaler):  # the schedule steps the scaler and the optimizer
            loss = self.model.train_batch([ids, labels], optimizer=self.optimizer, lr_scheduler=self.scheduler, scaler=self.scaler)
        return loss.detach().astype("float32").reshape([])

    @paddle.no_grad()
    def evaluate(self, micro_batches: list[dict]) -> tuple[float, int]:
        """(sum of the token losses, loss-bearing tokens) over this rank's validation micro-batches.

        Flat models: the loss function's token sums are added up; a pipeline's loss returns token sums
        while the step hooks' `evaluation()` contexts are entered. The caller's sum / tokens over all
        data ranks is the exact token-weighted mean. A pipeline evaluates `accumulate_steps` micro-batches per
        call (fleet's eval_batch cuts its input into that many; the last group is filled with copies
        whose loss mask is zero) and returns their mean, times accumulate_steps the sum."""
        tokens = int(sum(float(np.asarray(mb["loss_mask"]).sum()) for mb in micro_batches))
        total = 0.0
        self.model.eval()
        with evaluating(self.hooks):
            if self.pipeline and micro_batches:
                steps = self.accumulate_steps
                set_pipeline_micro_batches(self.model, steps)  # a ramp-up step may have left another count
                blank = dict(micro_batches[-1], loss_mask=np.zeros_like(micro_batches[-1]["loss_mask"]))
                padded = list(micro_batches) + [blank] * (-len(micro_batches) % steps)
                for i in range(0, len(padded), steps):
                    ids, labels = pipeline_inputs([self.inputs(mb) for mb in padded[i:i + steps]])
                    with self.amp.autocast():
                        loss = self.model.eval_batch([ids, labels], compute_loss=True)
                    total += float(loss.astype("float32").reshape([])) * steps
            else:
                for mb in micro_batches:
                    mb = self.inputs(mb)
                    ids, labels = to_tensors(mb)
                    with self.amp.autocast():
                        loss_sum, _ = self.loss_fn(self.model(ids, **packing_inputs(mb)), labels)
                    total += float(loss_sum.astype("float32"))
        self.model.train()
        return total, tokens
