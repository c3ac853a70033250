"""The router of an MoE layer: its GEMM (`Router`) and its decision for one micro-batch (`route`: scores, top-k with
the expert bias and group limits, combine weights, the capacity queue). Single-device code.

    python -m pytest tests/models/test_moe.py tests/models/test_moe_precision.py -q
    logits = Router(h, E, "fp32")(x)          # x [T, h] -> [T, E] fp32
    r = route(logits, top_k, "softmax", norm_topk=True, bias=expert_bias, capacity_factor=0.0, groups=None)

Precision (`model.moe_router_dtype`): with `fp32` the router weight stays fp32 under AMP O2 (`decorate` leaves it)
and the caller runs the GEMM, `route` and the balancing losses inside `llmtrain.paddle_compat.amp.fp32_region()`,
where AMP casts nothing: fp32 logits from fp32 operands (O2 would otherwise cast a white-listed matmul's inputs to
bf16, fp32 weight or not). With `amp` the GEMM runs as AMP gives it (bf16 under train.amp=bf16) and only its output
is cast to fp32.

Routing (`route`): logits = x W_r (fp32, no bias); scores = softmax(logits) or
sigmoid(logits); the top-k experts are chosen on scores + `expert_bias` (the
auxiliary-loss-free bias: zero unless moved, `moe_bias_update_rate > 0`, or imported), their weights
are the unbiased scores, renormalised to sum 1 when `moe_norm_topk`. With
`moe_capacity_factor > 0` each expert keeps at most C = ceil(factor * T * k / E)
of a micro-batch's T tokens, first choices before second choices and earlier
tokens before later ones (GShard's order); the rest is dropped (weight 0) and
counted. Dropless (the default) computes every choice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from llmtrain.models.config import ModelConfig
from llmtrain.models.dispatch import capacity
from llmtrain.models.field_checks import group_problems  # noqa: F401  (its home before the split)
from llmtrain.paddle_compat import amp


class Router(nn.Layer):
    """x [T, h] -> logits [T, E] fp32 = x W_r, W_r [h, E] (`weight`, no bias); `dtype`: `fp32` or `amp` (module
    docstring). With `fp32` call it inside `amp.fp32_region()`."""

    def __init__(self, hidden: int, experts: int, dtype: str = "fp32"):
        super().__init__()
        if dtype not in ("fp32", "amp"):
            raise ValueError(f"model.moe_router_dtype={dtype!r}: expected 'fp32' or 'amp'")
        self.dtype = dtype
        self.weight = self.create_parameter([hidden, experts])
        if dtype == "fp32":
            amp.keep_fp32_under_o2(self)

    def forward(self, x):  # [T, h]
        if self.dtype == "fp32":
            x32 = x if x.dtype == paddle.float32 else x.astype("float32")
            return paddle.matmul(x32, self.weight)  # [T, E] fp32 operands, fp32 GEMM
        return paddle.matmul(x, self.weight).astype("float32")  # [T, E]; AMP casts the operands


@dataclass
class Routing:
    """The routing decision of one micro-batch of T tokens over E experts."""

    index: paddle.Tensor
    """[T, k] int64 chosen experts; -1 where the choice was dropped by the capacity."""
    weight: paddle.Tensor
    """[T, k] fp32 combine weights (0 where dropped); differentiable w.r.t. the router."""
    probs: paddle.Tensor
    """[T, E] fp32 router probabilities (for the aux loss; sigmoid scores normalised per token)."""
    logits: paddle.Tensor
    """[T, E] fp32 router logits (for the z-loss)."""
    counts: paddle.Tensor
    """[E] fp32 choices per expert before dropping (no gradient)."""
    dropped: paddle.Tensor
    """[] fp32 number of dropped (token, expert) choices (no gradient)."""
    chosen: Optional[paddle.Tensor] = None
    """[T, k] int64 the top-k choice before the capacity drops it (what a recomputed forward routes by again)."""
    aux_counts: Optional[paddle.Tensor] = None
    """[E] fp32 what the aux loss counts when it is not `counts`: the top-k of `probs` without the expert bias
    (`model.moe_aux_counts=unbiased`, ERNIE 4.5; set by `MoEFeedForward`, no gradient)."""


@dataclass(frozen=True)
class GroupLimit:
    """Group-limited routing (DeepSeek): the E routed experts form `groups` equal groups (consecutive expert ids)
    and a token chooses its top-k among the experts of its `keep` best groups only."""

    groups: int
    """DeepSeek's `n_group`."""
    keep: int
    """DeepSeek's `topk_group`."""
    score: str = "top2"
    """A group's rank: `top2` (sum of its two best selection scores: V3's `noaux_tc`) or `max` (V2)."""


