"""Every use of Paddle internals, behind one fence and one version check.

    python -m pytest tests/paddle_compat -q

llmtrain uses only public Paddle 3.x APIs except in this package. Each module here
checks `paddle.__version__` (`version.py`: exactly 3.3.1, or it refuses with the list
to re-audit) before it touches a private name. On a Paddle upgrade, re-read each entry
of `AUDIT` in the new release, fix what moved, then raise `TESTED_PADDLE_VERSION`.

- `cpu_backend/`: stand-ins that let fleet's GPU-only pieces (tensor-parallel kernels,
  pipeline p2p, gloo sub-groups, ZeRO-2/3 device gates) run on CPU processes over gloo;
  installed only when the device is CPU, so the GPU path never sees them.
- `optim.py`, `zero.py`, `fleet.py`, `amp.py`, `process.py`: the private attributes the training
  path reads or sets on every device; `host_memory.py`: the host allocator's counter (planner checks);
  `elastic.py`: the restart race of Paddle's etcd launcher (installed by `python -m llmtrain.launch`).
- `kernels.py`, `moe_kernels.py`: public but release-sensitive fused kernels (`paddle.incubate`), chosen on GPU;
  the MoE combine kernel only with the tested release (else the tensor ops).
"""
from __future__ import annotations

from llmtrain.paddle_compat.version import TESTED_PADDLE_VERSION, check_paddle_version, require_tested_paddle

__all__ = ["AUDIT", "TESTED_PADDLE_VERSION", "check_paddle_version", "require_tested_paddle"]

AUDIT = (
    # (private Paddle name, where we use it, why) -- the list to re-read on a Paddle upgrade
    ("Optimizer._grad_clip, HybridParallelOptimizer._inner_opt, GroupSharded*._optim",
     "paddle_compat/optim.py", "find and replace the clip fleet/ZeRO installed, to record the global norm"),
    ("HybridParallelClipGrad._global_norm/_clip/_hcg/_timers/split_norm_comm",
     "paddle_compat/optim.py", "subclass fleet's hybrid clip to keep its cross-group norm"),
    ("paddle.nn.clip._squared_l2_norm", "paddle_compat/optim.py", "the fused kernel every global-norm clip uses"),
    ("HybridParallelOptimizer._hybrid_sync_grad", "paddle_compat/optim.py",
     "leave expert gradients out of fleet's dp / ZeRO-1 sync and reduce them right after (expert parallelism)"),
    ("DygraphShardingOptimizer._parameter_list/_partition_parameters/_rank2params/_param2rank/"
     "_set_inner_opt_attr/_sharding_sync_parameters/_sharding_rank", "paddle_compat/optim.py",
     "keep experts out of the ZeRO-1 partition: each sharding rank updates its own (ep x sharding)"),
    ("group_sharded_utils.GroupShardedClipGrad", "paddle_compat/optim.py", "record the ZeRO-3 clip norm"),
    ("GroupShardedStage3._param2buffer/_param2buffer_size/_rank, param.fw_storage",
     "paddle_compat/zero.py, checkpoint/", "save and load each rank's ZeRO-3 flat slice"),
    ("GroupShardedStage3._grad_storages, GradStorage._params/_param_ids/_param2align/_array_grads/buffer",
     "paddle_compat/zero.py", "lay ZeRO-3's all-reduced storage of unsliced gradients out by structured name (Paddle "
     "orders it by unique names, which can differ between ranks) and check each gradient is still its view"),
    ("fleet.layers.mpu.mp_ops._c_identity", "paddle_compat/fleet.py", "tied LM head under tp: identity forward, "
     "all-reduce of the input gradient backward"),
    ("PipelineLayer.shared_comm, param.is_firstly_shared", "paddle_compat/fleet.py",
     "count a tied table once in the pipeline's gradient norm (Paddle never sets the flag)"),
    ("PipelineParallel.accumulate_steps/forward_hooks/backward_hooks/_chunk_2_comm_buffers",
     "paddle_compat/fleet.py", "a per-step micro-batch count for 1F1B pipelines (batch ramp-up); the strategy's "
     "accumulate_steps is read once at construction"),
    ("Optimizer._apply_optimize, Tensor._copy_to/_share_buffer_to/pin_memory", "paddle_compat/offload.py",
     "optimizer state to host memory around each update; a recomputed block's input to host memory (offload)"),
    ("paddle.base.core.host_memory_stat_current_value", "paddle_compat/host_memory.py",
     "bytes held on the host after a forward: the planner's activation check under recompute"),
    ("launch.controllers.master.ETCDMaster.register_heartbeat/restart_peer/wait_peer_ready, beat_thread, "
     "heartbeat_prefix, Context.status", "paddle_compat/elastic.py",
     "fix the etcd launcher's restart race (FAILED -> RESTARTING only via a watch callback; a heartbeat thread "
     "that ends while FAILED never comes back)"),
    ("GradScaler._found_inf/_scale/_optimizer_states/_cache_found_inf/_decr_count/_incr_count, "
     "amp.grad_scaler._refresh_optimizer_state", "paddle_compat/amp.py",
     "the fp16 loss scaler: its overflow flag read inside the clip (the divergence guard), its per-step state reset "
     "after a rejected step, and `_update` without the float()-of-a-[1]-tensor TypeError of numpy >= 2"),
    ("Layer._cast_to_low_precision, amp.auto_cast.amp_global_state().amp_dtype, Tracer._amp_level",
     "paddle_compat/amp.py", "fp32 islands under O2 (the MoE router and combine): a layer's parameters kept fp32 by "
     "decorate, an auto_cast(enable=False) block that leaves the recorded AMP dtype as it was"),
    ("os._exit after closing outputs", "paddle_compat/process.py",
     "skip an interpreter teardown that can crash in gloo after a CPU job finished"),
    ("paddle._C_ops.flash_attn/flash_attn_grad", "paddle_compat/flash_blocks.py",
     "the context-parallel ring's per-block flash attention with its log-sum-exp, back-propagated with the merged "
     "output and log-sum-exp (GPU only; as Paddle's own auto_parallel ring_attention)"),
    ("DygraphShardingOptimizerV2._comm_buffer_list/_color_to_comm_buffer_list/_parameter_list/_slice_params/"
     "_collect_comm_buffers/_assign_slice_grad/filter_parameters, FusedCommBuffer._sharding_param_grad_view/"
     "_comm_grads/scale_grads/grad_storage/need_reduce_scale_sync, a parameter's `color`", "paddle_compat/sharding_v2.py",
     "V2's per-parameter slices (checkpoints, holdings), the timeline of its bucket collectives, the routed experts' "
     "own buckets over edp and their 1/ep, the slices assigned before fleet's dp / sep all-reduce reads them"),
    ("DygraphShardingOptimizer._rank2fused/_rank2params/_sharding_rank/_inner_opt/tensor_fusion/comm_overlap/"
     "origin_decay_param_fun/_set_inner_opt_attr", "paddle_compat/sharding_fused.py",
     "V1 tensor fusion's fused optimizer state cut to canonical parameter names and laid back; V1 comm overlap's "
     "weight-decay rule restored (fleet keys it on fused names while updating the unfused parameters)"),
    ("collective._new_process_group_impl, mp_ops._c_*/_mp_allreduce/_c_softmax_with_cross_entropy, "
     "hybrid_parallel_util.broadcast_input_data, ParallelEnv.device_id, p2p_communication internals, "
     "GroupSharded* constructors, ParamStorage, GroupShardedClipGrad._dygraph_clip, group_sharded_parallel",
     "paddle_compat/cpu_backend/", "CPU stand-ins (each module's docstring says what and why)"),
)
