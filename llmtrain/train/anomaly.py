"""Divergence guard: non-finite and spike detection on every step, agreed by all ranks; skip / rewind / stop.

    python llmtrain/pretrain.py train.anomaly.policy=rewind train.anomaly.max_rewinds=3   # the defaults
    guard = AnomalyGuard(cfg.train.anomaly, topo, runner, clip, optimizer)   # gates the optimizer's clip
    out = guard.run_step(runner, micro_batches, step)   # StepRunner.run, re-run once on a non-finite result
    action = guard.act(out.anomaly)                     # "skip" | "rewind" | "stop"

Where the check sits: between the backward and the update. The recording clip computes the
step's global gradient norm (every layout's own reduction: dp, tp, pp, sharding, ZeRO, ep) inside
`optimizer.step()`; `GatedClip` wraps it and, before any parameter or optimizer state changes,
calls `AnomalyGuard.judge`: one all-reduce of five numbers over the whole job (this rank's step
loss and a count where it holds one, rank 0's norm, a count and a rank-id sum of ranks whose local
loss is non-finite). Every rank derives the same verdict from the same reduced numbers, so every
rank either applies the update or raises `AnomalousStep` at the same point: no rank waits on a
collective the others skipped, whatever the layout. A rejected step leaves parameters and optimizer
state untouched (the clip runs before the update), its gradients are cleared and the LR schedule
advances (the step counts).

What is an anomaly (thresholds in `AnomalyConfig`; history = the last `window` accepted steps):
- non-finite loss (mean over data ranks) or non-finite global gradient norm;
- loss spike: loss > loss_spike x median(history) and loss - median > loss_spike_min_increase, once
  `warmup_steps` steps are in the history;
- grad-norm spike: grad_norm > grad_norm_spike x median(history), once `grad_norm_warmup_steps` are.
The median ignores earlier outliers and a slow trend; rejected steps never enter the history.

Re-run (`rerun`): a non-finite first result re-runs the same micro-batches from the same state
(parameters untouched, gradients cleared, the RNG state of the step's start restored) once. A finite
re-run is a transient fault (a flipped bit, a faulty device): logged with the ranks whose local loss
was non-finite and their hosts, counted (`transient_faults`), and the re-run's update is kept. A
repeated non-finite result is the data's or the numerics': the policy acts.

Policies (`policy`), for an anomaly the re-run did not clear:
- `stop`: end the run (`Diverged`, exit status `EXIT_DIVERGED`) naming the step, the anomaly, the values
  and the newest healthy checkpoint; no checkpoint is written from the rejected state.
- `skip`: drop the update (data consumed, LR advances), count it; after `max_consecutive_skips` in a row: stop.
- `rewind` (default): reload the newest healthy checkpoint at least `rewind_back_steps` before the anomaly,
  replay the data up to the window and skip the samples of the last `skip_batches` global batches ending
  with the anomalous one; after `max_rewinds` rewinds (or with no healthy checkpoint): stop.
"""
from __future__ import annotations

import math
import socket
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Optional

import paddle
import paddle.distributed as dist

from llmtrain.utils.log import log0, log_all

EXIT_DIVERGED = 5
"""Process exit status of a run the guard stopped (2: configuration error, 3/4: the watchdog)."""

POLICIES = ("stop", "skip", "rewind")
KINDS = ("nonfinite_loss", "nonfinite_grad_norm", "loss_spike", "grad_norm_spike")


