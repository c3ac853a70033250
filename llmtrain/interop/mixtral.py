"""PaddleNLP Mixtral (`MixtralForCausalLM`, 2.8.1) <-> our MoE decoder: config fields and parameter names.

    python -m pytest tests/interop/test_mixtral.py -q

What PaddleNLP's Mixtral computes, read from `paddlenlp/transformers/mixtral/modeling.py`,
and the ModelConfig that reproduces it:
  - the Llama body (RMSNorm fp32, rotate-half RoPE with `rope_theta`, grouped-query
    attention, no biases, an [hidden, vocab] LM head of its own);
  - every block's FFN is `MixtralSparseMoeBlock`: router `gate` [h, E] without bias,
    softmax in fp32, top-k (`num_experts_per_tok`) renormalised to sum 1, each expert a
    SwiGLU MLP act(w1 x) * (w3 x) -> w2 of width `intermediate_size`; dropless; no shared
    expert -> our moe_router=softmax, moe_norm_topk=true, moe_first_dense_layers=0,
    moe_num_shared_experts=0, moe_capacity_factor=0;
  - `router_aux_loss_coef` -> moe_aux_loss_coef. PaddleNLP computes its aux loss once
    over the router logits of all layers concatenated (`load_balancing_loss_func`, no
    padding mask) -> moe_aux_loss_scope=model, so a training step's loss equals
    PaddleNLP's forward loss with `output_router_logits=True`;
  - `sliding_window` is not implemented by PaddleNLP 2.8.1 (it logs a warning and
    attends to everything), so a set window is noted and ignored as PaddleNLP does.
Keys: `mixtral.layers.N.block_sparse_moe.gate.weight` [h, E];
`...block_sparse_moe.experts.E.w1/w3.weight` [h, f] (gate, up), `w2.weight` [f, h] (down),
stacked into our `layers.N.mlp.experts.w_gate/w_up/w_down` [E, ...]. Our expert bias
(auxiliary-loss-free balancing) has no PaddleNLP counterpart: imported as zeros, and a
model whose bias is non-zero (the router chooses with it) is refused on export.
"""
from __future__ import annotations

import functools

import dataclasses

import numpy as np

from llmtrain.interop.keys import SourceTensors, UnsupportedConfig, switch_mismatches
from llmtrain.models.config import ModelConfig

MODEL_TYPE = "mixtral"

# MixtralConfig defaults of PaddleNLP 2.8.1 for the fields we read.
DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, max_position_embeddings=4096 * 32,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                rope_theta=1e6, tie_word_embeddings=False, num_experts_per_tok=2, num_local_experts=8,
                router_aux_loss_coef=0.001, initializer_range=0.02, sliding_window=None)


def config_from_paddlenlp(c: dict, name: str, source: str) -> tuple[ModelConfig, list[str]]:
    """ModelConfig reproducing PaddleNLP's Mixtral for config.json dict `c`, and notes."""
    g = {k: c.get(k, v) for k, v in DEFAULTS.items()}
    notes = [f"{k} absent from config.json: PaddleNLP default {v!r} used" for k, v in DEFAULTS.items() if k not in c]
    heads, kv = g["num_attention_heads"], g["num_key_value_heads"] or g["num_attention_heads"]
    bad = []
    if g["hidden_size"] % heads:
        bad.append(f"hidden_size={g['hidden_size']} not divisible by num_attention_heads={heads}")
    if heads % kv:
        bad.append(f"num_attention_heads={heads} not divisible by num_key_value_heads={kv}")
    if c.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={c['hidden_act']!r} (our experts are SwiGLU with silu)")
    if not 1 <= g["num_experts_per_tok"] <= g["num_local_experts"]:
        bad.append(f"num_experts_per_tok={g['num_experts_per_tok']} with num_local_experts={g['num_local_experts']}")
    if bad:
        raise UnsupportedConfig(f"{source}: Mixtral config not supported: " + "; ".join(bad))
    if g["sliding_window"] is not None:
        notes.append(f"sliding_window={g['sliding_window']} is ignored, as PaddleNLP 2.8.1 ignores it (full attention)")
    cfg = ModelConfig(
        name=name, hidden_size=g["hidden_size"], num_layers=g["num_hidden_layers"], num_heads=heads,
        num_kv_heads=None if kv == heads else kv, ffn_hidden_size=g["intermediate_size"],
        vocab_size=g["vocab_size"], max_position_embeddings=g["max_position_embeddings"], position="rope",
        rope_theta=float(g["rope_theta"]), norm="rmsnorm", norm_eps=float(g["rms_norm_eps"]), activation="swiglu",
        bias=False, tie_embeddings=bool(g["tie_word_embeddings"]), init_std=float(g["initializer_range"]),
        moe_num_experts=int(g["num_local_experts"]), moe_top_k=int(g["num_experts_per_tok"]), moe_router="softmax",
        moe_norm_topk=True, moe_aux_loss_coef=float(g["router_aux_loss_coef"]), moe_aux_loss_scope="model",
        moe_z_loss_coef=0.0)
    return cfg, notes


