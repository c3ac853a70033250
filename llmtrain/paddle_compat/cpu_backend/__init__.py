"""Run fleet's hybrid parallelism (dp, tp, pp, sharding) on CPU processes over gloo.

Use, in the entry script, before `fleet.init`:

    from llmtrain.paddle_compat import cpu_backend
    cpu_backend.install()          # True on CPU (stand-ins installed), False elsewhere
    fleet.init(is_collective=True, strategy=strategy)

then launch with `python -m paddle.distributed.launch --nproc_per_node N script.py`.

`install()` is a no-op returning False unless `paddle.get_device() == "cpu"`, so the GPU
path never sees any of this. On CPU it checks `paddle.__version__` (the stand-ins patch
private functions of exactly paddlepaddle 3.3.1 and refuse any other release) and then
replaces, once per process:

  gloo_groups      collective._new_process_group_impl       private store per gloo group
  mp_ops           fleet mp_ops._c_identity/_c_concat/_c_split/_mp_allreduce/
                   _c_softmax_with_cross_entropy             PyLayers over gloo collectives
  tensor_parallel  hybrid_parallel_util.broadcast_input_data  no "gpu:N" on CPU
                   ParallelEnv.device_id                      unset on CPU builds
  pipeline_p2p     p2p_communication.initialize_p2p_groups, _batched_p2p_ops, _p2p_ops,
                   SendRecvMeta.send_meta/recv_meta           ordered per-direction channels
  dualpipe_p2p     DualPipeVParallel._commit_and_wait_comm    DualPipeV's batched p2p on those channels
  sequence_parallel  fleet sequence_parallel_utils.all_gather/reduce_scatter  gloo all_gather; all_reduce
                                                             then this rank's rows (gloo has no reduce-scatter)
  sharding         GroupShardedOptimizerStage2/GroupShardedStage2/GroupShardedStage3
                   constructors (device gate, "cpu" default), ParamStorage's param copy,
                   storage cvt_to_device, GroupShardedClipGrad._dygraph_clip,
                   group_sharded_parallel                     ZeRO stages 2 and 3 on CPU
  context_parallel llmtrain.paddle_compat.collectives.reduce_scatter/all_to_all/ring_shift
                                                             from gloo all_gather / all_reduce
  fused_comm       tensor_fusion_helper.get_current_device_type/alignment, dist.reduce_scatter (tensor form)
                                                             fleet's fused buffers (sharding V2, tensor fusion,
                                                             comm overlaps) on CPU

Each module's docstring says which Paddle function it replaces, why, and what the GPU
path does instead. `installed_patches()` lists the replaced attributes.

Not a patch, and applied to one-process CPU runs too (by `init_distributed`), not by install():
  host_allocator   glibc mallopt: freed host memory stays in the process (no page fault per
                   new large tensor), as Paddle's caching allocator keeps device memory on a GPU

Notes for the trainer on CPU:
  * call `check_strategy(strategy)` before `fleet.init`: `mp_configs.mp_async_allreduce`
    must stay False (its fused linear calls the raw c_identity kernel);
  * pipeline partial send/recv across tp ranks is always disabled on CPU (pipeline_p2p),
    whatever `pipeline_configs.enable_partial_send_recv` says; results are identical;
  * `group_sharded_parallel` must be looked up after install() (module attribute, or an
    import inside the function): a name imported earlier is Paddle's GPU-only original;
  * ParallelCrossEntropy with mp degree 1 returns None in Paddle (CPU and GPU alike):
    use a plain cross entropy when tp == 1;
  * group_sharded offload=True is refused on CPU (nothing to offload to).
"""

from __future__ import annotations

import paddle

from . import (context_parallel, dualpipe_p2p, fused_comm, gloo_groups, mp_ops, pipeline_p2p, sequence_parallel,
               sharding, tensor_parallel)
from ..patching import installed as installed_patches
from ..version import TESTED_PADDLE_VERSION, check_paddle_version

__all__ = ["install", "is_installed", "installed_patches", "check_strategy", "TESTED_PADDLE_VERSION"]

_INSTALLED = False


def install() -> bool:
    """Install every CPU stand-in; idempotent. Returns True if active, False off-CPU."""
    global _INSTALLED
    if paddle.get_device() != "cpu":
        return False  # GPU-ONLY(fleet-nccl): fleet's own kernels and process groups, nothing replaced
    if _INSTALLED:
        return True
    check_paddle_version()
    for module in (gloo_groups, mp_ops, tensor_parallel, pipeline_p2p, dualpipe_p2p, sharding, sequence_parallel,
                   context_parallel, fused_comm):
        module.install_patches()
    _INSTALLED = True
    return True


def is_installed() -> bool:
    return _INSTALLED


def check_strategy(strategy) -> None:
    """Raise ValueError for strategy options the CPU backend cannot honour."""
    mp_configs = strategy.hybrid_configs["mp_configs"]
    if mp_configs.mp_async_allreduce:
        raise ValueError(
            "hybrid_configs.mp_configs.mp_async_allreduce=True is GPU-only: its fused "
            "column-parallel linear calls the c_identity kernel directly, which has no "
            "CPU implementation. Leave it False on CPU."
        )


def stop_pipeline_channels() -> None:
    """Let the pipeline channel threads finish queued work (what their atexit hook does)."""
    pipeline_p2p._LINKS.stop()

