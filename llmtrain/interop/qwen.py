"""PaddleNLP Qwen (`QWenForCausalLM`, 2.8.1) <-> our decoder: config fields, parameter names, LoRA adapters.

    python -m pytest tests/interop/test_qwen.py -q

What PaddleNLP's Qwen computes, read from `paddlenlp/transformers/qwen/modeling.py`, and the
ModelConfig that reproduces it:
  - RMSNorm in fp32 with `layer_norm_epsilon` (as our `rmsnorm`); pre-norm blocks;
  - attention: one fused `c_attn` linear [h, 3 h] WITH bias (always), split into equal q | k | v
    thirds, heads of width hidden_size / num_attention_heads (so `kv_channels` must equal it);
    no grouped-query attention; `c_proj` [h, h] with a bias only when `no_bias=false`;
    scores q k^T / sqrt(d), causal, softmax in fp32. Our config: bias=(not no_bias), qkv_bias=true;
  - rotary embedding, rotate-half form with base `rotary_emb_base` over the whole head
    (`rotary_pct` < 1 rotates part of it: rejected), as our `Rotary`;
  - MLP: `w1` and `w2` of width intermediate_size / 2 and out = c_proj(w1(x) * silu(w2(x))):
    SwiGLU with gate = w2, up = w1, down = c_proj and ffn_hidden_size = intermediate_size / 2;
  - LM head: `lm_head.weight` [h, V], logits = hidden @ W (never tied, as PaddleNLP's Llama: see
    `llama.py`; a head equal to the embedding transposed imports as tied);
  - `use_dynamic_ntk` and `use_logn_attn` (on by default) act only in PaddleNLP's eval mode and only on
    sequences longer than `seq_length` (NTK-scaled RoPE base, log-n scaled queries); up to `seq_length`
    they change nothing. We implement neither, so a Qwen with either switch imports with
    max_position_embeddings = seq_length: the run refuses data.seq_len beyond it instead of
    computing something else. `use_long_sequence_strategies` is rejected.
LoRA (`paddlenlp.peft`) on Qwen adapts the fused `c_attn`: one A [h, r] and B [r, 3h]. Reading it gives
our q, k and v adapters A and the thirds of B (exact, same rank). Writing ours, whose q/k/v adapters have
their own A, stacks them: A = [A_q A_k A_v] [h, n r], B block-diagonal [n r, 3h] (n = adapted projections
among q, k, v), exact; PaddleNLP's LoRAConfig has one rank for all modules, so the file's rank is n r and
the other modules' adapters are padded with zero columns of A and zero rows of B (lora_alpha scaled by n so
alpha / r is unchanged).
"""
from __future__ import annotations

import functools

import dataclasses

import numpy as np

from llmtrain.interop.keys import SourceTensors, UnsupportedConfig, switch_mismatches
from llmtrain.models.config import ModelConfig

MODEL_TYPE = "qwen"
ARCHITECTURE = "QWenForCausalLM"

# QWenConfig defaults of PaddleNLP 2.8.1 for the fields we read (`seq_length` has none: PaddleNLP needs it)
DEFAULTS = dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                layer_norm_epsilon=1e-6, initializer_range=0.02, max_position_embeddings=8192, kv_channels=128,
                rotary_pct=1.0, rotary_emb_base=10000, use_dynamic_ntk=True, use_logn_attn=True,
                intermediate_size=22016, no_bias=True, tie_word_embeddings=False, use_long_sequence_strategies=False)


