"""What the divergence guard writes: every message, the metrics fields, a checkpoint's health entry.

    python -m pytest -q tests/train/test_anomaly.py      # the messages as a user sees them
    stop_message(verdict, reason, newest)                 # the text of Diverged (exit status 5)
    record_fields(policy, verdict, loss_scale)            # fields of every metrics.jsonl record

All the guard's wording lives in this module, so it can be changed in one place (docs/divergence.md quotes the
stop message; tests/train/test_anomaly.py checks its parts).
"""
from __future__ import annotations

import socket
from typing import Optional

from llmtrain.utils.log import log0, log_all

STOP_ADVICE = ("If the learning rate caused it (a run that diverges again after its rewinds), a lower one is a new LR "
               "schedule, and a resume under a changed learning rate skips no data (the rewinds' windows are trained "
               "on): optim.lr=<lower> optim.on_resume=config checkpoint.resume=auto")
"""The last sentence of the stop message: what the user does when the learning rate is the cause
(tests/train/test_contract.py follows it as written: the resume contract accepts it)."""


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.6g}"


def describe(v) -> str:
    """`step N: <each anomaly> (loss L, grad_norm G)`."""
    parts = []
    for k in v.kinds:
        if k == "loss_spike":
            parts.append(f"loss spike: loss {v.loss:.6g} > median {v.median_loss:.6g} of the last healthy steps")
        elif k == "grad_norm_spike":
            parts.append(f"grad-norm spike: grad_norm {v.grad_norm:.6g} > median {v.median_grad_norm:.6g}")
        elif k == "nonfinite_fp8_amax":
            where = f" in {', '.join(v.fp8_tensors[:4])}{' ...' if len(v.fp8_tensors) > 4 else ''}" \
                if v.fp8_tensors else ""
            parts.append(f"FP8: non-finite amax (inf or NaN) in {v.fp8_tiles} tile(s){where}, caught before the cast "
                         "to FP8 would have saturated it to +-448 (train.fp8)")
        elif k == "loss_scale_overflow":
            parts.append(f"persistent fp16 loss-scale overflow (loss scale now {_fmt(v.loss_scale)})")
        else:
            parts.append(f"non-finite {k[len('nonfinite_'):].replace('_', ' ')}")
    if not parts and v.overflow:
        parts.append(f"fp16 loss-scale overflow (loss scale now {_fmt(v.loss_scale)})")
    return f"step {v.step}: " + "; ".join(parts) + f" (loss {_fmt(v.loss)}, grad_norm {_fmt(v.grad_norm)})"


def overflow_line(v, in_a_row: int, cfg) -> None:
    log0(f"{describe(v)}: the loss scaler skipped the update ({in_a_row} in a row; an anomaly at "
         f"train.anomaly.max_consecutive_overflows={cfg.max_consecutive_overflows} or a scale below "
         f"train.anomaly.min_loss_scale={cfg.min_loss_scale:g})")


def skip_line(v, in_a_row: int) -> None:
    log0(f"anomaly at {describe(v)}: update skipped ({in_a_row} in a row)")


def rerun_repeated_line(step: int) -> None:
    log0(f"step {step}: the re-run repeated the non-finite result: not a transient fault")


def transient_lines(first, rerun, rank: int) -> None:
    """A non-finite first run whose re-run was finite: rank 0 says so, the ranks that saw it name their host."""
    who = (f"ranks with a non-finite local loss: {first.bad_ranks}" if first.bad_ranks else
           "not attributable to a rank (the gradient norm is reduced over all ranks)")
    log0(f"transient fault at step {first.step}: {describe(first)} on the first run, finite on the re-run "
         f"(loss {_fmt(rerun.loss)}, grad_norm {_fmt(rerun.grad_norm)}); {who}; continuing with the re-run's result")
    if rank in first.bad_ranks:
        log_all(f"transient fault at step {first.step} on rank {rank}, host {socket.gethostname()}")


def rewind_line(v, to_step: int, rewinds: int, max_rewinds: int, window: tuple[int, int]) -> None:
    log0(f"anomaly at {describe(v)}: rewound to step {to_step} (rewind {rewinds} of {max_rewinds}); "
         f"samples {window[0]}..{window[1] - 1} will be skipped")


def target_skipped_line(path: str) -> None:
    log0(f"rewind: {path} failed verification (see above); trying the next older healthy checkpoint")


def window_skipped_line(start: int, end: int) -> None:
    log0(f"skipped samples {start}..{end - 1} (an anomalous data window)")


def newest_description(newest: Optional[tuple[int, str]]) -> str:
    """`<path> (step N, loss L, grad_norm G)` of the newest healthy checkpoint, or `none`."""
    if newest is None:
        return "none"
    from llmtrain.checkpoint.health import health_of

    h = health_of(newest[1])
    values = "" if h.get("loss") is None else f", loss {h['loss']:.6g}, grad_norm {_fmt(h.get('grad_norm'))}"
    return f"{newest[1]} (step {newest[0]}{values})"


def _samples(windows) -> str:
    """`8..31, 40..47`: consumed-sample windows [from, to), adjacent ones joined."""
    joined: list = []
    for a, b in sorted(windows):
        if joined and a <= joined[-1][1]:
            joined[-1][1] = max(joined[-1][1], b)
        else:
            joined.append([a, b])
    return ", ".join(f"{a}..{b - 1}" for a, b in joined)


def stop_message(v, reason: str, newest: Optional[tuple[int, str]], windows=()) -> str:
    """The message of `Diverged`: the step, the anomaly, its values, why the policy stopped, the newest healthy
    checkpoint, and what to do when the data is the cause (what a resume skips: `windows`, the consumed-sample
    windows the rewinds recorded) and when the learning rate is."""
    data = ("If the data caused it, checkpoint.resume=auto continues from it"
            + (f" and skips samples {_samples(windows)} (the windows the rewinds recorded)" if windows else "")
            + ". ")
    return (f"training stopped at {describe(v)}: {reason}; newest healthy checkpoint: {newest_description(newest)}. "
            f"{data}{STOP_ADVICE}")


def windows_waived_line(lr_then, lr_now, windows) -> None:
    log0(f"resume: the learning rate in force changed ({lr_then:g} in the checkpoint, {lr_now:g} now), so the "
         f"divergence is taken for the learning rate's: samples {_samples(windows)}, which the rewinds recorded to "
         "skip, are trained on (the data was not the cause)")


def corrupt_target_message(v, before: int) -> str:
    return (f"training stopped at {describe(v)}: no healthy checkpoint at step <= {before} passed verification "
            f"(see above)")


def health(v) -> dict:
    """The manifest's `health` of a checkpoint written after the step of verdict `v` (None: no step judged yet)."""
    if v is None:
        return {"status": "healthy", "loss": None, "grad_norm": None, "anomaly": []}
    return {"status": "anomalous" if v.kinds else "healthy", "loss": v.loss, "grad_norm": v.grad_norm,
            "anomaly": list(v.kinds)}


def record_fields(counts: dict, v, loss_scale: Optional[float]) -> dict:
    """Fields of every metrics.jsonl record: the counters, this step's anomaly and overflow, the fp16 loss scale."""
    rec = {f"{k}_total": n for k, n in counts.items()}
    if v is not None and v.kinds:
        rec["anomaly"] = list(v.kinds)
    if v is not None and v.overflow:
        rec["loss_scale_overflow"] = True
    if loss_scale is not None:
        rec["loss_scale"] = loss_scale
    return rec
