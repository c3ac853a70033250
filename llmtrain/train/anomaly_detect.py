"""The divergence guard's detector: a step's verdict from one all-reduce over the job, before its update.

    python -m pytest -q tests/train/test_guard_fast.py -k judge
    detector = Detector(cfg.train.anomaly, topo, comm, local_loss, scaler)
    v = detector.judge(norm, step)      # a Verdict; raises AnomalousStep (every rank alike) when rejected

Where the check sits: between the backward and the update. The recording clip computes the step's global
gradient norm (every layout's own reduction: dp, tp, pp, sharding, ZeRO, ep) inside `optimizer.step()`;
`GatedClip` wraps it and, before any parameter or optimizer state changes, calls the judge: one all-reduce of
six numbers over the whole job (this rank's step loss and a count where it holds one, rank 0's norm, a count
and a rank-id sum of ranks whose local loss is non-finite, a count of ranks whose fp16 loss scaler found
inf/NaN gradients). Every rank derives the same verdict from the same reduced numbers, so every rank either
goes on to the update or raises `AnomalousStep` at the same point: no rank waits on a collective the others
skipped, whatever the layout. A rejected step leaves parameters and optimizer state untouched (the clip runs
before the update).

fp16 (Megatron-LM's split between its loss scaler and its rerun checks): a step whose gradients overflowed is
the scaler's. Its non-finite norm is expected, so it is neither rejected nor entered in the history; the
optimizer skips its update (Paddle's `found_inf`) and the scaler lowers the scale after the clip returns. A
non-finite LOSS is never the scaler's (the scale multiplies the loss after the forward): it stays an anomaly.
"""
from __future__ import annotations

import math
import socket
from collections import deque
from statistics import median
from typing import Callable, Optional

import paddle

from llmtrain.paddle_compat.amp import overflow_flag
from llmtrain.train.anomaly import AnomalousStep, AnomalyConfig, Verdict
from llmtrain.utils.log import log_all


class Detector:
    """The verdict of each step and the history of accepted steps (the same on every rank)."""

    def __init__(self, cfg: AnomalyConfig, topo, comm, local_loss: Callable[[], Optional[paddle.Tensor]],
                 scaler=None, fp8=None):
        """`local_loss()`: this rank's step loss (fp32 scalar tensor) or None where it holds none (a pipeline's
        earlier stages). `scaler`: fp16's loss scaler (its overflow flag is read inside the clip) or None. `fp8`:
        the model's `FP8Health` under `train.fp8` (a seventh number in the all-reduce: its non-finite tiles), or None."""
        self.cfg, self.topo, self.comm, self.local_loss, self.scaler = cfg, topo, comm, local_loss, scaler
        self.fp8 = fp8
        self.history: deque = deque(maxlen=cfg.window)  # (step, loss, grad_norm) of accepted steps

    def judge(self, norm, step: int) -> Verdict:
        """The step's verdict from one all-reduce; raises AnomalousStep (every rank alike) when it is rejected."""
        loss = self.local_loss()
        rank, zero = self.topo.rank, paddle.zeros([], "float32")
        mine = loss.astype("float32").reshape([]) if loss is not None else zero
        bad = (~paddle.isfinite(mine)).astype("float32")
        flag = overflow_flag(self.scaler)  # bool [1] set by the scaler's unscale, None without an active scaler
        parts = [mine, paddle.full([], 1.0 if loss is not None else 0.0, "float32"),
                 norm.astype("float32").reshape([]) if norm is not None and rank == 0 else zero, bad, bad * (rank + 1),
                 flag.astype("float32").reshape([]) if flag is not None else zero]
        if self.fp8 is not None:
            parts.append(self.fp8.count().reshape([]))  # FP8 tiles with an inf/NaN amax on this rank this step
        vec = paddle.stack(parts).astype("float64")  # [6] (+1 under FP8), built on the device: one read below
        vec = self.comm.all_reduce_sum(vec).numpy().tolist()  # the whole job: every rank gets the same numbers
        v = Verdict(step, loss=vec[0] / vec[1] if vec[1] else None, grad_norm=vec[2] if norm is not None else None,
                    overflow=vec[5] > 0)
        if self.fp8 is not None and vec[6] > 0:  # before the loss or the norm: a saturated NaN looks finite
            v.fp8_tiles, v.fp8_tensors = int(vec[6]), self.fp8.offenders()
            v.kinds.append("nonfinite_fp8_amax")
        if vec[3] == 1:
            v.bad_ranks = [int(vec[4]) - 1]
        elif vec[3] > 1:
            v.bad_ranks = [f"{int(vec[3])} ranks"]
        if rank in v.bad_ranks or (vec[3] > 1 and float(bad) > 0):
            log_all(f"step {step}: non-finite local loss on host {socket.gethostname()}")
        if v.loss is not None and not math.isfinite(v.loss):
            v.kinds.append("nonfinite_loss")
        if v.grad_norm is not None and not math.isfinite(v.grad_norm) and not v.overflow:
            v.kinds.append("nonfinite_grad_norm")  # (an overflow's non-finite norm is the loss scaler's)
        if not v.kinds and not v.overflow:
            self._spikes(v)
        if v.kinds:
            raise AnomalousStep(v)
        if not v.overflow:
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

    def forget_after(self, step: int) -> None:
        """After a rewind to `step`: the accepted steps after it are undone."""
        self.history = deque((x for x in self.history if x[0] <= step), maxlen=self.cfg.window)


class GatedClip:
    """The recording clip, then the guard's verdict, before the optimizer applies the update."""

    def __init__(self, inner, guard):
        """`guard.judge(norm)` is called after `inner` computed the norm (`AnomalyGuard.judge`)."""
        self.inner, self.guard = inner, guard

    def __call__(self, params_grads):
        out = self.inner(params_grads)
        self.guard.judge(self.inner.last_norm)  # raises AnomalousStep: no rank updates
        return out

    def __getattr__(self, item):
        return getattr(self.inner, item)
