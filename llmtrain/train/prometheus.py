"""Prometheus metrics of a training run: `/metrics` on every rank.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py +parallel=dp2 train.metrics_port=9400
    curl -s 127.0.0.1:9400/metrics   # rank 0; local rank r serves on 9400 + r

Off unless `train.metrics_port` is set. Each rank serves its own registry (not the
process-global one, so Python/process collectors stay out) from a daemon thread of
`prometheus_client`. Every series carries `job` (the run: `train.metrics_job`, else the
basename of run.dir), `rank` (global rank) and `node` (env LLMTRAIN_NODE_NAME, else the host name); no label grows with
steps or data. The scrape config sets `honor_labels: true` so `job` stays ours.

The values are the ones metrics.jsonl gets (`Meter` feeds both):
- llmtrain_tokens_total (counter): loss-bearing tokens trained on over all data ranks: the
  restored `tokens_total` at start, then every logged step's tokens, the steps redone after a
  divergence-guard rewind included; it never decreases (rate() is the throughput of the work
  done). Updated on log steps; every rank reports the same value (it is all-reduced).
- llmtrain_model_tokens (gauge): metrics.jsonl's exact `tokens_total`, the tokens the model's
  current state has seen: it drops to the checkpoint's count after a rewind.
- llmtrain_step, llmtrain_last_step_timestamp_seconds: every step (local, no collective).
- llmtrain_step_duration_seconds (histogram): wall seconds of each step, data wait included
  (metrics.jsonl's `step_time` is the window mean of the same clock).
- llmtrain_tokens_per_second, llmtrain_mfu_ratio (0..1), llmtrain_loss, llmtrain_grad_norm,
  llmtrain_learning_rate, llmtrain_data_wait_seconds (mean per step over the window): the
  last logged record.
- llmtrain_checkpoint_save_duration_seconds, llmtrain_checkpoint_last_success_timestamp_seconds:
  the last completed save (the timestamp is 0 until the first save of the process);
  llmtrain_checkpoint_interval_steps: `checkpoint.interval` (0: only at the end), so the
  "checkpoint too old" alert counts in intervals.
- llmtrain_memory_bytes{kind=parameters|optimizer|gradients}: this rank's holdings as
  measured for memory.json after the first step.
- llmtrain_info{model,layout,version} 1.
- Divergence guard (`llmtrain.train.anomaly`), counters since the process started, every rank the same value:
  llmtrain_anomalies_total{kind=nonfinite_loss|nonfinite_grad_norm|loss_spike|grad_norm_spike|loss_scale_overflow}
  (steps the guard rejected), llmtrain_skipped_steps_total, llmtrain_rewinds_total, llmtrain_transient_faults_total
  (a non-finite step whose re-run was finite), llmtrain_loss_scale_overflows_total (fp16: steps whose update the
  loss scaler skipped) and llmtrain_loss_scale (fp16: the loss scale of the last logged step; NaN without fp16).
"""
from __future__ import annotations

import math
import os
import socket
import time
from typing import Optional

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics,
                               start_http_server)

# Seconds; tiny CPU steps to multi-minute steps of big models.
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)

METRIC_NAMES = (
    "llmtrain_tokens_total", "llmtrain_step", "llmtrain_tokens_per_second", "llmtrain_mfu_ratio", "llmtrain_loss",
    "llmtrain_grad_norm", "llmtrain_learning_rate", "llmtrain_step_duration_seconds", "llmtrain_data_wait_seconds",
    "llmtrain_checkpoint_save_duration_seconds", "llmtrain_checkpoint_last_success_timestamp_seconds",
    "llmtrain_last_step_timestamp_seconds", "llmtrain_checkpoint_interval_steps", "llmtrain_memory_bytes",
    "llmtrain_info", "llmtrain_anomalies_total", "llmtrain_skipped_steps_total", "llmtrain_rewinds_total",
    "llmtrain_transient_faults_total", "llmtrain_loss_scale_overflows_total", "llmtrain_model_tokens",
    "llmtrain_loss_scale",
)
"""Every metric family served (a histogram adds _bucket/_sum/_count, the counter is named with _total)."""


def local_rank() -> int:
    """This process's index on its node, as paddle.distributed.launch sets it (0 without the launcher)."""
    return int(os.environ.get("PADDLE_LOCAL_RANK", "0"))


