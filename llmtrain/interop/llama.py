"""PaddleNLP Llama (`LlamaForCausalLM`, 2.8.1) <-> our decoder: config fields and parameter names.

    python -m pytest tests/interop -q -k llama

What PaddleNLP's Llama computes, read from `paddlenlp/transformers/llama/modeling.py`,
and the ModelConfig that reproduces it:
  - RMSNorm in fp32 with `rms_norm_eps`; SwiGLU MLP always (`hidden_act` is not read);
    no biases anywhere; head_dim = hidden_size / num_attention_heads;
  - rotary embedding in the rotate-half form (`rotate_half`: [-x2, x1] of the two halves),
    inv_freq = 1 / rope_theta^(2i/d), cos/sin of [freqs, freqs] — as our `Rotary`;
    `use_fused_rope` (GPU) calls the fused kernel with use_neox_rotary_style=False, which
    is the same rotate-half form. `rope_scaling_type` (linear / ntk / dynamic_ntk),
    `alibi` and `use_long_sequence_strategies` change positions: rejected;
  - grouped-query attention repeats each kv head num_heads/num_kv_heads times
    consecutively (`repeat_kv`), as our `repeat_interleave`;
  - the LM head: `LlamaLMHead` is its own [hidden, vocab] parameter and the logits are
    hidden @ W with no transpose. PaddleNLP 2.8.1 never ties it to the embedding:
    `tie_weights()` is not called for Llama (and would give a [vocab, hidden] matrix that
    the untransposed matmul cannot use). So with `tie_word_embeddings=true` the file still
    carries `lm_head.weight`, and PaddleNLP computes with it. We import a tied model only
    when that head equals the embedding transposed (bit for bit); otherwise untied, as
    PaddleNLP runs it. On export a tied model writes lm_head.weight = embedding^T.
Fused layouts: `qkv_proj` [h, nh*d + 2*nkv*d] is viewed by PaddleNLP as
[.., nkv, (g + 2) * d] with g = nh / nkv and split into (g*d, d, d): per kv head, its g
query heads, then its k, then its v. `gate_up_fused_proj` [h, 2f] is cut in halves
(gate, then up) by `swiglu`. Whether a layer is fused is read from the keys present
(PaddleNLP converts between the two forms on load, so a key form need not match the flags).
"""
from __future__ import annotations

import functools

import dataclasses

import numpy as np

from llmtrain.interop.keys import SourceTensors, UnsupportedConfig, switch_mismatches
from llmtrain.models.config import ModelConfig

MODEL_TYPE = "llama"

# LlamaConfig defaults of PaddleNLP 2.8.1 for the fields we read (used when config.json omits them).
DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, max_position_embeddings=2048,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None, rms_norm_eps=1e-6,
                rope_theta=10000.0, tie_word_embeddings=False, alibi=False, rope_scaling_type=None,
                use_long_sequence_strategies=False, initializer_range=0.02)


def config_from_paddlenlp(c: dict, name: str, source: str) -> tuple[ModelConfig, list[str]]:
    """ModelConfig reproducing PaddleNLP's Llama for config.json dict `c`, and notes on what was decided.

    `tie_embeddings` here is the config's flag; `to_canonical` settles it from the tensors."""
    g = {k: c.get(k, v) for k, v in DEFAULTS.items()}
    notes = [f"{k} absent from config.json: PaddleNLP default {v!r} used" for k, v in DEFAULTS.items()
             if k not in c and k != "num_key_value_heads"]
    heads = g["num_attention_heads"]
    kv = g["num_key_value_heads"] or heads
    bad = []
    if g["alibi"]:
        bad.append("alibi=true (ALiBi position biases; our decoder uses RoPE)")
    if g["rope_scaling_type"] is not None:
        bad.append(f"rope_scaling_type={g['rope_scaling_type']!r} (scaled RoPE is not implemented in our decoder)")
    if g["use_long_sequence_strategies"]:
        bad.append("use_long_sequence_strategies=true (custom position strategy)")
    if g["hidden_size"] % heads:
        bad.append(f"hidden_size={g['hidden_size']} not divisible by num_attention_heads={heads}")
    if heads % kv:
        bad.append(f"num_attention_heads={heads} not divisible by num_key_value_heads={kv}")
    if bad:
        raise UnsupportedConfig(f"{source}: Llama config not supported: " + "; ".join(bad))
    if c.get("hidden_act", "silu") != "silu":
        notes.append(f"hidden_act={c['hidden_act']!r} is not read by PaddleNLP's Llama (always SwiGLU); SwiGLU used")
    cfg = ModelConfig(
        name=name, hidden_size=g["hidden_size"], num_layers=g["num_hidden_layers"], num_heads=heads,
        num_kv_heads=None if kv == heads else kv, ffn_hidden_size=g["intermediate_size"],
        vocab_size=g["vocab_size"], max_position_embeddings=g["max_position_embeddings"], position="rope",
        rope_theta=float(g["rope_theta"]), norm="rmsnorm", norm_eps=float(g["rms_norm_eps"]), activation="swiglu",
        bias=False, tie_embeddings=bool(g["tie_word_embeddings"]), init_std=float(g["initializer_range"]))
    return cfg, notes