def config_from_paddlenlp(c: dict, name: str, source: str) -> tuple[ModelConfig, list[str]]:
    """ModelConfig reproducing PaddleNLP's Qwen for config.json dict `c`, and notes on what was decided."""
    g = {k: c.get(k, v) for k, v in DEFAULTS.items()}
    notes = [f"{k} absent from config.json: PaddleNLP default {v!r} used" for k, v in DEFAULTS.items() if k not in c]
    h, heads = g["hidden_size"], g["num_attention_heads"]
    bad = []
    if h % heads:
        bad.append(f"hidden_size={h} not divisible by num_attention_heads={heads}")
    elif g["kv_channels"] != h // heads:
        bad.append(f"kv_channels={g['kv_channels']} != hidden_size / num_attention_heads = {h // heads} "
                   "(PaddleNLP's Qwen then splits c_attn inconsistently)")
    if float(g["rotary_pct"]) != 1.0:
        bad.append(f"rotary_pct={g['rotary_pct']} (partial rotary is not implemented in our decoder)")
    if g["use_long_sequence_strategies"]:
        bad.append("use_long_sequence_strategies=true (custom position strategy)")
    if g["intermediate_size"] % 2:
        bad.append(f"intermediate_size={g['intermediate_size']} is odd (Qwen's w1/w2 are intermediate_size / 2 wide)")
    if "seq_length" not in c:
        bad.append("seq_length absent (PaddleNLP's QWenAttention needs it)")
    if bad:
        raise UnsupportedConfig(f"{source}: Qwen config not supported: " + "; ".join(bad))
    max_pos = int(g["max_position_embeddings"])
    if g["use_dynamic_ntk"] or g["use_logn_attn"]:
        limit = min(max_pos, int(c["seq_length"]))
        if limit < max_pos:
            notes.append(f"use_dynamic_ntk/use_logn_attn: PaddleNLP's eval changes RoPE and query scale beyond "
                         f"seq_length={c['seq_length']}; model.max_position_embeddings set to {limit} (not {max_pos})")
        max_pos = limit
    cfg = ModelConfig(
        name=name, hidden_size=h, num_layers=g["num_hidden_layers"], num_heads=heads, num_kv_heads=None,
        ffn_hidden_size=g["intermediate_size"] // 2, vocab_size=g["vocab_size"], max_position_embeddings=max_pos,
        position="rope", rope_theta=float(g["rotary_emb_base"]), norm="rmsnorm",
        norm_eps=float(g["layer_norm_epsilon"]),
        activation="swiglu", bias=not g["no_bias"], qkv_bias=True, tie_embeddings=bool(g["tie_word_embeddings"]),
        init_std=float(g["initializer_range"]))
    return cfg, notes


def config_to_paddlenlp(cfg: ModelConfig) -> tuple[dict, list[str]]:
    """config.json fields for `QWenForCausalLM` computing what `cfg` computes, and notes."""
    wants = (("position", "rope"), ("norm", "rmsnorm"), ("activation", "swiglu"), ("norm_position", "pre"))
    bad = switch_mismatches(cfg, "decoder", ARCHITECTURE, "Qwen", wants)
    if not cfg.has_qkv_bias():
        bad.append("model.qkv_bias=false (PaddleNLP's Qwen always has a c_attn bias)")
    if cfg.kv_heads() != cfg.num_heads:
        bad.append(f"model.num_kv_heads={cfg.num_kv_heads} (PaddleNLP's Qwen has no grouped-query attention; "
                   "write it as a Hugging Face Qwen2 with --format hf)")
    if cfg.moe_num_experts:
        bad.append(f"model.moe_num_experts={cfg.moe_num_experts} (Qwen is dense)")
    if bad:
        raise UnsupportedConfig(f"model {cfg.name!r} cannot be written as a PaddleNLP Qwen: " + "; ".join(bad))
    notes = ["tied embeddings: lm_head.weight written as the embedding transposed (PaddleNLP 2.8.1 keeps a "
             "separate Qwen head)"] if cfg.tie_embeddings else []
    out = dict(
        architectures=[ARCHITECTURE], model_type=MODEL_TYPE, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=2 * cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, kv_channels=cfg.attn_head_dim(),
        max_position_embeddings=cfg.max_position_embeddings,
        seq_length=cfg.max_position_embeddings, layer_norm_epsilon=cfg.norm_eps, rotary_emb_base=cfg.rope_theta,
        rotary_pct=1.0, no_bias=not cfg.bias, tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std, use_dynamic_ntk=False, use_logn_attn=False, use_long_sequence_strategies=False,
        use_flash_attention=False, use_fused_rms_norm=False, use_fused_rope=False)
    return out, notes


# (our canonical name inside a block, PaddleNLP name inside `qwen.h.{i}.`) of the unfused linears
LINEARS = (("attn.o_proj", "attn.c_proj"), ("mlp.gate_proj", "mlp.w2"), ("mlp.up_proj", "mlp.w1"),
           ("mlp.down_proj", "mlp.c_proj"))