def config_to_paddlenlp(cfg: ModelConfig) -> tuple[dict, list[str]]:
    """config.json fields for `MixtralForCausalLM` computing what `cfg` computes, and notes."""
    wants = (("position", "rope"), ("norm", "rmsnorm"), ("activation", "swiglu"), ("norm_position", "pre"),
             ("moe_router", "softmax"), ("moe_norm_topk", True), ("moe_first_dense_layers", 0),
             ("moe_num_shared_experts", 0), ("moe_capacity_factor", 0.0), ("moe_routed_scale", 1.0))
    bad = switch_mismatches(cfg, "decoder", "MixtralForCausalLM", "Mixtral", wants)
    if cfg.bias:
        bad.append("model.bias=true (PaddleNLP's Mixtral has no biases)")
    if cfg.moe_num_experts <= 0:
        bad.append("model.moe_num_experts=0 (a dense model is written as Llama)")
    if cfg.moe_ffn_hidden_size not in (None, cfg.ffn_hidden_size):
        bad.append(f"model.moe_ffn_hidden_size={cfg.moe_ffn_hidden_size} != model.ffn_hidden_size="
                   f"{cfg.ffn_hidden_size} (Mixtral's experts have intermediate_size)")
    if bad:
        raise UnsupportedConfig(f"model {cfg.name!r} cannot be written as a PaddleNLP Mixtral: " + "; ".join(bad))
    notes = []
    if cfg.moe_aux_loss_scope != "model":
        notes.append("model.moe_aux_loss_scope=layer: PaddleNLP's Mixtral pools its aux loss over all layers "
                     "(logits equal; the aux term of a training loss differs)")
    if cfg.moe_z_loss_coef:
        notes.append(f"model.moe_z_loss_coef={cfg.moe_z_loss_coef}: PaddleNLP's Mixtral has no router z-loss")
    if cfg.tie_embeddings:
        notes.append("tied embeddings: lm_head.weight written as the embedding transposed")
    out = dict(
        architectures=["MixtralForCausalLM"], model_type=MODEL_TYPE, vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.expert_ffn_size(), num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads(),
        max_position_embeddings=cfg.max_position_embeddings, seq_length=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, hidden_act="silu",
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
        num_local_experts=cfg.moe_num_experts, num_experts_per_tok=cfg.moe_top_k,
        router_aux_loss_coef=cfg.moe_aux_loss_coef, sliding_window=None)
    return out, notes


