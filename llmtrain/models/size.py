"""Parameter counts and model FLOPs per token (6 N + 12 L h s; under LoRA 4 N + 6 N_lora + 12 L h s), from the config alone.

    python -m pytest tests/models -q -k "parameter_count or flops"

Counting from the config (not from local parameters) gives the same figures on
every rank and layout.
"""
from __future__ import annotations

from llmtrain.models.config import ModelConfig


def _ffn_parameters(cfg: ModelConfig, f: int, bias: bool) -> int:
    """One feed-forward of inner width f (SwiGLU: gate, up, down; else up, down)."""
    h = cfg.hidden_size
    n_proj = 3 if cfg.activation == "swiglu" else 2
    return n_proj * h * f + (((n_proj - 1) * f + h) if bias else 0)


def _mla_parameters(cfg: ModelConfig) -> int:
    """Multi-head latent attention (`llmtrain/models/mla.py`): q_a [h, r_q] + its norm + q_b [r_q, nh qk] (or one
    q_proj [h, nh qk]), kv_a [h, r_kv + d_r] + its norm, kv_b [r_kv, nh (d_n + d_v)], o [nh d_v, h]."""
    h, nh, per_norm = cfg.hidden_size, cfg.num_heads, 2 if cfg.norm == "layernorm" else 1
    qk, rq, r = cfg.mla_qk_nope_head_dim + cfg.mla_qk_rope_head_dim, cfg.mla_q_lora_rank, cfg.mla_kv_lora_rank
    q = h * rq + per_norm * rq + rq * nh * qk if rq else h * nh * qk
    kv = h * (r + cfg.mla_qk_rope_head_dim) + per_norm * r + r * nh * (cfg.mla_qk_nope_head_dim + cfg.mla_v_head_dim)
    bias = ((rq or 0) + r + cfg.mla_qk_rope_head_dim + h) if cfg.bias else 0
    return q + kv + nh * cfg.mla_v_head_dim * h + bias


def block_parameters(cfg: ModelConfig, index: int = 0, active: bool = False) -> int:
    """Parameters of transformer block `index`. An MoE block counts its router, expert bias, shared experts and
    all routed experts, or with `active=True` only the top_k routed experts a token passes through (and no bias)."""
    h, d = cfg.hidden_size, cfg.attn_head_dim()
    q, kv = cfg.num_heads * d, cfg.kv_heads() * d
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if cfg.has_qkv_bias() else 0) + (h if cfg.bias else 0)
    attn += 2 * d if cfg.qk_norm else 0  # q_norm, k_norm weights [d]
    if cfg.is_mla():
        attn = _mla_parameters(cfg)
    norm = h * (2 if cfg.norm == "layernorm" else 1)
    if not cfg.is_moe_layer(index):
        return attn + _ffn_parameters(cfg, cfg.ffn_hidden_size, cfg.bias) + 2 * norm
    e = cfg.moe_num_experts
    routed = (cfg.moe_top_k if active else e) * _ffn_parameters(cfg, cfg.expert_ffn_size(), False)
    shared = _ffn_parameters(cfg, cfg.moe_num_shared_experts * cfg.expert_ffn_size(), cfg.bias) \
        if cfg.moe_num_shared_experts else 0
    router = h * e + (0 if active else e)
    return attn + routed + shared + router + 2 * norm


def _blocks(cfg: ModelConfig, active: bool = False) -> int:
    return sum(block_parameters(cfg, i, active) for i in range(cfg.num_layers))


def _input_tables(cfg: ModelConfig) -> int:
    """Parameters of the input lookup tables: word, learned position, token type, task type."""
    h = cfg.hidden_size
    n = cfg.vocab_size * h
    if cfg.position == "learned" or cfg.family == "encoder":
        n += cfg.max_position_embeddings * h
    if cfg.family == "encoder":
        n += (cfg.type_vocab_size + cfg.task_type_vocab_size) * h
    return n


def parameter_count(cfg: ModelConfig) -> int:
    """All parameters of the model (a tied table counted once)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    norm = h * (2 if cfg.norm == "layernorm" else 1)
    total = _input_tables(cfg) + _blocks(cfg)
    if cfg.family == "encoder":
        total += norm  # embedding norm
        total += norm if cfg.norm_position == "pre" else 0  # final norm
        total += h * h + h + norm + v  # MLM transform, its norm, output bias
    else:
        total += norm  # final norm
    if not cfg.tie_embeddings:
        total += v * h
    return total


def flops_parameters(cfg: ModelConfig) -> int:
    """N of 6N: all parameters except the input lookup tables (word, position, types);
    the output projection (V x h) counts whether tied or not. Mixture-of-Experts: only the
    ACTIVE parameters (top_k routed experts per token, plus router and shared experts)."""
    n = parameter_count(cfg) - _input_tables(cfg) - _blocks(cfg) + _blocks(cfg, active=True)
    if not cfg.tie_embeddings:
        return n  # the separate head table is still in n
    return n + cfg.vocab_size * cfg.hidden_size


def flops_per_token(cfg: ModelConfig, seq_len: int, lora_numel: int | None = None) -> float:
    """Training FLOPs per token, 6 N + 12 L h s (forward + backward; PaLM/torchtitan form).

    Causal attention is NOT halved here (the 12 L h s term counts the full
    s x s score matrix; with multi-head latent attention it is 6 L nh (d_qk + d_v) s, the widths of q.k and
    p.v), and activation recompute is not counted, so MFU from
    this figure is comparable with PaLM's and torchtitan's. These are FLOPs per
    *processed* position; the trainer multiplies by positions/s, not by
    loss-bearing tokens/s (they differ for masked LM and fine-tuning).

    LoRA (`lora_numel`: the adapters' elements, `llmtrain.models.lora_targets.adapter_numel`):
    4 N + 6 N_lora + 12 L h s. The frozen base runs its forward (2 N) and passes
    input gradients back (2 N) but computes no weight gradients; the adapters
    cost forward plus both backward products (6 N_lora); attention has no weights
    and is unchanged.
    """
    attention = 12.0 * cfg.num_layers * cfg.hidden_size * seq_len
    if cfg.is_mla():  # q.k over nh x (d_n + d_r), p.v over nh x d_v instead of h each
        qk = cfg.mla_qk_nope_head_dim + cfg.mla_qk_rope_head_dim
        attention = 6.0 * cfg.num_layers * cfg.num_heads * (qk + cfg.mla_v_head_dim) * seq_len
    if lora_numel is not None:
        return 4.0 * flops_parameters(cfg) + 6.0 * lora_numel + attention
    return 6.0 * flops_parameters(cfg) + attention
