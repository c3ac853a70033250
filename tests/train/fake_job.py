"""One process playing one rank of a job: scripted peers, a tiny model under the real guard and checkpointer.

    comm = ScriptedComm(rank=1, world=2, broadcasts=rank0.sent)   # rank 1, fed what rank 0 broadcast
    rig = GuardRig(tmp_path, tiny_gpt, comm=comm)                  # model, optimizer, StepRunner, AnomalyGuard,
    out = rig.step()                                               # Checkpointer, Meter, a layout-free data stand-in
    forced_loss_scaler()                                           # Paddle's real GradScaler, enabled on CPU
                                                                   # (tests/gpu_paths/amp_fp16_rehearsal.py)

The guard and the checkpointer take a `comm` (`llmtrain.parallel.job_comm.JobComm`'s two methods); here the other
ranks' parts of each collective are scripted: `all_reduce_sum` adds `others(mine)` (default: zeros, a peer
that contributes nothing, as a healthy rank with a finite loss does not to the bad-rank counts), and
`broadcast_ints` records what this rank sends as source and, on another rank, returns the next scripted payload.
Running rank 0 first and handing its `sent` to a rank-1 instance reproduces what rank 1 receives in a real job
(torchtitan tests distributed code paths the same way, with a fake backend in one process).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np
import paddle

from gpu_paths.amp_fp16_rehearsal import forced_loss_scaler  # noqa: F401  (tests/gpu_paths: a namespace import)
from train.faults import BadGrad  # tests/train: a namespace import


class ScriptedComm:
    """The job's collectives as seen by one rank, the other ranks' contributions scripted."""

    def __init__(self, rank: int = 0, world: int = 1, others: Optional[Callable] = None, broadcasts=()):
        self.rank, self.world = rank, world
        self.others = others or (lambda mine: np.zeros_like(mine))
        self.broadcasts = list(broadcasts)
        self.sent: list = []
        """What this rank broadcast as source, in order."""
        self.reduced: list = []
        """This rank's contribution to each all-reduce, in order."""

    def all_reduce_sum(self, t):
        mine = t.numpy()
        self.reduced.append(mine.copy())
        return paddle.to_tensor(mine + self.others(mine).astype(mine.dtype), dtype=t.dtype)

    def broadcast_ints(self, values, src: int = 0) -> list[int]:
        if self.rank == src:
            self.sent.append(list(values))
            return [int(v) for v in values]
        assert self.broadcasts, f"rank {self.rank}: a broadcast nobody scripted"
        return [int(v) for v in self.broadcasts.pop(0)]


class FakeData:
    """A layout-free sample order: sample i is always the same tokens (seeded by i); 8 samples per step."""

    def __init__(self, vocab: int, seq: int = 16, batch: int = 8, micro: int = 4):
        self.vocab, self.seq, self.batch, self.micro = vocab, seq, batch, micro
        self.consumed_samples = 0
        self.seen: list[int] = []
        """The first sample of every batch handed out."""

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])

    def next_step(self) -> list[dict]:
        start = self.consumed_samples
        self.seen.append(start)
        rows = np.stack([np.random.default_rng(i).integers(0, self.vocab, self.seq + 1) for i in
                         range(start, start + self.batch)])
        self.consumed_samples += self.batch
        return [dict(input_ids=rows[i:i + self.micro, :-1], labels=rows[i:i + self.micro, 1:],
                     loss_mask=np.ones((self.micro, self.seq), np.float32)) for i in range(0, self.batch, self.micro)]


