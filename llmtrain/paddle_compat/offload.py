"""Offload to host memory: optimizer state between steps, a recomputed block's input between forward and backward.

    python llmtrain/pretrain.py model=llama-tiny train.offload_optimizer=true            # memory.json "offload"
    python llmtrain/pretrain.py model=llama-tiny train.recompute=full train.offload_activations=true
    python -m pytest tests/paddle_compat/test_host_offload.py -q

Optimizer state (`OptimizerOffload`, as PaddleFormers' `offload_optim`: the update runs on the device, the state
lives on the host between updates): every accumulator (Adam moments, beta powers) and fp32 master weight of the
innermost Paddle optimizer (`optim.optimizer_state_tensors`; under ZeRO only this rank's share, so it composes with
sharding) is copied to host memory after each optimizer step and back before the next, the tensor object kept
(`Tensor._share_buffer_to`, as Paddle's own recompute offload does), so the optimizer never sees the move. The
innermost optimizer's `_apply_optimize` (the update, after the clip) is wrapped: `step` calls it, and so does
fleet's ZeRO-1 optimizer, which forwards it to its inner optimizer without calling the inner `step` (measured:
wrapping `step` missed every sharding2 update).

Activations (`offloaded_checkpoint`): a fully recomputed block keeps only its input; here that input is copied
to host memory in the forward and the block re-runs from it in the backward (a PyLayer in the form of Paddle's
reentrant recompute, random state kept), the copy back started one block ahead: when block i's backward begins, block
i-1's input starts its way back (`Tensor._copy_to(place, blocking=False)`), overlapping block i's recompute and
backward.

GPU-only (marked `GPU-ONLY(offload)`): pinned host memory (`Tensor.pin_memory`) and asynchronous copies to the
GPU (`Tensor.cuda(blocking=False)`), rehearsed on CPU by tests/gpu_paths/test_offload.py. On CPU the same code runs with `CPUPlace` copies (host == device: the bytes
move and are counted, no memory is freed), which the tests exercise; scripts/gpu_acceptance.sh runs the tests on a
GPU, where the device bytes must fall.
"""
from __future__ import annotations

from llmtrain.paddle_compat.version import require_tested_paddle


def to_host(t, blocking: bool = True):
    """A host copy of `t`: pinned (page-locked) memory on a GPU, so the copy back can be asynchronous; a CPU copy
    otherwise."""
    import paddle

    from llmtrain.paddle_compat.kernels import on_gpu

    if on_gpu():
        return t.pin_memory(blocking=blocking)  # GPU-ONLY(offload)
    return t._copy_to(paddle.CPUPlace(), blocking)


def to_device(t, blocking: bool = True):
    """A device copy of host tensor `t` (on a GPU asynchronous from pinned memory when not `blocking`)."""
    import paddle

    from llmtrain.paddle_compat.kernels import on_gpu

    if on_gpu():
        return t.cuda(blocking=blocking)  # GPU-ONLY(offload): this process's GPU
    return t._copy_to(paddle.CPUPlace(), blocking)


def move_into(t, copy) -> None:
    """Make tensor `t` hold `copy`'s storage (the object others hold keeps working)."""
    copy._share_buffer_to(t)


class OptimizerOffload:
    """Keeps the innermost optimizer's state on the host between steps (see the module docstring).

    `host_bytes`: bytes moved to the host after the last step; `moves`: host round trips so far."""

    def __init__(self, optimizer):
        require_tested_paddle()
        from llmtrain.paddle_compat.optim import optimizer_chain

        self.inner = list(optimizer_chain(optimizer))[-1]
        self.host_bytes = 0
        self.moves = 0
        self.on_host = False
        original = self.inner._apply_optimize

        def apply_optimize(*args, **kwargs):  # the update itself, whoever calls it
            self.reload()
            try:
                return original(*args, **kwargs)
            finally:
                self.offload()

        self.inner._apply_optimize = apply_optimize

    def tensors(self):
        from llmtrain.paddle_compat.optim import is_allocated, optimizer_state_tensors

        seen = set()
        for _, t in optimizer_state_tensors(self.inner):
            if is_allocated(t) and id(t) not in seen:
                seen.add(id(t))
                yield t

    def offload(self) -> int:
        """Move every state tensor to host memory; returns the bytes moved."""
        moved = 0
        for t in self.tensors():
            move_into(t, to_host(t))
            moved += int(t.numel()) * t.element_size()
        self.host_bytes, self.on_host = moved, True
        self.moves += 1
        return moved

    def reload(self) -> None:
        """Bring the state back to the device for the update."""
        if not self.on_host:
            return
        for t in self.tensors():
            move_into(t, to_device(t))
        self.on_host = False

    def report(self) -> dict:
        """memory.json's "offload" entry: bytes of optimizer state on the host between steps, by place."""
        places: dict = {}
        for t in self.tensors():
            key = str(t.place)
            places[key] = places.get(key, 0) + int(t.numel()) * t.element_size()
        return {"optimizer_host_bytes": self.host_bytes, "optimizer_places": places, "round_trips": self.moves}


class _Prefetch:
    """The offloaded inputs of this forward's blocks, in forward order: a block's backward starts the copy back of
    the block before it."""

    def __init__(self):
        self.pending = []  # weak references: a forward whose backward never runs leaves nothing alive here

    def add(self, ctx) -> None:
        import weakref

        self.pending = [r for r in self.pending if r() is not None] + [weakref.ref(ctx)]

    def start_previous(self, ctx) -> None:
        alive = [r() for r in self.pending]
        if ctx in alive:
            i = alive.index(ctx)
            prev = alive[i - 1] if i > 0 else None
            if prev is not None and prev.device_copy is None:
                prev.device_copy = to_device(prev.host, blocking=False)  # async from pinned memory on a GPU
            del self.pending[i:]


PREFETCH = _Prefetch()


def offloaded_checkpoint(fn, x, *rest):
    """fn(x, *rest) whose input x [b, s, h] waits for the backward in host memory and whose forward re-runs there
    (a fully recomputed block with its kept input offloaded); `rest`: non-differentiable arguments (masks,
    positions or None)."""
    require_tested_paddle()
    import numpy as np
    import paddle
    from paddle.autograd import PyLayer

    class OffloadedRecompute(PyLayer):
        @staticmethod
        def forward(ctx, x):
            ctx.rng = paddle.get_rng_state()
            ctx.np_rng = np.random.get_state()
            with paddle.no_grad():
                out = fn(x, *rest)
            ctx.host = to_host(x)  # the kept input, off the device until the backward
            ctx.device_copy = None
            ctx.stop = x.stop_gradient
            PREFETCH.add(ctx)
            return out

        @staticmethod
        def backward(ctx, dout):
            PREFETCH.start_previous(ctx)
            x = ctx.device_copy if ctx.device_copy is not None else to_device(ctx.host)
            x = x.detach()
            x.stop_gradient = False
            now, now_np = paddle.get_rng_state(), np.random.get_state()
            paddle.set_rng_state(ctx.rng)
            np.random.set_state(ctx.np_rng)
            try:
                with paddle.enable_grad():
                    out = fn(x, *rest)
            finally:
                paddle.set_rng_state(now)
                np.random.set_state(now_np)
            paddle.autograd.backward([out], [dout])
            return x.grad

    return OffloadedRecompute.apply(x)
