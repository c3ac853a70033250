"""Paddle ZeRO-3 (`GroupShardedStage3`) internals llmtrain reads (which flat slice of each parameter a rank holds)
and repairs (frozen parameters cut back to their slices after the backward, `stage3_reslice`).

    slices = stage3_slices(model)    # {param name: (start, end, padded size)}; {} for any other model
    stage3_reslice(model, frozen)    # gathered frozen parameters back to this rank's slices
    layout = stage3_lay_out_unsliced(model, key)   # unsliced gradients laid out in `key` order (rank-independent)
    problems = stage3_unsliced_grad_problems(model)   # each unsliced .grad still a view at its storage offset
    model, optimizer, scaler = built_without(build, optimizer, experts, stage)   # ZeRO-2/3 never seeing `experts`

Stage 3 flattens each sliced parameter, pads it to a multiple of the sharding degree
and keeps rank r's part in `param.fw_storage`; the bounds live in the wrapper's
private `_param2buffer` / `_param2buffer_size` / `_rank`; a layer's sliced parameters are listed in
`_trainable_params[id(layer)]` (frozen ones too), gathered ones in `_task_flow.full_param` with
`status` "all" / "part" and `use_count`. Parameters left whole (`_unslice_params`: smaller than the segment, or in an
excluded layer such as a tied word table) get their `.grad` as a view into one flat `GradStorage` per dtype
(`_grad_storages`), which the optimizer step scales by 1/sharding and all-reduces as one tensor; Paddle lays the views
out in the order of the parameters' unique names (`p.name`, e.g. "layer_norm_51.w_0"). Read in Paddle 3.3.1.
"""
from __future__ import annotations

from llmtrain.paddle_compat.version import require_tested_paddle


def stage3_slices(model) -> dict:
    """{parameter name: (start, end, padded size)} of the parameters ZeRO-3 sliced on this rank."""
    buffers = getattr(model, "_param2buffer", None)
    if not buffers:
        return {}
    require_tested_paddle()
    rank = model._rank
    return {name: (*buffers[name][rank], model._param2buffer_size[name]) for name in buffers}


def stage3_storage(param):
    """The flat [end - start] tensor holding this rank's slice of a ZeRO-3 parameter (Paddle's `fw_storage`)."""
    require_tested_paddle()
    return param.fw_storage


def zero_grad_buffers(model) -> list:
    """The flat gradient buffers Paddle's ZeRO-2/3 wrappers keep (`_grad_storages`: ZeRO-2 {dtype: {rank: storage}},
    ZeRO-3 {dtype: storage}); [] for any other model."""
    storages = getattr(model, "_grad_storages", None) or {}
    if storages:
        require_tested_paddle()
    out = []
    for per_dtype in storages.values():
        for storage in (per_dtype.values() if isinstance(per_dtype, dict) else [per_dtype]):
            buf = getattr(storage, "buffer", None)
            if buf is not None:
                out.append(buf)
    return out


def stage3_frozen_by_layer(model) -> dict:
    """{id(layer): [its sliced parameters that are frozen]} of a ZeRO-3 model (`_trainable_params` lists every
    sliced parameter per layer, trainable or not)."""
    require_tested_paddle()
    return {lid: [p for p in params if p.stop_gradient]
            for lid, params in model._trainable_params.items() if any(p.stop_gradient for p in params)}


def stage3_reslice(model, params) -> int:
    """Cut each of `params` that ZeRO-3 gathered whole back to this rank's slice; returns how many were cut.

    Paddle 3.3.1 gathers a layer's sliced parameters again for its backward pass (status "all", whole tensor
    in `_task_flow.full_param`) and slices them back only in the gradient hook of a trainable parameter, so a
    frozen one would stay whole from its first backward on. This does that slicing for the frozen ones."""
    require_tested_paddle()
    gathered = model._task_flow.full_param
    cut = 0
    for p in params:
        if getattr(p, "status", None) != "all" or p.name not in gathered:
            continue
        full, _task = gathered.pop(p.name)
        start, end = model._param2buffer[p.name][model._rank]
        p._clear_data()
        p.fw_storage = full._slice(start, end).detach().clone()
        p.status, p.use_count = "part", 0
        cut += 1
    return cut


def _unsliced_views(model) -> list:
    """[(GradStorage, [(param, offset, numel)])] of a ZeRO-3 model: where each unsliced parameter's gradient view sits
    in its storage's flat buffer (`GradStorage._add_grad_as_view`: numel, then `_param2align[name]` padding)."""
    out = []
    for storage in model._grad_storages.values():
        views, offset = [], 0
        for p in storage._params:
            views.append((p, offset, p._numel()))
            offset += p._numel() + storage._param2align[p.name]
        out.append((storage, views))
    return out


