"""This process's slice of a full logical tensor under tensor parallelism.

    python -m pytest tests/parallel/test_slicing.py -q
    slices = TensorSlices(topo.tp_rank, layout.tp)
    init_parameters(named_params, cfg.model, seed, slices)      # llmtrain.models.init
    load_full_state(named_params, state, slices)

Initialisation and checkpoints work on the full logical tensor under its
canonical name; this module goes between that tensor and what one tp rank
holds. `TensorParallelRoles` (`tensor.py`) tags every parameter it splits with
its split axis (`llmtrain.contracts.tags`); each tp rank holds one contiguous chunk of that axis, rank r
the r-th (fleet's layout). An untagged parameter is whole on every rank.

Expert parallelism (`llmtrain/parallel/experts.py`): stacked routed experts are
tagged with their expert axis (axis 0, the expert index); each ep rank holds one
contiguous block of num_experts / ep experts, rank r the r-th. Experts are never
split across tp (they are whole on every tp rank).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

from llmtrain.contracts import tags


def split_axis(param: paddle.Tensor):
    """The axis of `param` cut across tp ranks, or None when every rank holds it whole."""
    return tags.split_axis(param)


def expert_axis(param: paddle.Tensor):
    """The expert axis of a stacked routed-expert tensor (cut across ep ranks), or None."""
    return tags.expert_axis(param)


def full_shape(param: paddle.Tensor, tp_degree: int, ep_degree: int = 1) -> list[int]:
    """Logical (unsplit) shape of a possibly tp-split or ep-split parameter."""
    shape = list(param.shape)
    axis = split_axis(param)
    if axis is not None:
        shape[axis] *= tp_degree
    axis = expert_axis(param)
    if axis is not None:
        shape[axis] *= ep_degree
    return shape


def local_slice(full: np.ndarray, param: paddle.Tensor, tp_rank: int, tp_degree: int,
                ep_rank: int = 0, ep_degree: int = 1) -> np.ndarray:
    """This rank's contiguous chunk of `full` along the split axis (fleet's layout), or its block of experts."""
    axis = expert_axis(param)
    if axis is not None and ep_degree > 1:
        size = full.shape[axis] // ep_degree
        index = [slice(None)] * full.ndim
        index[axis] = slice(ep_rank * size, (ep_rank + 1) * size)
        return full[tuple(index)]
    axis = split_axis(param)
    if axis is None or tp_degree == 1:
        return full
    size = full.shape[axis] // tp_degree
    index = [slice(None)] * full.ndim
    index[axis] = slice(tp_rank * size, (tp_rank + 1) * size)
    return full[tuple(index)]


@dataclass(frozen=True)
class TensorSlices:
    """The `slices` argument of `init_parameters` / `load_full_state` for one tp rank."""

    tp_rank: int = 0
    tp_degree: int = 1
    ep_rank: int = 0
    ep_degree: int = 1

    def full_shape(self, param: paddle.Tensor) -> list[int]:
        return full_shape(param, self.tp_degree, self.ep_degree)

    def local(self, full: np.ndarray, param: paddle.Tensor) -> np.ndarray:
        return local_slice(full, param, self.tp_rank, self.tp_degree, self.ep_rank, self.ep_degree)
