"""LoRA in the trainer: adapters trained, base frozen and outside the optimizer, adapters initialised.

    python llmtrain/finetune.py model.init_from=PADDLENLP_DIR finetune.lora.rank=8 data.files=[chat.jsonl] ...

`split_adapters` cuts this rank's canonical parameters into the adapters (what the
optimizer, the gradient clip and the checkpoints hold) and the base (frozen with
`stop_gradient`, so no gradient is allocated for it and the optimizer never sees it).
A checkpoint of a LoRA run therefore stores the adapters and their optimizer state
alone; the base is named by the run's config in its manifest (`model.init_from`, or
the seed when the base was initialised from (seed, name)), and a resume or an export
rebuilds it from there. The adapters start from (seed, canonical name) draws (A) and
zeros (B), or from a PaddleNLP adapter directory (`finetune.lora.init_from`).
"""
from __future__ import annotations

from llmtrain.models.init import init_parameters, load_full_state
from llmtrain.models.lora import is_adapter
from llmtrain.utils.log import log0


def split_adapters(named: list) -> tuple[list, list]:
    """(adapters, base) of (canonical name, parameter) pairs; the base is frozen."""
    adapters = [(n, p) for n, p in named if is_adapter(n)]
    base = [(n, p) for n, p in named if not is_adapter(n)]
    for _, p in base:
        p.stop_gradient = True
    return adapters, base


def no_adapter_problem(adapters: list, pp_rank: int, pp: int, targets) -> str | None:
    """The refusal of a rank whose pipeline stage holds no adapter (None: it holds some). Paddle 3.3.1's optimizers
    index their parameter list's first entry (optimizer/adamw.py, AdamW.step, line 662: IndexError on an empty list)
    and fleet's pipeline buckets (parallel.dp_comm_overlap, pp_sharding_comm_overlap) stop at a chunk with no
    trainable parameter (meta_parallel/pipeline_parallel.py, lines 974-977), then assert 'comm buffers should be
    created' (line 1265); measured on CPU: a Llama of 8 blocks under pp2 with adapters on blocks 0-3 only."""
    if adapters:
        return None
    return (f"finetune.lora.target_modules={list(targets)} adapt no linear on pipeline stage {pp_rank} of "
            f"parallel.pp={pp}: a stage without a trainable parameter is not served by Paddle 3.3.1's optimizer "
            "(AdamW.step reads its first parameter) nor by fleet's pipeline buckets; adapt a linear in every stage's "
            "blocks, or move the split (parallel.pp_layers)")


def init_adapters(adapters: list, base: list, run, slices) -> None:
    """Adapters from `run.initial_adapters` (a PaddleNLP adapter directory) or from (seed, canonical name)."""
    cfg = run.cfg
    if getattr(run, "initial_adapters", None) is not None:
        load_full_state(adapters, run.initial_adapters, slices, source=cfg.finetune.lora.init_from)
    else:
        init_parameters(adapters, cfg.model, cfg.seed, slices)
    n_ad = sum(int(p.size) for _, p in adapters)
    n_base = sum(int(p.size) for _, p in base)
    log0(f"LoRA r={cfg.finetune.lora.rank} alpha={cfg.finetune.lora.alpha}: {len(adapters) // 2} adapted linears on "
         f"this rank, {n_ad} trainable parameters, {n_base} frozen ({100.0 * n_ad / max(n_ad + n_base, 1):.3f}% "
         f"trainable)")
