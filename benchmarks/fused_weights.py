"""Fused projections on CPU: one GEMM over concatenated weights (kept or not for the backward) against one GEMM per
weight, side by side.

    python benchmarks/fused_weights.py [--rounds 5]

The ways a layer can compute several projections of one input x:
- `concat kept`: autograd over the weights concatenated at every forward, one GEMM, the output split (llmtrain before
  issue 45 item 3: `Experts.ffn` with `model.fuse_ffn`, `concat_linear` for `fuse_qkv` / `fuse_ffn`). The GEMM keeps
  the concatenated weight for its backward: a copy of the weights per layer and micro-batch;
- `concat not kept`: the same GEMM through `llmtrain.models.fused_linear.ConcatLinear` (what the dense fused
  projections run now): the weights concatenated again in the backward, nothing kept but x and the parameters;
- `separate`: one GEMM per weight on the same x (what the routed experts run now: two bmm): the GEMMs keep x (one
  tensor, shared) and the parameters themselves.
For each shape: forward + backward time of each way against `concat kept`, alternating the order over `--rounds`
rounds after a warm-up (the ratio taken within each round: this host's speed moves by tens of percent over minutes),
and the bytes the forward leaves allocated on the host (Paddle's host "Allocated" counter: on CPU exactly the bytes
saved for backward plus the outputs). Prints a markdown table (benchmarks/README.md holds a run).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import paddle
import paddle.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmtrain.models.fused_linear import ConcatLinear  # noqa: E402
from llmtrain.paddle_compat.host_memory import host_allocated_bytes  # noqa: E402

SHAPES = [  # (label, kind, dims)
    ("experts gate|up, moe-tiny: E 8, C 512, h 128, f 96", "bmm", (8, 512, 128, 96)),
    ("experts gate|up: E 16, C 256, h 1024, f 704", "bmm", (16, 256, 1024, 704)),
    ("dense q|k|v, GQA: T 2048, h 1024, q 1024, kv 256", "linear", (2048, 1024, (1024, 256, 256))),
    ("dense gate|up: T 2048, h 1024, f 2816", "linear", (2048, 1024, (2816, 2816))),
]


def make(kind: str, dims):
    """(x, weights) of one shape, all requiring gradients."""
    paddle.seed(0)
    if kind == "bmm":
        e, c, h, f = dims
        tensors = [paddle.randn([e, c, h]), paddle.randn([e, h, f]) * 0.02, paddle.randn([e, h, f]) * 0.02]
    else:
        t, h, outs = dims
        tensors = [paddle.randn([t, h])] + [paddle.randn([h, o]) * 0.02 for o in outs]
    for x in tensors:
        x.stop_gradient = False
    return tensors[0], tensors[1:]


WAYS = {"bmm": ("concat kept", "separate"), "linear": ("concat kept", "concat not kept", "separate")}


def forward(kind: str, way: str, x, weights):
    """The projections of x, as a list (`way`: one of WAYS[kind])."""
    if kind == "bmm":
        if way == "concat kept":
            return paddle.bmm(x, paddle.concat(weights, axis=-1)).chunk(len(weights), axis=-1)
        return [paddle.bmm(x, w) for w in weights]
    if way == "concat kept":
        return paddle.split(F.linear(x, paddle.concat(weights, axis=1)), [w.shape[1] for w in weights], axis=-1)
    if way == "concat not kept":
        return list(ConcatLinear.apply(x, False, *weights))
    return [F.linear(x, w) for w in weights]


def step(kind, way, x, weights) -> tuple[float, int]:
    """(seconds of forward + backward, bytes the forward left allocated on the host)."""
    start, held0 = time.perf_counter(), host_allocated_bytes()
    outs = forward(kind, way, x, weights)
    held = host_allocated_bytes() - held0
    sum(o.square().sum() for o in outs).backward()
    for t in (x, *weights):
        t.clear_gradient()
    return time.perf_counter() - start, held


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    print("| shape | way | time / concat kept (median, range) | bytes held after forward | the weights' bytes |")
    print("|---|---|---|---|---|")
    for label, kind, dims in SHAPES:
        x, weights = make(kind, dims)
        ways = WAYS[kind]
        for way in ways:
            step(kind, way, x, weights)  # warm-up
        ratios: dict = {w: [] for w in ways}
        held: dict = {}
        for r in range(a.rounds):
            t = {}
            for way in ways if r % 2 == 0 else ways[::-1]:
                t[way], held[way] = step(kind, way, x, weights)
            for way in ways:
                ratios[way].append(t[way] / t["concat kept"])
        weight_bytes = int(sum(w.numel() for w in weights)) * 4
        for way in ways:
            rs = ratios[way]
            print(f"| {label} | {way} | {statistics.median(rs):.3f} ({min(rs):.2f}-{max(rs):.2f}) | {held[way]:,} "
                  f"| {weight_bytes:,} |")


if __name__ == "__main__":
    main()