@dataclass
class AnomalyConfig:
    """`train.anomaly`: what counts as a divergence and what the run does about it (docs/divergence.md)."""

    policy: str = "rewind"
    """`rewind` (reload the newest healthy checkpoint, skip the offending data; bounded by max_rewinds, then stop),
    `skip` (drop the step's update; bounded by max_consecutive_skips, then stop) or `stop` (exit status 5)."""

    rerun: bool = True
    """Re-run a step whose loss or gradient norm is non-finite once from the same state: finite the second time
    means a transient hardware fault (logged, counted, the re-run's update kept)."""

    window: int = 100
    """Accepted steps whose median is the reference of the spike tests."""

    warmup_steps: int = 1
    """Accepted steps in the history before the loss-spike test starts (a doubling of the loss is never noise)."""

    loss_spike: float = 2.0
    """A loss above this many times the window's median loss is a spike (LLM Foundry's loss-spike multiplier)."""

    loss_spike_min_increase: float = 1.0
    """...and above the median by at least this much (nats): low fine-tuning losses may double harmlessly."""

    grad_norm_warmup_steps: int = 20
    """Accepted steps in the history before the grad-norm-spike test starts (early norms move by large factors)."""

    grad_norm_spike: float = 10.0
    """A gradient norm (before clipping) above this many times the window's median is a spike; 0 disables."""

    max_consecutive_skips: int = 5
    """policy=skip: stop after this many skipped steps in a row (the state itself is bad, not a batch)."""

    max_rewinds: int = 3
    """policy=rewind: rewinds per process; the next anomaly after that stops the run."""

    rewind_back_steps: int = 0
    """policy=rewind: reload the newest healthy checkpoint at least this many steps before the anomalous step."""

    skip_batches: int = 1
    """policy=rewind: global batches skipped after the rewind, ending with the anomalous step's (PaLM skipped a few
    hundred around a spike); those before the rewind checkpoint cannot be skipped (already trained on)."""

    initial_checkpoint: bool = True
    """Save step 0 when a fresh run starts with checkpoint.interval > 0, so a rewind or a stop always has a healthy
    checkpoint from before the first update (a bad LR shows in the first steps, before the first interval)."""


def config_problems(cfg: AnomalyConfig) -> list[str]:
    """Value checks of `train.anomaly` (one line per problem, naming the field and the value)."""
    p = []
    if cfg.policy not in POLICIES:
        p.append(f"train.anomaly.policy={cfg.policy!r}: one of {', '.join(POLICIES)}")
    for name in ("window", "max_consecutive_skips", "skip_batches"):
        if getattr(cfg, name) < 1:
            p.append(f"train.anomaly.{name}={getattr(cfg, name)}: must be >= 1")
    for name in ("warmup_steps", "grad_norm_warmup_steps", "max_rewinds", "rewind_back_steps"):
        if getattr(cfg, name) < 0:
            p.append(f"train.anomaly.{name}={getattr(cfg, name)}: must be >= 0")
    if cfg.loss_spike <= 1.0:
        p.append(f"train.anomaly.loss_spike={cfg.loss_spike}: must be > 1")
    if cfg.grad_norm_spike != 0 and cfg.grad_norm_spike <= 1.0:
        p.append(f"train.anomaly.grad_norm_spike={cfg.grad_norm_spike}: must be > 1 (0 disables)")
    return p


@dataclass
class Verdict:
    """What the guard decided about one step (identical on every rank)."""

    step: int
    kinds: list = field(default_factory=list)
    """Anomalies found (`KINDS`); empty: healthy."""
    loss: Optional[float] = None
    grad_norm: Optional[float] = None
    median_loss: Optional[float] = None
    median_grad_norm: Optional[float] = None
    bad_ranks: list = field(default_factory=list)
    """Ranks whose own loss was non-finite (a non-finite gradient norm is reduced over ranks: not attributable)."""

    @property
    def nonfinite(self) -> bool:
        return any(k.startswith("nonfinite") for k in self.kinds)

    def describe(self) -> str:
        parts = []
        for k in self.kinds:
            if k == "loss_spike":
                parts.append(f"loss spike: loss {self.loss:.6g} > median {self.median_loss:.6g} of the last "
                             f"healthy steps")
            elif k == "grad_norm_spike":
                parts.append(f"grad-norm spike: grad_norm {self.grad_norm:.6g} > median {self.median_grad_norm:.6g}")
            else:
                parts.append(f"non-finite {k[len('nonfinite_'):].replace('_', ' ')}")
        return (f"step {self.step}: " + "; ".join(parts)
                + f" (loss {_fmt(self.loss)}, grad_norm {_fmt(self.grad_norm)})")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.6g}"


class AnomalousStep(Exception):
    """Raised on every rank alike from inside `optimizer.step()`, before the update, for a rejected step."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.describe())
        self.verdict = verdict


class Diverged(RuntimeError):
    """The guard stopped the run; the entry script prints the message and exits with EXIT_DIVERGED."""


class GatedClip:
    """The recording clip, then the guard's verdict, before the optimizer applies the update."""

    def __init__(self, inner, guard: "AnomalyGuard"):
        self.inner, self.guard = inner, guard

    def __call__(self, params_grads):
        out = self.inner(params_grads)
        self.guard.judge(self.inner.last_norm)  # raises AnomalousStep: no rank updates
        return out

    def __getattr__(self, item):
        return getattr(self.inner, item)


