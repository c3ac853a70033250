"""ZeRO stages 2 and 3 through Paddle's own group-sharded classes.

    model, optimizer, scaler, hooks = wrap_zero(core, optimizer, scaler, layout, topo)   # after fleet.init

`parallel.sharding_stage=2` -> `group_sharded_parallel(level="os_g")`
(GroupShardedOptimizerStage2 + GroupShardedStage2: optimizer states and gradients
sharded), `3` -> `level="p_g_os"` (GroupShardedStage3: parameters too), over
fleet's sharding group, with fleet's dp group for dp x sharding. Stage 1 does not
come here: it is fleet's `sharding_degree` through `fleet.distributed_optimizer`.
On CPU, `llmtrain.paddle_compat.cpu_backend` lets Paddle's classes run over gloo.

Clipping: under fleet's hybrid topology Paddle's stage 2 installs fleet's
`HybridParallelClipGrad` (norm over sharding, mp and pp groups), which
``llmtrain.train.clip.install_recording_clip`` records like stage 1. Stage 3
installs `GroupShardedClipGrad` (norm over the sharding group only — so stage 3
refuses tp > 1 in `layout.py`); `RecordingShardedClip` wraps it to record the
norm it uses (sliced gradients' squares all-reduced over the sharding group,
un-sliced parameters' squares added once) and then lets Paddle clip.

Context parallelism (cp > 1): Paddle's wrappers reduce gradients over the sharding group (and dp) only, and the
cp ranks of a sharding rank hold the same parameters with the gradients of their own positions; `SumOverContext`
all-reduces the gradients a rank holds (`zero_held_gradients`: its owned storages under stage 2, its slices and
the unsliced parameters' storage under stage 3) over the cp group before the optimizer step, so the step, its clip
and its dp reduction see the sum over the whole sequence. Traffic: one all-reduce over cp of 1/sharding of the
gradients (stage 2/3) per step, on top of the sharding group's reduction.

Unsliced parameters under stage 3 (the tied word table, parameters of at most `parallel.zero3_segment_size` elements):
their gradients are views into one flat storage per dtype that the optimizer step all-reduces as one tensor over the
sharding group. Paddle orders the views by the parameters' unique names, which differ between ranks that built a
different number of layers before (a power of ten crossed at different places: "layer_norm_99" sorts after
"layer_norm_100") and then the all-reduce silently adds up different parameters' gradients. `wrap_zero` lays them out
by structured name instead (`stage3_lay_out_unsliced`), checks that every rank of the sharding and dp groups holds the
same layout (`_check_same_layout`: a 56-bit digest all-gathered once), and `UnslicedGradCheck` checks before every
update that each unsliced gradient is still the view the all-reduce reaches (a re-allocated one would be this rank's
alone): either failure raises instead of training on a wrong gradient.

Frozen parameters (the base under LoRA): stage 3 slices them like any parameter but, in
Paddle 3.3.1, never cuts them back to their slice once its backward pass has gathered them
(that happens in a trainable parameter's gradient hook). `_reslice_frozen` does it: each
layer's as soon as the gradient of its input is complete, the rest at the end of each step.
"""
from __future__ import annotations

import hashlib
import json

import paddle
import paddle.distributed as dist

from llmtrain.contracts import tags
from llmtrain.contracts.steps import StepHook
from llmtrain.paddle_compat.optim import (
    get_grad_clip,
    group_sharded_clip_class,
    optimizer_chain,
    set_grad_clip,
    squared_l2_norm,
)
from llmtrain.paddle_compat.zero import (
    built_without,
    stage3_frozen_by_layer,
    stage3_lay_out_unsliced,
    stage3_reslice,
    stage3_unsliced_grad_problems,
    zero_held_gradients,
)

LEVELS = {2: "os_g", 3: "p_g_os"}


