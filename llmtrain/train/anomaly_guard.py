"""The divergence guard as the training loop sees it: a step under the guard, then what to do about it.

    python -m pytest -q tests/train/test_guard_fast.py
    guard = AnomalyGuard(cfg.train.anomaly, topo, runner, clip, optimizer, windows)   # gates the optimizer's clip
    guard.before_next_step(data)                          # after a rewind: jump over the skipped data window
    out = guard.run_step(runner, micro_batches, step, samples)   # out.anomaly: a Verdict when rejected
    action = guard.policy(out.anomaly, ckpt)              # "skip" | "rewind" | "stop" (every rank the same)
    step = guard.rewind(out.anomaly, ckpt, data, meter)   # or guard.stop(...): raises Diverged

Re-run (`rerun`): a non-finite first result re-runs the same micro-batches from the same state (parameters
untouched, gradients cleared, the RNG state of the step's start restored) once. A finite re-run is a transient
fault (a flipped bit, a faulty device): logged with the ranks whose local loss was non-finite and their hosts,
counted (`transient_faults`), and the re-run's update is kept. A repeated non-finite result is the data's or
the numerics': the policy acts. A rejected step's gradients are cleared and the LR schedule advances (the step
counts).

fp16: a step whose gradients overflowed passes the detector (the scaler's business), the scaler skips its update
and lowers the scale; afterwards the guard reads the new scale, counts the overflow and, when it persists
(`Policy.overflowed`), returns the step as rejected (`loss_scale_overflow`) for the policy to act on.
The parts: `anomaly_detect.py`, `anomaly_policy.py`, `anomaly_rewind.py`, `anomaly_report.py`.
"""
from __future__ import annotations

from typing import Optional

import paddle

from llmtrain.paddle_compat.amp import loss_scale
from llmtrain.parallel.job_comm import JobComm
from llmtrain.train import anomaly_report as report
from llmtrain.train.anomaly import AnomalousStep, AnomalyConfig, Diverged, Verdict
from llmtrain.train.anomaly_detect import Detector, GatedClip
from llmtrain.train.anomaly_policy import Policy
from llmtrain.train.anomaly_rewind import Rewinder, SkipWindows


