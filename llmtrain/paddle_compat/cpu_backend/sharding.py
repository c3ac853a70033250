"""ZeRO stages 2 and 3 (Paddle's group-sharded classes) on CPU processes over gloo.

Use: installed by `llmtrain.paddle_compat.cpu_backend.install()`. Afterwards, on CPU,

    model, opt, scaler = paddle.distributed.sharding.group_sharded_parallel(
        model, opt, level="os_g" | "p_g_os", group=sharding_group)

(or the classes `GroupShardedOptimizerStage2` + `GroupShardedStage2`, and
`GroupShardedStage3`, with device="cpu") run Paddle's own ZeRO-2/3 logic unchanged.

What we found in Paddle 3.3.1 (fleet/meta_parallel/sharding/*, distributed/sharding/
group_sharded.py): the classes' algorithms already have CPU branches and use only
collectives gloo implements -- stage 2 reduces each gradient (bucket) to its owner with
`dist.reduce` and broadcasts updated shards with `dist.broadcast`; stage 3 all-gathers
parameters (`process_group.all_gather`) and all-reduces full gradients before keeping
its slice (no reduce_scatter is involved in either); alignment uses `alignment["cpu"]`
(4096 bytes), and `_get_device_min_chunk_size` is only called for custom devices. What
stops them is a handful of device checks, each replaced below by one small stand-in:

1. `GroupShardedOptimizerStage2.__init__` and `GroupShardedStage3.__init__` assert
   `core.is_compiled_with_cuda() or is_compiled_with_xpu() or device is custom` (a
   build-capability gate; nothing after it needs CUDA on a non-offload run), and stage 2
   parses `int(paddle.get_device().split(":")[1])` (for offload's `.cuda(dev_id)`).
   Stand-in: run Paddle's constructor with the module's `core` answering
   `is_compiled_with_cuda() -> True` and its `paddle.get_device()` answering "cpu:0",
   for the duration of the constructor only (module-level views; every other attribute
   is forwarded, nothing outside the two modules is touched). We checked that in these
   two modules `is_compiled_with_cuda` is read only by the assertion, and
   `paddle.get_device` only by stage 2's id parse, GroupShardedClipGrad's device string
   (see 3) and stage 3's DEV/DEV_ID globals, which come out "cpu"/0 -- the same values
   its own "cpu" branch produces. `offload=True` is refused on CPU: it means "keep the
   optimizer on the host while training on a device", which has no meaning here.
2. `group_sharded_storage.cvt_to_device` copies a host buffer to "the" accelerator and
   raises on a CPU build. On CPU the buffer is already where training happens: returned
   as is.
3. `GroupShardedClipGrad._dygraph_clip` parses "gpu:N" and, when the current device is
   "cpu" (Paddle's offload case), moves the norm with `.cuda(N)`. Stand-in: the same
   global-norm clip (sharded grads' squares all-reduced over the sharding group,
   un-sliced stage-3 params' squares added once, clip = max_norm / max(norm, max_norm))
   computed on CPU.
4. `group_sharded_parallel` asserts device in gpu/xpu/custom. Stand-in: the same wiring
   of the three classes with device="cpu".
5. `ParamStorage._add_param_as_view` (stage 2's flat parameter buffer) does
   `param_cpu = param.cpu(); param._clear_data(); slice.set_value(param_cpu)`. On GPU
   `.cpu()` is a copy; on CPU it is the same storage, so the values are freed before they
   are copied ("Tensor not initialized yet"). Stand-in: copy first (Paddle's own function
   with convert_gpu=False), then free the parameter's storage -- the same end state.

6. `GroupShardedStage2.__init__` (and the two constructors of 1) default to
   device="gpu" (evaluated when Paddle is imported); the gradient storages then run
   `device_guard(..., "gpu")`, i.e. `paddle.set_device("gpu:0")`, which fails on a CPU
   build. Stand-in: the same constructor with the default device "cpu".

Import-order caveat: `from paddle.distributed.sharding import group_sharded_parallel`
executed BEFORE install() binds Paddle's original function; call it as
`paddle.distributed.sharding.group_sharded_parallel(...)` or import it after install().
(The classes are patched in place and are safe to import at any time.)

Deviation from the GPU path to know about: none in the math (same collectives, same
order, fp32 on CPU). ZeRO memory savings are real: each rank keeps optimizer state for
its own shard only (tests/paddle_compat/test_cpu_zero.py: per-rank Adam state is
1/2 of the single-process state at k=2, exactly for stage 2, +5% alignment padding for
stage 3).
"""