class RecordingShardedClip:
    """Paddle's GroupShardedClipGrad, plus `last_norm` (the global norm it clips with). Under expert parallelism
    (`expert_group` set: the data group, on one rank of which each expert tensor's gradient lives) the experts'
    squares are summed over that group and the clip is applied here with Paddle's formula."""

    def __init__(self, inner, group):
        self.inner = inner
        self.group = group
        self.last_norm = None
        self.expert_group = None

    @paddle.no_grad()
    def __call__(self, params_grads):
        sliced = paddle.zeros([1], dtype="float32")
        unsliced = paddle.zeros([1], dtype="float32")
        experts = paddle.zeros([1], dtype="float32")
        for p, g in params_grads:
            if g is None or getattr(p, "need_clip", True) is False:
                continue
            sq = squared_l2_norm(g).astype("float32").reshape([1])
            if self.expert_group is not None and tags.is_expert(p):
                experts = experts + sq
            elif hasattr(p, "unslice"):
                unsliced = unsliced + sq
            else:
                sliced = sliced + sq
        dist.all_reduce(sliced, group=self.group)
        if self.expert_group is None:
            self.last_norm = paddle.sqrt(sliced + unsliced).reshape([])
            return self.inner(params_grads)
        dist.all_reduce(experts, group=self.expert_group)
        self.last_norm = norm = paddle.sqrt(sliced + unsliced + experts).reshape([])
        limit = paddle.full([], self.inner._clip.clip_norm, dtype="float32")
        scale = limit / paddle.maximum(norm, limit)  # GroupShardedClipGrad's formula
        for p, g in params_grads:
            if g is not None and getattr(p, "need_clip", True) is not False:
                g.scale_(scale.astype(g.dtype))
        return params_grads

    def __getattr__(self, item):
        return getattr(self.inner, item)


def _install_recorder(optimizer, group) -> RecordingShardedClip:
    sharded_clip = group_sharded_clip_class()
    for opt in optimizer_chain(optimizer):
        clip = get_grad_clip(opt)
        if isinstance(clip, sharded_clip):
            recorder = RecordingShardedClip(clip, group)
            set_grad_clip(opt, recorder)
            return recorder
    raise RuntimeError("Paddle's GroupShardedClipGrad was not found on the ZeRO optimizer; set optim.clip_grad > 0")


def wrap_zero(core, optimizer, scaler, layout, topo):
    """ZeRO-2/3 wrappers over the sharding group; returns (model, optimizer, scaler, step hooks) with a recording
    clip."""
    group, dp_group = topo.group("sharding"), topo.group("dp")
    experts = [p for p in core.parameters() if tags.is_expert(p)] if layout.ep > 1 else []
    extra = {}
    if layout.sharding_stage == 3:
        # Stage 3 gathers a sliced parameter only around its own layer's forward; a tied word
        # table is also read by the output projection, outside that forward, so it stays unsliced.
        # Routed experts (ep > 1) are not Paddle's to manage (`built_without`): their layers stay unsliced too.
        extra["exclude_layer"] = [id(layer) for layer in core.sublayers()
                                  if tags.is_tied_table(layer) or any(tags.is_expert(p) for p in layer.parameters(
                                      include_sublayers=False))]
        extra["segment_size"] = layout.zero3_segment_size
    else:
        extra["buffer_max_size"] = layout.zero2_buffer_size

    def build():
        return paddle.distributed.sharding.group_sharded_parallel(
            core, optimizer, level=LEVELS[layout.sharding_stage], scaler=scaler, group=group, dp_group=dp_group, **extra)

    model, optimizer, scaler = built_without(build, optimizer, experts, layout.sharding_stage)
    hooks = []
    if layout.sharding_stage == 3:
        tags.set_recording_clip(optimizer, _install_recorder(optimizer, group))
        _check_same_layout(_lay_out_by_structure(core, model), [group, dp_group])
        hooks = [UnslicedGradCheck(model)] + _reslice_frozen(core, model)
    if layout.cp > 1:
        hooks.append(SumOverContext(model, topo.cp_group))
    return model, optimizer, scaler, hooks


