"""LoRA over the whole model: which linears a `finetune.lora` adapts, the adapters' size, and its problems.

    python -m pytest tests/train/test_lora.py -q
    problems = lora_problems(cfg.model, cfg.finetune.lora, tp)      # gathered by llmtrain.resolve
    n = adapter_numel(cfg.model, cfg.finetune.lora)                 # r (in + out) per adapted linear

These questions need the whole model (built lazily, nothing allocated), so they live
apart from `llmtrain.models.lora`, which the layer factory uses while a model is built.
"""
from __future__ import annotations

import re

from llmtrain.contracts import tags
from llmtrain.models.lora import LoraConfig, linear_modules, matching


def lora_targets(model_cfg, cfg: LoraConfig) -> tuple[dict, list[str]]:
    """({adapted module name: (in, out) full sizes}, all linear names) of the whole model, without allocating it."""
    from llmtrain.models import build_model, shape_only

    with shape_only():
        model = build_model(model_cfg)
    sizes = {n: tuple(tags.linear_of(layer)[1:]) for n, layer in linear_modules(model)}
    return {n: sizes[n] for n in matching(list(sizes), list(cfg.target_modules))}, list(sizes)


def adapter_numel(model_cfg, cfg: LoraConfig) -> int:
    """Elements of all adapters of the whole model: r (in + out) per adapted linear (0 without LoRA)."""
    if cfg.rank <= 0:
        return 0
    return sum(cfg.rank * (i + o) for i, o in lora_targets(model_cfg, cfg)[0].values())


def lora_problems(model_cfg, cfg: LoraConfig, tp: int) -> list[str]:
    """Problems of `finetune.lora` for this model and tensor-parallel degree (empty: fine)."""
    if cfg.rank < 0:
        return [f"finetune.lora.rank={cfg.rank}: must be >= 0 (0: off)"]
    if cfg.rank == 0:
        return [] if cfg.init_from is None else [
            f"finetune.lora.init_from={cfg.init_from} needs finetune.lora.rank > 0 (it is read from the directory's "
            "lora_config.json, so any positive value)"]
    problems = []
    if cfg.alpha <= 0:
        problems.append(f"finetune.lora.alpha={cfg.alpha}: must be > 0")
    if not 0 <= cfg.dropout < 1:
        problems.append(f"finetune.lora.dropout={cfg.dropout}: must be in [0, 1)")
    if cfg.dropout > 0 and tp > 1:
        problems.append(f"finetune.lora.dropout={cfg.dropout} with parallel.tp={tp}: the dropout masks of an input "
                        "replicated over tp ranks would differ between ranks; not implemented, use dropout=0")
    for p in cfg.target_modules:
        try:
            re.compile(p)
        except re.error as e:
            problems.append(f"finetune.lora.target_modules: {p!r} is not a regular expression ({e})")
    if problems:
        return problems
    hit, names = lora_targets(model_cfg, cfg)
    if not hit:
        problems.append(f"finetune.lora.target_modules={list(cfg.target_modules)} match none of the model's "
                        f"{len(names)} linears (e.g. {', '.join(names[:4])})")
    return problems
