"""The pipeline bubble of fleet's DualPipeV schedule, as a fraction of 1F1B's on the same stages.

    python -m llmtrain.plan model=llama-7b data.seq_len=4096 plan.devices=16    # prices it for pp_schedule=dualpipev
    factor = dualpipe_bubble_factor(cfg, seq_len)     # bubble(DualPipeV) = factor x bubble(1F1B, same stages)

DeepSeek's DualPipe table (github.com/deepseek-ai/DualPipe, README) gives the bubble of DualPipeV on PP/2 devices
as (PP/2 - 1)(F&B + B - 3W), with PP the number of chunks (2 per device), F, B and W one chunk's forward, full
backward and weight-gradient times, and F&B a forward and a backward of two chunks run overlapped. 1F1B on the
same devices idles (PP/2 - 1)(F + B) of whole-device times, i.e. (PP/2 - 1)·2(F + B) in chunk times. llmtrain's
models do not define fleet's `overlapped_forward_backward`, so F&B = F + B, and the ratio is

    (F + 2B - 3W) / (2(F + B)).

With backward = 2 x forward (B = 2F) and W the weight-gradient share of the backward: (5F - 3W) / 6F. W is the
linears' weight-gradient GEMMs (every linear is a `SplitBWLinear` under DualPipeV): 2 FLOPs per parameter per
token of the 6·N + 12·L·h·s a token costs (`llmtrain.models.size.flops_parameters`; attention's core and the
element-wise ops are not split). A model of linears alone gives 1/3, no split at all 5/6. The micro-batch count
does not enter (the schedule needs m >= 2 pp; 1F1B's bubble divided by m as before).
"""
from __future__ import annotations


def weight_grad_share(cfg, seq_len: int) -> float:
    """W / (F + B): the share of a micro-batch's compute that is the linears' weight gradients, by FLOPs
    (remembered per model and sequence length: a ranking asks for every DualPipeV row)."""
    hit = _SHARE.get((id(cfg), seq_len))
    if hit is not None and hit[0] is cfg:
        return hit[1]
    from llmtrain.models.size import flops_parameters

    n = flops_parameters(cfg)
    per_token = 6 * n + 12 * cfg.num_layers * cfg.hidden_size * seq_len
    share = 2 * n / per_token if per_token else 0.0
    _SHARE[(id(cfg), seq_len)] = (cfg, share)  # the model kept alive with its id
    return share


_SHARE: dict = {}


def dualpipe_bubble_factor(cfg, seq_len: int) -> float:
    """bubble(DualPipeV) / bubble(1F1B) on the same stages and micro-batches: (F + 2B - 3W) / (2(F + B)) with
    F = 1/3, B = 2/3 of a micro-batch's compute and W = `weight_grad_share`."""
    f, b, w = 1 / 3, 2 / 3, weight_grad_share(cfg, seq_len)
    return (f + 2 * b - 3 * w) / (2 * (f + b))
