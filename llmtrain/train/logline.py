"""The per-interval log line: one line of text per `train.log_interval` from a metrics.jsonl record.

    python llmtrain/pretrain.py train.log_interval=10       # rank 0 logs `step 10/20 | loss ... | lr ...`
    line = interval_line(record, max_steps)

Written by `llmtrain.train.metrics.Meter` on rank 0 through the rank-0 logger (stderr: the launcher's
workerlog.0), whether or not a progress bar is shown. Fields, in order (docs/configuration.md, "Metrics", defines
each number): step/total, loss, lr, grad norm, tokens/s of the job, TFLOP/s per device and MFU, the largest GPU
memory allocation of any rank (GPU only), the fp16 loss scale (fp16 only, `overflow` when the step's update was
skipped), the data wait per step, and the divergence guard's counters once any is non-zero plus this step's
anomaly kinds.
"""
from __future__ import annotations

from typing import Optional

GIB = 2**30

GUARD_COUNTERS = (("anomalies_total", "anomalies"), ("skipped_steps_total", "skipped"), ("rewinds_total", "rewinds"),
                  ("transient_faults_total", "transient faults"), ("loss_scale_overflows_total", "overflows"))
"""(record key, label) of the divergence guard's counters, shown once non-zero."""


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def interval_line(rec: dict, max_steps: int) -> str:
    """`step 10/200 | loss 7.2134 | lr 3.00e-04 | grad norm 1.234 | 12,345 tok/s | 0.123 TFLOP/s/device |
    MFU 12.3% | data wait 1.2 ms/step`, then `mem`, `loss scale` and `anomalies` where they apply."""
    width = len(str(max_steps))
    parts = [
        f"step {rec['step']:>{width}}/{max_steps}",
        f"loss {rec['loss']:.4f}",
        f"lr {rec['lr']:.2e}",
        f"grad norm {_num(rec.get('grad_norm'), '.3f')}",
        f"{rec['tokens_per_sec']:,.0f} tok/s",
        f"{rec['tflops_per_device']:.3g} TFLOP/s/device",
        "MFU " + ("-" if rec.get("mfu") is None else f"{100 * rec['mfu']:.1f}%"),
    ]
    if rec.get("max_memory_allocated") is not None:  # GPU: the largest allocation of any rank so far
        parts.append(f"mem {rec['max_memory_allocated'] / GIB:.2f} GiB")
    if rec.get("loss_scale") is not None:  # fp16: the dynamic loss scale after this step's update
        parts.append(f"loss scale {rec['loss_scale']:g}" + (" overflow" if rec.get("loss_scale_overflow") else ""))
    parts.append(f"data wait {1e3 * rec['data_wait_time']:.1f} ms/step")
    guard = [f"{label} {rec[key]}" for key, label in GUARD_COUNTERS if rec.get(key)]
    if rec.get("anomaly"):
        guard.append(f"this step: {' '.join(rec['anomaly'])}")
    if guard:
        parts.append(", ".join(guard))
    return " | ".join(parts)
