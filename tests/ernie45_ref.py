"""A numpy forward of ERNIE 4.5 (dense and MoE) as PaddleFormers 1.2.0 publishes it, reading the saved directory.

    from ernie45_ref import ernie_logits, ernie_loss
    ernie_logits(dir, ids)            # float64 logits [b, s, V]
    ernie_loss(dir, mb)               # training loss of a micro-batch: masked mean CE + the router losses

Written from PaddleFormers' `transformers/ernie4_5/modeling.py`, `ernie4_5_moe/modeling.py` and `nn/moe/topk_gate.py`,
independently of llmtrain (its own reader, names and formulas), with config.json's published field names and
PaddleFormers' defaults where a field is absent: RMSNorm x / sqrt(mean(x^2) + eps) * w; q/k/v/o [out, in]; GQA
(query head j reads kv head j // (heads / kv heads)); RoPE in the interleaved form (pairs 2i, 2i+1 rotated by
inv_freq[i] = theta^(-2i/d)), scale head_dim^-0.5; SwiGLU down(silu(gate(x)) * up(x)); MoE block i when
(i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <= moe_layer_end_index (-1: last): softmax router in
fp32 over `mlp.gate.weight`, top moe_k chosen on probs + `moe_statics.e_score_correction_bias` (moe_use_aux_free),
weighted by the unbiased probs / max(their sum, 1e-12) (moe_norm_gate_logits), plus the shared experts' SwiGLU of
width moe_intermediate_size x moe_num_shared_experts. Router losses per MoE block, summed: router_aux_loss_coef x
E sum_i mean_t(p_ti) x (unbiased top-k choices of i / T) and router_z_loss_coef x mean_t logsumexp(logits_t)^2
(the orthogonal loss, moe_orthogonal_loss_lambda, is left out: llmtrain does not implement it). The
multi-token-prediction tensors (model.mtp_*) are not used by the logits.
"""
from __future__ import annotations

import json
import os

import numpy as np
from hf_tiny import load_hf

DEFAULTS = dict(moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1, moe_num_shared_experts=2,
                moe_k=2, moe_use_aux_free=True, moe_norm_gate_logits=True, router_aux_loss_coef=1e-2,
                router_z_loss_coef=1e-4, rms_norm_eps=1e-6)


def _get(c: dict, key: str):
    return c.get(key, DEFAULTS.get(key))


def is_moe_block(c: dict, i: int) -> bool:
    if c["model_type"] != "ernie4_5_moe":
        return False
    end = _get(c, "moe_layer_end_index")
    end = c["num_hidden_layers"] - 1 if end < 0 else end
    return (i + 1) % _get(c, "moe_layer_interval") == 0 and _get(c, "moe_layer_start_index") <= i <= end


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def ernie_forward(ckpt_dir, ids: np.ndarray):
    """(logits [b, s, V] float64, per MoE block (router logits [T, E], unbiased top-k [T, k]))."""
    c, t = load_hf(ckpt_dir)
    h, nh = c["hidden_size"], c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nh
    d = c.get("head_dim") or h // nh
    eps = _get(c, "rms_norm_eps")
    b, s = ids.shape
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))

    def rms(x, w):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w

    def lin(x, name):
        return x @ t[name + ".weight"].T

    def swiglu(x, p):
        g = lin(x, p + "gate_proj")
        return lin(g / (1.0 + np.exp(-g)) * lin(x, p + "up_proj"), p + "down_proj")

    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]
    ang = np.repeat(np.outer(np.arange(s), inv), 2, axis=-1)  # [s, d]: each frequency twice, interleaved
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]

    def rope(x):  # [b, s, n, d]: (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin) on every pair
        rot = np.stack([-x[..., 1::2], x[..., 0::2]], -1).reshape(x.shape)
        return x * cos + rot * sin

    causal = np.arange(s)[None, :] <= np.arange(s)[:, None]
    routers = []
    x = t["model.embed_tokens.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = rms(x, t[p + "input_layernorm.weight"])
        q = rope(lin(y, p + "self_attn.q_proj").reshape(b, s, nh, d))
        k = rope(lin(y, p + "self_attn.k_proj").reshape(b, s, nkv, d))
        v = lin(y, p + "self_attn.v_proj").reshape(b, s, nkv, d)
        k, v = np.repeat(k, nh // nkv, 2), np.repeat(v, nh // nkv, 2)
        sc = np.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5 + np.where(causal, 0.0, -np.inf)
        att = np.einsum("bhqk,bkhd->bqhd", _softmax(sc), v).reshape(b, s, nh * d)
        x = x + lin(att, p + "self_attn.o_proj")
        y = rms(x, t[p + "post_attention_layernorm.weight"])
        if not is_moe_block(c, i):
            x = x + swiglu(y, p + "mlp.")
            continue
        flat = y.reshape(b * s, h)
        logits = flat @ t[p + "mlp.gate.weight"].T  # [T, E]
        probs = _softmax(logits)
        k_ = _get(c, "moe_k")
        bias = t[p + "mlp.moe_statics.e_score_correction_bias"][0] if _get(c, "moe_use_aux_free") else 0.0
        top = np.argsort(-(probs + bias), axis=-1, kind="stable")[:, :k_]
        w = np.take_along_axis(probs, top, -1)
        if _get(c, "moe_norm_gate_logits"):
            w = w / np.maximum(w.sum(-1, keepdims=True), 1e-12)
        out = np.zeros_like(flat)
        for tok in range(b * s):
            for j in range(k_):
                out[tok] += w[tok, j] * swiglu(flat[tok], f"{p}mlp.experts.{top[tok, j]}.")
        if _get(c, "moe_num_shared_experts"):
            out = out + swiglu(flat, p + "mlp.shared_experts.")
        routers.append((logits, np.argsort(-probs, axis=-1, kind="stable")[:, :k_]))
        x = x + out.reshape(b, s, h)
    x = rms(x, t["model.norm.weight"])
    head = t["model.embed_tokens.weight"] if c.get("tie_word_embeddings") else t["lm_head.weight"]
    return x @ head.T, routers


def ernie_logits(ckpt_dir, ids: np.ndarray) -> np.ndarray:
    return ernie_forward(ckpt_dir, np.asarray(ids))[0]


def router_loss(c: dict, routers: list) -> float:
    """Sum over MoE blocks of aux_coef x aux + z_coef x z (PaddleFormers' `_calc_router_loss`, no orthogonal term)."""
    total = 0.0
    for logits, free in routers:
        num_tokens, e = logits.shape
        probs = _softmax(logits)
        f = np.bincount(free.reshape(-1), minlength=e) / num_tokens
        aux = e * float((probs.mean(0) * f).sum())
        m = logits.max(-1)
        z = float(((np.log(np.exp(logits - m[:, None]).sum(-1)) + m) ** 2).mean())
        total += _get(c, "router_aux_loss_coef") * aux + _get(c, "router_z_loss_coef") * z
    return total


def ernie_loss(ckpt_dir, mb) -> float:
    """Masked mean cross entropy of one micro-batch (input_ids, labels, loss_mask) plus the router losses."""
    logits, routers = ernie_forward(ckpt_dir, np.asarray(mb["input_ids"]))
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.asarray(mb["labels"])[..., None].astype(np.int64), -1)[..., 0]
    mask = np.asarray(mb["loss_mask"])
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        c = json.load(f)
    return float((ce * mask).sum() / mask.sum()) + router_loss(c, routers)
