"""The activations DualPipeV keeps per stage, read off fleet's schedule: its two chunks' micro-batches in flight.

    python -m llmtrain.plan model=deepseek-v3 plan.device=h800 plan.devices=256 train.global_batch_size=4096 data.seq_len=4096
    v_flights(pp=4, micro_batches=16, stage=0)     # ((8, 1), ...): (down-chunk, up-chunk) micro-batches held at once
    v_held(down_bytes, up_bytes, pp=4, micro_batches=16, stage=0)   # the most bytes the stage holds for backward

Stage s of DualPipeV runs chunk s on the way down the V and chunk 2·pp - 1 - s on the way back up
(llmtrain/parallel/dualpipe.py). Fleet 3.3.1's schedule (`DualPipeVParallel.forward_backward_pipeline`) runs on
stage s, with m micro-batches: (pp - s - 1)·2 forwards of the down chunk; s + 1 pairs (down, up) of forwards;
pp - s - 1 x (up backward, its weight gradients, up forward); m - 2·pp + s + 1 x (down forward, up backward, up
forward, down backward); pp - s - 1 x (up backward, up forward, down backward); s + 1 x (up backward, down backward);
then the remaining down backwards and weight passes. Replaying that order and counting, per chunk, the
micro-batches whose forward ran and whose backward has not, gives the states the stage passes through; its peak
is (2·pp - s, s + 1): stage 0 holds 2·pp micro-batches of its down chunk (the embedding's end) and one of its up
chunk (the head's, so the logits once), the last stage pp + 1 and pp. DualPipe's table (github.com/deepseek-ai/
DualPipe) gives PP + 1 = 2·pp + 1 chunk-micro-batches per device, the same count; what the replay adds is which
chunk they belong to, which matters when a stage's two chunks hold different blocks (a cost-balanced split gives
stage 0's up chunk, beside the head, fewer blocks, so stage 0 holds more than the table's even count says).

A backward whose weight gradients are deferred (`WeightGradStore`, the "W" passes) keeps its linears' inputs until
its weight pass; in fleet's order a deferred pass is either popped before the next forward (the pp - s - 1 steps
above) or comes after the last forward, when fewer micro-batches are held than at the peak: it moves no peak and is
not counted. Needs m >= 2·pp (fleet asserts it; `llmtrain.parallel.layout` refuses fewer).
"""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4096)
def v_flights(pp: int, micro_batches: int, stage: int) -> tuple[tuple[int, int], ...]:
    """The (down-chunk, up-chunk) micro-batch counts stage `stage` holds for backward at the moments just after a
    forward, in fleet's order, keeping those no other state bounds in both counts (the candidates for a peak)."""
    if micro_batches < 2 * pp:
        raise ValueError(f"DualPipeV with pp={pp} needs >= {2 * pp} micro-batches, got {micro_batches}")
    s, m = stage, micro_batches
    order = (["F0"] * ((pp - s - 1) * 2) + ["F0", "F1"] * (s + 1) + ["B1", "F1"] * (pp - s - 1)
             + ["F0", "B1", "F1", "B0"] * (m - 2 * pp + s + 1) + ["B1", "F1", "B0"] * (pp - s - 1)
             + ["B1", "B0"] * (s + 1) + ["B0"] * (pp - s - 1))
    held, states = [0, 0], set()
    for op in order:
        held[int(op[1])] += 1 if op[0] == "F" else -1
        if op[0] == "F":
            states.add(tuple(held))
    if held != [0, 0]:
        raise AssertionError(f"DualPipeV replay of pp={pp}, m={m}, stage {s} ends holding {held}")
    return tuple(sorted(a for a in states if not any(b != a and b[0] >= a[0] and b[1] >= a[1] for b in states)))


def v_held(down_bytes: float, up_bytes: float, *, pp: int, micro_batches: int, stage: int) -> float:
    """The most bytes stage `stage` holds for backward: max over `v_flights` of n_down x `down_bytes` + n_up x
    `up_bytes` (one micro-batch's saved bytes of the down chunk's blocks and of the up chunk's)."""
    return max(a * down_bytes + b * up_bytes for a, b in v_flights(pp, micro_batches, stage))


def v_least_flight(pp: int, stage: int) -> int:
    """Micro-batches of any one block of stage `stage` held at the schedule's peak, whichever chunk it is in:
    min(2·pp - stage, stage + 1) (a lower bound per block, for `llmtrain.plan.prune`)."""
    return min(2 * pp - stage, stage + 1)