class GuardRig:
    """A tiny model trained under the real StepRunner, AnomalyGuard, Checkpointer and Meter, as one rank."""

    def __init__(self, tmp, model_cfg, comm: Optional[ScriptedComm] = None, anomaly: Optional[dict] = None,
                 scaler=None, max_steps: int = 20, lr: float = 1e-2, keep_last: int = 0):
        from llmtest import compose
        from llmtrain.checkpoint.manager import Checkpointer
        from llmtrain.checkpoint.state import training_state
        from llmtrain.config import to_config
        from llmtrain.models import build_model
        from llmtrain.models.init import init_parameters
        from llmtrain.models.stages import canonical_parameters
        from llmtrain.parallel.layout import Layout
        from llmtrain.parallel.strategy import Topology
        from llmtrain.train.amp import AmpPlan
        from llmtrain.train.anomaly_guard import AnomalyGuard
        from llmtrain.train.anomaly_rewind import SkipWindows
        from llmtrain.train.config import OptimConfig
        from llmtrain.train.metrics import Meter
        from llmtrain.train.optim import build_optimizer
        from llmtrain.train.step import StepRunner

        self.comm = comm or ScriptedComm()
        self.topo = Topology(rank=self.comm.rank, world=self.comm.world)
        self.run_dir = str(tmp)
        os.makedirs(self.run_dir, exist_ok=True)
        overrides = [f"run.dir={tmp}", f"checkpoint.keep_last={keep_last}", "checkpoint.interval=0"]
        overrides += [f"train.anomaly.{k}={v}" for k, v in (anomaly or {}).items()]
        self.cfg = to_config(compose(overrides))
        paddle.seed(0)
        self.model = build_model(model_cfg)
        self.named = canonical_parameters(self.model)
        init_parameters(self.named, model_cfg, seed=3)
        self.opt, self.sched = build_optimizer(self.named, OptimConfig(lr=lr, warmup_steps=0), max_steps=max_steps)
        self.clip = self.opt._grad_clip
        self.scaler = scaler
        self.fault: Callable[[int], Optional[str]] = lambda start: None
        """The fault of the batch starting at sample `start`: None, "spike" (logits x 300) or "inf" (inf gradients)."""
        amp = AmpPlan.from_config("fp16" if scaler is not None else "none")  # (the scaler acts under an fp16 autocast)
        self.runner = StepRunner(self.model, self._loss, self.opt, self.sched, self.clip, amp, scaler=scaler)
        self.data = FakeData(model_cfg.vocab_size)
        state = training_state(self.named, self.model, self.opt, self.sched, scaler, self.data)
        self.windows = SkipWindows()
        state.manifest_parts.append(self.windows)
        self.ckpt = Checkpointer(self.cfg, Layout(), self.topo, state, comm=self.comm)
        self.guard = AnomalyGuard(self.cfg.train.anomaly, self.topo, self.runner, self.clip, self.opt, self.windows,
                                  comm=self.comm)
        self.meter = Meter(self.run_dir, self.topo, 1.0, None, 1, max_steps, progress_bar=False, visualdl=False)
        self.step_no = 0
        self.records: list[dict] = []

    def _loss(self, logits, labels):
        kind = self.fault(self.data.seen[-1])
        if kind == "spike":
            logits = logits * 300.0
        elif kind == "inf":
            logits = BadGrad.apply(logits, float("inf"))
        return self.model.loss_fn(logits, labels)

    def step(self):
        """One step of the training loop's guard calls (trainer.py `_loop`); returns (StepOutput, action)."""
        self.guard.before_next_step(self.data)
        before = self.data.consumed_samples
        mbs = self.data.next_step()
        out = self.guard.run_step(self.runner, mbs, self.step_no + 1, (before, self.data.consumed_samples))
        self.step_no += 1
        action = self.guard.policy(out.anomaly, self.ckpt) if out.anomaly is not None else None
        rec = self.meter.update(self.step_no, out, 0.0, 0.0, extra={"consumed_samples": self.data.consumed_samples,
                                                                   **self.guard.metrics()})
        self.records.append(rec)
        if action == "stop":
            self.guard.stop(out.anomaly, self.ckpt, self.meter)
        if action == "rewind":
            self.step_no = self.guard.rewind(out.anomaly, self.ckpt, self.data, self.meter)
            self.records = [r for r in self.records if r["step"] <= self.step_no]
        return out, action

    def save(self) -> str:
        return self.ckpt.save(self.step_no, self.meter.tokens_total_exact(), health=self.guard.health())

    def weights(self) -> dict:
        return {n: p.numpy().copy() for n, p in self.named}

    def checkpoint(self, step: int) -> str:
        return os.path.join(self.run_dir, "checkpoints", f"step_{step}")
