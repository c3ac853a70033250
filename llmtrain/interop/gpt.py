"""PaddleNLP GPT (`GPTForCausalLM`, 2.8.1) <-> our decoder: config fields and parameter names.

    python -m pytest tests/interop -q -k gpt

What PaddleNLP's GPT computes, read from `paddlenlp/transformers/gpt/modeling.py`,
and the ModelConfig that reproduces it:
  - pre-norm blocks, or post-norm with `normalize_before=false` (norm1/norm2 after each
    residual add) — our `norm_position`; the final `decoder.norm` is applied in both;
  - LayerNorm epsilon hard-coded to 1e-5 everywhere: `layer_norm_eps` in config.json is not read;
  - the MLP calls `F.gelu(x, approximate=True)` (tanh form) whatever `hidden_activation`
    says; any value other than "gelu" makes PaddleNLP itself fail, so we reject it;
  - attention scores are q k^T scaled by (scale_qk_coeff * d)^-1/2 then by scale_qk_coeff,
    i.e. by sqrt(scale_qk_coeff / d): only 1.0 is ordinary attention, others are rejected;
  - learned absolute positions, biases on every linear, and the LM head is always the
    word table (`GPTLMHead` gets `embedding_weights`): GPT is tied, `lm_head.weight` in a
    state dict is the same tensor as `gpt.embeddings.word_embeddings.weight`.
Weights are [in, out] in both, so no transposes. Fused attention
(`qkv_proj`, [h, 3h]) is reshaped by PaddleNLP to [.., heads, 3*d] and split on the
last axis, so its columns are per head (q_h, k_h, v_h); we split it that way.
`fuse_attention_ffn` has no effect on GPT in 2.8.1 (always `linear1`/`linear2`).
"""
from __future__ import annotations

import functools

import numpy as np

from llmtrain.interop.keys import SourceTensors, UnsupportedConfig, switch_mismatches
from llmtrain.models.config import ModelConfig

MODEL_TYPE = "gpt"
PREFIX = "gpt."
LN_EPS = 1e-5  # GPTLayerNorm(..., epsilon=1e-5) in every place PaddleNLP builds one

# GPTConfig defaults of PaddleNLP 2.8.1 for the fields we read (used when config.json omits them).
DEFAULTS = dict(vocab_size=50304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072, max_position_embeddings=512, hidden_activation="gelu",
                normalize_before=True, scale_qk_coeff=1.0, initializer_range=0.02)


def config_from_paddlenlp(c: dict, name: str, source: str) -> tuple[ModelConfig, list[str]]:
    """ModelConfig reproducing PaddleNLP's GPT for config.json dict `c`, and notes on what was decided."""
    g = {k: c.get(k, v) for k, v in DEFAULTS.items()}
    notes = [f"{k} absent from config.json: PaddleNLP default {v!r} used" for k, v in DEFAULTS.items() if k not in c]
    bad = []
    if g["hidden_activation"] != "gelu":
        bad.append(f"hidden_activation={g['hidden_activation']!r} (PaddleNLP's GPT MLP only runs gelu, tanh form)")
    if float(g["scale_qk_coeff"]) != 1.0:
        bad.append(f"scale_qk_coeff={g['scale_qk_coeff']} (scores scaled by sqrt(coeff/d), not 1/sqrt(d))")
    if g["hidden_size"] % g["num_attention_heads"]:
        bad.append(f"hidden_size={g['hidden_size']} not divisible by num_attention_heads={g['num_attention_heads']}")
    if bad:
        raise UnsupportedConfig(f"{source}: GPT config not supported: " + "; ".join(bad))
    if c.get("layer_norm_eps", LN_EPS) != LN_EPS:
        notes.append(f"layer_norm_eps={c['layer_norm_eps']} in config.json is ignored by PaddleNLP's GPT "
                     f"(hard-coded {LN_EPS}); we use {LN_EPS} to match it")
    cfg = ModelConfig(
        name=name, hidden_size=g["hidden_size"], num_layers=g["num_hidden_layers"],
        num_heads=g["num_attention_heads"], num_kv_heads=None, ffn_hidden_size=g["intermediate_size"],
        vocab_size=g["vocab_size"], max_position_embeddings=g["max_position_embeddings"], position="learned",
        norm="layernorm", norm_eps=LN_EPS, norm_position="pre" if g["normalize_before"] else "post",
        activation="gelu_tanh", bias=True, tie_embeddings=True,
        init_std=float(g["initializer_range"]))
    return cfg, notes


