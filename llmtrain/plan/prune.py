"""Memory first: a lower bound of a pipeline layout's worst-rank memory over every split of its blocks, so that a
ranking prices the default (cost-balanced) split only for layouts that might fit.

    python -m llmtrain.plan model=deepseek-v3 plan.device=h800 plan.devices=256 train.global_batch_size=4096 data.seq_len=4096
    bound = split_free_bound(model_cfg, layout, seq_len=4096, mode="full", amp="bf16", device="gpu", dev=profile)

`llmtrain.plan.estimate.memory_estimate` prices a pipeline stage s holding b_s blocks (its chunks' blocks) as its
worst rank's parameters, gradients and optimizer states plus flight_s micro-batches of its blocks' activations
(`estimate.in_flight`; under DualPipeV each block at least `dualpipe_memory.v_least_flight`, whichever of the stage's
two chunks holds it), the embedding's holdings on stage 0, the head's and the logits on the last (DualPipeV: on
stage 0), the
framework margin on every one. Each block adds at least u_s = the least, over the model's blocks, of (its
parameters + gradients + optimizer states / the ranks sharing them + flight_s x its saved bytes, or under full
recompute flight_s x its kept input): the worst rank of a stage holds at least the average of its ranks, and
sharded states average to 1/sharding (dense) and 1/edp (experts sharded over the expert-data-parallel group). With
F_s the stage's fixed part (ends, margin, one block's full set under full recompute: on the last stage the larger
of it and the logits', which are alive at other times), every split has
max_s (F_s + u_s b_s) >= C, the least value with sum_s max(0, (C - F_s) / u_s) >= L (the blocks relaxed to real
numbers summing to L): a layout whose bound exceeds the device's memory fits under no split and is not priced.
"""
from __future__ import annotations

from llmtrain.plan.dualpipe_memory import v_least_flight
from llmtrain.plan.estimate import activation_parts, in_flight, moe_blocks
from llmtrain.plan.memory import _local_entries, _opt_elems, _spec_list

_PARTS: dict = {}


def _held(cfg, layout, amp: str) -> tuple[list, float, float]:
    """([least per-rank bytes of block i's parameters, gradients and states], the embedding's, the head's)."""
    ep = getattr(layout, "ep", 1)
    sh = layout.sharding
    edp = layout.dp * sh // ep if ep > 1 else 1
    key = (id(cfg), amp, layout.tp, ep, sh, edp)
    hit = _PARTS.get(key)
    if hit is not None and hit[0] is cfg:
        return hit[1]
    sums = _chunk_sums(cfg, layout.tp, ep, amp)
    e_share = (edp if sh > 1 else 1) if ep > 1 else sh  # the experts' states: over edp (sharded) or whole
    per = {c: fixed + 4 * dense_opt / sh + 4 * expert_opt / e_share for c, (fixed, dense_opt, expert_opt) in sums.items()}
    out = ([per.get(i, 0.0) for i in range(cfg.num_layers)], per.get("first", 0.0), per.get("last", 0.0))
    _PARTS[key] = (cfg, out)
    return out


_SUMS: dict = {}


def _chunk_sums(cfg, tp: int, ep: int, amp: str) -> dict:
    """{chunk: (bytes of its parameters and gradients on a rank, optimizer elements of its dense parameters, of its
    routed experts' (ep > 1))}, exact integers, per model and (tp, ep, precision): `_held` divides the optimizer
    elements by the ranks sharing them."""
    key = (id(cfg), tp, ep, amp)
    hit = _SUMS.get(key)
    if hit is not None and hit[0] is cfg:
        return hit[1]
    sums: dict = {}
    for s, n, b in _local_entries(_spec_list(cfg, None), tp, ep, amp)[0]:  # elements on a rank, bytes each
        trained = s.trainable and not s.frozen
        fixed, dense_opt, expert_opt = sums.get(s.chunk, (0, 0, 0))
        opt = _opt_elems(n, b == 2, not trained)
        sums[s.chunk] = (fixed + n * b + (n * b if trained else 0), dense_opt + (0 if ep > 1 and s.expert else opt),
                         expert_opt + (opt if ep > 1 and s.expert else 0))
    _SUMS[key] = (cfg, sums)  # the model kept alive with its id
    return sums


