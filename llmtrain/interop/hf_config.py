"""Hugging Face `config.json` <-> ModelConfig for Llama, Qwen2, Qwen3 and Qwen3-MoE (the weights: `hf_format.py`).

    python -m pytest tests/interop/test_hf_format.py tests/interop/test_hf_qwen3.py -q
    cfg, notes = config_from_hf(json.load(open("Qwen3-8B/config.json")), "qwen3", "qwen3-8b", "Qwen3-8B/config.json")

What each family computes, read from `transformers`' `modeling_{llama,qwen2,qwen3,qwen3_moe}.py` and
`modeling_rope_utils.py`, and the ModelConfig fields that reproduce it:
  - all: pre-norm RMSNorm in fp32 (`rms_norm_eps`), SwiGLU (`hidden_act` silu only), RoPE rotate-half with
    `rope_theta` (transformers 5 keeps it in `rope_parameters`), grouped-query attention; heads of `head_dim`
    when config.json has one (Qwen3's default 128), else hidden_size / num_attention_heads;
  - `rope_scaling` / `rope_parameters` (`rope_type` or the older `type`): default, linear, dynamic, yarn, llama3
    -> model.rope_scaling (see `llmtrain/models/rope.py`); dynamic's reference length is max_position_embeddings,
    and the model then runs up to factor x that (our max_position_embeddings); yarn/llama3 take
    `original_max_position_embeddings` (yarn: max_position_embeddings when absent). longrope and others: refused;
  - Qwen2: bias on q, k, v only; Qwen3 / Qwen3-MoE: `attention_bias` (q, k, v and o) and RMSNorm on each q/k
    head before RoPE (`q_norm`, `k_norm` [head_dim]: our qk_norm); Llama: `attention_bias` and `mlp_bias`,
    both or neither;
  - sliding windows: Qwen2/Qwen3 use `sliding_window` on the blocks `layer_types` marks "sliding_attention"
    (without layer_types: blocks >= max_window_layers, only when `use_sliding_window`); Qwen3-MoE (transformers
    5) on every block when `use_sliding_window` (a `max_window_layers` below the layer count is refused: older
    versions windowed only the upper blocks). A window query t sees keys t-W+1..t;
  - Qwen3-MoE: every block's FFN is a router `gate` [E, h] (softmax in fp32, top `num_experts_per_tok`,
    renormalised when `norm_topk_prob`) over `num_experts` SwiGLU experts of `moe_intermediate_size`, dropless,
    no shared expert; `mlp_only_layers` equal to the first k blocks (decoder_sparse_step 1) is our
    moe_first_dense_layers = k, any other placement is refused. The balancing loss enters transformers' loss
    only with `output_router_logits` (default false): then router_aux_loss_coef x the aux loss pooled over all
    layers (`load_balancing_loss_func`, our moe_aux_loss_scope=model), else coefficient 0 (what it computes).
    With an attention_mask transformers leaves padded positions out of that aux loss; ours counts every position.
"""
from __future__ import annotations

from llmtrain.interop.hf_rope import rope_from_hf, rope_params, rope_to_hf
from llmtrain.interop.keys import UnsupportedConfig, switch_mismatches
from llmtrain.models.config import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
_COMMON = dict(hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
               tie_word_embeddings=False, head_dim=None)
_QWEN_WINDOW = dict(use_sliding_window=False, sliding_window=4096, max_window_layers=28, layer_types=None)
DEFAULTS = {  # transformers' config defaults for the fields we read
    "llama": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
                  attention_bias=False, mlp_bias=False),
    "qwen2": dict(_COMMON, **_QWEN_WINDOW, vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768),
    "qwen3": dict(_COMMON, **_QWEN_WINDOW, vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                  max_position_embeddings=32768, attention_bias=False),
    "qwen3_moe": dict(_COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768,
                      attention_bias=False, use_sliding_window=False, sliding_window=4096, decoder_sparse_step=1,
                      moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128, norm_topk_prob=False,
                      output_router_logits=False, router_aux_loss_coef=0.001, mlp_only_layers=None),
}
_QUIET = ("num_key_value_heads", "head_dim", "rope_scaling", "layer_types", "mlp_only_layers", "max_window_layers",
          "sliding_window")
