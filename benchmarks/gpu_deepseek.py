"""PyTorch twin of llmtrain's DeepSeek-V3-shaped decoder: multi-head latent attention and the sigmoid router.

    python benchmarks/twin_ops.py --out benchmarks/data/twin_ops --only deepseek-capacity deepseek-dropless

`DeepSeekDecoder` is `gpu_moe.MoEDecoder` with two parts of `llmtrain/models` written out as the GPU path runs them:

- attention: `llmtrain/models/mla.py`'s `MLAttention`: q = q_b(rms(q_a(x))) [b, s, nh, d_n + d_r] (one q_proj
  without a q rank), c_kv | k_pe = kv_a(x) [r_kv] | [d_r], k_n | v = kv_b(rms(c_kv)) [nh, d_n] | [nh, d_v]; RoPE
  (rotate-half, as `gpu_model.RoPE`) on q's d_r part and on the ONE shared rotary key, expanded to every head;
  q = [q_n, q_r], k = [k_n, k_r]; v zero-padded to d_n + d_r (flash kernels take one head width:
  `mla.padded_value_core`), flash attention through SDPA, the output cut back to d_v, o_proj [nh d_v, h];
- the router (`llmtrain/models/router.py` `route` with `kind="sigmoid"`): scores = sigmoid(logits) [T, E] fp32,
  probs = scores / their row sum (the aux loss's), selection on scores + the expert bias (zero here, as llmtrain's
  is until `moe_bias_update_rate` moves it), limited to the `keep` best of `groups` groups (a group's score: its
  top-2 summed, V3's `noaux_tc`, or its max), top-k, the weights the unbiased chosen scores renormalised, the
  capacity queue as `gpu_moe.route`; the routed experts' output times `routed_scale`;
- the first `first_dense` blocks keep a dense SwiGLU MLP of width `dense_ffn` (`model.moe_first_dense_layers`).

The routed experts, the shared expert and the balancing losses are `MoEDecoder`'s (`experts_slots`, ...).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from gpu_model import Arch, Decoder
from gpu_moe import CAPACITIES, IMPLS, MoE, MoEDecoder, cumsum0  # noqa: F401  (CAPACITIES: the dropless reads)


@dataclass
class MLA:
    """Latent attention's widths (`model.mla_*`): q rank (0: one q_proj), kv rank, no-RoPE, RoPE and value widths."""

    q_rank: int
    kv_rank: int
    nope: int
    rope: int
    v: int

    def as_dict(self):
        return asdict(self)


@dataclass
class SigmoidRouter:
    """DeepSeek-V3's router (`model.moe_router=sigmoid`, `moe_n_group`, `moe_topk_group`, `moe_group_score`,
    `moe_routed_scale`) and the dense blocks before the first MoE block (`moe_first_dense_layers`)."""

    groups: int = 1  # 1: no group limit
    keep: int = 1
    group_score: str = "top2"  # top2 | max
    routed_scale: float = 1.0
    first_dense: int = 0
    dense_ffn: int = 0  # the dense blocks' MLP width

    def as_dict(self):
        return asdict(self)


