"""Paddle ZeRO-3 (`GroupShardedStage3`) internals llmtrain reads: which flat slice of each parameter a rank holds.

    slices = stage3_slices(model)    # {param name: (start, end, padded size)}; {} for any other model

Stage 3 flattens each sliced parameter, pads it to a multiple of the sharding degree
and keeps rank r's part in `param.fw_storage`; the bounds live in the wrapper's
private `_param2buffer` / `_param2buffer_size` / `_rank`. Read in Paddle 3.3.1.
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
