"""Tiny Hugging Face-layout Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoints built here, and a numpy forward of the
published architectures.

    from hf_tiny import make_hf_checkpoint, reference_logits
    make_hf_checkpoint(dir, "qwen3", vocab_size=96, seed=0)     # config.json + 2 shards + index, like transformers
    reference_logits(dir, ids)                                  # float64 logits, [b, s, V]

Written from `transformers`' `modeling_llama.py` / `modeling_qwen2.py` / `modeling_qwen3.py` /
`modeling_qwen3_moe.py` and `modeling_rope_utils.py` as published, independently of `llmtrain` (its own file
writer, names and formulas): linear weights [out, in]; Qwen2 has bias on q, k, v only (Llama: `attention_bias` on
q, k, v, o; `mlp_bias` on gate, up, down); RMSNorm x / sqrt(mean(x^2) + eps) * w; Qwen3 RMSNorms each q and k head
(`q_norm`, `k_norm` [head_dim]) before RoPE; RoPE rotate-half with inv_freq = 1 / theta^(2i/d) and cos/sin of
[freqs, freqs], scaled per `rope_scaling` (linear, dynamic, yarn, llama3: `rope_inv_freq`); GQA repeats each kv
head for consecutive query heads (`repeat_kv`); sliding windows mask keys with kv_idx <= q_idx - window on the
windowed blocks (`layer_types`, else use_sliding_window and index >= max_window_layers; Qwen3-MoE every block);
SwiGLU down(silu(gate(x)) * up(x)); Qwen3-MoE: softmax router in fp32, top-k, renormalised when norm_topk_prob,
sum of the chosen experts' SwiGLU weighted; tied embeddings: logits through the embedding table.
"""
from __future__ import annotations

import json
import os

import numpy as np


def make_hf_tokenizer(out_dir, texts: list[str], vocab_size: int = 320) -> None:
    """A byte-level BPE `tokenizer.json` (Qwen2's kind) trained here with `tokenizers`, plus tokenizer_config.json
    naming `<|endoftext|>` as eos and pad (as Qwen2's does; no bos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts, trainer)
    os.makedirs(out_dir, exist_ok=True)
    tk.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                   "unk_token": None, "model_max_length": 32768}, f)


ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM"}


def hf_config(family: str, **kw) -> dict:
    """A tiny config.json of `family` with the published files' field names (Qwen3: head_dim 16 != 32 / 4 heads)."""
    c = dict(architectures=[ARCHS[family]], model_type=family,
             vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, hidden_act="silu", max_position_embeddings=64, rms_norm_eps=1e-6,
             rope_theta=10000.0 if family == "llama" else 1000000.0, tie_word_embeddings=family != "llama",
             torch_dtype="float32", initializer_range=0.02)
    if family == "llama":
        c.update(attention_bias=False, mlp_bias=False)
    else:
        c.update(use_sliding_window=False, sliding_window=4096 if family == "qwen2" else None, max_window_layers=2)
    if family in ("qwen3", "qwen3_moe"):
        c.update(head_dim=16, attention_bias=False, attention_dropout=0.0, rope_scaling=None, bos_token_id=1,
                 eos_token_id=2, use_cache=True)
    if family == "qwen3_moe":
        c.update(tie_word_embeddings=False, decoder_sparse_step=1, moe_intermediate_size=24, num_experts=4,
                 num_experts_per_tok=2, norm_topk_prob=True, output_router_logits=False, router_aux_loss_coef=0.001,
                 mlp_only_layers=[])
    c.update(kw)
    return c


def _head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]  # getattr(config, "head_dim", h / nh)


def _is_moe(c: dict, i: int) -> bool:
    return c["model_type"] == "qwen3_moe" and i not in (c.get("mlp_only_layers") or []) and (
        (i + 1) % c.get("decoder_sparse_step", 1) == 0)