from __future__ import annotations

import contextlib

import paddle
import paddle.distributed as dist
from paddle.distributed import sharding as paddle_sharding
from paddle.distributed.fleet.meta_parallel.sharding import (
    group_sharded_optimizer_stage2 as stage2_opt_module,
    group_sharded_stage2 as stage2_module,
    group_sharded_stage3 as stage3_module,
    group_sharded_storage as storage_module,
    group_sharded_utils as utils_module,
)
from paddle.distributed.sharding import group_sharded as group_sharded_module

from ..patching import original, replace

GroupShardedOptimizerStage2 = stage2_opt_module.GroupShardedOptimizerStage2
GroupShardedStage2 = stage2_module.GroupShardedStage2
GroupShardedStage3 = stage3_module.GroupShardedStage3
GroupShardedClipGrad = utils_module.GroupShardedClipGrad


class _View:
    """A module seen through a few overridden attributes (everything else forwarded)."""

    def __init__(self, module, **overrides):
        self._module, self._overrides = module, overrides

    def __getattr__(self, name):
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._module, name)


@contextlib.contextmanager
def _cpu_capable(module):
    """While active, `module`'s `core.is_compiled_with_cuda()` is True and its
    `paddle.get_device()` is "cpu:0" (see module docstring, item 1)."""
    saved = {name: module.__dict__[name] for name in ("core", "paddle")}
    module.__dict__["core"] = _View(saved["core"], is_compiled_with_cuda=lambda: True)
    module.__dict__["paddle"] = _View(saved["paddle"], get_device=lambda: "cpu:0")
    try:
        yield
    finally:
        module.__dict__.update(saved)


def _refuse_offload(offload: bool) -> None:
    if offload:
        raise ValueError(
            "group-sharded offload=True moves optimizer state from the accelerator to the "
            "host; on a CPU-only job everything already is on the host. Use offload=False."
        )


def _stage2_optimizer_init(
    self, params, optim, group=None, offload=False, device="cpu", pretrain_sync_models=True,
    dp_group=None, **kw,
):
    """CPU stand-in for `GroupShardedOptimizerStage2.__init__` (item 1 of the docstring).

    Same signature; `device` defaults to "cpu" instead of "gpu". GPU: the same
    constructor, whose assertion passes on a CUDA build.
    """
    _refuse_offload(offload)
    with _cpu_capable(stage2_opt_module):
        original(GroupShardedOptimizerStage2, "__init__")(
            self, params, optim, group=group, offload=offload, device=device,
            pretrain_sync_models=pretrain_sync_models, dp_group=dp_group, **kw,
        )


def _stage2_init(
    self, layer, sharding_optimizer, group=None, sync_buffers=False, buffer_max_size=2**23,
    auto_refresh_trainable=True, device="cpu", dp_group=None,
):
    """CPU stand-in for `GroupShardedStage2.__init__` (item 6 of the docstring).

    Same signature with `device` defaulting to "cpu" instead of "gpu".
    """
    original(GroupShardedStage2, "__init__")(
        self, layer, sharding_optimizer, group=group, sync_buffers=sync_buffers,
        buffer_max_size=buffer_max_size, auto_refresh_trainable=auto_refresh_trainable,
        device=device, dp_group=dp_group,
    )


def _stage3_init(
    self, layer, optimizer, group=None, sync_buffers=False, device="cpu", segment_size=2**20,
    pretrain_sync_models=True, offload=False, sync_comm=False, dp_group=None, exclude_layer=None,
):
    """CPU stand-in for `GroupShardedStage3.__init__` (item 1 of the docstring).

    Same signature; `device` defaults to "cpu" instead of "gpu". GPU: the same
    constructor, whose assertion passes on a CUDA build.
    """
    _refuse_offload(offload)
    with _cpu_capable(stage3_module):
        original(GroupShardedStage3, "__init__")(
            self, layer, optimizer, group=group, sync_buffers=sync_buffers, device=device,
            segment_size=segment_size, pretrain_sync_models=pretrain_sync_models,
            offload=offload, sync_comm=sync_comm, dp_group=dp_group, exclude_layer=exclude_layer,
        )


@paddle.autograd.no_grad()
def _add_param_as_view(self, param, align, convert_gpu=True):
    """CPU stand-in for `ParamStorage._add_param_as_view` (item 5 of the docstring).

    Copies `param` (flattened) into this storage's buffer at the fill offset, then, as
    Paddle's convert_gpu path does, releases the parameter's own storage (it becomes a
    view of the buffer in `_convert_buffer`). Returns the original shape.
    """
    shape = original(storage_module.ParamStorage, "_add_param_as_view")(self, param, align, False)
    if convert_gpu:
        param._clear_data()
    return shape