def split_free_bound(cfg, layout, *, seq_len: int, mode: str, amp: str, device: str, dev,
                     moe_imbalance: float | None = None) -> float:
    """Bytes the worst rank of `layout` (pp > 1) holds at least, whatever its split (module docstring). `mode`:
    none, full, or `parts` (any recompute of parts of blocks: each block keeps at least its input, as under full,
    and no block's full set is counted)."""
    ep = getattr(layout, "ep", 1)
    dualpipev = getattr(layout, "pp_schedule", "1f1b") == "dualpipev"
    # what the bound reads: the degrees and sizes `_held` and `activation_parts` key on, the pipeline's shape (ZeRO
    # stages 1-3 of one sharding degree share it)
    key = (id(cfg), id(dev), seq_len, mode, amp, device, moe_imbalance, layout.pp, layout.virtual_pp,
           layout.grad_accum, dualpipev, layout.tp, ep, layout.sharding, layout.dp * layout.sharding // ep,
           layout.micro_batch, getattr(layout, "sequence_parallel", False), getattr(layout, "cp", 1))
    hit = _BOUNDS.get(key)
    if hit is None or hit[0] is not cfg or hit[1] is not dev:
        hit = _BOUNDS[key] = (cfg, dev, _split_free_bound(cfg, layout, seq_len, mode, amp, device, dev, moe_imbalance))
    return hit[2]


_BOUNDS: dict = {}


def _split_free_bound(cfg, layout, seq_len: int, mode: str, amp: str, device: str, dev,
                      moe_imbalance: float | None) -> float:
    """`split_free_bound`, computed."""
    parts = mode == "parts"
    mode = "full" if parts else mode
    p, v, m = layout.pp, layout.virtual_pp, layout.grad_accum
    flash = cfg.attention == "flash" or (cfg.attention == "auto" and dev.async_launch)
    dense, moe_act, kept, logits = activation_parts(cfg, layout, seq_len, mode, dev.dtype_bytes, flash, device,
                                                    moe_imbalance)
    blocks, first, last = _held(cfg, layout, amp)
    kinds = _kinds(cfg, blocks, dense, moe_act)
    least_act = min(a for _, a in kinds)
    fixed, per = [], []
    dualpipev = getattr(layout, "pp_schedule", "1f1b") == "dualpipev"
    head = 0 if dualpipev else p - 1  # the stage of the head and logits (DualPipeV's V: stage 0)
    for st in range(p):
        f = v_least_flight(p, st) if dualpipev else in_flight(p, v, m, st)
        per.append(min(h + f * (kept if mode == "full" else a) for h, a in kinds))
        block = least_act if mode == "full" and not parts else 0.0  # a re-running block's full set
        fixed.append(dev.framework_bytes + (first if st == 0 else 0.0)  # on the head's stage: the larger of it and
                     + (last + max(logits, block) if st == head else block))  # the head's peak (`_beyond_head`)
    return water_level(fixed, per, cfg.num_layers)


def _kinds(cfg, blocks: list, dense: float, moe_act: float) -> tuple:
    """The distinct (held bytes, saved bytes) of the model's blocks, remembered per holdings list and sizes."""
    key = (id(blocks), dense, moe_act)
    hit = _KINDS.get(key)
    if hit is None or hit[0] is not blocks:
        kinds = {(h, moe_act if is_moe else dense) for h, is_moe in zip(blocks, moe_blocks(cfg))}  # the distinct blocks
        hit = _KINDS[key] = (blocks, tuple(kinds))  # the holdings list kept alive with its id
    return hit[1]


_KINDS: dict = {}


def water_level(fixed: list, per: list, total: float) -> float:
    """The least C >= max(fixed) with sum_s max(0, (C - fixed[s]) / per[s]) >= total (exact: the sum is piecewise
    linear in C, with a knot at each fixed[s])."""
    order = sorted(range(len(fixed)), key=lambda s: fixed[s])
    slope = base = 0.0  # sum over the stages below C of 1/per and fixed/per: the sum is slope x C - base
    for i, s in enumerate(order):
        slope += 1.0 / per[s]
        base += fixed[s] / per[s]
        c = (total + base) / slope
        if i == len(order) - 1 or c <= fixed[order[i + 1]]:
            return max(c, max(fixed))
    return max(fixed)
