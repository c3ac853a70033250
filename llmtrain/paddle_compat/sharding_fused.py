"""fleet's stage-1 sharding V1 with tensor fusion (`sharding_configs.tensor_fusion`): which parameters each fused
parameter (`generated_tensor_N`) of this rank holds, and where.

    LLMTRAIN_SAMPLE_SEED=all python -m pytest -q tests/parallel/test_parity.py -k v2_under_tp
    spans = fused_spans(optimizer)   # {fused var name: (its numel, [(param var name, offset, numel)])}; {} without

V1 partitions whole parameters over the sharding ranks (sorted greedy, `_partition_parameters`), then, with
tensor_fusion, lays each rank's parameters end to end in fused parameters (`fused_parameters`: grouped by fp32,
tp-distributed, clipped and weight-decayed, in buckets of `comm_buffer_size_MB`; each parameter padded to the
device's 256-byte alignment), the parameters becoming views into them (`ParamStorage.add_rank_params`). The inner
optimizer steps on this rank's fused parameters (`_rank2fused[sharding rank]`), so its accumulators and master
weights are 1-D and keyed by the fused parameter's name. A parameter's place in its fused parameter is read from
the storage itself (its data address minus the fused parameter's, in elements), not recomputed. Read in Paddle
3.3.1 (meta_optimizers/dygraph_optimizer/dygraph_sharding_optimizer.py `_tensor_fusion`,
fleet/utils/tensor_fusion_helper.py `flatten_dense_tensors`).
"""
from __future__ import annotations

from llmtrain.paddle_compat.optim import optimizer_chain
from llmtrain.paddle_compat.version import require_tested_paddle


def sharding_v1_fused(optimizer):
    """fleet's V1 `DygraphShardingOptimizer` with tensor fusion in `optimizer`'s wrapper chain, or None."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
        DygraphShardingOptimizer,
    )

    return next((o for o in optimizer_chain(optimizer)
                 if type(o) is DygraphShardingOptimizer and o.tensor_fusion), None)


def fused_spans(optimizer) -> dict:
    """{fused parameter name: (its numel, [(parameter name, offset, numel)])} of this rank's fused parameters:
    parameter `name` is elements [offset, offset + numel) of the flat fused parameter (and of each of its
    accumulators and its master weight). {} without V1 tensor fusion."""
    shard = sharding_v1_fused(optimizer)
    if shard is None:
        return {}
    require_tested_paddle()
    rank = shard._sharding_rank
    params = shard._rank2params[rank]
    out = {}
    for fused in shard._rank2fused[rank]:
        base, size, elem = fused.data_ptr(), int(fused._numel()), fused.element_size()
        members = out.setdefault(fused.name, (size, []))[1]
        for p in params:
            off = p.data_ptr() - base
            if 0 <= off < size * elem:
                if off % elem:
                    raise RuntimeError(f"{p.name} starts {off} bytes into {fused.name}: not on an element boundary")
                members.append((p.name, off // elem, int(p._numel())))
    placed = sum(len(v[1]) for v in out.values())
    if placed != len(params):
        raise RuntimeError(f"tensor fusion: {placed} of this rank's {len(params)} parameters found in its fused "
                           "parameters (a parameter no longer a view into its fused buffer)")
    return out


def set_fused_state(optimizer, state: dict) -> None:
    """Load `state` (keyed by this rank's fused parameter names) into the optimizer V1 wraps: V1's own
    `set_state_dict` keeps only the keys naming one of this rank's parameters (`_rank2params`), which drops
    every fused parameter's."""
    require_tested_paddle()
    sharding_v1_fused(optimizer)._inner_opt.set_state_dict(state)


def restore_v1_overlap_decay(optimizer) -> bool:
    """Give V1 with `comm_overlap` and without `tensor_fusion` its weight-decay rule back; True when it did.

    fleet 3.3.1 fuses the gradients into reduce buckets whenever comm_overlap is on (`_tensor_fusion`) and replaces
    the inner optimizer's `_apply_decay_param_fun` by one keyed on the fused parameters' names, but without
    tensor_fusion its `step` updates the unfused parameters (`_origin_parameter_list`), whose names that rule never
    holds: no parameter decays (measured on CPU, sharding2 Llama: the grad norms of a run with weight decay equal
    one process's with optim.weight_decay=0, 5e-5 off its own by step 4). The unfused parameters are what is
    updated, so their original rule is the right one."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
        DygraphShardingOptimizer,
    )

    shard = next((o for o in optimizer_chain(optimizer) if type(o) is DygraphShardingOptimizer), None)
    if shard is None or not shard.comm_overlap or shard.tensor_fusion or shard.origin_decay_param_fun is None:
        return False
    require_tested_paddle()
    shard._set_inner_opt_attr("_apply_decay_param_fun", shard.origin_decay_param_fun)
    return True


def secondary_shared_spans(optimizer, params) -> dict:
    """{fused parameter name: [(offset, numel)]} of the parameters among `params` marked as a later pipeline stage's
    copy of a tied table (`is_firstly_shared` False, `llmtrain.paddle_compat.fleet.mark_secondary_shared_copies`)
    inside this rank's fused parameters: V1 tensor fusion lays the copy into a fused parameter, which fleet's clip
    sees instead of the marked copy, so it counts the table twice (measured: a tied GPT under sharding2 x pp2,
    grad_norm 1.628 for one process's 1.565); llmtrain's recording clip takes these spans back out."""
    secondary = {p.name for p in params if getattr(p, "is_firstly_shared", True) is False}
    out = {}
    for fused, (_, members) in fused_spans(optimizer).items():
        spans = [(off, n) for name, off, n in members if name in secondary]
        if spans:
            out[fused] = spans
    return out