def group_limit(cfg: ModelConfig) -> Optional[GroupLimit]:
    """The model's group limit (`moe_n_group`, `moe_topk_group`, `moe_group_score`), None without grouping."""
    return GroupLimit(cfg.moe_n_group, cfg.moe_topk_group, cfg.moe_group_score) if cfg.moe_n_group > 1 else None


def limit_to_groups(choose: paddle.Tensor, limit: Optional[GroupLimit]) -> paddle.Tensor:
    """Selection scores [T, E] with every expert outside the token's `limit.keep` best groups set to -inf, so it is
    never chosen (DeepSeek-V3's inference code; transformers fills 0.0, the same choice unless a bias below -1 makes
    selection scores negative). Unchanged when `limit` is None. No gradient flows through the choice."""
    if limit is None:
        return choose
    num_tokens, num_experts = choose.shape
    grouped = choose.reshape([num_tokens, limit.groups, num_experts // limit.groups])  # [T, G, E/G]
    if limit.score == "top2":
        group_score = paddle.topk(grouped, 2, axis=-1)[0].sum(-1)  # [T, G]
    else:
        group_score = grouped.max(-1)  # [T, G]
    _, best = paddle.topk(group_score, limit.keep, axis=-1)  # [T, keep]
    chosen = F.one_hot(best, limit.groups).sum(1) > 0  # [T, G]
    mask = chosen.unsqueeze(-1).expand([num_tokens, limit.groups, num_experts // limit.groups])  # [T, G, E/G]
    return paddle.where(mask.reshape([num_tokens, num_experts]), choose, paddle.full_like(choose, float("-inf")))


def route(logits: paddle.Tensor, top_k: int, kind: str = "softmax", norm_topk: bool = True,
          bias: Optional[paddle.Tensor] = None, capacity_factor: float = 0.0,
          groups: Optional[GroupLimit] = None, chosen: Optional[paddle.Tensor] = None) -> Routing:
    """Route T tokens from their router logits [T, E] (fp32); see the module docstring. `chosen` [T, k]: the
    top-k choice to take instead of choosing (a recomputed forward routing exactly as its first run did)."""
    num_tokens, num_experts = logits.shape
    if kind == "softmax":
        scores = F.softmax(logits, axis=-1)  # [T, E]
        probs = scores
    elif kind == "sigmoid":
        scores = F.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdim=True)
    else:
        raise ValueError(f"model.moe_router={kind!r}: expected 'softmax' or 'sigmoid'")
    choose = scores if bias is None else scores + bias.detach()[None]
    choose = limit_to_groups(choose, groups)  # group-limited routing (DeepSeek): only the best groups' experts
    if chosen is None:
        _, index = paddle.topk(choose.detach(), top_k, axis=-1)  # [T, k]
    else:
        index = chosen
    first = index
    weight = paddle.take_along_axis(scores, index, axis=-1)  # [T, k]
    if norm_topk:
        weight = weight / weight.sum(-1, keepdim=True)
    with paddle.no_grad():
        onehot = F.one_hot(index, num_experts)  # [T, k, E]
        counts = onehot.sum([0, 1]).astype("float32")  # [E]
        dropped = paddle.zeros([], "float32")
        if capacity_factor > 0:
            cap = capacity(num_tokens, top_k, num_experts, capacity_factor)
            ordered = onehot.transpose([1, 0, 2]).reshape([top_k * num_tokens, num_experts])  # slot-major
            position = paddle.cumsum(ordered, axis=0) * ordered  # 1-based place in its expert's queue
            keep = (position.sum(-1) <= cap).reshape([top_k, num_tokens]).transpose([1, 0])  # [T, k]
            dropped = (~keep).astype("float32").sum()
            index = paddle.where(keep, index, paddle.full_like(index, -1))
    if capacity_factor > 0:
        weight = weight * keep.astype(weight.dtype)
    return Routing(index, weight, probs, logits, counts, dropped, chosen=first)