def stage3_lay_out_unsliced(model, key) -> list:
    """Lay every unsliced parameter's gradient view out in its flat storage in the order of `key(param)` (a string
    every rank computes alike, e.g. the parameter's structured name) instead of Paddle's order of unique names;
    returns [(key, dtype, offset, numel)] of the new layout. Call before the first backward (the buffers are zeroed).

    Why: the storage is all-reduced as one flat tensor, so element i must be the same parameter's gradient on every
    rank. Paddle sorts the views by `p.name`, which comes from a per-process counter: a rank that built one more layer
    earlier in the process (a second model, a rank-0-only helper) names its parameters differently, and once the
    numbers cross a power of ten ("layer_norm_99" vs "layer_norm_100") the string order differs between ranks and the
    all-reduce silently sums different parameters' gradients (measured: grad norm off from the second step, loss of
    the first step and every rank's holdings unchanged)."""
    require_tested_paddle()
    for storage in model._grad_storages.values():
        storage._params.sort(key=key)
        storage._param_ids = [id(p) for p in storage._params]
        storage.buffer.zero_()
        storage._array_grads()  # views re-made from offset 0 in `_params` order
    return [(key(p), str(p.dtype), offset, numel) for _, views in _unsliced_views(model) for p, offset, numel in views]


def stage3_unsliced_grad_problems(model) -> list:
    """Unsliced parameters of a ZeRO-3 model whose gradient is no longer the view at its offset of the storage the
    optimizer step all-reduces (re-allocated or cleared by something outside Paddle's stage 3): that gradient would
    be this rank's own, never summed over the sharding group. [] when every view is in place."""
    require_tested_paddle()
    problems = []
    for storage, views in _unsliced_views(model):
        base, size = storage.buffer.data_ptr(), storage.buffer.element_size()
        for p, offset, numel in views:
            g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
            if g is None or g.data_ptr() != base + offset * size or g._numel() != numel:
                where = "none" if g is None else f"at {g.data_ptr()}, {g._numel()} elements"
                problems.append(f"{p.name} {list(p.shape)}: gradient {where}, expected the storage view at "
                                f"{base + offset * size} ({numel} elements)")
    return problems


def zero_held_gradients(model) -> list:
    """The gradient tensors this rank of a ZeRO-2/3 model holds after the backward and before the optimizer step
    (the ones its optimizer step reads), each reduced over the sharding group already or about to be:

    - stage 2 (`GroupShardedStage2`): the flat gradient storages whose `destination` is this rank (the gradients of
      the parameters it owns), and the owned parameters too large for a storage (`_param_grads`: their `.grad`,
      or `.main_grad` under O2's master gradients);
    - stage 3 (`GroupShardedStage3`): every sliced trainable parameter's `bw_storage` (this rank's slice of its
      gradient) and the storages of the unsliced parameters' whole gradients (`_grad_storages`, all-reduced over
      the sharding group inside the optimizer step).

    Summing each of them over another group of ranks that hold the same parameters (context parallelism's cp
    ranks) before the step gives the step the gradients summed over that group too. Read in Paddle 3.3.1."""
    require_tested_paddle()
    if hasattr(model, "_param2buffer"):  # stage 3
        unsliced = set(id(p) for p in model._unslice_params)
        out = [p.bw_storage for p in model._layer.parameters()
               if p.trainable and id(p) not in unsliced and getattr(p, "bw_storage", None) is not None]
        return out + [s.buffer for s in model._grad_storages.values()]
    rank, owner = model._rank, model._trainable_param2rank
    out = [s.buffer for per_dtype in model._grad_storages.values() for s in per_dtype.values()
           if s.destination == rank]
    for p in model._trainable_params:
        if p.name in model._param_grads and owner[p.name] == rank:
            g = p.main_grad if model.use_main_grad else p.grad
            if g is not None:
                out.append(g)
    return out


def built_without(build, optimizer, params, stage: int):
    """`build()` (a call of Paddle's `group_sharded_parallel` on `optimizer`, returning (model, optimizer,
    scaler)), with the ZeRO-2/3 wrappers never managing `params` (parameters whose values differ per rank of the
    sharding group: routed experts; llmtrain reduces, updates and clears them itself). Returns what it returned.

    - stage 2: `GroupShardedOptimizerStage2` partitions, reduces and broadcasts the parameters of the list it is
      given (`group_sharded_parallel` passes `optimizer._parameter_list`), and `GroupShardedStage2` hooks those
      only: the list is the others' while the wrappers are built; the inner optimizer keeps every parameter and
      steps those with a gradient;
    - stage 3: `GroupShardedStage3` broadcasts every parameter from the sharding group's first rank, and slices
      (or keeps in its all-reduced gradient storage) every trainable one: `params` are frozen while it is built
      (their layers must be in its `exclude_layer`, else frozen ones are sliced too) and their values put back;
      then they join its `_unslice_params`, which its step adds to the inner optimizer's list and its gradient
      clearing and slicing skip, without a gradient storage.
    Read in Paddle 3.3.1."""
    require_tested_paddle()
    values = [p.clone() for p in params]
    ids = {id(p) for p in params}
    full = optimizer._parameter_list
    if stage == 2:
        optimizer._parameter_list = [p for p in full if id(p) not in ids]
    else:
        for p in params:
            p.stop_gradient = True
    try:
        model, wrapped, scaler = build()
    finally:
        optimizer._parameter_list = full
        for p, value in zip(params, values):
            p.stop_gradient = False
            p.set_value(value)
    if stage == 3:
        for p in params:
            model._unslice_params.add(p)
    return model, wrapped, scaler
