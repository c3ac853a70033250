"""Multi-head latent attention (DeepSeek-V2/V3) as one layer, single-device code.

    python -m pytest tests/models/test_mla.py -q
    python llmtrain/pretrain.py model=deepseek-tiny            # model.mla_kv_lora_rank > 0 selects this layer

Per position, with h the hidden size, nh heads, r_q / r_kv the compression ranks and d_n / d_r / d_v the
no-RoPE, RoPE and value widths (`ModelConfig.mla_*`; DeepSeek's q_lora_rank, kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim):

    q            = q_b_proj(q_a_norm(q_a_proj(x)))   [nh, d_n + d_r]   (or q_proj(x) when r_q is None: V2-Lite)
    c_kv | k_pe  = kv_a_proj(x)                      [r_kv] | [d_r]    (k_pe: ONE rotary key shared by all heads)
    k_n  | v     = kv_b_proj(kv_a_norm(c_kv))        [nh, d_n] | [nh, d_v]
    q = [q_n, rope(q_r)], k = [k_n, rope(k_pe) for every head]; out = softmax(q k^T * scale) v -> o_proj

scale = (d_n + d_r)^-0.5, times mscale^2 with YaRN rope scaling (mscale = 0.1 * mscale_all_dim * ln(factor) + 1,
DeepSeek's `yarn_get_mscale`); it is folded into q so the attention cores keep their one signature
(`llmtrain.models.layers.choose_attention`: they divide by sqrt(q's width)); v is d_v wide, narrower than q and k.
The rotary part uses the rotate-half `Rotary` over d_r: DeepSeek's checkpoints rotate interleaved pairs
(x0, x1), (x2, x3), ..., which is the same attention once the rotary rows of q_b_proj (q_proj) and kv_a_proj are
permuted evens-then-odds; `llmtrain/interop/deepseek.py` does that on import and undoes it on export.

Parallel plans act through `Roles`: the down-projections q_a_proj and kv_a_proj are replicated linears (whole on
every rank; their norms read the whole compressed vector), q_b_proj / q_proj and kv_b_proj are column linears
(whole heads per rank), o_proj a row linear, and the shared rotary key reaches this rank's heads through
`roles.head_shared` (its gradient is summed over the ranks), so every replicated weight gets the same full
gradient on every tp rank. A context-parallel plan wraps the attention core as for any attention.
"""
from __future__ import annotations

import math

import paddle
import paddle.nn as nn