def route_sigmoid(logits, bias, moe: MoE, r: SigmoidRouter):
    """llmtrain.models.router.route, sigmoid kind, with the group limit: (index [T, k] (-1 dropped), weight [T, k]
    fp32, probs [T, E], counts [E] fp32, dropped [] fp32)."""
    T, E = logits.shape
    k = moe.top_k
    scores = torch.sigmoid(logits)  # [T, E] fp32
    probs = scores / scores.sum(-1, keepdim=True)
    choose = scores + bias.detach()[None]
    if r.groups > 1:  # the keep best groups' experts only; the rest -inf
        grouped = choose.view(T, r.groups, E // r.groups)  # [T, G, E/G]
        if r.group_score == "top2":
            group_score = torch.topk(grouped, 2, dim=-1)[0].sum(-1)  # [T, G]
        else:
            group_score = grouped.amax(-1)
        best = torch.topk(group_score, r.keep, dim=-1)[1]  # [T, keep]
        chosen = F.one_hot(best, r.groups).sum(1) > 0  # [T, G]
        mask = chosen.unsqueeze(-1).expand(T, r.groups, E // r.groups).reshape(T, E)
        choose = torch.where(mask, choose, torch.full_like(choose, float("-inf")))
    _, index = torch.topk(choose.detach(), k, dim=-1)  # [T, k]
    weight = torch.gather(scores, -1, index)  # take_along_axis
    if moe.norm_topk:
        weight = weight / weight.sum(-1, keepdim=True)
    with torch.no_grad():
        onehot = F.one_hot(index, E)  # [T, k, E] int64
        counts = onehot.sum((0, 1)).float()  # [E]
        dropped = torch.zeros((), device=logits.device)
        if moe.capacity_factor > 0:
            ordered = onehot.transpose(0, 1).reshape(k * T, E)  # slot-major
            place = (cumsum0(ordered, moe) * ordered).sum(-1)  # 1-based place in its expert's queue
            keep = (place <= moe.capacity(T)).reshape(k, T).t()  # [T, k]
            dropped = (~keep).float().sum()
            index = torch.where(keep, index, torch.full_like(index, -1))
    if moe.capacity_factor > 0:
        weight = weight * keep.to(weight.dtype)
    return index, weight, probs, counts, dropped


class DeepSeekDecoder(MoEDecoder):
    """`MoEDecoder` with latent attention (`mla`) in every block, the sigmoid router (`router`) in every MoE block
    and `router.first_dense` dense blocks first (module docstring); `a.heads` heads, `a.ffn` the shared expert's
    width."""

    def __init__(self, a: Arch, moe: MoE, mla: MLA, router: SigmoidRouter, device, dtype=torch.bfloat16,
                 recompute: bool = False, generator=None):
        super().__init__(a, moe, device, dtype, recompute, generator)
        self.mla, self.router = mla, router
        kw = dict(device=device, dtype=dtype)

        def mat(i, o, std=0.02):  # [in, out], as Paddle's Linear weight
            return torch.nn.Parameter(torch.randn(i, o, **kw, generator=generator) * std)

        h, nh, qk = a.hidden, a.heads, mla.nope + mla.rope
        for i, b in enumerate(self.blocks):
            del b.wq, b.wk, b.wv, b.wo
            if mla.q_rank:
                b.q_a, b.q_b = mat(h, mla.q_rank), mat(mla.q_rank, nh * qk)
                b.q_norm = torch.nn.Parameter(torch.ones(mla.q_rank, **kw))
            else:
                b.wq = mat(h, nh * qk)
            b.kv_a, b.kv_b = mat(h, mla.kv_rank + mla.rope), mat(mla.kv_rank, nh * (mla.nope + mla.v))
            b.kv_norm = torch.nn.Parameter(torch.ones(mla.kv_rank, **kw))
            b.wo = mat(nh * mla.v, h, 0.02 / math.sqrt(2 * a.layers))
            b.dense = i < router.first_dense
            if b.dense:  # a dense SwiGLU MLP of its own width instead of the MoE feed-forward
                del b.w_router, b.w_gate, b.w_up, b.w_down
                b.wgate, b.wup = mat(h, router.dense_ffn), mat(h, router.dense_ffn)
                b.wdown = mat(router.dense_ffn, h, 0.02 / math.sqrt(2 * a.layers))
            else:
                b.register_buffer("expert_bias", torch.zeros(moe.experts, device=device, dtype=torch.float32))
        inv = 1.0 / (10000.0 ** (torch.arange(0, mla.rope, 2, device=device, dtype=torch.float32) / mla.rope))
        freqs = torch.outer(torch.arange(a.seq, device=device, dtype=torch.float32), inv)  # [s, d_r/2]
        emb = torch.cat([freqs, freqs], -1)  # [s, d_r]: the rotary part's tables
        self.cos = emb.cos().to(dtype)[None, :, None, :]  # [1, s, 1, d_r]
        self.sin = emb.sin().to(dtype)[None, :, None, :]

    def attention(self, blk, x):  # x [b, s, h] -> [b, s, h]
        mla, nh = self.mla, self.a.heads
        qk = mla.nope + mla.rope
        if mla.q_rank:
            q = self.norm(x @ blk.q_a, blk.q_norm) @ blk.q_b  # [b, s, r_q] -> [b, s, nh qk]
        else:
            q = x @ blk.wq
        q_nope, q_pe = q.view(*x.shape[:2], nh, qk).split([mla.nope, mla.rope], dim=-1)
        c_kv, k_pe = (x @ blk.kv_a).split([mla.kv_rank, mla.rope], dim=-1)  # [b, s, r_kv], [b, s, d_r]
        kv = (self.norm(c_kv, blk.kv_norm) @ blk.kv_b).view(*x.shape[:2], nh, mla.nope + mla.v)
        k_nope, v = kv.split([mla.nope, mla.v], dim=-1)  # [b, s, nh, d_n], [b, s, nh, d_v]
        q_pe, k_pe = self.rope(q_pe.contiguous()), self.rope(k_pe.unsqueeze(2).contiguous())  # k_pe [b, s, 1, d_r]
        q = torch.cat([q_nope, q_pe], dim=-1)  # [b, s, nh, qk]
        k = torch.cat([k_nope, k_pe.expand(-1, -1, nh, -1)], dim=-1)  # [b, s, nh, qk]
        if mla.v != qk:  # flash kernels take one head width: v zero-padded (mla.padded_value_core)
            v = torch.cat([v, v.new_zeros(*v.shape[:-1], qk - mla.v)], dim=-1)  # [b, s, nh, qk]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        out = out.transpose(1, 2)[..., :mla.v].reshape(*x.shape[:2], nh * mla.v)  # [b, s, nh d_v]
        return out @ blk.wo

    def mlp(self, blk, x):  # x [b, s, h] -> [b, s, h]
        if blk.dense:
            return Decoder.mlp(self, blk, x)
        moe, shape = self.moe, x.shape
        flat = x.reshape(-1, shape[-1])  # [T, h]
        if moe.router_dtype == "fp32":
            logits = flat.float() @ blk.w_router  # [T, E]: fp32 operands, TF32 GEMM
        else:
            logits = (flat @ blk.w_router).float()  # [T, E]: bf16 GEMM, logits cast
        index, weight, probs, counts, dropped = route_sigmoid(logits, blk.expert_bias, moe, self.router)
        y = IMPLS[moe.impl](moe, flat, index, weight, counts, blk.w_gate, blk.w_up, blk.w_down)
        if self.router.routed_scale != 1.0:
            y = y * self.router.routed_scale
        if moe.shared_ffn:
            y = y + Decoder.mlp(self, blk, flat)
        self.terms.append((counts / flat.shape[0], probs.mean(0), torch.logsumexp(logits, -1).pow(2).mean()))
        with torch.no_grad():
            self.stat_counts = counts if self.stat_counts is None else self.stat_counts + counts
            self.stat_dropped = dropped if self.stat_dropped is None else self.stat_dropped + dropped
        return y.view(shape)
