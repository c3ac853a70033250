"""What context parallelism (`parallel.cp`) needs of the model and the data, checked without paddle.

    python -m pytest tests/parallel/test_context.py -q -k problems
    problems = context_problems(cfg.parallel, cfg.model, cfg.data.seq_len)

`llmtrain.parallel.context` (the plan itself) re-exports it; the planner reads it from here so that a ranking
never imports paddle.
"""
from __future__ import annotations


def context_problems(parallel, model, seq_len: int, document_mask: bool = False, on_gpu: bool = False) -> list[str]:
    """What `parallel.cp` needs of the model and data, with the numbers (empty when cp == 1)."""
    cp = getattr(parallel, "cp", 1) if parallel is not None else 1
    if cp <= 1:
        return []
    problems = []
    if model.family != "decoder":
        problems.append(f"parallel.cp={cp} with model.family={model.family}: context parallelism is implemented for "
                        "the causal decoder only")
    if seq_len % (2 * cp):
        problems.append(f"data.seq_len={seq_len} is not divisible by 2 x parallel.cp = {2 * cp} (each rank holds two "
                        "of the 2·cp equal chunks of a sequence)")
    elif parallel.sequence_parallel and (seq_len // cp) % parallel.tp:
        problems.append(f"parallel.sequence_parallel=true with parallel.cp={cp}: a rank's {seq_len // cp} positions "
                        f"(data.seq_len={seq_len} / cp) are not divisible by parallel.tp={parallel.tp}")
    if parallel.cp_comm == "a2a":
        kv = model.num_kv_heads or model.num_heads
        for fname, heads in (("model.num_heads", model.num_heads), ("model.num_kv_heads", kv)):
            if heads % parallel.tp == 0 and (heads // parallel.tp) % cp:
                problems.append(f"parallel.cp_comm=a2a: {fname}={heads} / parallel.tp={parallel.tp} = "
                                f"{heads // parallel.tp} heads per tp rank is not divisible by parallel.cp={cp} "
                                "(the all-to-all gives each cp rank heads/cp of them); use cp_comm=ring or allgather")
    if getattr(model, "sliding_window", 0) > 0 and parallel.cp_comm != "a2a":
        problems.append(f"model.sliding_window={model.sliding_window} with parallel.cp_comm={parallel.cp_comm}: the "
                        "ring and all-gather blocks take no window; use cp_comm=a2a (the model's own core sees the "
                        "whole sequence)")
    if getattr(model, "moe_num_experts", 0) > 0:
        problems.append(f"parallel.cp={cp} with model.moe_num_experts={model.moe_num_experts}: Mixture-of-Experts under "
                        f"context parallelism is not implemented: each cp rank would route only its {seq_len // cp} of "
                        f"the {seq_len} positions of a sequence, so the capacity C = ceil(factor x T x top_k / E), the "
                        "balancing losses' f_i and P_i and the auxiliary-loss-free bias's counts would be computed "
                        f"over 1/{cp} of each micro-batch's tokens T instead of all of them (they need summing over "
                        "the cp group inside the MoE layer); use parallel.cp=1 (with ep, tp or pp) for MoE models")
    if parallel.cp_comm == "ring" and document_mask and on_gpu:
        problems.append(f"parallel.cp_comm=ring with data.document_mask=true on GPU: the ring's flash attention "
                        "blocks take no per-document mask; use cp_comm=allgather or a2a (flashmask)")
    return problems
