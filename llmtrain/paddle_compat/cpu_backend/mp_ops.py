"""Tensor-parallel communication ops for CPU: fleet's mp_ops rebuilt on gloo collectives.

Use: installed by `llmtrain.paddle_compat.cpu_backend.install()`. Afterwards fleet's
`ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding` and
`ParallelCrossEntropy` (paddle/distributed/fleet/layers/mpu/mp_layers.py) run on CPU
processes launched with `python -m paddle.distributed.launch`.

Why. In Paddle 3.3.1 the dygraph paths of `_c_identity`, `_c_concat`, `_c_split`,
`_mp_allreduce` and `_c_softmax_with_cross_entropy` (mpu/mp_ops.py) call the C++ ops
c_identity / c_concat / c_split / mp_allreduce_sum / c_softmax_with_cross_entropy,
whose kernels exist only for GPU/XPU/custom devices and talk to NCCL-style comm
contexts. Each stand-in below is a PyLayer built from `paddle.distributed.all_reduce` /
`all_gather` (both supported by gloo) with the forward and backward of the GPU op.
`_c_lookup_table` (c_embedding) has a CPU kernel and is left alone.

Conventions, as in the GPU kernels: "split"/"concat" act on the LAST axis; a tensor-
parallel group of n ranks holds equal slices; rank r owns slice r.

Static-graph / PIR calls (not used by llmtrain) are passed to Paddle's originals.
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer
from paddle.distributed import collective
from paddle.distributed.fleet.layers.mpu import mp_ops as paddle_mp_ops
from paddle.framework import in_dynamic_mode

from ..patching import original, replace

_REPLACED = (
    "_c_identity",
    "_c_concat",
    "_c_split",
    "_mp_allreduce",
    "_c_softmax_with_cross_entropy",
)


def _contiguous(x):
    return x if x.is_contiguous() else x.contiguous()


def _all_gather_last_axis(x, group):
    """[..., d] on each of n ranks -> [..., n*d], rank order."""
    parts: list = []
    dist.all_gather(parts, _contiguous(x), group=group)
    return paddle.concat(parts, axis=-1)


def _own_slice_last_axis(x, group):
    """[..., n*d] -> this rank's [..., d]."""
    return paddle.split(x, group.nranks, axis=-1)[group.rank].clone()


def _summed(x, group):
    out = _contiguous(x).clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class _CopyToGroup(PyLayer):
    """Forward: identity. Backward: sum the gradient over the group (c_identity)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return _summed(dy, ctx.group)


class _ReduceFromGroup(PyLayer):
    """Forward: sum over the group (mp_allreduce_sum). Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _summed(x, group)

    @staticmethod
    def backward(ctx, dy):
        return dy


