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