def config_to_paddlenlp(cfg: ModelConfig) -> tuple[dict, list[str]]:
    """config.json fields for `LlamaForCausalLM` computing what `cfg` computes, and notes."""
    wants = (
        ("position", "rope"),
        ("norm", "rmsnorm"),
        ("activation", "swiglu"),
        ("norm_position", "pre"),
    )
    bad = switch_mismatches(cfg, "decoder", "LlamaForCausalLM", "Llama", wants)
    if cfg.bias:
        bad.append("model.bias=true (PaddleNLP's Llama has no biases)")
    if bad:
        raise UnsupportedConfig(f"model {cfg.name!r} cannot be written as a PaddleNLP Llama: " + "; ".join(bad))
    notes = ["tied embeddings: lm_head.weight written as the embedding transposed (PaddleNLP 2.8.1 keeps a "
             "separate Llama head)"] if cfg.tie_embeddings else []
    out = dict(
        architectures=["LlamaForCausalLM"], model_type=MODEL_TYPE, vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads(),
        max_position_embeddings=cfg.max_position_embeddings, seq_length=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, hidden_act="silu",
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std, alibi=False,
        rope_scaling_type=None, fuse_attention_qkv=False, fuse_attention_ffn=False)
    return out, notes


def split_fused_qkv(w: np.ndarray, heads: int, kv_heads: int, head_dim: int) -> list[np.ndarray]:
    """Llama `qkv_proj` [h, nh*d + 2*nkv*d] -> q [h, nh*d], k [h, nkv*d], v [h, nkv*d]."""
    g = heads // kv_heads
    w = np.asarray(w)
    grouped = w.reshape(w.shape[0], kv_heads, g + 2, head_dim)  # [h, nkv, g+2, d]
    q = grouped[:, :, :g, :].reshape(w.shape[0], heads * head_dim)  # query head index = kv * g + j
    k = grouped[:, :, g, :].reshape(w.shape[0], kv_heads * head_dim)
    v = grouped[:, :, g + 1, :].reshape(w.shape[0], kv_heads * head_dim)
    return [np.ascontiguousarray(x) for x in (q, k, v)]


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """1 / theta^(2i/d), i < d/2, in fp32 as PaddleNLP computes it."""
    return (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))))