def hf_shapes(c: dict) -> dict[str, list[int]]:
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    nh = c["num_attention_heads"]
    nkv, d = c.get("num_key_value_heads") or nh, _head_dim(c)
    qwen3 = c["model_type"] in ("qwen3", "qwen3_moe")
    qkv_bias = c["model_type"] == "qwen2" or c.get("attention_bias", False)
    o_bias, mlp_bias = c.get("attention_bias", False), c.get("mlp_bias", False)  # Llama's / Qwen3's switches
    out = {"model.embed_tokens.weight": [v, h]}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = [h]
        out[p + "post_attention_layernorm.weight"] = [h]
        for n, rows in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
            out[f"{p}self_attn.{n}_proj.weight"] = [rows, h]
            if qkv_bias:
                out[f"{p}self_attn.{n}_proj.bias"] = [rows]
        out[p + "self_attn.o_proj.weight"] = [h, nh * d]
        if o_bias:
            out[p + "self_attn.o_proj.bias"] = [h]
        if qwen3:
            out[p + "self_attn.q_norm.weight"] = [d]
            out[p + "self_attn.k_norm.weight"] = [d]
        if _is_moe(c, i):
            fe = c["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = [c["num_experts"], h]
            for j in range(c["num_experts"]):
                for n, shape in (("gate", [fe, h]), ("up", [fe, h]), ("down", [h, fe])):
                    out[f"{p}mlp.experts.{j}.{n}_proj.weight"] = shape
            continue
        for n, shape in (("gate", [f, h]), ("up", [f, h]), ("down", [h, f])):
            out[f"{p}mlp.{n}_proj.weight"] = shape
            if mlp_bias:
                out[f"{p}mlp.{n}_proj.bias"] = shape[:1]
    out["model.norm.weight"] = [h]
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = [v, h]
    return out


def make_hf_checkpoint(out_dir, family: str, seed: int = 0, shards: int = 2, **kw) -> dict:
    """Write a random tiny HF checkpoint (norms near 1, biases non-zero) as `save_pretrained` lays it out."""
    from safetensors.numpy import save_file

    c = hf_config(family, **kw)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in hf_shapes(c).items():
        if name.endswith("norm.weight"):  # input/post-attention/final norms, and Qwen3's q_norm / k_norm
            tensors[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[name] = ((0.5 if "embed" in name else 0.1) * rng.standard_normal(shape)).astype(np.float32)
    os.makedirs(out_dir, exist_ok=True)
    names = sorted(tensors)
    parts = np.array_split(np.arange(len(names)), shards)
    weight_map = {}
    for j, idx in enumerate(parts):
        fname = f"model-{j + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        save_file({names[k]: tensors[names[k]] for k in idx}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({names[k]: fname for k in idx})
    if shards > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            total = sum(t.nbytes for t in tensors.values())
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    return c


def load_hf(ckpt_dir) -> tuple[dict, dict]:
    """(config.json dict, {name: float64 array}) of an HF directory, read with `safetensors.numpy` (fp32 files)."""
    from safetensors.numpy import load_file

    with open(os.path.join(ckpt_dir, "config.json")) as f:
        c = json.load(f)
    t = {}
    for fname in sorted(os.listdir(ckpt_dir)):
        if fname.endswith(".safetensors"):
            t.update({k: v.astype(np.float64) for k, v in load_file(os.path.join(ckpt_dir, fname)).items()})
    return c, t


def rope_inv_freq(c: dict, d: int, seq_len: int) -> tuple[np.ndarray, float]:
    """(inv_freq [d/2], attention scaling on cos/sin) as transformers computes them for config `c` (float64)."""
    base = c["rope_theta"]
    inv = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    r = c.get("rope_scaling") or {}
    kind = r.get("rope_type", r.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    factor = r["factor"]
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "dynamic":  # _compute_dynamic_ntk_parameters with seq_len = max(position_ids) + 1
        mpe = c["max_position_embeddings"]
        n = max(seq_len, mpe)
        base = base * ((factor * n / mpe) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d)), 1.0
    orig = r.get("original_max_position_embeddings") or c["max_position_embeddings"]
    if kind == "yarn":
        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * np.log(scale) + 1.0

        att = r.get("attention_factor")
        if att is None:
            att = (mscale(factor, r["mscale"]) / mscale(factor, r["mscale_all_dim"])
                   if r.get("mscale") and r.get("mscale_all_dim") else mscale(factor))
        fast, slow = r.get("beta_fast") or 32, r.get("beta_slow") or 1

        def corr(rot):
            return (d * np.log(orig / (rot * 2 * np.pi))) / (2 * np.log(base))

        lo, hi = corr(fast), corr(slow)
        if r.get("truncate", True):
            lo, hi = np.floor(lo), np.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        extrap = 1 - ramp
        return inv / factor * (1 - extrap) + inv * extrap, float(att)
    if kind == "llama3":
        lo_f, hi_f = r["low_freq_factor"], r["high_freq_factor"]
        wavelen = 2 * np.pi / inv
        llama = np.where(wavelen > orig / lo_f, inv / factor, inv)
        smooth = (orig / wavelen - lo_f) / (hi_f - lo_f)
        smoothed = (1 - smooth) * llama / factor + smooth * llama
        mid = ~(wavelen < orig / hi_f) & ~(wavelen > orig / lo_f)
        return np.where(mid, smoothed, llama), 1.0
    raise ValueError(f"rope type {kind}")


def windowed_layers(c: dict) -> list[int]:
    """Blocks with a sliding window, as transformers' configs derive them."""
    L = c["num_hidden_layers"]
    if c.get("layer_types"):
        return [i for i, t in enumerate(c["layer_types"]) if t == "sliding_attention"]
    if not c.get("use_sliding_window") or c.get("sliding_window") is None or c["model_type"] == "llama":
        return []
    if c["model_type"] == "qwen3_moe":
        return list(range(L))
    return [i for i in range(L) if i >= c["max_window_layers"]]


def router_probs_and_choice(c: dict, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(softmax probs [T, E], chosen experts [T, k], their weights [T, k]) of Qwen3-MoE's router."""
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    k = c["num_experts_per_tok"]
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, top, -1)
    if c["norm_topk_prob"]:
        w = w / w.sum(-1, keepdims=True)
    return probs, top, w


def aux_loss(c: dict, router_logits: list) -> float:
    """transformers' `load_balancing_loss_func` without a mask: E * sum over (k, E) of the mean one-hot choices
    times the mean router probability, over every layer's tokens pooled."""
    logits = np.concatenate(router_logits)  # [L T, E]
    probs, top, _ = router_probs_and_choice(c, logits)
    e = c["num_experts"]
    onehot = np.eye(e)[top]  # [L T, k, E]
    return float(e * (onehot.mean(0) * probs.mean(0)[None]).sum())


def reference_forward(ckpt_dir, ids: np.ndarray) -> tuple[np.ndarray, list]:
    """(logits [b, s, V] float64, router logits per MoE block [b s, E]) of the HF model in `ckpt_dir`."""
    c, t = load_hf(ckpt_dir)
    h, nh = c["hidden_size"], c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nh
    d, eps = _head_dim(c), c["rms_norm_eps"]
    b, s = ids.shape

    def rms(x, w):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w

    def linear(x, name):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    def swiglu(x, p):
        gate = linear(x, p + "gate_proj")
        return linear(gate / (1.0 + np.exp(-gate)) * linear(x, p + "up_proj"), p + "down_proj")

    inv_freq, att = rope_inv_freq(c, d, s)
    freqs = np.outer(np.arange(s, dtype=np.float64), inv_freq)  # [s, d/2]
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = att * np.cos(emb)[None, :, None, :], att * np.sin(emb)[None, :, None, :]  # [1, s, 1, d]

    def rope(x):  # [b, s, n, d]
        rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + rotated * sin

    qi, ki = np.arange(s)[:, None], np.arange(s)[None, :]
    windowed = windowed_layers(c)
    router_logits = []
    x = t["model.embed_tokens.weight"][ids]  # [b, s, h]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = rms(x, t[p + "input_layernorm.weight"])
        q = linear(y, p + "self_attn.q_proj").reshape(b, s, nh, d)
        k = linear(y, p + "self_attn.k_proj").reshape(b, s, nkv, d)
        if p + "self_attn.q_norm.weight" in t:  # Qwen3: per-head RMSNorm before RoPE
            q, k = rms(q, t[p + "self_attn.q_norm.weight"]), rms(k, t[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        v = linear(y, p + "self_attn.v_proj").reshape(b, s, nkv, d)
        k, v = np.repeat(k, nh // nkv, axis=2), np.repeat(v, nh // nkv, axis=2)  # query head j -> kv head j // g
        allowed = ki <= qi
        if i in windowed:
            allowed &= ki > qi - c["sliding_window"]
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d) + np.where(allowed, 0.0, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nh * d)
        x = x + linear(attn, p + "self_attn.o_proj")
        y = rms(x, t[p + "post_attention_layernorm.weight"])
        if _is_moe(c, i):
            flat = y.reshape(b * s, h)
            logits = flat @ t[p + "mlp.gate.weight"].T  # [T, E]
            router_logits.append(logits)
            _, top, w = router_probs_and_choice(c, logits)
            out = np.zeros_like(flat)
            for tok in range(b * s):
                for slot in range(top.shape[1]):
                    out[tok] += w[tok, slot] * swiglu(flat[tok], f"{p}mlp.experts.{top[tok, slot]}.")
            x = x + out.reshape(b, s, h)
        else:
            x = x + swiglu(y, p + "mlp.")
    x = rms(x, t["model.norm.weight"])
    head = t["model.embed_tokens.weight"] if c["tie_word_embeddings"] else t["lm_head.weight"]
    return x @ head.T, router_logits


def reference_logits(ckpt_dir, ids: np.ndarray) -> np.ndarray:
    """Logits [b, s, V] (float64) of the HF model in `ckpt_dir` for token ids [b, s]."""
    return reference_forward(ckpt_dir, ids)[0]


def reference_loss(ckpt_dir, ids: np.ndarray, labels: np.ndarray, mask: np.ndarray) -> float:
    """transformers' training loss of the batch: masked mean cross entropy (+ router_aux_loss_coef x the aux loss
    when a Qwen3-MoE sets output_router_logits)."""
    logits, router = reference_forward(ckpt_dir, ids)
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, labels[..., None].astype(np.int64), -1)[..., 0]
    loss = float((ce * mask).sum() / mask.sum())
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        c = json.load(f)
    if router and c.get("output_router_logits"):
        loss += c["router_aux_loss_coef"] * aux_loss(c, router)
    return loss
