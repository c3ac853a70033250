"""Checks of the attention and routing fields that need no model built (paddle-free: the planner's path).

    python -m pytest tests/models/test_mla.py -q
    problems = mla_problems(cfg.model) + group_problems(cfg.model)

`llmtrain.models.mla` and `llmtrain.models.router` (which build the layers these fields describe) re-export them;
`llmtrain.parallel.layout.model_fit_problems` reads them from here so that a ranking never imports paddle.
"""
from __future__ import annotations


def mla_problems(model, sequence_parallel: bool = False) -> list[str]:
    """The `model.mla_*` fields fit together and with the layout (empty: fine; nothing to check without MLA)."""
    if not getattr(model, "mla_kv_lora_rank", 0):
        return []
    problems = []
    for name in ("mla_kv_lora_rank", "mla_qk_rope_head_dim", "mla_v_head_dim"):
        if getattr(model, name) <= 0:
            problems.append(f"model.{name}={getattr(model, name)}: must be > 0 with multi-head latent attention")
    if model.mla_qk_rope_head_dim % 2:
        problems.append(f"model.mla_qk_rope_head_dim={model.mla_qk_rope_head_dim}: the rotary part must be even")
    if model.mla_qk_nope_head_dim < 0:
        problems.append(f"model.mla_qk_nope_head_dim={model.mla_qk_nope_head_dim}: must be >= 0")
    if model.mla_q_lora_rank is not None and model.mla_q_lora_rank <= 0:
        problems.append(f"model.mla_q_lora_rank={model.mla_q_lora_rank}: must be > 0, or null for one q_proj")
    if model.family != "decoder" or model.position != "rope":
        problems.append(f"model.mla_kv_lora_rank={model.mla_kv_lora_rank} (multi-head latent attention) needs "
                        f"model.family=decoder and position=rope (have {model.family}, {model.position})")
    if model.num_kv_heads not in (None, model.num_heads):
        problems.append(f"model.num_kv_heads={model.num_kv_heads} with multi-head latent attention: every head has "
                        "its own keys and values from c_kv; set num_kv_heads=null")
    for name, value, why in (("qk_norm", model.qk_norm, "MLA's own norms are on the compressed vectors"),
                             ("sliding_window", model.sliding_window, "not implemented for MLA"),
                             ("head_dim", model.head_dim, "MLA's widths are mla_qk_nope/rope_head_dim and "
                                                          "mla_v_head_dim")):
        if value:
            problems.append(f"model.{name}={value} with multi-head latent attention: {why}")
    if sequence_parallel:
        problems.append("parallel.sequence_parallel=true with multi-head latent attention (model.mla_kv_lora_rank > "
                        "0): not implemented (the replicated down-projections would see sequence shards)")
    return problems


def group_problems(model) -> list[str]:
    """`moe_n_group` / `moe_topk_group` / `moe_group_score` fit the experts and top_k (empty: fine)."""
    e, g, keep = model.moe_num_experts, model.moe_n_group, model.moe_topk_group
    if e <= 0 or (g == 1 and keep == 1):
        return []
    problems = []
    if g < 1 or e % g:
        return [f"model.moe_n_group={g}: must be >= 1 and divide model.moe_num_experts={e}"]
    if not 1 <= keep <= g:
        problems.append(f"model.moe_topk_group={keep}: must be in 1..model.moe_n_group={g}")
    elif model.moe_top_k > keep * (e // g):
        problems.append(f"model.moe_top_k={model.moe_top_k} > model.moe_topk_group={keep} x {e // g} experts per "
                        "group: a token could not find its experts")
    if model.moe_group_score not in ("top2", "max"):
        problems.append(f"model.moe_group_score={model.moe_group_score!r}: expected 'top2' or 'max'")
    elif model.moe_group_score == "top2" and e // g < 2:
        problems.append(f"model.moe_group_score=top2 needs >= 2 experts per group (moe_num_experts={e}, "
                        f"moe_n_group={g})")
    return problems