def window_from_hf(c: dict, g: dict, family: str, layers: int, bad: list) -> tuple[int, list | None]:
    """(model.sliding_window, model.sliding_window_layers) of a Qwen config (see the module docstring)."""
    if family == "llama":
        return 0, None
    types = g.get("layer_types")
    if types is not None:
        if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
            bad.append(f"layer_types={types!r}: need {layers} entries of full_attention / sliding_attention")
            return 0, None
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        if not sliding:
            return 0, None
        if not g["sliding_window"]:
            bad.append("layer_types marks sliding_attention blocks but sliding_window is null")
            return 0, None
        return int(g["sliding_window"]), None if len(sliding) == layers else sliding
    if not g["use_sliding_window"] or not g["sliding_window"]:
        return 0, None
    if family == "qwen3_moe":
        if c.get("max_window_layers") is not None and c["max_window_layers"] < layers:
            bad.append(f"use_sliding_window with max_window_layers={c['max_window_layers']} < num_hidden_layers="
                       f"{layers}: transformers versions disagree on which Qwen3-MoE blocks are windowed")
            return 0, None
        return int(g["sliding_window"]), None
    first = int(g["max_window_layers"])
    sliding = list(range(first, layers))
    if not sliding:
        return 0, None
    return int(g["sliding_window"]), None if first == 0 else sliding


def window_to_hf(cfg: ModelConfig, family: str) -> dict:
    """config.json window fields for our sliding_window / sliding_window_layers (raises where not expressible)."""
    L, w = cfg.num_layers, cfg.sliding_window
    if w <= 0:
        out = dict(use_sliding_window=False, sliding_window=None)
        return out if family == "qwen3_moe" else dict(out, max_window_layers=L)
    sliding = list(range(L)) if cfg.sliding_window_layers is None else sorted(cfg.sliding_window_layers)
    if family == "qwen3_moe":
        if len(sliding) != L:
            raise UnsupportedConfig(f"model.sliding_window_layers={cfg.sliding_window_layers}: Qwen3-MoE windows "
                                    "every block or none")
        return dict(use_sliding_window=True, sliding_window=w)
    types = ["sliding_attention" if i in sliding else "full_attention" for i in range(L)]
    first = sliding[0] if sliding else L
    out = dict(use_sliding_window=True, sliding_window=w, layer_types=types)
    if sliding == list(range(first, L)):
        out["max_window_layers"] = first  # older transformers read this form (they ignore layer_types)
    return out


def _moe_layers(g: dict, layers: int, bad: list) -> int:
    """moe_first_dense_layers for Qwen3-MoE's mlp_only_layers / decoder_sparse_step."""
    only = sorted(g["mlp_only_layers"] or [])
    if int(g["decoder_sparse_step"]) != 1:
        bad.append(f"decoder_sparse_step={g['decoder_sparse_step']} (MoE on every block after the first dense ones "
                   "only)")
    if only != list(range(len(only))):
        bad.append(f"mlp_only_layers={only} (only the first k blocks may be dense)")
    return len(only)


