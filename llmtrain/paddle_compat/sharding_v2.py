"""fleet's stage-1 sharding V2 (`DygraphShardingOptimizerV2`, `sharding_configs.split_param`): which flat slice of
each parameter's optimizer state this rank holds, and the fused buffers behind it.

    python -m pytest -q tests/parallel/test_parity.py -k "sharding2v2 or tp2sharding2"
    spans = v2_slices(optimizer)     # {param name: (start, end, padded size)} this rank's slices; {} without V2
    buffers = fused_buffers(optimizer)   # fleet's FusedCommBuffer objects (V2's, or the pipeline's under pp overlap)

V2 lays the parameters of each bucket (`comm_buffer_size_MB`, 256 MiB by default) end to end in one flat buffer,
each padded to a multiple of `alignment / dtype bytes x sharding degree` elements, and gives sharding rank r the
r-th contiguous 1/n of the buffer. A parameter's part on this rank is `ShardingGradView._param_begin ..
_param_end` (buffer offsets; `_index` is where the parameter starts, `_padded_size` its padded length), possibly
empty. The inner optimizer sees one 1-D "slice parameter" per parameter, with the parameter's own name, so its
accumulators and master weight are keyed `<param name>_moment1_0` ... with the slice's length (padding included
when the slice reaches it). The parameters themselves stay whole on every rank (all-gathered after each update).
Under the pipeline's `sharding_comm_overlap` the buffers are the pipeline's (`param.comm_buffer_ref`) until V2's
first step collects them. Read in Paddle 3.3.1 (fleet/utils/tensor_fusion_helper.py,
meta_optimizers/dygraph_optimizer/dygraph_sharding_optimizer.py).
"""
from __future__ import annotations

from llmtrain.paddle_compat.optim import optimizer_chain
from llmtrain.paddle_compat.version import require_tested_paddle