def cvt_to_device(x, dev_id, blocking=True):
    """CPU stand-in for `group_sharded_utils.cvt_to_device` as used by group_sharded_storage.

    GPU: `x._copy_to(CUDAPlace(dev_id))`. CPU: `x` already lives on the training device.
    """
    return x


@paddle.autograd.no_grad()
def _dygraph_clip(self, params_grads):
    """CPU stand-in for `GroupShardedClipGrad._dygraph_clip` (item 3 of the docstring).

    norm^2 = all_reduce_sum(sum of sliced grads^2 over the sharding group) + sum of
    un-sliced (stage-3 `unslice`) grads^2; every grad is scaled in place by
    max_norm / max(norm, max_norm). Returns `params_grads`, like Paddle.
    """
    sliced = paddle.zeros([], dtype="float32")
    unsliced = paddle.zeros([], dtype="float32")
    for p, g in params_grads:
        if g is None or getattr(p, "need_clip", True) is False:
            continue
        square_sum = paddle.sum(paddle.square(g.astype("float32")))
        if hasattr(p, "unslice"):
            unsliced = unsliced + square_sum
        else:
            sliced = sliced + square_sum
    dist.all_reduce(sliced, group=self._group)
    norm = paddle.sqrt(sliced + unsliced)
    max_norm = paddle.full([], self.clip_norm, dtype="float32")
    factor = max_norm / paddle.maximum(norm, max_norm)
    for p, g in params_grads:
        if g is None or getattr(p, "need_clip", True) is False:
            continue
        origin_state = g.stop_gradient
        g.stop_gradient = True
        g.scale_(factor.astype(g.dtype))
        g.stop_gradient = origin_state
    return params_grads


def group_sharded_parallel(
    model,
    optimizer,
    level,
    scaler=None,
    group=None,
    offload=False,
    sync_buffers=False,
    buffer_max_size=2**23,
    segment_size=2**20,
    sync_comm=False,
    dp_group=None,
    exclude_layer=None,
):
    """CPU stand-in for `paddle.distributed.sharding.group_sharded_parallel` (item 4).

    Same signature and return value; wires the same classes as Paddle with
    device="cpu": level "os"/"os_g" -> GroupShardedOptimizerStage2 + GroupShardedStage2,
    "p_g_os" -> GroupShardedStage3; a GradScaler is wrapped with GroupShardedScaler.
    GPU: identical wiring with device="gpu"/"xpu" after a device assertion.
    """
    if level not in ("os", "os_g", "p_g_os"):
        raise ValueError(f"level must be 'os', 'os_g' or 'p_g_os', got {level!r}")
    _refuse_offload(offload)
    if level in ("os", "os_g"):
        optimizer = GroupShardedOptimizerStage2(
            params=optimizer._parameter_list,
            optim=optimizer,
            group=group,
            offload=offload,
            dp_group=dp_group,
            device="cpu",
        )
        model = GroupShardedStage2(
            model,
            optimizer,
            group=group,
            sync_buffers=sync_buffers,
            buffer_max_size=buffer_max_size,
            dp_group=dp_group,
            device="cpu",
        )
    else:
        model = GroupShardedStage3(
            model,
            optimizer=optimizer,
            group=group,
            sync_buffers=sync_buffers,
            segment_size=segment_size,
            offload=offload,
            sync_comm=sync_comm,
            dp_group=dp_group,
            device="cpu",
            exclude_layer=exclude_layer,
        )
    if isinstance(scaler, paddle.amp.GradScaler):
        scaler = utils_module.GroupShardedScaler(scaler)
    return model, optimizer, scaler


def install_patches() -> None:
    replace(GroupShardedOptimizerStage2, "__init__", _stage2_optimizer_init)
    replace(GroupShardedStage2, "__init__", _stage2_init)
    replace(GroupShardedStage3, "__init__", _stage3_init)
    replace(storage_module, "cvt_to_device", cvt_to_device)
    replace(storage_module.ParamStorage, "_add_param_as_view", _add_param_as_view)
    replace(GroupShardedClipGrad, "_dygraph_clip", _dygraph_clip)
    replace(group_sharded_module, "group_sharded_parallel", group_sharded_parallel)
    replace(paddle_sharding, "group_sharded_parallel", group_sharded_parallel)
