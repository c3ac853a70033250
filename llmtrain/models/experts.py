"""The routed experts of one MoE layer, stacked [E, h, f] / [E, h, f] / [E, f, h], run as batched GEMMs.

    python -m pytest tests/models/test_dispatch.py tests/models/test_moe.py -q
    experts = roles.experts(cfg)          # Experts(cfg, cfg.moe_num_experts) unless a plan spreads them
    y = experts(x, index, weight)         # x [T, h], index [T, k] int64 (-1: dropped), weight [T, k] fp32 -> [T, h]

The formulation (the op sequence the planner's PyTorch twin mirrors; `llmtrain.models.dispatch` has steps 1-5, 7):

    x [T, h] this rank's tokens; index [T, k] int64 (-1: dropped by the capacity); weight [T, k] fp32; E experts
    1. idx = index.T.reshape([k T])                       slot-major: every token's 1st choice, then every 2nd, ...
                                                          (GShard's queue order, as route() counts the capacity)
    2. onehot = one_hot(clip(idx, 0), E) * (idx >= 0)     [k T, E] int64, dropped rows zero
       pos = (cumsum(onehot, 0) * onehot).sum(-1) - 1     [k T] place of the choice in its expert's queue
    3. C = ceil(factor T k / E)                           capacity mode (moe_capacity_factor > 0): static, no host read
       C = int(onehot.sum(0).max())                       dropless: THE ONE HOST READ of the layer (an expert-parallel
                                                          dispatcher takes the max over its ep group first)
    4. kept = idx >= 0 (and pos < C in capacity mode: route() already dropped those; a guard, no host read)
       slot = idx * C + pos (kept), E C (dropped)         [k T]; E C is a trash row
       source = scatter(full([E C + 1], T), slot, tile(arange(T), [k]))[:E C]
                                                          [E C] int64: the token of each buffer row, T if empty
    5. buffer = gather(concat(x, zeros([1, h])), source).reshape([E, C, h])    expert-major; empty rows zero
       (backward: one index_add of d buffer into [T + 1, h])
       (expert parallelism: [E, C, h] = [ep, E_local, C, h] -> exchange over the ep group -> [E_local, ep C, h])
    6. swiglu: g = bmm(buf, w_gate), u = bmm(buf, w_up)   [E_l, N, f] each, on the stacked parameters themselves
               (never concatenated: that copy [E_l, h, 2f] was kept for the backward, 0.69 GB per layer of
               qwen-moe-a2.7b in bf16); inner = silu(g) * u (model.fuse_swiglu: one kernel)
       gelu:   inner = gelu(bmm(buf, w_up))
       out = bmm(inner, w_down)                           [E_l, N, h]
       (expert parallelism: the reverse exchange -> [E, C, h])
    7. row = slot with dropped -> 0, laid out [T, k] (token-major); w = weight * kept [T, k] (0 where dropped)
       y = (gather(out.reshape([E C, h]), row) [T, k, h] * w [T, k, 1]).sum(1)  -> [T, h]
       in fp32 (out cast to fp32 first, the sum cast once to out's dtype; model.moe_router_dtype=amp: w cast to
       out's dtype and the sum in it); on a GPU: Paddle's fused moe_combine(out [E C, h], w [T, k], row [T, k]
       int32), one kernel, given the same dtypes

Deviations from the plan written before it was built (TEAM's formulation): step 5 gathers each buffer row's token
through the inverse map `source` instead of scattering x[tok] into the rows `slot` (the same buffer; on CPU the
gather's forward + backward measured 6x faster than index_add's, whose backward Paddle runs slowly; no [k T, h]
copy of x); the combine gathers in token-major order [T, k] (the layout of the fused kernel; the same rows and bytes
as the slot-major gather) and uses row 0 with weight 0 for a dropped choice (the expert output has no trash row;
weight 0 is exact).

The buffer rows past an expert's load are zeros; the experts compute them (no bias: their output is zero and their
gradient contribution is zero). The stacked weights take part in every step, so every rank's expert gradient
exists even when no token chose its experts. `LocalDispatch` is one device; an expert-parallel plan
(`llmtrain.parallel.experts`) builds the same layer with a block of the experts and a dispatcher that moves the
buffer between ranks; the router, the balancing losses and the statistics live in `llmtrain.models.moe`.
"""
from __future__ import annotations

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from llmtrain.contracts import tags
from llmtrain.models import dispatch as moe_dispatch
from llmtrain.models.config import ModelConfig
from llmtrain.models.recompute import checkpointed
from llmtrain.paddle_compat import kernels


