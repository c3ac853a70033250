"""Count the Paddle calls that make the host wait for the device (a test instrument, no GPU needed).

    from host_syncs import count_host_syncs
    with count_host_syncs() as syncs:
        loss = model(ids); loss.backward()
    assert syncs.total <= 3, syncs.calls

On a GPU every one of these copies a value (or a data-dependent size) from the device to the host and blocks the
Python thread until the queue before it has run:
- a tensor's value read on the host: `Tensor.numpy`, `item`, `tolist`, `__float__`, `__int__`, `__bool__` (an `if`
  on a tensor), `__index__`, `__array__`, `__repr__`/`__str__`;
- ops whose OUTPUT SHAPE depends on the data, so the host must learn it before it can describe the result:
  `paddle.nonzero`, `masked_select`, one-argument `paddle.where`, `unique`, `unique_consecutive`, `bincount`,
  `Tensor.__getitem__` with a boolean mask, `paddle.repeat_interleave` with a tensor of repeats.
A read inside another counted call (`__float__` calling `item`) counts once.

What a count proves, and what it does not: it counts the Python calls above made while the block runs, on CPU. A
GPU synchronisation that happens inside Paddle's C++ is invisible to it: a kernel that copies a device value to the
host itself (an attribute given as a device tensor, e.g. `topk` with a tensor k or `arange` with device bounds; a
data-shaped op reached from C++; `moe_permute`'s host token counts, `moe_gate_dispatch_partial_nosoftmaxtopk`), a
collective, or the CUDA allocator waiting for memory. So "0 counted" means the model code asks for no value on the
host, not that the GPU stream never stalls; which kernels of the MoE path synchronise internally was read in their
sources (docs/models.md, "Host synchronisation"), not measured here.
"""
from __future__ import annotations

import contextlib
import traceback

import paddle

TENSOR_READS = ("numpy", "item", "tolist", "__float__", "__int__", "__bool__", "__index__", "__array__",
                "__repr__", "__str__", "nonzero", "masked_select", "unique", "unique_consecutive")
"""paddle.Tensor methods that read values (or a data-dependent shape) on the host."""
DATA_SHAPED = ("nonzero", "masked_select", "unique", "unique_consecutive", "bincount")
"""paddle functions whose output shape depends on the data."""


class HostSyncs:
    """What `count_host_syncs` saw: `calls`, one (name, caller line) per synchronising call."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.depth = 0

    @property
    def total(self) -> int:
        return len(self.calls)

    def record(self, name: str) -> None:
        """Note a call, with the innermost caller outside Paddle and this file (the line that asked for it)."""
        outside = [f for f in traceback.extract_stack()[:-2]
                   if "site-packages/paddle" not in f.filename and not f.filename.endswith("host_syncs.py")]
        where = f"{outside[-1].filename}:{outside[-1].lineno}" if outside else "?"
        self.calls.append((name, where))


def _counted(syncs: HostSyncs, name: str, fn, when=None):
    def wrapper(*args, **kwargs):
        outer = syncs.depth == 0
        if outer and (when is None or when(*args, **kwargs)):
            syncs.record(name)
        syncs.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            syncs.depth -= 1
    return wrapper


def _bool_index(self, item, *rest):
    items = item if isinstance(item, tuple) else (item,)
    return any(isinstance(i, paddle.Tensor) and i.dtype == paddle.bool for i in items)


def _one_arg_where(condition, x=None, y=None, name=None):
    return x is None and y is None


def _tensor_repeats(x, repeats, axis=None, name=None, **kw):
    return isinstance(repeats, paddle.Tensor)


@contextlib.contextmanager
def count_host_syncs():
    """Count synchronising calls made inside the block (forward and backward: a PyLayer's backward is Python too)."""
    syncs = HostSyncs()
    saved = []

    def patch(owner, attr, name, when=None):
        fn = getattr(owner, attr)
        saved.append((owner, attr, fn))
        setattr(owner, attr, _counted(syncs, name, fn, when))

    for attr in TENSOR_READS:
        if hasattr(paddle.Tensor, attr):
            patch(paddle.Tensor, attr, f"Tensor.{attr}")
    patch(paddle.Tensor, "__getitem__", "Tensor[bool mask]", _bool_index)
    for attr in DATA_SHAPED:
        patch(paddle, attr, f"paddle.{attr}")
    patch(paddle, "where", "paddle.where(cond)", _one_arg_where)
    patch(paddle, "repeat_interleave", "paddle.repeat_interleave(tensor repeats)", _tensor_repeats)
    try:
        yield syncs
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)