def config_to_paddlenlp(cfg: ModelConfig) -> tuple[dict, list[str]]:
    """config.json fields for `GPTForCausalLM` computing what `cfg` computes, and notes."""
    wants = (
        ("position", "learned"),
        ("norm", "layernorm"),
        ("activation", "gelu_tanh"),
    )
    bad = switch_mismatches(cfg, "decoder", "GPTForCausalLM", "GPT", wants)
    if cfg.norm_eps != LN_EPS:
        bad.append(f"model.norm_eps={cfg.norm_eps} (PaddleNLP's GPT hard-codes {LN_EPS})")
    if not cfg.tie_embeddings:
        bad.append("model.tie_embeddings=false (PaddleNLP's GPTForCausalLM always ties the LM head)")
    if cfg.kv_heads() != cfg.num_heads:
        bad.append(f"model.num_kv_heads={cfg.num_kv_heads} (PaddleNLP's GPT has no grouped-query attention)")
    if bad:
        raise UnsupportedConfig(f"model {cfg.name!r} cannot be written as a PaddleNLP GPT: " + "; ".join(bad))
    notes = [] if cfg.bias else ["model.bias=false: PaddleNLP's GPT always has biases; written as zeros (exact)"]
    out = dict(
        architectures=["GPTForCausalLM"], model_type=MODEL_TYPE, vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.ffn_hidden_size, max_position_embeddings=cfg.max_position_embeddings,
        seq_length=cfg.max_position_embeddings, hidden_activation="gelu", layer_norm_eps=LN_EPS,
        normalize_before=cfg.norm_position == "pre", scale_qk_coeff=1.0, initializer_range=cfg.init_std,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,  # our model has no dropout
        fuse_attention_qkv=False, fuse_attention_ffn=False, tie_word_embeddings=True)
    return out, notes


def split_fused_qkv(w: np.ndarray, heads: int, head_dim: int) -> list[np.ndarray]:
    """GPT `qkv_proj` weight [h, 3*nh*d] (or bias [3*nh*d]) -> q, k, v, each [h, nh*d] (or [nh*d]).

    Columns are grouped per head as (q_h, k_h, v_h), each d wide."""
    w = np.asarray(w)
    lead = w.shape[:-1]
    per_head = w.reshape(*lead, heads, 3, head_dim)  # [.., nh, 3, d]
    return [np.ascontiguousarray(per_head[..., :, j, :].reshape(*lead, heads * head_dim)) for j in range(3)]