class AnomalyGuard:
    """One run's divergence guard: detector, policy state, rewind (the same decisions on every rank)."""

    def __init__(self, cfg: AnomalyConfig, topo, runner, clip, optimizer, windows: Optional[SkipWindows] = None,
                 comm=None, fp8=None):
        """Wraps `clip` (the recording clip on `optimizer`) in a `GatedClip`. `windows`: the skipped data windows,
        a component of the checkpoints (`Trainer` passes the one in its training state). `comm`: the job's
        collectives (default `JobComm(topo.world)`; tests pass a scripted stand-in). `fp8`: the model's `FP8Health`
        under `train.fp8` (non-finite amaxes reject the step), or None."""
        from llmtrain.paddle_compat.optim import get_grad_clip, optimizer_chain, set_grad_clip

        self.cfg, self.topo, self.runner = cfg, topo, runner
        self.scaler = runner.scaler
        self.detector = Detector(cfg, topo, comm or JobComm(topo.world), self._local_loss, self.scaler, fp8)
        self.policy_state = Policy(cfg)
        self.windows = windows if windows is not None else SkipWindows()
        self.rewinder = Rewinder(cfg, self.windows)
        self.last: Optional[Verdict] = None
        """The verdict of the latest step."""
        self.loss_scale: Optional[float] = loss_scale(self.scaler)
        self._step, self._judged, self._target = 0, False, None
        wrapped = 0
        for opt in optimizer_chain(optimizer):
            if get_grad_clip(opt) is clip:
                set_grad_clip(opt, GatedClip(clip, self))
                wrapped += 1
        if not wrapped:
            raise RuntimeError("anomaly guard: the recording clip is not on the optimizer")

    @property
    def counts(self) -> dict:
        return self.policy_state.counts

    @property
    def kind_counts(self) -> dict:
        return self.policy_state.kind_counts

    # ---- detection (inside optimizer.step, through the gated clip) ----
    def _local_loss(self):
        """This rank's step loss (fp32 scalar tensor) or None where it holds none (a pipeline's earlier stages)."""
        if self.runner.pipeline:
            from llmtrain.paddle_compat.fleet import pipeline_step_loss

            return pipeline_step_loss(self.runner.model)
        losses = getattr(self.runner, "step_losses", None)
        return paddle.stack(losses).mean() if losses else None

    def judge(self, norm) -> Verdict:
        """The current step's verdict (`Detector.judge`); raises AnomalousStep when it is rejected."""
        self._judged = True
        try:
            self.last = self.detector.judge(norm, self._step)
        except AnomalousStep as e:
            self.last = e.verdict
            raise
        return self.last

    # ---- one step, re-run once on a non-finite result ----
    def run_step(self, runner, micro_batches, step: int, samples: tuple[int, int]):
        """`runner.run(micro_batches)` under the guard; the StepOutput carries `anomaly` (a Verdict or None).
        `samples`: (consumed samples before, after) this step's batch."""
        self._step, self._judged, self.last = step, False, None
        self.rewinder.track(step, samples)
        rng = paddle.get_rng_state() if self.cfg.rerun else None
        try:
            return self._attempt(runner, micro_batches)
        except AnomalousStep as e:
            first = e.verdict
            runner.optimizer.clear_grad()  # the rejected step's gradients; nothing was applied
        if first.nonfinite and self.cfg.rerun:
            paddle.set_rng_state(rng)
            self._judged = False
            try:
                out = self._attempt(runner, micro_batches)
                self.policy_state.transient()
                report.transient_lines(first, self.last, self.topo.rank)
                return out
            except AnomalousStep as e:
                runner.optimizer.clear_grad()
                report.rerun_repeated_line(step)
                first = e.verdict
        runner.scheduler.step()  # the step counts (the update was dropped)
        self.policy_state.rejected(first)
        return _rejected_output(micro_batches, first)

    def _attempt(self, runner, micro_batches):
        out = runner.run(micro_batches)
        if not self._judged:  # the clip did not run (no gradient reached it): judge the loss alone
            self.judge(None)
        v = self.last
        if self.scaler is not None:
            self.loss_scale = v.loss_scale = loss_scale(self.scaler)  # after the scaler's update
        out.anomaly = None
        if not v.overflow:
            self.policy_state.accepted()
        elif self.policy_state.overflowed(v):  # persists: an anomaly (the scaler already skipped the update)
            v.kinds.append("loss_scale_overflow")
            self.policy_state.rejected(v)
            out.anomaly = v
        return out

    # ---- the trainer's calls for a rejected step (checkpointer, data, meter are the loop's) ----
    def policy(self, v: Verdict, ckpt) -> str:
        """`skip`, `rewind` or `stop` for a rejected step (every rank calls it: a rewind's target is agreed here)."""
        self._target = None
        p = self.policy_state
        if self.cfg.policy == "rewind" and p.counts["rewinds"] < self.cfg.max_rewinds:
            self._target = self.rewinder.find_target(v, ckpt)
        return p.act(v, has_healthy_checkpoint=self._target is not None)

    def stop(self, v: Verdict, ckpt, meter) -> None:
        """Raise Diverged naming the step, the anomaly, its values and the newest healthy checkpoint."""
        ckpt.close()  # the last background write is complete: the newest healthy checkpoint is whole
        meter.write_event({"step": v.step, "event": "stopped", "anomaly": list(v.kinds),
                           "reason": self.policy_state.reason})
        meter.close()
        raise Diverged(report.stop_message(v, self.policy_state.reason, ckpt.newest_healthy(), self.windows.windows))

    def rewind(self, v: Verdict, ckpt, data, meter) -> int:
        """Reload the target `policy` agreed on; returns its step (the loop continues there)."""
        self.policy_state.rewound()
        step, window = self.rewinder.rewind(v, self._target, ckpt, data, meter, self.counts)
        self.detector.forget_after(step)
        self.loss_scale = loss_scale(self.scaler)  # the checkpoint's
        meter.write_event({"step": v.step, "event": "rewind", "anomaly": list(v.kinds), "to_step": step,
                           "skip_samples": list(window), **self.metrics()})
        return step

    def before_next_step(self, data) -> None:
        """Skip the recorded data windows when the data position reaches one of them."""
        self.windows.before_next_step(data)

    # ---- reporting ----
    def health(self) -> dict:
        """The manifest's `health` of a checkpoint written now."""
        return report.health(self.last)

    def metrics(self) -> dict:
        """Fields of every metrics.jsonl record: this step's anomaly or overflow (if any), the counters, the scale."""
        return report.record_fields(self.counts, self.last, self.loss_scale)


def _rejected_output(micro_batches, v: Verdict):
    """A StepOutput for a rejected step: its (agreed) loss and norm, nothing trained."""
    import numpy as np

    from llmtrain.train.step import StepOutput

    tokens = int(sum(float(np.asarray(mb["loss_mask"]).sum()) for mb in micro_batches))
    positions = int(sum(np.asarray(mb["input_ids"]).size for mb in micro_batches))
    nan = float("nan")
    out = StepOutput(loss=paddle.to_tensor(v.loss if v.loss is not None else nan, dtype="float32"), tokens=tokens,
                     positions=positions,
                     grad_norm=paddle.to_tensor(v.grad_norm if v.grad_norm is not None else nan, dtype="float32"))
    out.anomaly = v
    return out
