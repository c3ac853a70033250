"""Recompute modes on CPU: peak memory and step time of one training step per mode, side by side, with the planner.

    python benchmarks/recompute_modes.py [--rounds 5] [--model llama] [--seq 512] [--batch 2]

One process (one rank) trains a small Llama-style model (h 256, 8 heads, 2 kv heads, f 704, 4 blocks, math
attention, fp32) or moe-tiny (4 blocks, 8 experts top-2). For each mode (`train.recompute` and module sets) it
measures, on the same weights and batch:
- held: the bytes the forward leaves allocated until the backward (Paddle's host "Allocated" counter: on CPU exactly
  what autograd keeps, `llmtrain.paddle_compat.host_memory`), and the planner's figure for it
  (`llmtrain.plan.estimate.memory_estimate`'s activations + logits, one micro-batch, `Recompute` of the mode);
- peak: the allocator's peak over forward + backward above the start;
- time: forward + backward + AdamW step, each round running every mode once in a rotated order after a warm-up, the
  ratio to `none` taken within the round and the median over rounds reported (this host's speed moves by tens of
  percent over minutes: DESIGN's measuring rule).
Prints a markdown table (benchmarks/README.md holds a run).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import numpy as np
import paddle

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmtrain.config import compose_config, to_config  # noqa: E402
from llmtrain.contracts.steps import mean_loss  # noqa: E402
from llmtrain.models import build_model  # noqa: E402
from llmtrain.models.init import init_parameters  # noqa: E402
from llmtrain.models.recompute import recompute_from  # noqa: E402
from llmtrain.models.stages import canonical_parameters  # noqa: E402
from llmtrain.paddle_compat.host_memory import host_allocated_bytes, host_peak_bytes  # noqa: E402
from llmtrain.parallel.layout import Layout  # noqa: E402
from llmtrain.plan.estimate import memory_estimate  # noqa: E402

MODES = {
    "llama": [("none", ()), ("full", ()), ("full_attn", ()), ("core_attn", ()), ("selective", ("mlp",)),
              ("selective", ("norm",)), ("core_attn", ("mlp", "norm"))],
    "moe": [("none", ()), ("full", ()), ("core_attn", ()), ("selective", ("moe",)), ("selective", ("moe_act",)),
            ("selective", ("shared_experts",)), ("core_attn", ("moe", "norm"))],
}
MODELS = {
    "llama": ["model=llama-tiny", "model.hidden_size=256", "model.num_heads=8", "model.num_kv_heads=2",
              "model.ffn_hidden_size=704", "model.num_layers=4"],
    "moe": ["model=moe-tiny"],
}


def label(mode, modules) -> str:
    return mode + (f" + {','.join(modules)}" if modules else "") if mode != "selective" else ",".join(modules)


class Case:
    """One mode's model, optimizer and planner figure on shared weights."""

    def __init__(self, cfg, mode, modules, ids, labels, state):
        self.name = label(mode, modules)
        self.rc = recompute_from(mode=mode, modules=modules, blocks=[cfg.num_layers])
        paddle.seed(0)
        self.model = build_model(cfg, recompute=self.rc)
        self.model.set_state_dict(state)
        self.model.train()
        self.opt = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=self.model.parameters())
        self.ids, self.labels = ids, labels
        b, s = ids.shape
        layout = dataclasses.replace(Layout(), micro_batch=b, grad_accum=1)
        est = memory_estimate(cfg, layout, s, self.rc, "none", "cpu", 4, False, 0.0)
        self.planned = est["activations"] - est["recompute_transient"] + est["other"]  # held after the forward

    def step(self):
        """(seconds, bytes held after the forward, peak bytes) of one training step."""
        t0 = time.perf_counter()
        with host_peak_bytes() as peak:
            before = host_allocated_bytes()
            logits = self.model(self.ids)
            loss = mean_loss(self.model.loss_fn(logits, (self.labels, paddle.ones(self.labels.shape, "float32"))))
            held = host_allocated_bytes() - before
            loss.backward()
        self.opt.step()
        self.opt.clear_grad()
        return time.perf_counter() - t0, held, peak.bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    cfg = to_config(compose_config(MODELS[args.model] + ["model.vocab_size=2560", "model.attention=math",
                                                         f"model.max_position_embeddings={args.seq}"])).model
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(0, cfg.vocab_size, (args.batch, args.seq)))
    labels = paddle.to_tensor(rng.integers(0, cfg.vocab_size, (args.batch, args.seq)))
    paddle.seed(0)
    ref = build_model(cfg)
    init_parameters(canonical_parameters(ref), cfg, 7)
    state = ref.state_dict()
    cases = [Case(cfg, m, mods, ids, labels, state) for m, mods in MODES[args.model]]
    for c in cases:  # warm-up
        c.step()
    ratios = {c.name: [] for c in cases}
    mem = {}
    for r in range(args.rounds):
        order = cases[r % len(cases):] + cases[:r % len(cases)]
        got = {c.name: c.step() for c in order}
        for c in cases:
            ratios[c.name].append(got[c.name][0] / got[cases[0].name][0])
            mem[c.name] = got[c.name][1:]
    base_time = statistics.median(ratios[cases[0].name])
    none_held = mem[cases[0].name][0]
    print(f"{args.model}: h {cfg.hidden_size}, {cfg.num_layers} blocks, batch {args.batch} x seq {args.seq}, fp32, "
          f"math attention, {args.rounds} rounds, paddle {paddle.__version__}")
    print("| mode | held for backward (MB) | planned (MB) | plan/measured | drop vs none (MB) | peak (MB) "
          "| step time vs none (median) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for c in cases:
        held, peak = mem[c.name]
        print(f"| {c.name} | {held / 1e6:.2f} | {c.planned / 1e6:.2f} | {c.planned / held:.3f} | "
              f"{(none_held - held) / 1e6:.2f} | {peak / 1e6:.2f} | {statistics.median(ratios[c.name]) / base_time:.3f} |")


if __name__ == "__main__":
    main()