class _GatherLastAxis(PyLayer):
    """Forward: all-gather along the last axis (c_concat). Backward: keep own slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last_axis(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _own_slice_last_axis(dy, ctx.group)


class _SplitLastAxis(PyLayer):
    """Forward: keep own slice of the last axis (c_split). Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_slice_last_axis(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_last_axis(dy, ctx.group)


class _VocabParallelSoftmaxCE(PyLayer):
    """Cross entropy over logits split along the vocabulary (last) axis.

    logits: [..., V/n] this rank's vocabulary slice; label: [..., 1] global ids.
    Returns (loss [..., 1], softmax [..., V/n]); loss is 0 where label == ignore_index,
    and so is the gradient, exactly like the GPU c_softmax_with_cross_entropy kernel.
    """

    @staticmethod
    def forward(ctx, logits, label, group, ignore_index):
        vocab_local = logits.shape[-1]
        lab = label.reshape([-1]).astype("int64")  # [N]
        valid = ((lab >= 0) & (lab < vocab_local * group.nranks)) | (lab == ignore_index)
        if not bool(valid.all()):
            raise ValueError(
                f"ParallelCrossEntropy: labels must lie in [0, {vocab_local * group.nranks}) "
                f"or equal ignore_index={ignore_index}"
            )

        def reduce(t, op):  # in place over the group, as fleet's kernel reduces over the mp ranks
            dist.all_reduce(t, op=op, group=group)

        loss, softmax, saved = vocab_ce_forward(logits.reshape([-1, vocab_local]), lab,
                                                group.rank * vocab_local, ignore_index, reduce)
        ctx.save_for_backward(*saved)
        ctx.logits_shape = logits.shape
        ctx.mark_non_differentiable(softmax)
        return loss.reshape(label.shape), softmax.reshape(logits.shape)

    @staticmethod
    def backward(ctx, dloss, dsoftmax_unused):
        return vocab_ce_backward(ctx.saved_tensor(), dloss).reshape(ctx.logits_shape), None


def vocab_ce_forward(x, lab, start: int, ignore_index: int, reduce):
    """The local math of `_VocabParallelSoftmaxCE.forward` on this rank's logits x [N, V/n] (vocabulary rows
    start..start+V/n) and global labels lab [N]; `reduce(tensor, op)` sums or maxes a tensor over the group in
    place (three calls, [N, 1] each). Returns (loss [N, 1], softmax [N, V/n], what the backward keeps). The
    planner's calibration (`llmtrain.plan.measure`) times this and `vocab_ce_backward` with an identity
    `reduce`, so the cost model prices the ops this stand-in really runs."""
    vocab_local = x.shape[-1]
    row_max = x.max(axis=-1, keepdim=True)  # [N, 1]
    reduce(row_max, dist.ReduceOp.MAX)
    shifted = x - row_max  # [N, V/n]

    mine = (lab >= start) & (lab < start + vocab_local)  # [N]
    local_lab = paddle.where(mine, lab - start, paddle.zeros_like(lab))
    target = paddle.take_along_axis(shifted, local_lab.unsqueeze(-1), axis=-1)
    target = target * mine.astype(x.dtype).unsqueeze(-1)  # [N, 1], 0 if not mine
    reduce(target, dist.ReduceOp.SUM)

    exp = paddle.exp(shifted)  # [N, V/n]
    sum_exp = exp.sum(axis=-1, keepdim=True)  # [N, 1]
    reduce(sum_exp, dist.ReduceOp.SUM)

    ignored = (lab == ignore_index).unsqueeze(-1)  # [N, 1]
    loss = paddle.where(ignored, paddle.zeros_like(target), paddle.log(sum_exp) - target)
    softmax = exp / sum_exp
    return loss, softmax, (softmax, local_lab, mine, ignored)


def vocab_ce_backward(saved, dloss):
    """The gradient of `vocab_ce_forward`'s loss for its logits [N, V/n], from what it kept and dloss [N, 1]."""
    softmax, local_lab, mine, ignored = saved
    one_hot = paddle.nn.functional.one_hot(local_lab, softmax.shape[-1])  # [N, V/n]
    one_hot = one_hot.astype(softmax.dtype) * mine.astype(softmax.dtype).unsqueeze(-1)
    grad = (softmax - one_hot) * dloss.reshape([-1, 1])
    return paddle.where(ignored, paddle.zeros_like(grad), grad)


def _c_identity(tensor, group=None, skip_c_identity_dynamic=False):
    """CPU stand-in for fleet mp_ops `_c_identity` (mpu/mp_ops.py).

    GPU: `_C_ops.c_identity` forward, all_reduce_on_calc_stream of the grad backward.
    Here: the same as a PyLayer over `dist.all_reduce`.
    """
    if group is not None and not group.is_member():
        return None
    if not in_dynamic_mode():
        return original(paddle_mp_ops, "_c_identity")(tensor, group, skip_c_identity_dynamic)
    if skip_c_identity_dynamic:
        return tensor
    group = collective._get_default_group() if group is None else group
    return _CopyToGroup.apply(tensor, group)


def _c_concat(tensor, group=None):
    """CPU stand-in for fleet mp_ops `_c_concat` (mpu/mp_ops.py).

    GPU: `_C_ops.c_concat` (all-gather along the last axis; grad = own slice).
    Here: a PyLayer over `dist.all_gather`.
    """
    if group is not None and not group.is_member():
        return None
    if not in_dynamic_mode():
        return original(paddle_mp_ops, "_c_concat")(tensor, group)
    group = collective._get_default_group() if group is None else group
    return _GatherLastAxis.apply(tensor, group)


def _c_split(tensor, group=None):
    """CPU stand-in for fleet mp_ops `_c_split` (mpu/mp_ops.py).

    GPU: `_C_ops.c_split` (own slice of the last axis; grad = all-gather).
    Here: a PyLayer whose backward uses `dist.all_gather` along the last axis.
    """
    if group is not None and not group.is_member():
        return None
    if not in_dynamic_mode():
        return original(paddle_mp_ops, "_c_split")(tensor, group)
    group = collective._get_default_group() if group is None else group
    return _SplitLastAxis.apply(tensor, group)


def _mp_allreduce(
    tensor,
    op=dist.ReduceOp.SUM,
    group=None,
    use_calc_stream=True,
    use_model_parallel=True,
    skip_c_identity_dynamic=False,
):
    """CPU stand-in for fleet mp_ops `_mp_allreduce` (mpu/mp_ops.py).

    GPU: in-place all_reduce_on_calc_stream forward, `_C_ops.c_identity` backward (the
    grad passes through unchanged). Here: out-of-place `dist.all_reduce` forward,
    identity backward. Callers only use the returned tensor.
    """
    if group is not None and not group.is_member():
        return None
    if not in_dynamic_mode():
        return original(paddle_mp_ops, "_mp_allreduce")(
            tensor, op, group, use_calc_stream, use_model_parallel, skip_c_identity_dynamic
        )
    if op != dist.ReduceOp.SUM:
        raise ValueError(f"_mp_allreduce supports ReduceOp.SUM only, got {op}")
    group = collective._get_default_group() if group is None else group
    return _ReduceFromGroup.apply(tensor, group)


def _c_softmax_with_cross_entropy(
    logits, label, group=None, return_softmax=False, ignore_index=-100
):
    """CPU stand-in for fleet mp_ops `_c_softmax_with_cross_entropy` (mpu/mp_ops.py).

    GPU: `_C_ops.c_softmax_with_cross_entropy` (three NCCL all-reduces inside the
    kernel). Here: `_VocabParallelSoftmaxCE` with the same three reductions over gloo.
    Same contract: label [..., 1] or [...] of global ids; per-token loss with the
    label's trailing 1 kept ([..., 1]); 0 loss and 0 grad where label == ignore_index.
    Soft labels (label last dim > 1) are not supported (ParallelCrossEntropy never
    passes them).
    """
    if group is not None and not group.is_member():
        return None
    if not in_dynamic_mode():
        return original(paddle_mp_ops, "_c_softmax_with_cross_entropy")(
            logits, label, group, return_softmax, ignore_index
        )
    group = collective._get_default_group() if group is None else group
    if len(label.shape) == len(logits.shape) - 1:
        label = paddle.unsqueeze(label, axis=-1)
    if len(label.shape) != len(logits.shape) or label.shape[-1] != 1:
        raise ValueError(
            f"ParallelCrossEntropy on CPU needs hard labels of shape logits.shape[:-1] "
            f"(+ [1]); got logits {list(logits.shape)} and label {list(label.shape)}"
        )
    loss, softmax = _VocabParallelSoftmaxCE.apply(logits, label, group, ignore_index)
    return (loss, softmax) if return_softmax else loss


def install_patches() -> None:
    """Replace the five ops in mp_ops and in collective (which re-exports them)."""
    stand_ins = {name: globals()[name] for name in _REPLACED}
    for name, fn in stand_ins.items():
        replace(paddle_mp_ops, name, fn)
        if hasattr(collective, name):
            replace(collective, name, fn)