def to_canonical(src: SourceTensors, cfg: ModelConfig) -> tuple[dict[str, np.ndarray], ModelConfig, list[str]]:
    """Our canonical state from PaddleNLP Qwen tensors, the config with the tie settled, and notes."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    state: dict[str, np.ndarray] = {}
    notes: list[str] = []

    put = functools.partial(src.take_into, state)  # put(canon, key, shape)

    put("embed.word.weight", "qwen.wte.weight", [v, h])
    for i in range(cfg.num_layers):
        p, c = f"qwen.h.{i}.", f"layers.{i}."
        put(f"{c}attn_norm.weight", f"{p}ln_1.weight", [h])
        put(f"{c}mlp_norm.weight", f"{p}ln_2.weight", [h])
        w = src.take(p + "attn.c_attn.weight", [h, 3 * h])
        if w is not None:
            w = np.asarray(w)  # [h, 3h]: q | k | v
            for j, n in enumerate("qkv"):
                state[f"{c}attn.{n}_proj.weight"] = np.ascontiguousarray(w[:, j * h:(j + 1) * h])
        b = src.take(p + "attn.c_attn.bias", [3 * h])
        if b is not None:
            b = np.asarray(b)
            for j, n in enumerate("qkv"):
                state[f"{c}attn.{n}_proj.bias"] = np.ascontiguousarray(b[j * h:(j + 1) * h])
        for ours, theirs in LINEARS:
            n_in, n_out = (f, h) if ours == "mlp.down_proj" else (h, f) if ours.startswith("mlp") else (h, h)
            put(f"{c}{ours}.weight", f"{p}{theirs}.weight", [n_in, n_out])
            if cfg.bias:
                put(f"{c}{ours}.bias", f"{p}{theirs}.bias", [n_out])
        buf = p + "attn.rotary_emb.inv_freq"
        if src.has(buf):
            src.ignore(buf, "rotary inv_freq buffer (recomputed from rotary_emb_base)")
    put("final_norm.norm.weight", "qwen.ln_f.weight", [h])
    tie = cfg.tie_embeddings
    head = src.take("lm_head.weight", [h, v]) if (src.has("lm_head.weight") or not tie) else None
    word = state.get("embed.word.weight")
    if tie and head is not None and word is not None and not np.array_equal(np.asarray(head), np.asarray(word).T):
        tie = False
        notes.append("tie_word_embeddings=true but lm_head.weight differs from the embedding: PaddleNLP 2.8.1 "
                     "computes with the separate lm_head.weight, so we import an untied model")
    if not tie and head is not None:
        state["lm_head.proj.weight"] = head
    return state, dataclasses.replace(cfg, tie_embeddings=tie), notes


def from_canonical(state: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """PaddleNLP QWenForCausalLM tensors from our canonical state (already checked against `cfg`)."""
    out = {"qwen.wte.weight": state["embed.word.weight"]}
    for i in range(cfg.num_layers):
        p, c = f"qwen.h.{i}.", f"layers.{i}."
        out[f"{p}ln_1.weight"] = state[f"{c}attn_norm.weight"]
        out[f"{p}ln_2.weight"] = state[f"{c}mlp_norm.weight"]
        out[f"{p}attn.c_attn.weight"] = np.concatenate([state[f"{c}attn.{n}_proj.weight"] for n in "qkv"], axis=1)
        out[f"{p}attn.c_attn.bias"] = np.concatenate([state[f"{c}attn.{n}_proj.bias"] for n in "qkv"])
        for ours, theirs in LINEARS:
            out[f"{p}{theirs}.weight"] = state[f"{c}{ours}.weight"]
            if cfg.bias:
                out[f"{p}{theirs}.bias"] = state[f"{c}{ours}.bias"]
    out["qwen.ln_f.weight"] = state["final_norm.norm.weight"]
    out["lm_head.weight"] = (np.ascontiguousarray(state["embed.word.weight"].T) if cfg.tie_embeddings
                             else state["lm_head.proj.weight"])
    return out


# ------------------------------------------------------------------ LoRA adapters (paddlenlp.peft)

def lora_module_map(cfg: ModelConfig) -> dict[str, str]:
    """{our canonical linear: PaddleNLP module} for the unfused linears (q/k/v go through `c_attn`)."""
    return {f"layers.{i}.{ours}": f"qwen.h.{i}.{theirs}" for i in range(cfg.num_layers) for ours, theirs in LINEARS}


def lora_to_paddlenlp(adapters: dict, cfg: ModelConfig, rank: int) -> tuple[dict[str, np.ndarray], int, list[str]]:
    """({PaddleNLP adapter name: array}, the file's rank, adapted PaddleNLP modules) for our canonical adapters
    ({`layers.0.attn.q_proj.lora_A`: [h, r], ...}); see the module docstring for the stacked c_attn form."""
    h, names = cfg.hidden_size, lora_module_map(cfg)
    adapted_qkv = {}  # layer -> [n for n in "qkv" adapted]
    for key in adapters:
        module, factor = key.rsplit(".", 1)
        if factor not in ("lora_A", "lora_B"):
            raise UnsupportedConfig(f"adapter {key}: not a lora_A/lora_B tensor")
        parts = module.split(".")
        if len(parts) == 4 and parts[2] == "attn" and parts[3] in ("q_proj", "k_proj", "v_proj"):
            adapted_qkv.setdefault(int(parts[1]), set()).add(parts[3][0])
        elif module not in names:
            raise UnsupportedConfig(f"adapter {key}: no PaddleNLP Qwen module for it")
    n = max((len(s) for s in adapted_qkv.values()), default=1)
    if any(len(s) != n for s in adapted_qkv.values()):
        raise UnsupportedConfig("Qwen LoRA export: every layer must adapt the same number of q/k/v projections "
                                f"(found {sorted((i, sorted(s)) for i, s in adapted_qkv.items())})")
    big = n * rank
    out, modules = {}, []
    for i, which in sorted(adapted_qkv.items()):
        a = np.zeros([h, big], np.float32)
        b = np.zeros([big, 3 * h], np.float32)
        for slot, proj in enumerate(sorted(which, key="qkv".index)):
            col = "qkv".index(proj)
            a[:, slot * rank:(slot + 1) * rank] = np.asarray(adapters[f"layers.{i}.attn.{proj}_proj.lora_A"])
            b[slot * rank:(slot + 1) * rank, col * h:(col + 1) * h] = np.asarray(
                adapters[f"layers.{i}.attn.{proj}_proj.lora_B"])
        out[f"qwen.h.{i}.attn.c_attn.lora_A"], out[f"qwen.h.{i}.attn.c_attn.lora_B"] = a, b
        modules.append(f"qwen.h.{i}.attn.c_attn")
    for key, arr in sorted(adapters.items()):
        module, factor = key.rsplit(".", 1)
        if module not in names:
            continue
        arr = np.asarray(arr, dtype=np.float32)
        pad = big - rank
        arr = np.pad(arr, ((0, 0), (0, pad))) if factor == "lora_A" else np.pad(arr, ((0, pad), (0, 0)))
        out[f"{names[module]}.{factor}"] = arr
        if factor == "lora_A":
            modules.append(names[module])
    return out, big, modules


def lora_from_paddlenlp(tensors: dict, cfg: ModelConfig) -> tuple[dict[str, np.ndarray], list[str]]:
    """({our canonical adapter name: array}, unexpected names) of PaddleNLP Qwen adapter tensors."""
    h, theirs = cfg.hidden_size, {v: k for k, v in lora_module_map(cfg).items()}
    state, unexpected = {}, []
    for key, arr in tensors.items():
        module, _, factor = key.rpartition(".")
        arr = np.asarray(arr, dtype=np.float32)
        if factor not in ("lora_A", "lora_B"):
            unexpected.append(key)
        elif module.endswith(".attn.c_attn") and module.startswith("qwen.h."):
            i = module.split(".")[2]
            for j, n in enumerate("qkv"):
                piece = arr if factor == "lora_A" else np.ascontiguousarray(arr[:, j * h:(j + 1) * h])
                state[f"layers.{i}.attn.{n}_proj.{factor}"] = piece
        elif module in theirs:
            state[f"{theirs[module]}.{factor}"] = arr
        else:
            unexpected.append(key)
    return state, unexpected
