"""Token-throughput accounting and the metrics line.

    meter = Meter(run_dir, topo, flops_per_token, peak, ...)
    meter.update(step, out, lr, step_time, data_wait)   # every step; writes on log steps

Definitions (docs/configuration.md, "Metrics", says the same):
- tokens: loss-bearing target tokens (sum of loss_mask: padding and masked-out
  positions excluded), summed over all data-parallel and sharding ranks, never
  multiplied by tp or pp. `tokens` is this step's count, `tokens_total` the exact
  running sum since step 0 (restored from checkpoints).
- tokens_per_sec = tokens in the logging window / wall seconds of the window;
  tokens_per_sec_per_device = tokens_per_sec / world size.
- tflops_per_device = positions_per_sec_per_device x FLOPs per token / 1e12, with
  FLOPs per token = 6 N + 12 L h s (`llmtrain.models.size.flops_per_token`;
  causal attention not halved, recompute not counted); under LoRA 4 N + 6 N_lora
  + 12 L h s (the frozen base computes no weight gradients; N_lora: the adapters'
  elements). Positions are the input
  tokens processed; for packed pretraining they equal the loss-bearing tokens,
  for masked LM (15% bear loss) and fine-tuning (prompts bear none) they are
  more, and model FLOPs follow positions, not loss-bearing tokens.
- mfu = tflops_per_device x 1e12 / peak FLOP/s of one device (null if unknown). A CPU peak is measured once per
  machine and cached (`llmtrain.train.peak`), so MFU of the same work is comparable between runs there (not across
  machines); a measurement made under load comes out low, so the first window whose MFU exceeds 1 measures it
  again once and keeps (and caches) the higher value (logged). MFU can still exceed 1 after that: it is then
  logged as it is, not clipped.
- loss: mean over the steps of the logging window (one step when
  log_interval=1) of the step loss, itself the mean over micro-batches and data
  ranks of each micro-batch's mean token loss; grad_norm: global L2 norm of the
  logged step's gradient before clipping.
- step_time, data_wait_time: seconds per step, averaged over the window.
- time: Unix time (seconds) when the record was made, after the step's work; the
  wall clock between two records covers whole steps, logging included.

Every step record is also one log line on rank 0 (`llmtrain.train.logline`), in every mode; the tqdm progress
bar (`train.progress_bar`) is drawn only when stderr is a terminal, so the launcher's workerlog files hold plain
lines, never a `\r`-joined bar.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

import paddle
import paddle.distributed as dist

from llmtrain.train.logline import interval_line
from llmtrain.train.step import StepOutput
from llmtrain.utils.log import log0


class Meter:
    def __init__(
        self,
        run_dir: str,
        topo,
        flops_per_token: float,
        peak: Optional[float],
        log_interval: int,
        max_steps: int,
        start_step: int = 0,
        tokens_total: int = 0,
        progress_bar: bool = True,
        visualdl: bool = True,
        exporter=None,
        remeasure_peak=None,
    ):
        self.topo = topo
        self.flops_per_token = flops_per_token
        self.peak = peak
        self._remeasure_peak = remeasure_peak  # () -> FLOP/s, called at most once (CPU: a measured peak)
        self.log_interval = max(1, log_interval)
        self.max_steps = max_steps  # always logged, whatever the interval
        self.tokens_total = tokens_total
        self.is_writer = topo.rank == 0
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._pending_tokens = 0  # local tokens not yet folded into tokens_total
        self._window_tokens = 0
        self._window_positions = 0
        self._window_loss = None  # sum of step losses in the window, kept on device (no sync per step)
        self._window_steps = 0
        self._window_data_wait = 0.0
        self._window_start = time.perf_counter()
        self.last: dict = {}
        self.exporter = exporter  # llmtrain.train.prometheus.PrometheusExporter or None
        self._step_start = self._window_start
        self._bar = self._vdl = None
        if self.is_writer:
            _truncate_after(self.path, start_step)
            if progress_bar and _is_terminal(sys.stderr):  # never in a log file: there the log lines say it all
                from tqdm import tqdm

                self._bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                                 file=sys.stderr)
            if visualdl:
                from visualdl import LogWriter

                self._vdl = LogWriter(logdir=os.path.join(run_dir, "visualdl"))

    def reset_window(self) -> None:
        """Start a new timing window (after evaluation or checkpointing, which are not training time)."""
        self._window_start = self._step_start = time.perf_counter()
        self._window_tokens = self._window_steps = self._window_positions = 0
        self._window_loss = None
        self._window_data_wait = 0.0

    def _raise_peak(self, achieved: float) -> None:
        """MFU above 1 means the start-up peak was measured low: measure once more and keep the higher value."""
        remeasure, self._remeasure_peak = self._remeasure_peak, None
        old, new = self.peak, remeasure()
        self.peak = max(old, new)
        log0(f"model FLOP/s {achieved / 1e12:.3f} T exceed the measured CPU peak ({old / 1e12:.3f} T, "
             f"measured under load?): re-measured {new / 1e12:.3f} T, MFU now uses {self.peak / 1e12:.3f} T")

    def _max_memory_allocated(self) -> int:
        """paddle.device.cuda.max_memory_allocated(), maximum over every rank of the job."""
        peak = paddle.device.cuda.max_memory_allocated()  # GPU-ONLY(memory-metrics): bytes, this rank
        t = paddle.to_tensor([float(peak)], dtype="float64")
        if self.topo.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _reduce(self, values: list[float]) -> list[float]:
        """Sum over the data-parallel groups (dp, then sharding)."""
        t = paddle.to_tensor(values, dtype="float64")
        for group in self.topo.data_group():
            dist.all_reduce(t, group=group)
        return t.tolist()

    def update(self, step: int, out: StepOutput, lr: float, data_wait: float, extra: Optional[dict] = None) -> Optional[dict]:
        """Account one finished step (1-based `step`); on log steps write and return the record."""
        self._pending_tokens += out.tokens
        self._window_tokens += out.tokens
        self._window_positions += out.positions
        loss = out.loss.detach().astype("float32").reshape([])
        self._window_loss = loss if self._window_loss is None else self._window_loss + loss
        self._window_steps += 1
        self._window_data_wait += data_wait
        if self.exporter is not None:
            now = time.perf_counter()
            self.exporter.step_done(step, now - self._step_start)
            self._step_start = now
        if not self.logs(step):
            if self._bar is not None:
                self._bar.update(1)
            return None
        loss_local = float(self._window_loss) / self._window_steps  # syncs the device: the window's work is done
        window_seconds = time.perf_counter() - self._window_start
        loss_sum, pending, window_tokens, window_positions, step_tokens = self._reduce(
            [loss_local, self._pending_tokens, self._window_tokens, self._window_positions, out.tokens]
        )
        data_world = self.topo.data_world
        self.tokens_total += int(round(pending))
        self._pending_tokens = 0
        tps = window_tokens / window_seconds
        tps_dev = tps / self.topo.world
        tflops = window_positions / window_seconds / self.topo.world * self.flops_per_token / 1e12
        if self.peak and tflops * 1e12 > self.peak and self._remeasure_peak is not None:
            self._raise_peak(tflops * 1e12)
        rec = {
            "step": step,
            "loss": loss_sum / data_world,
            "lr": lr,
            "grad_norm": None if out.grad_norm is None else float(out.grad_norm.numpy().reshape(-1)[0]),
            "tokens": int(round(step_tokens)),
            "tokens_total": self.tokens_total,
            "tokens_per_sec": tps,
            "tokens_per_sec_per_device": tps_dev,
            "step_time": window_seconds / self._window_steps,
            "data_wait_time": self._window_data_wait / self._window_steps,
            "tflops_per_device": tflops,
            "mfu": None if not self.peak else tflops * 1e12 / self.peak,
            "time": time.time(),
        }
        if not getattr(self.topo, "on_cpu", True):  # GPU: the largest peak allocation of any rank so far (bytes)
            rec["max_memory_allocated"] = self._max_memory_allocated()  # GPU-ONLY(memory-metrics)
        rec.update(extra or {})
        self.last = rec
        if self.exporter is not None:
            self.exporter.record(rec)
        if self.is_writer:
            self._write(rec)
            self._log(interval_line(rec, self.max_steps))
        self.reset_window()
        return rec

    def _log(self, line: str) -> None:
        """A log line on rank 0; above the progress bar when one is drawn."""
        if self._bar is None:
            log0(line)
            return
        with self._bar.external_write_mode(file=sys.stderr):
            log0(line)

    def tokens_total_exact(self) -> int:
        """tokens_total including the not-yet-logged steps of the current window (a collective)."""
        (pending,) = self._reduce([self._pending_tokens])
        self.tokens_total += int(round(pending))
        self._pending_tokens = 0
        return self.tokens_total

    def logs(self, step: int) -> bool:
        """Whether step `step` (1-based) writes a record: every `log_interval`-th step and the last."""
        return step % self.log_interval == 0 or step == self.max_steps

    def reduce_tensor(self, t):
        """A tensor of per-data-rank values summed over the data-parallel ranks, on the device (a collective, no host
        read); a new tensor, `t` is left as it was."""
        t = t.clone()
        for group in self.topo.data_group():
            dist.all_reduce(t, group=group)
        return t

    def reduce_sum(self, values: list[float]) -> list[float]:
        """Sums of per-data-rank values over the data-parallel ranks, in fp64 (a collective)."""
        return self._reduce(values)

    def reduce_mean(self, value: float) -> float:
        """Mean of a per-data-rank value over the data-parallel ranks (a collective)."""
        (total,) = self._reduce([value])
        return total / self.topo.data_world

    def rewind(self, step: int, tokens_total: int) -> None:
        """After the divergence guard reloaded the checkpoint of `step`: drop the later records (they are redone),
        restore the token count, restart the window and the progress bar there."""
        self.tokens_total, self._pending_tokens = tokens_total, 0
        if self.is_writer:
            _truncate_after(self.path, step)
            if self._bar is not None:
                self._bar.n = step
                self._bar.refresh()
        self.reset_window()

    def write_event(self, rec: dict) -> None:
        """A non-step record (evaluation) in metrics.jsonl and VisualDL."""
        if self.is_writer:
            self._write(rec, bar=False)

    def _write(self, rec: dict, bar: bool = True) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self._vdl is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._vdl.add_scalar(tag=f"train/{k}" if "eval" not in k else k, value=v, step=rec["step"])
        if self._bar is not None and bar:
            self._bar.update(rec["step"] - self._bar.n)
            post = {"loss": f"{rec['loss']:.4f}", "tok/s": f"{rec['tokens_per_sec']:.0f}"}
            if rec.get("mfu") is not None:
                post["mfu"] = f"{100 * rec['mfu']:.1f}%"
            for key, short in (("anomalies_total", "anomalies"), ("skipped_steps_total", "skipped"),
                               ("rewinds_total", "rewinds"), ("transient_faults_total", "transient")):
                if rec.get(key):  # divergence guard counters, shown once non-zero
                    post[short] = rec[key]
            self._bar.set_postfix(post)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._vdl is not None:
            self._vdl.close()


def _is_terminal(stream) -> bool:
    """True when `stream` is an interactive terminal (not a file, pipe or the launcher's workerlog)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


REDONE = os.path.join("superseded", "metrics-of-redone-steps.jsonl")
"""Where a resume moves the records of the steps it redoes (under the run directory; appended, never deleted)."""


def _truncate_after(path: str, step: int) -> None:
    """On resume from `step`, move the records of later steps (they are about to be redone) to `REDONE`."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        # records of later steps leave (they are redone); divergence-guard events (rewind, stopped) are history: kept
        lines = [line for line in f if line.strip()]
    kept = [json.loads(line).get("step", 0) <= step or "event" in json.loads(line) for line in lines]
    if all(kept):
        return
    redone = os.path.join(os.path.dirname(path), REDONE)
    os.makedirs(os.path.dirname(redone), exist_ok=True)
    with open(redone, "a") as f:
        f.writelines(line for line, k in zip(lines, kept) if not k)
    keep = [line for line, k in zip(lines, kept) if k]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def read_metrics(path: str) -> list[dict]:
    """All records of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