class LocalDispatch:
    """One device: every expert is here; the buffer stays where it is."""

    def agree_capacity(self, largest_load: paddle.Tensor) -> int:
        """Dropless capacity from this micro-batch's largest expert load [] (the layer's one host read)."""
        return moe_dispatch.host_int(largest_load)

    def to_experts(self, buffer):
        """[E, C, h] this rank's tokens by expert -> [E_local, N, h] the rows this rank's experts serve."""
        return buffer

    def from_experts(self, out):
        """[E_local, N, h] outputs of this rank's experts -> [E, C, h] outputs for this rank's tokens."""
        return out


class Experts(nn.Layer):
    """Routed experts first .. first + n_local - 1 of num_experts, stacked; SwiGLU (or GeLU up/down)."""

    def __init__(self, cfg: ModelConfig, num_local: int, first: int = 0, dispatcher=None):
        super().__init__()
        h, f = cfg.hidden_size, cfg.expert_ffn_size()
        self.first, self.num_local, self.num_experts = first, num_local, cfg.moe_num_experts
        self.capacity_factor = cfg.moe_capacity_factor
        self.combine_fp32 = cfg.moe_router_dtype == "fp32"  # the combine's weighted sum in fp32 under AMP
        self.swiglu = cfg.activation == "swiglu"
        self.approximate = cfg.activation == "gelu_tanh"
        self.fuse_swiglu = cfg.fused("fuse_swiglu")
        self.dispatcher = dispatcher or LocalDispatch()
        self.recompute_act = False  # re-run the activation in the backward (`train.recompute_modules=[moe_act]`)
        self.bmm = paddle.bmm  # the experts' GEMM x [E_l, N, a] @ w [E_l, a, b]; an FP8 recipe replaces it
        if self.swiglu:
            self.w_gate = self.create_parameter([num_local, h, f])
        self.w_up = self.create_parameter([num_local, h, f])
        self.w_down = self.create_parameter([num_local, f, h])
        tags.mark_residual_out(self.w_down)
        for p in self.parameters():
            tags.set_expert_axis(p, 0)  # the plan may hold a block of experts: full shape has num_experts rows

    def capacity(self, num_tokens: int, top_k: int):
        """C for a micro-batch of `num_tokens` (capacity mode), or None (dropless: from the step's largest load)."""
        if self.capacity_factor <= 0:
            return None
        return moe_dispatch.capacity(num_tokens, top_k, self.num_experts, self.capacity_factor)

    def forward(self, x, index, weight):  # x [T, h]; index, weight [T, k]
        if isinstance(self.dispatcher, LocalDispatch) and self.num_local != self.num_experts:
            raise ValueError(f"Experts holding {self.num_local} of {self.num_experts} experts needs an "
                             "expert-parallel dispatcher (llmtrain.parallel.experts)")
        slots = moe_dispatch.expert_slots(index, self.num_experts, self.capacity(*index.shape),
                                          self.dispatcher.agree_capacity)
        buffer = moe_dispatch.dispatch(x, slots)  # [E, C, h]
        out = self.dispatcher.from_experts(self.ffn(self.dispatcher.to_experts(buffer)))  # [E, C, h]
        return moe_dispatch.combine(out, slots, weight, fp32=self.combine_fp32)  # [T, h]

    def ffn(self, x):  # x [E_local, N, h] -> [E_local, N, h]
        if self.swiglu:
            gate, up = self.bmm(x, self.w_gate), self.bmm(x, self.w_up)  # [E_l, N, f] each
            act = self.act if not (self.recompute_act and self.training) else checkpointed(self.act)
            inner = act(gate, up)  # [E_l, N, f]
        else:
            up = self.bmm(x, self.w_up)  # [E_l, N, f]
            gelu = lambda u: F.gelu(u, approximate=self.approximate)  # noqa: E731
            inner = gelu(up) if not (self.recompute_act and self.training) else checkpointed(gelu)(up)
        return self.bmm(inner, self.w_down)

    def act(self, gate, up):  # [E_l, N, f] each -> silu(gate) * up
        return kernels.swiglu(gate, up) if self.fuse_swiglu else F.silu(gate) * up