def sharding_v2(optimizer):
    """The DygraphShardingOptimizerV2 in `optimizer`'s wrapper chain, or None."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
        DygraphShardingOptimizerV2,
    )

    return next((o for o in optimizer_chain(optimizer) if isinstance(o, DygraphShardingOptimizerV2)), None)


def fused_buffers(optimizer) -> list:
    """fleet's FusedCommBuffer objects of the V2 optimizer in `optimizer` (V2's own list, or, before its first step
    under the pipeline's sharding overlap, the pipeline's buffers its parameters point to); [] without V2."""
    v2 = sharding_v2(optimizer)
    if v2 is None:
        return []
    require_tested_paddle()
    if v2._comm_buffer_list:
        return list(v2._comm_buffer_list)
    seen, out = set(), []
    for p in v2._parameter_list:
        ref = getattr(p, "comm_buffer_ref", None)
        buf = ref() if ref is not None else None
        if buf is not None and id(buf) not in seen:
            seen.add(id(buf))
            out.append(buf)
    return out


def v2_slices(optimizer) -> dict:
    """{parameter name: (start, end, padded size)}: the elements [start, end) of the flattened parameter, padded to
    `padded size`, whose optimizer state this rank holds under V2; parameters with no part here are absent."""
    out = {}
    for buf in fused_buffers(optimizer):
        for name, view in buf._sharding_param_grad_view.items():
            start, end = view._param_begin - view._index, view._param_end - view._index
            if start < end:
                out[name] = (int(start), int(end), int(view._padded_size))
    return out


def pipeline_buffers(model) -> list:
    """The FusedCommBuffer objects fleet's PipelineParallel built for `dp_comm_overlap` / `sharding_comm_overlap`
    (`_chunk_2_comm_buffers`: {chunk id: [buffer]}); [] for any other model."""
    chunks = getattr(model, "_chunk_2_comm_buffers", None)
    if not chunks:
        return []
    require_tested_paddle()
    return [buf for bufs in chunks.values() for buf in bufs]


def pipeline_buckets_without(model, optimizer, params) -> list:
    """Have fleet's PipelineParallel `model` build its sharding-overlap buckets now (`register_sharding_comm_overlap_
    hook`, which its first `train_batch` calls otherwise; it builds them once) with `params` left out of them: flagged
    stop_gradient meanwhile, as fleet's `fused_gradient` takes the trainable parameters only (pipeline_parallel.py,
    lines 971-973). Returns the buckets."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelOptimizer,
    )

    require_tested_paddle()
    hybrid = next((o for o in optimizer_chain(optimizer) if isinstance(o, HybridParallelOptimizer)), None)
    if hybrid is None or not hasattr(model, "register_sharding_comm_overlap_hook"):
        raise RuntimeError("expected fleet's PipelineParallel and HybridParallelOptimizer (pp_sharding_comm_overlap)")
    out = [p for p in params if not p.stop_gradient]
    for p in out:
        p.stop_gradient = True
    try:
        model.register_sharding_comm_overlap_hook(hybrid)
    finally:
        for p in out:
            p.stop_gradient = False
    return pipeline_buffers(model)


def buffer_numel(buf) -> int:
    """Elements in a FusedCommBuffer's flat gradient buffer (padding included): the bytes each collective moves
    are this times the gradient's element size (fp32 under main-gradient training)."""
    require_tested_paddle()
    storage = getattr(buf, "grad_storage", None)
    if storage is not None and storage._is_initialized():
        return int(storage._numel())
    return int(getattr(buf, "buffer_size", 0))


def on_gradient_collective(buf, record) -> None:
    """Call `record(buf, start, end)` (time.perf_counter() seconds) around every gradient collective `buf` issues:
    fleet's `FusedCommBuffer._comm_grads` (reduce-scatter under V2, reduce under V1, all-reduce for dp), which
    runs from a gradient hook inside the backward under the comm overlaps and from the optimizer step otherwise.
    On GPU the call returns once the collective is queued on the communication stream (`end` is its issue, not
    its completion); over gloo it returns when the collective is done."""
    import time

    require_tested_paddle()
    inner = buf._comm_grads

    def timed():
        if not buf.need_reduce_scale_sync():
            return inner()
        start = time.perf_counter()
        out = inner()
        record(buf, start, time.perf_counter())
        return out

    buf._comm_grads = timed


def color_params(params, color: str, group) -> None:
    """Put `params` in V2 buckets of their own, reduce-scattered and all-gathered over `group` instead of the
    sharding group: fleet 3.3.1's per-parameter `color` (`{'color': name, 'group': group}`, read by
    `DygraphShardingOptimizerV2._build_comm_buffers`, which groups the parameters by (color, group) before cutting
    buckets). Set before the optimizer is wrapped (V2 builds its buckets in its constructor). `group` must be a
    process group object even with one member (its `nranks`, `rank` and `process_group` are read)."""
    require_tested_paddle()
    for p in params:
        p.color = {"color": color, "group": group}


def colored_buffers(optimizer, color: str) -> list:
    """The V2 buckets built for the parameters of `color` (`color_params`); [] without V2."""
    v2 = sharding_v2(optimizer)
    if v2 is None:
        return []
    require_tested_paddle()
    return list(v2._color_to_comm_buffer_list.get(color, []))


def rescale_after_reduce(buffers, factor: float) -> None:
    """Multiply each bucket's reduced gradient by `factor` right after fleet's own scaling (`scale_grads`: the wait
    for the bucket's reduce-scatter, then 1 / its group's size), before the optimizer reads the slices."""
    require_tested_paddle()
    for buf in buffers:
        inner = buf.scale_grads

        def scaled(_buf=buf, _inner=inner):
            reduced = _buf.need_reduce_scale_sync() and _buf.grad_storage is not None
            _inner()
            if reduced:
                _buf.grad_storage.scale_(factor)

        buf.scale_grads = scaled


def carry_marks(optimizer, attrs: tuple) -> int:
    """Give each V2 slice parameter its parameter's attributes `attrs` where the parameter has them (V2's
    `_create_slice_param` copies only is_distributed, optimize_attr, do_model_average, need_clip and no_sync);
    returns how many slice parameters got one.

    `is_firstly_shared` is the mark by which fleet's HybridParallelClipGrad skips the later pipeline stage's copy
    of a tied table (`llmtrain.paddle_compat.fleet.mark_secondary_shared_copies`): without it the clip's norm
    counts that table twice (measured: a tied GPT under sharding2 x pp2, grad_norm 1.627 for one process's 1.565);
    the experts' tag (`llmtrain.contracts.tags.EXPERT_AXIS_ATTR`) is how llmtrain's clip counts each expert once."""
    v2 = sharding_v2(optimizer)
    if v2 is None:
        return 0
    require_tested_paddle()
    marked = 0
    for p in v2._parameter_list:
        got = [a for a in attrs if hasattr(p, a)]
        for a in got:
            setattr(v2._slice_params[p.name], a, getattr(p, a))
        marked += bool(got)
    return marked


def slices_before_dp_sync(optimizer) -> bool:
    """Make V2 hand fleet's dp / sep all-reduce its slices from the first step on; True when V2 is there.

    fleet's HybridParallelOptimizer reduce-scatters V2's buckets, then all-reduces over dp (dp > 1) or dp x sep (cp >
    1) the slice parameters V2's `filter_parameters` returns: only those already initialised, which V2 does in its
    own `step` (`_assign_slice_grad`), after that all-reduce. So in fleet 3.3.1 the first step's slices are never
    summed over dp or sep (every later step's are: the slices stay views into the buckets). This assigns them (the
    same views; V2's step asserts it finds them so) before `filter_parameters` reads them."""
    v2 = sharding_v2(optimizer)
    if v2 is None:
        return False
    require_tested_paddle()
    inner = v2.filter_parameters

    def filter_parameters(parameter_list, hcg):
        v2._collect_comm_buffers()
        v2._assign_slice_grad()
        return inner(parameter_list, hcg)

    v2.filter_parameters = filter_parameters
    return True
