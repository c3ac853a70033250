"""The routed experts of one MoE layer, stacked: [E, h, f] / [E, h, f] / [E, f, h] on one device.

    python -m pytest tests/models/test_moe.py -q
    experts = roles.experts(cfg)          # Experts(cfg, cfg.moe_num_experts) unless a plan spreads them

An expert-parallel plan (`llmtrain.parallel.experts`) builds the same layer with a block
of the experts and a dispatcher that brings tokens to them; the router, the balancing
losses and the statistics live in `llmtrain.models.moe`.
"""
from __future__ import annotations

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from llmtrain.contracts import tags
from llmtrain.models.config import ModelConfig


class LocalDispatch:
    """One device: every expert is here, tokens stay where they are."""

    def dispatch(self, x, index, weight):
        """x [T, h], index/weight [T, k] -> the tokens and choices this rank's experts must serve."""
        return x, index, weight

    def combine(self, y):
        """y [T', h] partial outputs of this rank's experts -> [T, h] for this rank's tokens."""
        return y


class Experts(nn.Layer):
    """Routed experts first .. first + n_local - 1 of num_experts, stacked; SwiGLU (or GeLU up/down)."""

    def __init__(self, cfg: ModelConfig, num_local: int, first: int = 0, dispatcher=None):
        super().__init__()
        h, f = cfg.hidden_size, cfg.expert_ffn_size()
        self.first, self.num_local = first, num_local
        self.swiglu = cfg.activation == "swiglu"
        self.approximate = cfg.activation == "gelu_tanh"
        self.dispatcher = dispatcher or LocalDispatch()
        if self.swiglu:
            self.w_gate = self.create_parameter([num_local, h, f])
        self.w_up = self.create_parameter([num_local, h, f])
        self.w_down = self.create_parameter([num_local, f, h])
        tags.mark_residual_out(self.w_down)
        for p in self.parameters():
            tags.set_expert_axis(p, 0)  # the plan may hold a block of experts: full shape has num_experts rows

    def forward(self, x, index, weight):  # x [T, h]; index, weight [T, k]
        x, index, weight = self.dispatcher.dispatch(x, index, weight)  # [T', h], [T', k]
        num_tokens, top_k = index.shape
        flat_index = index.reshape([-1])  # [T' k]
        flat_weight = weight.reshape([-1])
        token = paddle.arange(num_tokens, dtype="int64").repeat_interleave(top_k)  # [T' k]
        out = paddle.zeros_like(x)  # [T', h]
        served = 0
        for j in range(self.num_local):
            pos = paddle.nonzero(flat_index == self.first + j).flatten()  # choices served by expert j
            if pos.shape[0] == 0:
                continue
            served += 1
            rows = paddle.gather(token, pos)  # [n]
            xe = paddle.gather(x, rows)  # [n, h]
            if self.swiglu:
                inner = F.silu(xe @ self.w_gate[j]) * (xe @ self.w_up[j])  # [n, f]
            else:
                inner = F.gelu(xe @ self.w_up[j], approximate=self.approximate)
            ye = (inner @ self.w_down[j]) * paddle.gather(flat_weight, pos).astype(x.dtype)[:, None]  # [n, h]
            out = paddle.index_add(out, rows, 0, ye)
        if served == 0:  # keep the stacked weights in the graph: their (zero) gradient exists on every rank
            out = out + 0.0 * sum(p.sum() for p in self.parameters()).astype(out.dtype)
        return self.dispatcher.combine(out)  # [T, h]