def to_canonical(src: SourceTensors, cfg: ModelConfig) -> tuple[dict[str, np.ndarray], ModelConfig, list[str]]:
    """Our canonical state from PaddleNLP Llama tensors, the config with the tie settled, and notes."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    nh, nkv, d = cfg.num_heads, cfg.kv_heads(), cfg.attn_head_dim()
    state: dict[str, np.ndarray] = {}
    notes: list[str] = []

    put = functools.partial(src.take_into, state)  # put(canon, key, shape)

    put("embed.word.weight", "llama.embed_tokens.weight", [v, h])
    inv_freq = rope_inv_freq(d, cfg.rope_theta)
    for i in range(cfg.num_layers):
        p, c = f"llama.layers.{i}.", f"layers.{i}."
        put(f"{c}attn_norm.weight", f"{p}input_layernorm.weight", [h])
        put(f"{c}mlp_norm.weight", f"{p}post_attention_layernorm.weight", [h])
        if src.has(p + "self_attn.qkv_proj.weight"):
            fused = src.take(p + "self_attn.qkv_proj.weight", [h, (nh + 2 * nkv) * d])
            if fused is not None:
                for n, arr in zip("qkv", split_fused_qkv(fused, nh, nkv, d)):
                    state[f"{c}attn.{n}_proj.weight"] = arr
        else:
            put(f"{c}attn.q_proj.weight", f"{p}self_attn.q_proj.weight", [h, nh * d])
            put(f"{c}attn.k_proj.weight", f"{p}self_attn.k_proj.weight", [h, nkv * d])
            put(f"{c}attn.v_proj.weight", f"{p}self_attn.v_proj.weight", [h, nkv * d])
        put(f"{c}attn.o_proj.weight", f"{p}self_attn.o_proj.weight", [nh * d, h])
        if src.has(p + "mlp.gate_up_fused_proj.weight"):
            fused = src.take(p + "mlp.gate_up_fused_proj.weight", [h, 2 * f])
            if fused is not None:
                fused = np.asarray(fused)
                state[f"{c}mlp.gate_proj.weight"] = np.ascontiguousarray(fused[:, :f])
                state[f"{c}mlp.up_proj.weight"] = np.ascontiguousarray(fused[:, f:])
        else:
            put(f"{c}mlp.gate_proj.weight", f"{p}mlp.gate_proj.weight", [h, f])
            put(f"{c}mlp.up_proj.weight", f"{p}mlp.up_proj.weight", [h, f])
        put(f"{c}mlp.down_proj.weight", f"{p}mlp.down_proj.weight", [f, h])
        buf = p + "self_attn.rotary_emb.inv_freq"  # a buffer some converted checkpoints carry
        if src.has(buf):
            have = src.tensors[buf]
            if have.shape != inv_freq.shape or not np.allclose(have, inv_freq, rtol=1e-5, atol=0):
                src.used.add(buf)
                src.problem(f"{buf} ({src.where(buf)}) differs from 1/rope_theta^(2i/d) with rope_theta="
                            f"{cfg.rope_theta}: the checkpoint's rotary frequencies are not what config.json says")
            else:
                src.ignore(buf, f"rotary inv_freq buffer, equal to the one rope_theta={cfg.rope_theta} gives")
    put("final_norm.norm.weight", "llama.norm.weight", [h])

    tie = cfg.tie_embeddings
    if src.has("lm_head.weight"):
        head = src.take("lm_head.weight", [h, v])
        word = state.get("embed.word.weight")
        if tie and head is not None and word is not None and not np.array_equal(head, np.asarray(word).T):
            tie = False
            notes.append("tie_word_embeddings=true but lm_head.weight differs from the embedding: PaddleNLP 2.8.1 "
                         "computes with the separate lm_head.weight, so we import an untied model")
        if not tie and head is not None:
            state["lm_head.proj.weight"] = head
    elif tie:
        notes.append("tie_word_embeddings=true and no lm_head.weight: we tie to the embedding as the config says "
                     "(PaddleNLP 2.8.1 itself would leave its separate lm_head randomly initialised)")
    else:
        src.take("lm_head.weight", [h, v])  # records it as missing
    return state, dataclasses.replace(cfg, tie_embeddings=tie), notes


def from_canonical(state: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """PaddleNLP LlamaForCausalLM tensors from our canonical state (already checked against `cfg`)."""
    out = {"llama.embed_tokens.weight": state["embed.word.weight"]}
    for i in range(cfg.num_layers):
        p, c = f"llama.layers.{i}.", f"layers.{i}."
        out[f"{p}input_layernorm.weight"] = state[f"{c}attn_norm.weight"]
        out[f"{p}post_attention_layernorm.weight"] = state[f"{c}mlp_norm.weight"]
        for n in "qkvo":
            out[f"{p}self_attn.{n}_proj.weight"] = state[f"{c}attn.{n}_proj.weight"]
        for n in ("gate", "up", "down"):
            out[f"{p}mlp.{n}_proj.weight"] = state[f"{c}mlp.{n}_proj.weight"]
    out["llama.norm.weight"] = state["final_norm.norm.weight"]
    out["lm_head.weight"] = (np.ascontiguousarray(state["embed.word.weight"].T) if cfg.tie_embeddings
                             else state["lm_head.proj.weight"])
    return out