class AnomalyGuard:
    """One run's detector, policy state and counters (identical on every rank)."""

    def __init__(self, cfg: AnomalyConfig, topo, runner, clip, optimizer):
        from llmtrain.paddle_compat.optim import get_grad_clip, optimizer_chain, set_grad_clip

        self.cfg, self.topo, self.runner = cfg, topo, runner
        self.history: deque = deque(maxlen=cfg.window)  # (step, loss, grad_norm) of accepted steps
        self.counts = {"anomalies": 0, "skipped_steps": 0, "rewinds": 0, "transient_faults": 0}
        self.kind_counts = {k: 0 for k in KINDS}
        self.consecutive_skips = 0
        self.reason = ""  # why the last `act` said stop
        self.last: Optional[Verdict] = None  # the verdict of the latest step
        self.positions: dict = {}  # step -> consumed samples before it (the recent ones)
        self.skip_windows: list = []  # [from, to) consumed-sample windows every rewind of this process skips
        self._step = 0
        self._judged = False
        wrapped = 0
        for opt in optimizer_chain(optimizer):
            if get_grad_clip(opt) is clip:
                set_grad_clip(opt, GatedClip(clip, self))
                wrapped += 1
        if not wrapped:
            raise RuntimeError("anomaly guard: the recording clip is not on the optimizer")

    # ---- detection ----
    def _local_loss(self):
        """This rank's step loss (fp32 scalar tensor) or None where it holds none (a pipeline's earlier stages)."""
        if self.runner.pipeline:
            from llmtrain.paddle_compat.fleet import pipeline_step_loss

            return pipeline_step_loss(self.runner.model)
        losses = getattr(self.runner, "step_losses", None)
        return paddle.stack(losses).mean() if losses else None

    def judge(self, norm) -> Verdict:
        """The step's verdict from one all-reduce; raises AnomalousStep (every rank alike) when it is rejected."""
        self._judged = True
        loss = self._local_loss()
        rank, zero = self.topo.rank, paddle.zeros([], "float32")
        mine = loss.astype("float32").reshape([]) if loss is not None else zero
        bad = (~paddle.isfinite(mine)).astype("float32")
        parts = [mine, paddle.full([], 1.0 if loss is not None else 0.0, "float32"),
                 norm.astype("float32").reshape([]) if norm is not None and rank == 0 else zero, bad, bad * (rank + 1)]
        vec = paddle.stack(parts).astype("float64")  # [5], built on the device: one read to the host below
        if self.topo.world > 1:
            dist.all_reduce(vec)  # the whole job: every rank gets the same five numbers
        vec = vec.numpy().tolist()
        v = Verdict(self._step, loss=vec[0] / vec[1] if vec[1] else None,
                    grad_norm=vec[2] if norm is not None else None)
        if vec[3] == 1:
            v.bad_ranks = [int(vec[4]) - 1]
        elif vec[3] > 1:
            v.bad_ranks = [f"{int(vec[3])} ranks"]
        if rank in v.bad_ranks or (vec[3] > 1 and float(bad) > 0):
            log_all(f"step {self._step}: non-finite local loss on host {socket.gethostname()}")
        if v.loss is not None and not math.isfinite(v.loss):
            v.kinds.append("nonfinite_loss")
        if v.grad_norm is not None and not math.isfinite(v.grad_norm):
            v.kinds.append("nonfinite_grad_norm")
        if not v.kinds:
            self._spikes(v)
        self.last = v
        if v.kinds:
            raise AnomalousStep(v)
        self.history.append((v.step, v.loss, v.grad_norm))
        return v

    def _spikes(self, v: Verdict) -> None:
        c = self.cfg
        losses = [x[1] for x in self.history if x[1] is not None]
        if v.loss is not None and len(losses) >= max(1, c.warmup_steps):
            v.median_loss = median(losses)
            if v.loss > c.loss_spike * v.median_loss and v.loss - v.median_loss > c.loss_spike_min_increase:
                v.kinds.append("loss_spike")
        norms = [x[2] for x in self.history if x[2] is not None]
        if c.grad_norm_spike and v.grad_norm is not None and len(norms) >= max(1, c.grad_norm_warmup_steps):
            v.median_grad_norm = median(norms)
            if v.grad_norm > c.grad_norm_spike * v.median_grad_norm:
                v.kinds.append("grad_norm_spike")

    # ---- one step, re-run once on a non-finite result ----
    def run_step(self, runner, micro_batches, step: int, samples: tuple[int, int]):
        """`runner.run(micro_batches)` under the guard; the StepOutput carries `anomaly` (a Verdict or None).
        `samples`: (consumed samples before, after) this step's batch."""
        self._step, self._judged, self.last = step, False, None
        self.positions[step] = samples
        for old in [s for s in self.positions if s <= step - self.cfg.skip_batches]:
            del self.positions[old]
        rng = paddle.get_rng_state() if self.cfg.rerun else None
        try:
            out = self._attempt(runner, micro_batches)
            self.consecutive_skips = 0
            return out
        except AnomalousStep as e:
            first = e.verdict
            runner.optimizer.clear_grad()  # the rejected step's gradients; nothing was applied
        if first.nonfinite and self.cfg.rerun:
            paddle.set_rng_state(rng)
            self._judged = False
            try:
                out = self._attempt(runner, micro_batches)
                self._transient(first)
                self.consecutive_skips = 0
                return out
            except AnomalousStep as e:
                runner.optimizer.clear_grad()
                log0(f"step {step}: the re-run repeated the non-finite result: not a transient fault")
                first = e.verdict
        runner.scheduler.step()  # the step counts (the update was dropped)
        self.counts["anomalies"] += 1
        for k in first.kinds:
            self.kind_counts[k] += 1
        return _rejected_output(micro_batches, first)

    def _attempt(self, runner, micro_batches):
        out = runner.run(micro_batches)
        if not self._judged:  # the clip did not run (fp16: the loss scaler skipped an inf step): judge the loss
            self.judge(None)
        out.anomaly = None
        return out

    def _transient(self, first: Verdict) -> None:
        self.counts["transient_faults"] += 1
        who = (f"ranks with a non-finite local loss: {first.bad_ranks}" if first.bad_ranks else
               "not attributable to a rank (the gradient norm is reduced over all ranks)")
        log0(f"transient fault at step {first.step}: {first.describe()} on the first run, finite on the re-run "
             f"(loss {_fmt(self.last.loss)}, grad_norm {_fmt(self.last.grad_norm)}); {who}; continuing with the "
             f"re-run's result")
        if self.topo.rank in first.bad_ranks:
            log_all(f"transient fault at step {first.step} on rank {self.topo.rank}, host {socket.gethostname()}")

    # ---- policy ----
    def act(self, v: Verdict, has_healthy_checkpoint: bool = True) -> str:
        """`skip`, `rewind` or `stop` for a rejected step (counts and limits applied)."""
        c = self.cfg
        if c.policy == "skip":
            self.consecutive_skips += 1
            if self.consecutive_skips > c.max_consecutive_skips:
                self.reason = f"{self.consecutive_skips} anomalous steps in a row (train.anomaly.max_consecutive_skips=" \
                              f"{c.max_consecutive_skips})"
                return "stop"
            self.counts["skipped_steps"] += 1
            log0(f"anomaly at {v.describe()}: update skipped ({self.consecutive_skips} in a row)")
            return "skip"
        if c.policy == "rewind":
            if self.counts["rewinds"] >= c.max_rewinds:
                self.reason = f"{self.counts['rewinds']} rewinds already (train.anomaly.max_rewinds={c.max_rewinds})"
                return "stop"
            if not has_healthy_checkpoint:
                self.reason = "no healthy checkpoint to rewind to"
                return "stop"
            return "rewind"
        self.reason = "train.anomaly.policy=stop"
        return "stop"

    # ---- the trainer's calls for a rejected step (checkpointer, data, meter are the loop's) ----
    def policy(self, v: Verdict, ckpt) -> str:
        """`skip`, `rewind` or `stop` for a rejected step (counted; a rewind needs a healthy checkpoint before it)."""
        from llmtrain.checkpoint.health import newest_healthy
        from llmtrain.checkpoint.manager import list_checkpoints

        ckpt.wait()  # async saves: the checkpoint being written counts
        target = newest_healthy(list_checkpoints(ckpt.root), before=v.step - 1 - self.cfg.rewind_back_steps)
        return self.act(v, has_healthy_checkpoint=target is not None)

    def stop(self, v: Verdict, ckpt, meter) -> None:
        """Raise Diverged naming the step, the anomaly, its values and the newest healthy checkpoint."""
        from llmtrain.checkpoint.health import health_of, newest_healthy
        from llmtrain.checkpoint.manager import list_checkpoints

        ckpt.close()  # the last background write is complete: the newest healthy checkpoint is whole
        newest = newest_healthy(list_checkpoints(ckpt.root))
        where = "none"
        if newest is not None:
            h = health_of(newest[1])
            values = "" if h.get("loss") is None else f", loss {h['loss']:.6g}, grad_norm {h['grad_norm']:.6g}"
            where = f"{newest[1]} (step {newest[0]}{values})"
        meter.write_event({"step": v.step, "event": "stopped", "anomaly": list(v.kinds), "reason": self.reason})
        meter.close()
        raise Diverged(f"training stopped at {v.describe()}: {self.reason}; newest healthy checkpoint: {where}. "
                       f"After fixing the cause (a lower optim.lr for a run that diverges again after rewinds), "
                       f"checkpoint.resume=auto continues from it")

    def rewind(self, v: Verdict, ckpt, data, meter) -> int:
        """Reload the newest healthy checkpoint before the anomaly; returns its step (the loop continues there)."""
        from llmtrain.checkpoint.health import newest_healthy
        from llmtrain.checkpoint.manager import list_checkpoints

        _, path = newest_healthy(list_checkpoints(ckpt.root), before=v.step - 1 - self.cfg.rewind_back_steps)
        if not ckpt._verify_shared(path):
            raise Diverged(f"training stopped at {v.describe()}: the rewind checkpoint {path} is incomplete or corrupt")
        state = ckpt.load(path)
        window = self.rewound(v, state.step, data.consumed_samples)
        meter.rewind(state.step, state.tokens_total)
        meter.write_event({"step": v.step, "event": "rewind", "anomaly": list(v.kinds), "to_step": state.step,
                           "skip_samples": list(window), **self.metrics()})
        return state.step

    def rewound(self, v: Verdict, to_step: int, to_samples: int) -> tuple[int, int]:
        """After reloading the checkpoint of `to_step`: skip the data window, forget the undone history."""
        self.counts["rewinds"] += 1
        first = max(v.step - self.cfg.skip_batches + 1, to_step + 1)
        start = self.positions[first][0] if first in self.positions else to_samples
        window = (max(start, to_samples), self.positions[v.step][1])
        self.skip_windows = sorted(self.skip_windows + [window])
        self.history = deque((x for x in self.history if x[0] <= to_step), maxlen=self.cfg.window)
        log0(f"anomaly at {v.describe()}: rewound to step {to_step} (rewind {self.counts['rewinds']} of "
             f"{self.cfg.max_rewinds}); samples {window[0]}..{window[1] - 1} will be skipped")
        return window

    def before_next_step(self, data) -> None:
        """Skip the windows recorded by this process's rewinds when the data position reaches one of them."""
        for start, end in self.skip_windows:
            if start <= data.consumed_samples < end:
                data.load_state_dict(dict(data.state_dict(), consumed_samples=end))
                log0(f"skipped samples {start}..{end - 1} (an anomalous data window)")

    # ---- reporting ----
    def health(self) -> dict:
        """The manifest's `health` of a checkpoint written now."""
        v = self.last
        if v is None:
            return {"status": "healthy", "loss": None, "grad_norm": None, "anomaly": []}
        return {"status": "anomalous" if v.kinds else "healthy", "loss": v.loss, "grad_norm": v.grad_norm,
                "anomaly": list(v.kinds)}

    def metrics(self) -> dict:
        """Fields of every metrics.jsonl record: this step's anomaly (if any) and the run's counters."""
        rec = {f"{k}_total": n for k, n in self.counts.items()}
        if self.last is not None and self.last.kinds:
            rec["anomaly"] = list(self.last.kinds)
        return rec


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