def config_from_hf(c: dict, family: str, name: str, source: str) -> tuple[ModelConfig, list[str]]:
    """ModelConfig computing what transformers' `family` computes for config.json `c`, and notes."""
    g = {k: c.get(k, v) for k, v in DEFAULTS[family].items()}
    notes = [f"{k} absent from config.json: transformers' default {v!r} used" for k, v in DEFAULTS[family].items()
             if k not in c and k not in _QUIET]
    h, heads = g["hidden_size"], g["num_attention_heads"]
    kv = g["num_key_value_heads"] or heads
    theta, scaling = rope_params(c, g)
    bad: list[str] = []
    if g["hidden_act"] != "silu":
        bad.append(f"hidden_act={g['hidden_act']!r} (SwiGLU with silu only)")
    head_dim = g["head_dim"]  # transformers' attention reads config.head_dim when present (Qwen2's config omits it)
    if heads % kv:
        bad.append(f"num_attention_heads={heads} not divisible by num_key_value_heads={kv}")
    if head_dim is None and h % heads:
        bad.append(f"hidden_size={h} not divisible by num_attention_heads={heads} (and no head_dim)")
    rope, max_pos = rope_from_hf(scaling, int(g["max_position_embeddings"]), bad, notes)
    window, window_layers = window_from_hf(c, g, family, g["num_hidden_layers"], bad)
    bias, qkv_bias = False, True
    if family == "llama":
        if bool(g["attention_bias"]) != bool(g["mlp_bias"]):
            bad.append(f"attention_bias={g['attention_bias']}, mlp_bias={g['mlp_bias']} (our model.bias puts a bias "
                       "on every linear or none)")
        bias, qkv_bias = bool(g["attention_bias"]), None
    elif family in ("qwen3", "qwen3_moe"):
        if g["attention_bias"]:
            bad.append("attention_bias=true (a bias on q, k, v and o but not on the MLP: not expressible here)")
        qkv_bias = None
    moe = {}
    if family == "qwen3_moe":
        e, k = int(g["num_experts"]), int(g["num_experts_per_tok"])
        if not 1 <= k <= e:
            bad.append(f"num_experts_per_tok={k} with num_experts={e}")
        first_dense = _moe_layers(g, g["num_hidden_layers"], bad)
        aux = float(g["router_aux_loss_coef"]) if g["output_router_logits"] else 0.0
        if not g["output_router_logits"]:
            notes.append("output_router_logits=false: transformers' loss has no balancing term, so "
                         "model.moe_aux_loss_coef=0")
        moe = dict(moe_num_experts=e, moe_top_k=k, moe_ffn_hidden_size=int(g["moe_intermediate_size"]),
                   moe_first_dense_layers=first_dense, moe_router="softmax", moe_norm_topk=bool(g["norm_topk_prob"]),
                   moe_aux_loss_coef=aux, moe_aux_loss_scope="model" if aux else "layer", moe_z_loss_coef=0.0)
    if bad:
        raise UnsupportedConfig(f"{source}: Hugging Face {ARCHITECTURES[family]} config not supported: "
                                + "; ".join(bad))
    cfg = ModelConfig(
        name=name, hidden_size=h, num_layers=g["num_hidden_layers"], num_heads=heads,
        num_kv_heads=None if kv == heads else kv, head_dim=None if head_dim in (None, h // heads) else int(head_dim),
        ffn_hidden_size=g["intermediate_size"], vocab_size=g["vocab_size"], max_position_embeddings=max_pos,
        position="rope", rope_theta=theta, rope_scaling=rope, norm="rmsnorm", norm_eps=float(g["rms_norm_eps"]),
        activation="swiglu", bias=bias, qkv_bias=qkv_bias, qk_norm=family in ("qwen3", "qwen3_moe"),
        sliding_window=window, sliding_window_layers=window_layers, tie_embeddings=bool(g["tie_word_embeddings"]),
        init_std=float(g["initializer_range"]), **moe)
    return cfg, notes


def hf_family_for(cfg: ModelConfig) -> str:
    """The HF family our config is written as (`hf_format.hf_family` tells a directory's): MLA -> DeepSeek-V2/V3;
    MoE -> Qwen3-MoE; QK-norm
    -> Qwen3; q/k/v-only bias -> Qwen2, otherwise Llama."""
    if cfg.is_mla():  # multi-head latent attention: DeepSeek-V2/V3 (`llmtrain.interop.deepseek`)
        from llmtrain.interop.deepseek import hf_family_of

        return hf_family_of(cfg)
    if cfg.moe_num_experts:
        return "qwen3_moe"
    if cfg.qk_norm:
        return "qwen3"
    return "qwen2" if cfg.has_qkv_bias() and not cfg.bias else "llama"


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json fields of the HF family computing what `cfg` computes (raises UnsupportedConfig)."""
    wants = (("position", "rope"), ("norm", "rmsnorm"), ("activation", "swiglu"), ("norm_position", "pre"))
    family = hf_family_for(cfg)
    arch = ARCHITECTURES[family]
    bad = switch_mismatches(cfg, "decoder", arch, family, wants)
    if family == "llama" and cfg.has_qkv_bias() != cfg.bias:
        bad.append(f"model.bias={cfg.bias}, qkv_bias={cfg.qkv_bias} (HF Llama's attention_bias covers q, k, v and o)")
    if family in ("qwen3", "qwen3_moe") and (cfg.bias or cfg.has_qkv_bias()):
        bad.append(f"model.bias={cfg.bias}, qkv_bias={cfg.qkv_bias} (Qwen3's attention_bias would also bias o; "
                   "its MLP has none)")
    if family == "llama" and cfg.sliding_window:
        bad.append(f"model.sliding_window={cfg.sliding_window} (HF Llama has no sliding window)")
    if family == "qwen3_moe":
        moe_wants = (("moe_router", "softmax"), ("moe_num_shared_experts", 0), ("moe_capacity_factor", 0.0),
                     ("moe_routed_scale", 1.0), ("moe_z_loss_coef", 0.0))
        bad += [f"model.{k}={getattr(cfg, k)!r} (Qwen3-MoE has {v!r})" for k, v in moe_wants if getattr(cfg, k) != v]
    if bad:
        raise UnsupportedConfig(f"model {cfg.name!r} cannot be written as a Hugging Face {arch}: " + "; ".join(bad))
    scaling, max_pos = rope_to_hf(cfg)
    out = dict(architectures=[arch], model_type=family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
               intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
               num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads(), hidden_act="silu",
               max_position_embeddings=max_pos, initializer_range=cfg.init_std, rms_norm_eps=cfg.norm_eps,
               rope_theta=cfg.rope_theta, rope_scaling=scaling, tie_word_embeddings=cfg.tie_embeddings,
               torch_dtype="float32", use_cache=True)
    if family == "llama":
        out.update(attention_bias=cfg.bias, mlp_bias=cfg.bias, head_dim=cfg.attn_head_dim())
    else:
        if cfg.head_dim is not None:
            out["head_dim"] = cfg.attn_head_dim()
        out.update(window_to_hf(cfg, family))
    if family in ("qwen3", "qwen3_moe"):
        out.update(attention_bias=False, head_dim=cfg.attn_head_dim(), attention_dropout=0.0)
    if family == "qwen3_moe":
        out.update(num_experts=cfg.moe_num_experts, num_experts_per_tok=cfg.moe_top_k,
                   moe_intermediate_size=cfg.expert_ffn_size(), norm_topk_prob=cfg.moe_norm_topk,
                   decoder_sparse_step=1, mlp_only_layers=list(range(cfg.moe_first_dense_layers)),
                   output_router_logits=bool(cfg.moe_aux_loss_coef) and cfg.moe_aux_loss_scope == "model",
                   router_aux_loss_coef=cfg.moe_aux_loss_coef or 0.001)
    return out


def export_notes(cfg: ModelConfig, family: str) -> list[str]:
    """What an export of `cfg` as `family` writes differently from what the run trained (training-only settings)."""
    if family == "qwen3_moe" and cfg.moe_aux_loss_coef and cfg.moe_aux_loss_scope == "layer":
        return [f"the run averaged its balancing loss per layer (moe_aux_loss_scope=layer); Qwen3-MoE pools it over "
                f"the layers, so config.json has output_router_logits=false, as the released configs do "
                f"(router_aux_loss_coef={cfg.moe_aux_loss_coef} kept); the logits are exact"]
    return []
