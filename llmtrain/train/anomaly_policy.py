"""The divergence guard's policy: what a rejected step leads to, the counters, and their limits.

    python -m pytest -q tests/train/test_guard_fast.py -k policy
    policy = Policy(cfg.train.anomaly)
    policy.act(verdict, has_healthy_checkpoint=True)   # "skip" | "rewind" | "stop" (policy.reason says why a stop)
    policy.overflowed(verdict)                          # fp16: count an overflow; True when it persists

Policies (`train.anomaly.policy`), for an anomaly the re-run did not clear:
- `stop`: end the run (exit status `EXIT_DIVERGED`) naming the step, the anomaly, the values and the newest
  healthy checkpoint; no checkpoint is written from the rejected state.
- `skip`: drop the update (data consumed, LR advances), count it; after `max_consecutive_skips` in a row: stop.
- `rewind` (default): reload the newest healthy checkpoint at least `rewind_back_steps` before the anomaly,
  replay the data up to the window and skip the samples of the last `skip_batches` global batches ending
  with the anomalous one; after `max_rewinds` rewinds (or with no healthy checkpoint): stop.
fp16 loss-scale overflows are counted here too; one becomes an anomaly (`loss_scale_overflow`) when it is the
`max_consecutive_overflows`-th in a row or leaves the scale below `min_loss_scale`.
"""
from __future__ import annotations

from llmtrain.train.anomaly import KINDS, AnomalyConfig, Verdict
from llmtrain.train.anomaly_report import overflow_line, skip_line


class Policy:
    """One run's policy state: counters (the same on every rank), the consecutive runs that bound them."""

    def __init__(self, cfg: AnomalyConfig):
        self.cfg = cfg
        self.counts = {"anomalies": 0, "skipped_steps": 0, "rewinds": 0, "transient_faults": 0,
                       "loss_scale_overflows": 0}
        """Running totals of this process (metrics.jsonl `<name>_total`, the Prometheus counters)."""
        self.kind_counts = {k: 0 for k in KINDS}
        """Rejected steps by anomaly kind."""
        self.consecutive_skips = 0
        self.consecutive_overflows = 0
        self.reason = ""
        """Why the last `act` said stop."""

    def accepted(self) -> None:
        """A step whose update was applied: the consecutive runs end."""
        self.consecutive_skips = self.consecutive_overflows = 0

    def rejected(self, v: Verdict) -> None:
        """Count a rejected step and its kinds."""
        self.counts["anomalies"] += 1
        for k in v.kinds:
            self.kind_counts[k] += 1

    def overflowed(self, v: Verdict) -> bool:
        """fp16: count the loss-scale overflow of `v` (the scaler skipped its update, `v.loss_scale` is the lowered
        scale); True when it persists, which makes it an anomaly."""
        c = self.cfg
        self.counts["loss_scale_overflows"] += 1
        self.consecutive_overflows += 1
        low = v.loss_scale is not None and v.loss_scale < c.min_loss_scale
        persists = self.consecutive_overflows >= c.max_consecutive_overflows or low
        overflow_line(v, self.consecutive_overflows, c)
        return persists

    def transient(self) -> None:
        self.counts["transient_faults"] += 1

    def act(self, v: Verdict, has_healthy_checkpoint: bool = True) -> str:
        """`skip`, `rewind` or `stop` for a rejected step (counts and limits applied)."""
        c = self.cfg
        if c.policy == "skip":
            self.consecutive_skips += 1
            if self.consecutive_skips > c.max_consecutive_skips:
                self.reason = (f"{self.consecutive_skips} anomalous steps in a row (train.anomaly.max_consecutive_skips="
                               f"{c.max_consecutive_skips})")
                return "stop"
            self.counts["skipped_steps"] += 1
            skip_line(v, self.consecutive_skips)
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

    def rewound(self) -> None:
        """A rewind happened: counted; the reloaded state starts new consecutive runs."""
        self.counts["rewinds"] += 1
        self.consecutive_skips = self.consecutive_overflows = 0