def _lay_out_by_structure(core, model) -> list:
    """Stage 3's unsliced gradient views laid out by structured parameter name ("embed.word.weight"), the same on
    every rank; returns the layout [(name, dtype, offset, numel)]."""
    names = {id(p): n for n, p in core.named_parameters()}

    def key(p):
        if id(p) not in names:
            raise RuntimeError(f"ZeRO-3 holds an unsliced gradient for {p.name} {list(p.shape)}, which is not a "
                               "parameter of the model it wraps: its place in the all-reduced storage is unknown")
        return names[id(p)]

    return stage3_lay_out_unsliced(model, key)


def _check_same_layout(layout: list, groups) -> None:
    """Raise on every rank unless each rank of each group (None or one-rank groups skipped) holds `layout`."""
    digest = int.from_bytes(hashlib.sha256(json.dumps(layout).encode()).digest()[:7], "big")  # < 2^56: fits int64
    mine = paddle.to_tensor([digest], dtype="int64")
    for group in groups:
        if group is None or group.nranks < 2:
            continue
        got = []
        dist.all_gather(got, mine, group=group)
        digests = [int(t.numpy()[0]) for t in got]
        if len(set(digests)) > 1:
            raise RuntimeError(
                f"ZeRO-3: the ranks {group.ranks} lay out their unsliced gradients differently ({len(layout)} views, "
                f"digests {digests}); the storage all-reduce would add up different parameters' gradients. Every rank "
                "must build the same model (same parameters, shapes and dtypes, in the same structure)")


class UnslicedGradCheck(StepHook):
    """ZeRO-3's check before every update: each unsliced parameter's gradient is still the view into the storage the
    optimizer step all-reduces (`stage3_unsliced_grad_problems`); else raise, naming the parameters."""

    def __init__(self, model):
        self.model = model

    def before_update(self, check) -> None:
        problems = stage3_unsliced_grad_problems(self.model)
        if problems:
            raise RuntimeError(f"ZeRO-3: {len(problems)} unsliced gradient(s) left the storage the sharding group "
                               "all-reduces; the update would use this rank's gradient alone: "
                               + "; ".join(problems[:5]))


class SumOverContext(StepHook):
    """ZeRO-2/3 under cp: each rank's held gradients summed over its cp group before the optimizer update."""

    def __init__(self, model, group):
        self.model, self.group = model, group

    @paddle.no_grad()
    def before_update(self, check) -> None:
        for g in zero_held_gradients(self.model):
            dist.all_reduce(g, group=self.group)


class ResliceFrozen(StepHook):
    """ZeRO-3's step hook: the frozen parameters still whole after the backward are cut back to their slices
    before the optimizer update."""

    def __init__(self, model, params):
        self.model, self.params = model, params

    def before_update(self, check) -> None:
        stage3_reslice(self.model, self.params)


def _reslice_frozen(core, model) -> list:
    """Frozen sliced parameters (the base under LoRA) cut back to their slices after the backward, which Paddle's
    stage 3 does only for trainable ones (`stage3_reslice`): a layer's, as soon as the gradient of its input
    is complete (its backward no longer needs them); those of layers whose input needs no gradient (the first
    block's q/k/v under LoRA: nothing before them trains) at the end of each step, by the returned step hook."""
    frozen = stage3_frozen_by_layer(model)
    if not frozen:
        return []
    for layer in core.sublayers(include_self=True):
        params = frozen.get(id(layer))
        if params:
            layer.register_forward_pre_hook(_InputGradRelease(model, params))
    everything = [p for params in frozen.values() for p in params]
    return [ResliceFrozen(model, everything)]


class _InputGradRelease:
    """Forward pre-hook: a gradient hook on the layer's input that cuts its frozen parameters back to slices."""

    def __init__(self, model, params):
        self.model, self.params = model, params

    def __call__(self, layer, inputs):
        x = inputs[0] if inputs else None
        if layer.training and isinstance(x, paddle.Tensor) and not x.stop_gradient:
            x.register_hook(self._release)

    def _release(self, grad):
        stage3_reslice(self.model, self.params)
        return grad
