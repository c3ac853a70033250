"""Divergence guard: what counts as an anomaly, its settings and its verdict (the guard's vocabulary).

    python llmtrain/pretrain.py train.anomaly.policy=rewind train.anomaly.max_rewinds=3   # the defaults
    python -m pytest -q tests/train/test_guard_fast.py        # the guard's logic, one process, seconds

The guard checks every optimizer step before its update is applied, on every layout, and acts by a policy
(docs/divergence.md). It is split by job:
- `anomaly.py` (here): `AnomalyConfig` (`train.anomaly`), the anomaly kinds, `Verdict`, the exceptions;
- `anomaly_detect.py`: the verdict of a step from one all-reduce over the job (`Detector`), taken inside
  `optimizer.step()` by the gated clip before any parameter changes (`GatedClip`);
- `anomaly_policy.py`: skip / rewind / stop, the counters and their limits (`Policy`), and when fp16 loss-scale
  overflows stop being the scaler's business;
- `anomaly_rewind.py`: the rewind (target chosen on rank 0, verified by all, older fallback; `Rewinder`) and the
  skipped data windows (`SkipWindows`, recorded in every checkpoint manifest);
- `anomaly_report.py`: what the guard writes: messages, metrics fields, checkpoint health;
- `anomaly_guard.py`: `AnomalyGuard`, which runs a step under the guard (with its re-run) and wires the rest.

What is an anomaly (thresholds in `AnomalyConfig`; history = the last `window` accepted steps):
- non-finite loss (mean over data ranks) or non-finite global gradient norm;
- loss spike: loss > loss_spike x median(history) and loss - median > loss_spike_min_increase, once
  `warmup_steps` steps are in the history;
- grad-norm spike: grad_norm > grad_norm_spike x median(history), once `grad_norm_warmup_steps` are;
- fp16 only: a loss-scale overflow that persists (`max_consecutive_overflows` in a row, or the scale below
  `min_loss_scale`). A single overflow is the loss scaler's business, not an anomaly: the scaler skips the
  update and lowers the scale, the guard counts it (`loss_scale_overflows_total`) and the run goes on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

EXIT_DIVERGED = 5
"""Process exit status of a run the guard stopped (2: configuration error, 3/4: the watchdog)."""

POLICIES = ("stop", "skip", "rewind")
KINDS = ("nonfinite_loss", "nonfinite_grad_norm", "nonfinite_fp8_amax", "loss_spike", "grad_norm_spike",
         "loss_scale_overflow")


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

    max_consecutive_overflows: int = 10
    """train.amp=fp16: this many loss-scale overflows in a row (each one's update skipped by the scaler, the scale
    halved) make the last one an anomaly (`loss_scale_overflow`) the policy acts on. Ten halvings from 2^15 leave
    a scale of 32: gradients that still overflow fp16 there are a divergence, not a scale set too high."""

    min_loss_scale: float = 1.0
    """train.amp=fp16: an overflow that leaves the loss scale below this is an anomaly (`loss_scale_overflow`):
    catches overflows frequent enough to keep halving the scale without ever being `max_consecutive_overflows`
    in a row (Megatron-LM's default minimum loss scale is 1 as well)."""


def config_problems(cfg: AnomalyConfig) -> list[str]:
    """Value checks of `train.anomaly` (one line per problem, naming the field and the value)."""
    p = []
    if cfg.policy not in POLICIES:
        p.append(f"train.anomaly.policy={cfg.policy!r}: one of {', '.join(POLICIES)}")
    for name in ("window", "max_consecutive_skips", "skip_batches", "max_consecutive_overflows"):
        if getattr(cfg, name) < 1:
            p.append(f"train.anomaly.{name}={getattr(cfg, name)}: must be >= 1")
    for name in ("warmup_steps", "grad_norm_warmup_steps", "max_rewinds", "rewind_back_steps", "min_loss_scale"):
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
    """Anomalies found (`KINDS`); empty: healthy (an fp16 overflow alone included)."""
    loss: Optional[float] = None
    grad_norm: Optional[float] = None
    median_loss: Optional[float] = None
    median_grad_norm: Optional[float] = None
    bad_ranks: list = field(default_factory=list)
    """Ranks whose own loss was non-finite (a non-finite gradient norm is reduced over ranks: not attributable)."""
    overflow: bool = False
    """fp16: the loss scaler found inf/NaN gradients on some rank (it skips the update and lowers the scale)."""
    loss_scale: Optional[float] = None
    """fp16: the loss scale after the step (after the scaler lowered it, on an overflow)."""
    fp8_tiles: int = 0
    """`train.fp8`: FP8 tiles over the job whose amax was inf or NaN in this step (caught before the cast)."""
    fp8_tensors: list = field(default_factory=list)
    """`train.fp8`: this rank's tensors (`<layer>:x|W|dY`) with such a tile."""

    @property
    def nonfinite(self) -> bool:
        """A non-finite loss or norm: what the re-run check re-runs."""
        return any(k.startswith("nonfinite") for k in self.kinds)

    def describe(self) -> str:
        from llmtrain.train.anomaly_report import describe

        return describe(self)


class AnomalousStep(Exception):
    """Raised on every rank alike from inside `optimizer.step()`, before the update, for a rejected step."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.describe())
        self.verdict = verdict


class Diverged(RuntimeError):
    """The guard stopped the run; the entry script prints the message and exits with EXIT_DIVERGED."""
