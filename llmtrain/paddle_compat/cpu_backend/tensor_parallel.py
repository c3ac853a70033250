"""CPU stand-ins for the device checks around fleet's tensor/pipeline-parallel wrappers.

Use: installed by `llmtrain.paddle_compat.cpu_backend.install()`. Afterwards
`fleet.distributed_model(model)` returns a working `TensorParallel` (its forward
broadcasts the inputs over the model-parallel group) and `PipelineLayer(...)` can be
constructed on a CPU-only Paddle build.

Two Paddle 3.3.1 functions are replaced:

* `fleet.utils.hybrid_parallel_util.broadcast_input_data` (also imported by name into
  `fleet.meta_parallel.tensor_parallel`, which is where `TensorParallel._pre_forward`
  looks it up). Paddle asserts the current device is gpu/xpu/custom and parses a device
  index from "gpu:N" before broadcasting every input tensor from the mp group's source
  rank. On CPU there is no index and the tensors already live on the CPU place, so the
  stand-in calls Paddle's own `_broadcast_nested_data` with the CPU place. On GPU the
  original copies each input to "gpu:N" first and then does the same broadcast.

* `paddle.distributed.ParallelEnv.device_id` (paddle/distributed/parallel.py), read by
  `PipelineLayer.__init__` (and `fleet.recompute.recompute_hybrid` for offload). A CPU
  build never sets `_device_id` (only the CUDA/XPU/custom branches of
  `ParallelEnv.__init__` do), so the property raises AttributeError. The stand-in
  returns the set value or 0 (the only CPU "device"). On GPU `_device_id` is always
  set from FLAGS_selected_gpus and the stand-in is not installed.
"""

from __future__ import annotations

import paddle
from paddle.distributed import ParallelEnv
from paddle.distributed.fleet.meta_parallel import tensor_parallel as paddle_tensor_parallel
from paddle.distributed.fleet.utils import hybrid_parallel_util

from ..patching import replace


def broadcast_input_data(hcg, *inputs, **kwargs):
    """CPU stand-in for `hybrid_parallel_util.broadcast_input_data` (see module docstring).

    Every tensor in `inputs`/`kwargs` (nested lists/tuples/dicts too) is overwritten in
    place with the model-parallel source rank's value; other objects are broadcast with
    `broadcast_object_list`. Returns the same `(inputs, kwargs)` structure as Paddle.
    """
    place = paddle.CPUPlace()
    if len(inputs) > 0:
        inputs = hybrid_parallel_util._broadcast_nested_data(hcg, "cpu", place, inputs)
    if len(kwargs) > 0:
        kwargs = hybrid_parallel_util._broadcast_nested_data(hcg, "cpu", place, kwargs)
    return inputs, kwargs


def _device_id(self) -> int:
    """CPU stand-in for the `ParallelEnv.device_id` property (see module docstring)."""
    return getattr(self, "_device_id", 0)


def install_patches() -> None:
    replace(hybrid_parallel_util, "broadcast_input_data", broadcast_input_data)
    replace(paddle_tensor_parallel, "broadcast_input_data", broadcast_input_data)
    replace(ParallelEnv, "device_id", property(_device_id))