from llmtrain.contracts import tags
from llmtrain.models.config import ModelConfig
from llmtrain.models.field_checks import mla_problems  # noqa: F401  (its home before the split)
from llmtrain.models.recompute import checkpointed
from llmtrain.models.layers import Rotary, build_norm, choose_attention, math_attention
from llmtrain.models.roles import Roles


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's `yarn_get_mscale`: 0.1 * mscale * ln(factor) + 1 for factor > 1, else 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """The attention scale of MLA: (d_n + d_r)^-0.5, times mscale(factor, mscale_all_dim)^2 when the rope scaling
    has an mscale_all_dim (DeepSeek's YaRN)."""
    scale = (cfg.mla_qk_nope_head_dim + cfg.mla_qk_rope_head_dim) ** -0.5
    r = cfg.rope_scaling
    if r.type != "none" and r.mscale_all_dim:
        m = yarn_mscale(float(r.factor), float(r.mscale_all_dim))
        scale *= m * m
    return scale


def padded_value_core(core, qk_dim: int):
    """The attention core with v [.., d_v] zero-padded to q's width qk_dim and the output cut back to d_v: the GPU
    flash kernels take one head width for q, k and v (the padding columns give zero outputs, so the result is the
    same; Hugging Face's DeepSeek pads the same way for flash attention)."""

    def attend(q, k, v, causal=True, mask=None, segments=None, **kw):
        dv = v.shape[-1]
        if dv == qk_dim:
            return core(q, k, v, causal, mask, segments, **kw)
        pad = paddle.zeros([*v.shape[:-1], qk_dim - dv], dtype=v.dtype)  # GPU-ONLY(mla-value-pad)
        v = paddle.concat([v, pad], axis=-1)  # GPU-ONLY(mla-value-pad): [b, s, nh, qk]
        return core(q, k, v, causal, mask, segments, **kw)[..., :dv]  # GPU-ONLY(mla-value-pad): [b, s, nh, d_v]

    return attend


class MLAttention(nn.Layer):
    """Multi-head latent attention: x [b, s, h] -> [b, s, h] (see the module docstring for the computation)."""

    def __init__(self, cfg: ModelConfig, roles: Roles):
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_heads
        self.nope, self.rope, self.dv = cfg.mla_qk_nope_head_dim, cfg.mla_qk_rope_head_dim, cfg.mla_v_head_dim
        self.qk = self.nope + self.rope
        self.kv_rank = cfg.mla_kv_lora_rank
        self.causal = cfg.family == "decoder"
        if cfg.mla_q_lora_rank:
            self.q_a_proj = roles.replicated_linear(h, cfg.mla_q_lora_rank, cfg.bias)  # [h, r_q] on every rank
            self.q_a_norm = build_norm(cfg, cfg.mla_q_lora_rank)
            self.q_b_proj = roles.column_linear(cfg.mla_q_lora_rank, nh * self.qk, False)  # [r_q, nh/tp * qk]
            self.q_proj = None
        else:
            self.q_proj = roles.column_linear(h, nh * self.qk, False)  # [h, nh/tp * qk]
        self.kv_a_proj = roles.replicated_linear(h, self.kv_rank + self.rope, cfg.bias)  # [h, r_kv + d_r]
        self.kv_a_norm = build_norm(cfg, self.kv_rank)
        self.kv_b_proj = roles.column_linear(self.kv_rank, nh * (self.nope + self.dv), False)  # [r_kv, nh/tp (d_n+d_v)]
        self.o_proj = roles.row_linear(nh * self.dv, h, cfg.bias)  # [nh/tp * d_v, h]
        tags.mark_residual_out(self.o_proj.weight)
        self.rotary = Rotary(self.rope, cfg.rope_theta, fused=cfg.fused("fuse_rope"),
                             max_positions=cfg.max_position_embeddings, scaling=cfg.rope_scaling)  # over d_r only
        self.q_factor = mla_softmax_scale(cfg) * math.sqrt(self.qk)  # the cores divide by sqrt(qk): 1 without YaRN
        core = choose_attention(cfg.attention)
        if core is not math_attention:  # flash kernels take one head width for q, k, v
            core = padded_value_core(core, self.qk)  # GPU-ONLY(mla-value-pad)
        self.attend = roles.attention_core(core)  # a plan may wrap the core (context parallelism's exchange)
        self.recompute_core = False  # re-run the core in the backward (`train.recompute=core_attn`)
        self.roles = roles

    def forward(self, x, mask=None, positions=None, segments=None, cache=None):
        # x [b, s, h]; mask [b, 1, 1, s] additive or None; positions, segments [b, s] or None; cache: this layer's
        # keys/values of earlier positions (generation), filled here
        if self.q_proj is None:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))  # [b, s, r_q] -> [b, s, nh/tp * qk]
        else:
            q = self.q_proj(x)
        q = q.reshape([0, 0, -1, self.qk])  # [b, s, nh/tp, d_n + d_r]
        q_nope, q_pe = paddle.split(q, [self.nope, self.rope], axis=-1)
        c_kv, k_pe = paddle.split(self.kv_a_proj(x), [self.kv_rank, self.rope], axis=-1)  # [b, s, r_kv], [b, s, d_r]
        kv = self.kv_b_proj(self.kv_a_norm(c_kv)).reshape([0, 0, -1, self.nope + self.dv])  # [b, s, nh/tp, d_n+d_v]
        k_nope, v = paddle.split(kv, [self.nope, self.dv], axis=-1)  # [b, s, nh/tp, d_n], [b, s, nh/tp, d_v]
        k_pe = self.roles.head_shared(k_pe).unsqueeze(2)  # [b, s, 1, d_r]
        q_pe, k_pe = self.rotary.apply_qk(q_pe, k_pe, positions)
        heads = q_nope.shape[2]
        q = paddle.concat([q_nope, q_pe], axis=-1)  # [b, s, nh/tp, qk]
        if self.q_factor != 1.0:
            q = q * self.q_factor
        k = paddle.concat([k_nope, k_pe.expand([-1, -1, heads, -1])], axis=-1)  # [b, s, nh/tp, qk]
        if cache is not None:
            if "k" in cache:  # one new position after a prefix: it attends to every cached key
                if q.shape[1] != 1:
                    raise ValueError(f"KV-cache decoding takes one position per call, got {q.shape[1]}")
                k = paddle.concat([cache["k"], k], axis=1)  # [b, t + 1, nh/tp, qk]
                v = paddle.concat([cache["v"], v], axis=1)
                cache["k"], cache["v"] = k, v
                return self.o_proj(math_attention(q, k, v, False, mask).reshape([0, 0, -1]))
            cache["k"], cache["v"] = k, v  # the prefix (prefill): causal as usual
        attend = checkpointed(self.attend) if self.recompute_core and self.training else self.attend
        out = attend(q, k, v, self.causal, mask, segments)  # [b, s, nh/tp, d_v]
        return self.o_proj(out.reshape([0, 0, -1]))  # [b, s, nh/tp * d_v] -> [b, s, h]