class PrometheusExporter:
    """One rank's metrics registry and, after `serve()`, its HTTP endpoint."""

    def __init__(self, job: str, rank: int, node: Optional[str] = None, model: str = "", layout: str = "",
                 version: str = "", tokens_total: int = 0, step: int = 0, checkpoint_interval: int = 0):
        disable_created_metrics()  # no *_created series: one series per name, as METRIC_NAMES lists
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.labels = {"job": job, "rank": str(rank), "node": node or socket.gethostname()}
        names = list(self.labels)

        def gauge(name, doc, extra=()):
            return Gauge(name, doc, names + list(extra), registry=reg)

        self._tokens = Counter("llmtrain_tokens", "Loss-bearing tokens trained on since step 0, over all data ranks, "
                               "steps redone after a rewind included (never decreases).", names, registry=reg)
        self._model_tokens = gauge("llmtrain_model_tokens", "Loss-bearing tokens the model's current state has seen "
                                   "(metrics.jsonl's tokens_total; drops after a rewind).")
        self._scale = gauge("llmtrain_loss_scale", "fp16 loss scale of the last logged step (NaN without fp16).")
        self._step = gauge("llmtrain_step", "Last finished optimizer step.")
        self._tps = gauge("llmtrain_tokens_per_second", "Loss-bearing tokens per second over the last logging window, all ranks.")
        self._mfu = gauge("llmtrain_mfu_ratio", "Model FLOPs utilisation of one device (0..1); NaN when the peak is unknown.")
        self._loss = gauge("llmtrain_loss", "Training loss, mean over the last logging window.")
        self._gnorm = gauge("llmtrain_grad_norm", "Global gradient L2 norm before clipping, last logged step.")
        self._lr = gauge("llmtrain_learning_rate", "Learning rate of the last logged step.")
        self._wait = gauge("llmtrain_data_wait_seconds", "Seconds per step spent waiting for data, mean over the last window.")
        self._ckpt_s = gauge("llmtrain_checkpoint_save_duration_seconds", "Wall seconds of the last completed checkpoint save.")
        self._ckpt_ts = gauge("llmtrain_checkpoint_last_success_timestamp_seconds",
                              "Unix time of the last completed checkpoint save.")
        self._ckpt_every = gauge("llmtrain_checkpoint_interval_steps", "Steps between checkpoints (checkpoint.interval; 0: at the end only).")
        self._ckpt_every.labels(**self.labels).set(checkpoint_interval)
        self._ckpt_ts.labels(**self.labels).set(0)
        self._step_ts = gauge("llmtrain_last_step_timestamp_seconds", "Unix time at the end of the last finished step.")
        self._mem = gauge("llmtrain_memory_bytes", "Bytes this rank holds, by kind (parameters, optimizer, gradients).",
                          ["kind"])
        self._hist = Histogram("llmtrain_step_duration_seconds", "Wall seconds per optimizer step, data wait included.",
                               names, buckets=STEP_BUCKETS, registry=reg)
        info = Info("llmtrain", "The run: model, layout, llmtrain version.", names, registry=reg)
        info.labels(**self.labels).info({"model": model, "layout": layout, "version": version})
        from llmtrain.train.anomaly import KINDS

        self._anomalies = Counter("llmtrain_anomalies", "Steps the divergence guard rejected, by anomaly kind.",
                                  names + ["kind"], registry=reg)
        self._guard = {key: Counter(f"llmtrain_{key}", doc, names, registry=reg) for key, doc in (
            ("skipped_steps", "Steps whose update the divergence guard dropped (train.anomaly.policy=skip)."),
            ("rewinds", "Reloads of the newest healthy checkpoint after an anomaly (train.anomaly.policy=rewind)."),
            ("transient_faults", "Steps with a non-finite result whose re-run from the same state was finite."),
            ("loss_scale_overflows", "fp16: steps whose update the loss scaler skipped (inf/NaN gradients)."))}
        for kind in KINDS:  # every series exists from the start, at 0
            self._anomalies.labels(**self.labels, kind=kind).inc(0)
        for c in self._guard.values():
            c.labels(**self.labels).inc(0)
        self._guard_seen: dict = {}
        self._model_seen = 0  # the model's tokens at the last update: the counter rises by what is added to them
        self._tokens.labels(**self.labels).inc(0)  # the series exists from the start, at 0
        self._scale.labels(**self.labels).set(math.nan)
        self.model_tokens(tokens_total)
        self._step.labels(**self.labels).set(step)
        self.server = None
        self.port: Optional[int] = None

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Start the HTTP endpoint on `port` (a daemon thread); returns the port."""
        self.server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = port
        return port

    def model_tokens(self, tokens_total: int) -> None:
        """The model's `tokens_total` now: the gauge takes it, the counter rises by the tokens added since the last
        call (a smaller value, which only `rewound` may bring, adds nothing)."""
        if tokens_total > self._model_seen:
            self._tokens.labels(**self.labels).inc(tokens_total - self._model_seen)
        self._model_seen = max(self._model_seen, tokens_total)
        self._model_tokens.labels(**self.labels).set(tokens_total)

    def rewound(self, tokens_total: int) -> None:
        """After a divergence-guard rewind: the model's tokens are the checkpoint's; the counter stays, and rises again
        with the redone steps."""
        self._model_seen = tokens_total
        self._model_tokens.labels(**self.labels).set(tokens_total)

    def step_done(self, step: int, seconds: float) -> None:
        """Every step: the step number, its wall seconds, the time it ended."""
        self._step.labels(**self.labels).set(step)
        self._hist.labels(**self.labels).observe(seconds)
        self._step_ts.labels(**self.labels).set(time.time())

    def record(self, rec: dict) -> None:
        """A logged metrics.jsonl record."""
        self.model_tokens(int(rec["tokens_total"]))
        pairs = ((self._tps, "tokens_per_sec"), (self._mfu, "mfu"), (self._loss, "loss"), (self._gnorm, "grad_norm"),
                 (self._lr, "lr"), (self._wait, "data_wait_time"), (self._scale, "loss_scale"))
        for gauge, key in pairs:
            value = rec.get(key)
            gauge.labels(**self.labels).set(math.nan if value is None else float(value))

    def guard_counts(self, counts: dict, kind_counts: dict) -> None:
        """The divergence guard's running totals (`AnomalyGuard.counts`, `.kind_counts`): raise the counters to them."""
        for key, total in [*((k, v) for k, v in counts.items() if k in self._guard),
                           *((("kind", k), v) for k, v in kind_counts.items())]:
            delta = total - self._guard_seen.get(key, 0)
            if delta > 0:
                c = self._anomalies.labels(**self.labels, kind=key[1]) if isinstance(key, tuple) \
                    else self._guard[key].labels(**self.labels)
                c.inc(delta)
                self._guard_seen[key] = total

    def checkpoint_saved(self, seconds: float) -> None:
        self._ckpt_s.labels(**self.labels).set(seconds)
        self._ckpt_ts.labels(**self.labels).set(time.time())

    def memory(self, entry: dict) -> None:
        """This rank's entry of memory.json."""
        for kind, key in (("parameters", "param_bytes"), ("optimizer", "optimizer_bytes"), ("gradients", "grad_bytes")):
            self._mem.labels(**self.labels, kind=kind).set(entry[key])

    def close(self, linger_s: float = 0.0) -> None:
        """Keep serving `linger_s` seconds (so the last values get scraped), then stop the endpoint."""
        if self.server is None:
            return
        if linger_s > 0:
            time.sleep(linger_s)
        self.server.shutdown()
        self.server.server_close()
        self.server = None


def exporter_for_run(cfg, layout, rank: int, tokens_total: int, step: int) -> Optional[PrometheusExporter]:
    """The serving exporter of this rank when `train.metrics_port` is set, else None."""
    port = cfg.train.metrics_port
    if port is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        __version__ = version("llmtrain")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        __version__ = "unknown"
    job = cfg.train.metrics_job or os.path.basename(os.path.normpath(cfg.run.dir))
    node = os.environ.get("LLMTRAIN_NODE_NAME")  # Kubernetes: the node (downward API), not the pod's host name
    exp = PrometheusExporter(job, rank, node=node, model=cfg.model.name, layout=layout.name, version=__version__,
                             tokens_total=tokens_total, step=step, checkpoint_interval=cfg.checkpoint.interval)
    try:
        exp.serve(port + local_rank())
    except OSError as e:
        raise RuntimeError(f"train.metrics_port={port}: local rank {local_rank()} cannot serve /metrics on port "
                           f"{port + local_rank()} ({e}); pick a port range free on every node") from None
    return exp
