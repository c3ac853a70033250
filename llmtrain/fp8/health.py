"""FP8Health: non-finite values seen by the FP8 quantisers, caught before the cast saturates them.

    python -m pytest tests/fp8/test_health.py -q
    health = FP8Health()
    health.record(q.amax, "layers.0.mlp.down_proj:dY")      # inside each quantisation (no host read)
    health.count()                                          # fp32 [] tensor: tiles with a non-finite amax this step
    health.offenders()                                      # ["layers.0.mlp.down_proj:dY", ...] (host reads)
    health.reset()                                          # at the start of a step (its `before_step`)

Paddle's casts to FP8 saturate: an inf or a NaN in an activation or a gradient becomes +-448 (e4m3; e5m2 keeps
NaN, inf becomes 57344), so an FP8 run can train on with garbage and a finite loss. Every quantisation records its
tiles' amax here; a tile whose amax is inf (an overflow) or NaN is counted on the device, and the divergence guard
(`llmtrain.train.anomaly_detect`) adds the count to its one all-reduce per step and rejects the step as
`fp8_nonfinite_amax`, naming the tensors (`offenders`).
"""
from __future__ import annotations

from typing import Dict, List

import paddle

from llmtrain.contracts.steps import StepHook


class FP8Health(StepHook):
    """Per-step count of FP8 tiles whose amax was inf or NaN, by tensor name (a step hook: reset before each step)."""

    def __init__(self):
        self._counts: Dict[str, paddle.Tensor] = {}

    def record(self, amax: paddle.Tensor, name: str) -> None:
        """Count the tiles of `amax` (fp32, any shape) that are not finite, under `name` (no host read)."""
        with paddle.no_grad():
            bad = (~paddle.isfinite(amax)).astype("float32").sum()
            prev = self._counts.get(name)
            self._counts[name] = bad if prev is None else prev + bad

    def count(self) -> paddle.Tensor:
        """fp32 []: non-finite tiles recorded since the last reset."""
        if not self._counts:
            return paddle.zeros([], "float32")
        return paddle.stack(list(self._counts.values())).sum()

    def offenders(self) -> List[str]:
        """The names whose tiles had a non-finite amax (reads every count to the host: call on a failure only)."""
        return [name for name, c in self._counts.items() if float(c) > 0]

    def reset(self) -> None:
        self._counts = {}

    def before_step(self, micro_batches: int) -> None:
        self.reset()
