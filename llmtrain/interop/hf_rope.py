"""Hugging Face RoPE settings (`rope_scaling`, transformers 5's `rope_parameters`) <-> model.rope_scaling, shared by
every HF family's config mapping (`hf_config.py` for Llama/Qwen, `deepseek.py` for DeepSeek-V2/V3).

    python -m pytest tests/interop/test_hf_qwen3.py tests/interop/test_deepseek.py -q
    rope, max_pos = rope_from_hf(config["rope_scaling"], config["max_position_embeddings"], bad, notes)

Types read: default, linear, dynamic, yarn, llama3 (see `llmtrain/models/rope.py`); longrope and others are refused.
"""
from __future__ import annotations

from llmtrain.models.config import ModelConfig, RopeScaling

ROPE_TYPES = {"linear": "linear", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3"}
_ROPE_KEYS = {"linear": ("factor",), "dynamic": ("factor",),
              "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                       "mscale_all_dim", "attention_factor", "truncate"),
              "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}


def rope_params(c: dict, g: dict) -> tuple[float, dict | None]:
    """(rope_theta, the scaling dict or None) from `rope_scaling` or transformers 5's `rope_parameters`."""
    theta, scaling = g["rope_theta"], g["rope_scaling"]
    params = c.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    return float(theta), scaling


def rope_from_hf(scaling: dict | None, max_pos: int, bad: list, notes: list) -> tuple[RopeScaling, int]:
    """(model.rope_scaling, our max_position_embeddings) for a HF scaling dict (problems appended to `bad`)."""
    if not scaling:
        return RopeScaling(), max_pos
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return RopeScaling(), max_pos
    if kind not in ROPE_TYPES:
        bad.append(f"rope_scaling={scaling!r}: rope_type {kind!r} is not implemented (linear, dynamic, yarn, llama3 are)")
        return RopeScaling(), max_pos
    extra = sorted(set(scaling) - {"rope_type", "type", "rope_theta", *_ROPE_KEYS[kind]})
    if extra:
        bad.append(f"rope_scaling fields {extra} are not used by {kind} RoPE here (refused rather than ignored)")
    r = {k: scaling[k] for k in _ROPE_KEYS[kind] if scaling.get(k) is not None}
    if "factor" not in r:
        bad.append(f"rope_scaling={scaling!r}: no factor")
        return RopeScaling(), max_pos
    for key in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "low_freq_factor",
                "high_freq_factor"):
        if key in r:
            r[key] = float(r[key])
    if kind == "dynamic":  # transformers' reference length is max_position_embeddings; the model reaches s x it
        r["original_max_position_embeddings"] = max_pos
        grown = int(max_pos * r["factor"])
        notes.append(f"rope_scaling dynamic (factor {r['factor']}): NTK scaling past max_position_embeddings="
                     f"{max_pos}; model.max_position_embeddings set to {grown}")
        return RopeScaling(type=kind, **r), grown
    if kind == "llama3" and "original_max_position_embeddings" not in r:
        bad.append("rope_scaling llama3 without original_max_position_embeddings")
        return RopeScaling(), max_pos
    given = "original_max_position_embeddings" in r
    r.setdefault("original_max_position_embeddings", max_pos)
    if kind == "yarn" and given and max_pos != r["original_max_position_embeddings"] * r["factor"]:
        notes.append(f"rope_scaling yarn: factor {r['factor']} used as given (transformers 4.4x-4.5x used "
                     f"max_position_embeddings / original_max_position_embeddings = "
                     f"{max_pos / r['original_max_position_embeddings']:g} when both were set)")
    return RopeScaling(type=kind, **{k: int(v) if k == "original_max_position_embeddings" else v
                                    for k, v in r.items()}), max_pos


def rope_to_hf(cfg: ModelConfig) -> tuple[dict | None, int]:
    """(config.json `rope_scaling` dict or None, its max_position_embeddings) for our model.rope_scaling."""
    r = cfg.rope_scaling
    if r.type == "none":
        return None, cfg.max_position_embeddings
    out = {"rope_type": r.type, "factor": r.factor}
    if r.type == "dynamic":  # its reference length is config.json's max_position_embeddings
        return out, r.original_max_position_embeddings or cfg.max_position_embeddings
    out["original_max_position_embeddings"] = r.original_max_position_embeddings or cfg.max_position_embeddings
    if r.type == "yarn":
        out.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow)
        if not r.truncate:
            out["truncate"] = False
        if r.mscale or r.mscale_all_dim:
            out.update(mscale=r.mscale, mscale_all_dim=r.mscale_all_dim)
        if r.attention_factor is not None:
            out["attention_factor"] = r.attention_factor
    if r.type == "llama3":
        out.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    return out, cfg.max_position_embeddings
