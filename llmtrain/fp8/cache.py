"""FP8 copies of the linears' weights, quantised once per optimizer step and reused by every micro-batch.

    python llmtrain/pretrain.py model=llama-tiny train.fp8=blockwise train.global_batch_size=8 \
        train.micro_batch_size=2                        # 4 micro-batches: each weight quantised once a step
    python -m pytest tests/fp8/test_cache.py -q

A weight changes only in the optimizer update (and in a checkpoint load or a rewind, between steps), so within a
step every micro-batch quantises the same values: Transformer Engine and Megatron-Core quantise at the first
micro-batch (`is_first_microbatch`) and reuse the copy. `WeightCache` does that for `FP8Gemm`: each layer's
quantised weight (on a GPU its two copies, W for dx and Wᵀ for the forward) is made at the first use in a step and
kept until the step ends (parameters only: a fused projection's concatenated weight is made anew at every call and
quantised each time). It is a step hook that forgets every copy before each step, after each step's update and
around an evaluation, so no copy outlives the values it was made from. The numbers are the same as without it
(tests/fp8/test_cache.py: losses equal bit for bit). What it costs: the copies live from the first forward to the
end of the step (one per linear; on a GPU two), where without it each micro-batch's copy lives until that
micro-batch's backward (`train.fp8_weight_cache=false` turns it off).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict

import paddle

from llmtrain.contracts.steps import StepHook


def identity(weight) -> tuple:
    """(id, is a parameter) of `weight`: what `WeightCache.get` keys a copy on."""
    return id(weight), bool(getattr(weight, "persistable", False))


class WeightCache(StepHook):
    """{(layer name, what): quantised weight} for the current step (module docstring)."""

    def __init__(self):
        self._held: Dict[tuple, Any] = {}
        self.made = 0
        """Quantisations made since construction (a test reads it: once per layer and step)."""

    def get(self, name: str, weight, what: str, make: Callable[[], Any], ident=None) -> Any:
        """The copy `what` of `weight` (a parameter) of layer `name`, or `make()` (under no_grad) kept until the step
        ends. A weight that is no parameter (a fused projection's concatenation, made anew at every call) is not
        cached: `make()` each time. `ident`: `identity(parameter)` when `weight` is a slice of that parameter (one
        expert of the stacked experts)."""
        held_id, persistable = ident if ident is not None else identity(weight)
        if not persistable:
            return make()
        key = (name, held_id, what)  # the experts' gate and up share a layer name: the parameter tells them apart
        hit = self._held.get(key)
        if hit is None:
            with paddle.no_grad():
                hit = self._held[key] = make()
            self.made += 1
        return hit

    def clear(self) -> None:
        self._held = {}

    def before_step(self, micro_batches: int) -> None:
        self.clear()  # a load or a rewind between steps changed the weights

    def after_step(self, record) -> None:
        self.clear()  # the update changed them

    @contextlib.contextmanager
    def evaluation(self):
        self.clear()
        try:
            yield
        finally:
            self.clear()
