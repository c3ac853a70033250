"""Global-norm gradient clipping that also records the norm it used, for logging.

    clip = GlobalNormClip(1.0)            # given to the optimizer
    optimizer = fleet.distributed_optimizer(optimizer)
    clip = install_recording_clip(optimizer)   # under tp/pp/sharding fleet wraps it; swap in a recorder
    ... optimizer.step(); clip.last_norm        # fp32 scalar tensor, the global norm over all ranks

Single device and pure data parallel (grads already all-reduced by
`paddle.DataParallel`): `GlobalNormClip` computes the norm itself. Under tensor,
pipeline or sharding parallelism fleet replaces the clip with
`HybridParallelClipGrad`, which all-reduces partial sums over the mp, pp and
sharding groups (counting tp-split parameters on every rank, replicated ones
once, a tied table on its first stage only); `RecordingHybridClip` keeps that
logic and stores the result. Either way the logged grad_norm is the norm of
the whole model's gradient, equal to the single-process one.
"""
from __future__ import annotations

import paddle

from llmtrain.contracts import tags
from llmtrain.paddle_compat.optim import (
    get_grad_clip,
    optimizer_chain,
    recording_hybrid_clip_classes,
    set_grad_clip,
    squared_l2_norm,
)

NO_CLIP = 1e30  # clip_norm used when clipping is disabled: the scale is exactly 1 in fp32


class GlobalNormClip(paddle.nn.ClipGradByGlobalNorm):
    """ClipGradByGlobalNorm with fleet's formula, scale = c / (max(norm, c) + 1e-6), recording `last_norm`."""

    def __init__(self, clip_norm: float):
        super().__init__(clip_norm if clip_norm > 0 else NO_CLIP)
        self.last_norm = None
        self.expert_group = None  # expert parallelism: expert gradients differ per ep rank, summed over this group

    @paddle.no_grad()
    def _dygraph_clip(self, params_grads):
        clipped = [(p, g) for p, g in params_grads if g is not None and getattr(p, "need_clip", True)]
        # the fused kernel Paddle's and fleet's clips use
        squares = [squared_l2_norm(g).astype("float32") for p, g in clipped
                   if self.expert_group is None or not tags.is_expert(p)]
        if self.expert_group is not None:  # each ep rank holds other experts: count each expert once
            experts = [squared_l2_norm(g).astype("float32").reshape([]) for p, g in clipped
                       if tags.is_expert(p)]
            total = paddle.add_n(experts) if experts else paddle.zeros([], "float32")
            paddle.distributed.all_reduce(total, group=self.expert_group)
            squares.append(total.reshape(squares[0].shape) if squares else total)
        if not squares:
            return params_grads
        norm = paddle.sqrt(paddle.add_n(squares)).reshape([])
        self.last_norm = norm
        limit = paddle.full([], self.clip_norm, dtype="float32")
        scale = limit / (paddle.maximum(norm, limit) + 1e-6)
        scales = {}
        for p, g in params_grads:
            if g is not None and getattr(p, "need_clip", True):
                if g.dtype not in scales:
                    scales[g.dtype] = scale.astype(g.dtype)
                g.multiply_(scales[g.dtype])
        return params_grads


def install_recording_clip(optimizer):
    """Return the clip object whose `last_norm` holds the step's global norm.

    Walks fleet's optimizer wrappers; where fleet installed a
    `HybridParallelClipGrad`, replaces it with an equivalent recording subclass.
    """
    zero_clip = tags.recording_clip(optimizer)
    if zero_clip is not None:  # ZeRO-2/3: llmtrain.parallel.zero installed it
        return zero_clip
    hybrid_cls, recording_cls, clone = recording_hybrid_clip_classes()
    found = None
    for opt in optimizer_chain(optimizer):
        clip = get_grad_clip(opt)
        if isinstance(clip, hybrid_cls) and not isinstance(clip, recording_cls):
            found = clone(clip)
            set_grad_clip(opt, found)
        elif isinstance(clip, (GlobalNormClip, recording_cls)):
            found = found or clip
    if found is None:
        raise RuntimeError("no global-norm clip found on the optimizer; build it with GlobalNormClip")
    return found