def to_canonical(src: SourceTensors, cfg: ModelConfig) -> tuple[dict[str, np.ndarray], ModelConfig, list[str]]:
    """Our canonical state from PaddleNLP GPT tensors, the config (unchanged: GPT is always tied), notes.

    Problems (missing, mis-shaped keys) are recorded in `src`."""
    h, f, v, nh, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.num_heads, cfg.attn_head_dim()
    state: dict[str, np.ndarray] = {}

    put = functools.partial(src.take_into, state)  # put(canon, key, shape)

    put("embed.word.weight", "gpt.embeddings.word_embeddings.weight", [v, h])
    put("embed.pos.weight", "gpt.embeddings.position_embeddings.weight", [cfg.max_position_embeddings, h])
    for i in range(cfg.num_layers):
        p, c = f"gpt.decoder.layers.{i}.", f"layers.{i}."
        for ours, theirs in (("attn_norm", "norm1"), ("mlp_norm", "norm2")):
            put(f"{c}{ours}.weight", f"{p}{theirs}.weight", [h])
            put(f"{c}{ours}.bias", f"{p}{theirs}.bias", [h])
        if src.has(p + "self_attn.qkv_proj.weight"):  # fused attention
            for part, shape in (("weight", [h, 3 * h]), ("bias", [3 * h])):
                fused = src.take(f"{p}self_attn.qkv_proj.{part}", shape)
                if fused is not None:
                    for n, arr in zip("qkv", split_fused_qkv(fused, nh, d)):
                        state[f"{c}attn.{n}_proj.{part}"] = arr
        else:
            for n in "qkv":
                put(f"{c}attn.{n}_proj.weight", f"{p}self_attn.{n}_proj.weight", [h, h])
                put(f"{c}attn.{n}_proj.bias", f"{p}self_attn.{n}_proj.bias", [h])
        put(f"{c}attn.o_proj.weight", f"{p}self_attn.out_proj.weight", [h, h])
        put(f"{c}attn.o_proj.bias", f"{p}self_attn.out_proj.bias", [h])
        put(f"{c}mlp.up_proj.weight", f"{p}linear1.weight", [h, f])
        put(f"{c}mlp.up_proj.bias", f"{p}linear1.bias", [f])
        put(f"{c}mlp.down_proj.weight", f"{p}linear2.weight", [f, h])
        put(f"{c}mlp.down_proj.bias", f"{p}linear2.bias", [h])
    put("final_norm.norm.weight", "gpt.decoder.norm.weight", [h])
    put("final_norm.norm.bias", "gpt.decoder.norm.bias", [h])
    if src.has("lm_head.weight"):  # the tied table saved a second time by save_pretrained
        head = src.take("lm_head.weight", [v, h])
        word = state.get("embed.word.weight")
        if head is not None and word is not None and not np.array_equal(head, word):
            src.problem(f"lm_head.weight ({src.where('lm_head.weight')}) differs from "
                        "gpt.embeddings.word_embeddings.weight, but GPTForCausalLM ties them: inconsistent checkpoint")
    return state, cfg, []


def from_canonical(state: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """PaddleNLP GPTForCausalLM tensors from our canonical state (already checked against `cfg`)."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size

    def bias(canon, width):
        return state[canon] if cfg.bias else np.zeros([width], np.float32)

    out = {"gpt.embeddings.word_embeddings.weight": state["embed.word.weight"],
           "gpt.embeddings.position_embeddings.weight": state["embed.pos.weight"]}
    for i in range(cfg.num_layers):
        p, c = f"gpt.decoder.layers.{i}.", f"layers.{i}."
        for ours, theirs in (("attn_norm", "norm1"), ("mlp_norm", "norm2")):
            out[f"{p}{theirs}.weight"] = state[f"{c}{ours}.weight"]
            out[f"{p}{theirs}.bias"] = state[f"{c}{ours}.bias"]
        for ours, theirs, width in (("attn.q_proj", "self_attn.q_proj", h), ("attn.k_proj", "self_attn.k_proj", h),
                                    ("attn.v_proj", "self_attn.v_proj", h), ("attn.o_proj", "self_attn.out_proj", h),
                                    ("mlp.up_proj", "linear1", f), ("mlp.down_proj", "linear2", h)):
            out[f"{p}{theirs}.weight"] = state[f"{c}{ours}.weight"]
            out[f"{p}{theirs}.bias"] = bias(f"{c}{ours}.bias", width)
    out["gpt.decoder.norm.weight"] = state["final_norm.norm.weight"]
    out["gpt.decoder.norm.bias"] = state["final_norm.norm.bias"]
    out["lm_head.weight"] = state["embed.word.weight"]  # as save_pretrained writes the tied table
    return out