def to_canonical(src: SourceTensors, cfg: ModelConfig) -> tuple[dict[str, np.ndarray], ModelConfig, list[str]]:
    """Our canonical state from PaddleNLP Mixtral tensors, the config with the tie settled, and notes."""
    h, f, v, e = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.moe_num_experts
    nh, nkv, d = cfg.num_heads, cfg.kv_heads(), cfg.attn_head_dim()
    state: dict[str, np.ndarray] = {}
    notes: list[str] = []

    put = functools.partial(src.take_into, state)  # put(canon, key, shape)

    put("embed.word.weight", "mixtral.embed_tokens.weight", [v, h])
    for i in range(cfg.num_layers):
        p, c = f"mixtral.layers.{i}.", f"layers.{i}."
        put(f"{c}attn_norm.weight", f"{p}input_layernorm.weight", [h])
        put(f"{c}mlp_norm.weight", f"{p}post_attention_layernorm.weight", [h])
        put(f"{c}attn.q_proj.weight", f"{p}self_attn.q_proj.weight", [h, nh * d])
        put(f"{c}attn.k_proj.weight", f"{p}self_attn.k_proj.weight", [h, nkv * d])
        put(f"{c}attn.v_proj.weight", f"{p}self_attn.v_proj.weight", [h, nkv * d])
        put(f"{c}attn.o_proj.weight", f"{p}self_attn.o_proj.weight", [nh * d, h])
        put(f"{c}mlp.router.weight", f"{p}block_sparse_moe.gate.weight", [h, e])
        state[f"{c}mlp.expert_bias"] = np.zeros([e], dtype=np.float32)
        for ours, theirs, shape in (("w_gate", "w1", [h, f]), ("w_up", "w3", [h, f]), ("w_down", "w2", [f, h])):
            parts = [src.take(f"{p}block_sparse_moe.experts.{j}.{theirs}.weight", shape) for j in range(e)]
            if all(x is not None for x in parts):
                state[f"{c}mlp.experts.{ours}"] = np.ascontiguousarray(np.stack([np.asarray(x) for x in parts]))
    put("final_norm.norm.weight", "mixtral.norm.weight", [h])
    tie = cfg.tie_embeddings
    head = src.take("lm_head.weight", [h, v])
    word = state.get("embed.word.weight")
    if tie and head is not None and word is not None and not np.array_equal(head, np.asarray(word).T):
        tie = False
        notes.append("tie_word_embeddings=true but lm_head.weight differs from the embedding: imported untied, "
                     "as PaddleNLP computes with its own lm_head.weight")
    if not tie and head is not None:
        state["lm_head.proj.weight"] = head
    return state, dataclasses.replace(cfg, tie_embeddings=tie), notes


def from_canonical(state: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """PaddleNLP MixtralForCausalLM tensors from our canonical state (already checked against `cfg`)."""
    out = {"mixtral.embed_tokens.weight": state["embed.word.weight"]}
    for i in range(cfg.num_layers):
        p, c = f"mixtral.layers.{i}.", f"layers.{i}."
        bias = state[f"{c}mlp.expert_bias"]
        if np.any(bias != 0):  # the router adds any non-zero bias to its selection scores
            raise UnsupportedConfig(f"{c}mlp.expert_bias is non-zero (max |b| {float(np.abs(bias).max()):.3g}): "
                                    "PaddleNLP's Mixtral routes without a selection bias, so the export would choose other experts")
        out[f"{p}input_layernorm.weight"] = state[f"{c}attn_norm.weight"]
        out[f"{p}post_attention_layernorm.weight"] = state[f"{c}mlp_norm.weight"]
        for n in "qkvo":
            out[f"{p}self_attn.{n}_proj.weight"] = state[f"{c}attn.{n}_proj.weight"]
        out[f"{p}block_sparse_moe.gate.weight"] = state[f"{c}mlp.router.weight"]
        for ours, theirs in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
            stacked = state[f"{c}mlp.experts.{ours}"]
            for j in range(cfg.moe_num_experts):
                out[f"{p}block_sparse_moe.experts.{j}.{theirs}.weight"] = np.ascontiguousarray(stacked[j])
    out["mixtral.norm.weight"] = state["final_norm.norm.weight"]
    out["lm_head.weight"] = (np.ascontiguousarray(state["embed.word.weight"].T) if cfg.tie_embeddings
                             else state["lm_head.proj.weight"])
    return out
