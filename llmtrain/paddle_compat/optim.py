"""Paddle optimizer and clip internals llmtrain reads or replaces (GPU and CPU path alike).

    for opt in optimizer_chain(optimizer): clip = get_grad_clip(opt)
    set_grad_clip(opt, recorder)                 # swap the clip fleet installed for a recording one
    squared_l2_norm(grad)                        # Paddle's fused kernel behind every global-norm clip

fleet and Paddle's ZeRO classes wrap the user's optimizer (`_inner_opt`, `_optim`)
and keep the clip in the private `_grad_clip` attribute; fleet's
`HybridParallelClipGrad` sums the squared norms in `_global_norm` and keeps its
inner clip, group and timers in `_clip`, `_hcg`, `_timers`. Read in Paddle 3.3.1.
"""
from __future__ import annotations

from llmtrain.contracts import tags
from llmtrain.paddle_compat.version import require_tested_paddle


def optimizer_chain(optimizer):
    """The optimizer and every optimizer it wraps (fleet's `_inner_opt`, Paddle ZeRO's `_optim`), outermost first."""
    require_tested_paddle()
    seen, todo = set(), [optimizer]
    while todo:
        opt = todo.pop()
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        yield opt
        todo += [opt.__dict__.get("_optim"), opt.__dict__.get("_inner_opt")]


def get_grad_clip(opt):
    """The clip object an optimizer (not its wrappers) applies, or None."""
    return opt.__dict__.get("_grad_clip")


def set_grad_clip(opt, clip) -> None:
    opt._grad_clip = clip


def squared_l2_norm(tensor):
    """sum(tensor^2) with Paddle's fused kernel (what ClipGradByGlobalNorm and fleet's clips use): shape [1]."""
    from paddle.nn.clip import _squared_l2_norm

    return _squared_l2_norm(tensor)


def recording_hybrid_clip_classes():
    """(fleet's HybridParallelClipGrad, a subclass storing `last_norm`, a factory cloning an instance into it).

    The subclass keeps fleet's norm logic (partial sums all-reduced over the mp, pp and
    sharding groups; tp-split parameters counted on every rank, replicated ones once)
    and stores sqrt(sum of squares) after the all-reduces."""
    require_tested_paddle()
    import paddle
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelClipGrad,
    )

    class RecordingHybridClip(HybridParallelClipGrad):
        last_norm = None
        expert_group = None  # expert parallelism: each expert's squared gradient norm is on one rank of this group
        expert_share = 1.0  # the share of the group's sum each rank adds (1/sharding: fleet sums over sharding next)
        _expert_fix = None
        # V1 tensor fusion under pp: {fused parameter name: [(offset, numel)]} of the later stages' copies of a tied
        # table inside this rank's fused parameters (the fused parameter cannot carry the copy's mark)
        shared_spans = None
        _shared_fix = None

        def _dygraph_clip(self, params_grads):
            if self.shared_spans:  # the squares of the copies' spans, taken back out of fleet's sums
                fix = {True: paddle.zeros([1], "float32"), False: paddle.zeros([1], "float32")}
                for p, g in params_grads:
                    spans = self.shared_spans.get(p.name)
                    if g is None or not spans or not getattr(p, "need_clip", True):
                        continue
                    flat = g.reshape([-1])
                    for off, n in spans:
                        fix[bool(getattr(p, "is_distributed", False))] += squared_l2_norm(flat[off: off + n]).astype("float32").reshape([1])
                self._shared_fix = fix
            if self.expert_group is not None:  # fleet counts them as replicated (identical on every rank)
                local = [squared_l2_norm(g).astype("float32").reshape([1]) for p, g in params_grads
                         if g is not None and getattr(p, "need_clip", True)
                         and tags.is_expert(p)]
                local = paddle.add_n(local) if local else paddle.zeros([1], "float32")
                total = local.clone()
                paddle.distributed.all_reduce(total, group=self.expert_group)
                self._expert_fix = total * self.expert_share - local
            return super()._dygraph_clip(params_grads)

        def _global_norm(self, global_norm_var_dist, global_norm_var_not_dist):
            if self._shared_fix is not None:  # a tied table's later copy counted once (its first stage's)
                global_norm_var_dist.add_(-self._shared_fix[True].reshape(global_norm_var_dist.shape))
                global_norm_var_not_dist.add_(-self._shared_fix[False].reshape(global_norm_var_not_dist.shape))
                self._shared_fix = None
            if self._expert_fix is not None:  # every expert counted once: a share of the group's sum replaces this rank's
                global_norm_var_not_dist.add_(self._expert_fix.reshape(global_norm_var_not_dist.shape))
                self._expert_fix = None
            super()._global_norm(global_norm_var_dist, global_norm_var_not_dist)
            if self._sums_dist_over_sep():  # each tp-split square counted once per context-parallel rank: undo
                global_norm_var_dist.scale_(1.0 / self._hcg.get_sep_parallel_world_size())
            self.last_norm = paddle.sqrt(global_norm_var_dist + global_norm_var_not_dist)

        def _sums_dist_over_sep(self) -> bool:
            """fleet all-reduces the tp-split squares over its check group, which spans the sep (context-parallel)
            axis too (fleet's `_set_check_group("data")`: every axis but dp), unless dp and sharding are both on
            or split_norm_comm is set; the sep ranks hold the same gradients, so that sum is cp times too big."""
            hcg = self._hcg
            if hcg.get_sep_parallel_world_size() <= 1 or hcg.get_model_parallel_world_size() <= 1:
                return False
            both = hcg.get_data_parallel_world_size() > 1 and hcg.get_sharding_parallel_world_size() > 1
            return not both and not self.split_norm_comm

    def clone(clip):
        return RecordingHybridClip(clip._clip, clip._hcg, clip.split_norm_comm, clip._timers)

    return HybridParallelClipGrad, RecordingHybridClip, clone


def group_sharded_clip_class():
    """Paddle's ZeRO-3 clip (`GroupShardedClipGrad`: norm over the sharding group only)."""
    require_tested_paddle()
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_utils import GroupShardedClipGrad

    return GroupShardedClipGrad


def optimizer_state_tensors(optimizer):
    """(variable name, tensor) of every accumulator (moments, beta powers) and master weight held by the
    Paddle optimizers under fleet's / Paddle ZeRO's wrappers (their private `_accumulators`, `_master_weights`)."""
    for opt in optimizer_chain(optimizer):
        accumulators = opt.__dict__.get("_accumulators")
        if not isinstance(accumulators, dict):
            continue
        for per_var in accumulators.values():
            yield from per_var.items()
        yield from (opt.__dict__.get("_master_weights") or {}).items()


def is_allocated(tensor) -> bool:
    """True if `tensor` exists and holds memory (a released ZeRO-3 parameter or a cleared grad does not)."""
    return tensor is not None and tensor._is_initialized()


def skip_in_dp_grad_sync(optimizer, skip, after=None) -> None:
    """fleet's HybridParallelOptimizer synchronises gradients in `_hybrid_sync_grad` before clipping and updating
    (every layout: the pipeline's `train_batch` steps the optimizer itself): ZeRO-1's reduce to each parameter's
    owner over the sharding group, then the dp all-reduce (when the model is not a `paddle.DataParallel`), both
    ignoring `no_sync`. Parameters for which `skip(param)` is true are left out of both (expert parallelism reduces
    them itself), and `after()` runs right after, still before the clip."""
    require_tested_paddle()
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelOptimizer,
    )

    found = False
    for opt in optimizer_chain(optimizer):
        if isinstance(opt, HybridParallelOptimizer):
            found = True
            sync = opt._hybrid_sync_grad

            def wrapped(params, _sync=sync):
                _sync([p for p in params if not skip(p)])
                if after is not None:
                    after()

            opt._hybrid_sync_grad = wrapped
    if not found:
        raise RuntimeError("no fleet HybridParallelOptimizer in the optimizer chain: expert gradients would not be "
                           "reduced")


def keep_local_in_zero1(optimizer, local, keep=None, after_sync=None) -> list:
    """fleet's stage-1 sharding optimizer (`DygraphShardingOptimizer`) with the parameters for which `local(param)`
    is true kept out of its partition: it partitions the others as before (sorted greedy, `_partition_parameters`),
    never reduces the local ones' gradients to an owner nor broadcasts them, and this rank updates, with its own
    optimizer state, the local parameters for which `keep(param)` is true (all of them when `keep` is None; their
    values differ per rank: experts). `after_sync()` runs right after fleet's broadcast of the updated shared
    parameters (the local ones' own broadcast). Returns the local parameters this rank updates.

    Internals (Paddle 3.3.1, without tensor fusion or comm overlap, the CPU and default path): `_parameter_list`
    (what it partitions and clears), `_rank2params` / `_param2rank` (owners: what `step` updates on this rank and
    `set_state_dict` loads), the inner optimizer's `_parameter_list` / `_param_groups` (what it allocates state for)
    and `_sharding_sync_parameters` (the broadcast of updated parameters from their owners, which must match on
    every rank: it runs over the shared partition only)."""
    require_tested_paddle()
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
        DygraphShardingOptimizer,
    )

    shard = next((o for o in optimizer_chain(optimizer) if isinstance(o, DygraphShardingOptimizer)), None)
    if shard is None or shard.tensor_fusion or shard.comm_overlap:
        raise RuntimeError("expected fleet's DygraphShardingOptimizer without tensor fusion or comm overlap")
    everything = shard._parameter_list
    mine = [p for p in everything if local(p) and (keep is None or keep(p))]
    shard._parameter_list = [p for p in everything if not local(p)]
    shared = shard._partition_parameters()  # the same rule over the replicated parameters only
    shard._parameter_list = everything  # clear_grad still clears every gradient
    owned = shared[shard._sharding_rank] + mine
    shard._rank2params = {**shared, shard._sharding_rank: owned}
    shard._param2rank = {p.name: r for r, params in shard._rank2params.items() for p in params}
    shard._set_inner_opt_attr("_parameter_list", owned)
    shard._set_inner_opt_attr("_param_groups", owned)
    sync = shard._sharding_sync_parameters

    def sync_shared():
        full = shard._rank2params
        shard._rank2params = shared
        try:
            sync()
        finally:
            shard._rank2params = full
        if after_sync is not None:
            after_sync()

    shard._sharding_sync_parameters = sync_shared
    return mine


ADAM_ACCUMULATORS = ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc", "moment2_max")
"""The accumulators of Paddle's Adam/AdamW per parameter (`moment2_max`: amsgrad)."""


class OptimizerState:
    """A Paddle optimizer's `state_dict()` read by (parameter variable name, accumulator name).

    Paddle keys an accumulator `<var name>_<accumulator>_0` and keeps master weights (AMP O2) under
    `master_weights`; this is the one place that knows it."""

    def __init__(self, state: dict):
        self.state = state
        self.masters = state.get("master_weights", {}) or {}

    def accumulators(self, var_name: str):
        """(accumulator name, tensor) of every Adam accumulator `var_name` has, in `ADAM_ACCUMULATORS` order."""
        for acc in ADAM_ACCUMULATORS:
            var = self.state.get(f"{var_name}_{acc}_0")
            if var is not None:
                yield acc, var

    def master(self, var_name: str):
        """The fp32 master weight of `var_name`, or None."""
        return self.masters.get(var_name)


def optimizer_state_dict(accumulators: dict, masters: dict, lr_state) -> dict:
    """The dict Paddle's `optimizer.set_state_dict` takes: accumulators {var name: {accumulator: tensor}}, master
    weights {var name: tensor} and the LR scheduler's state (Paddle's optimizer requires the key)."""
    state = {f"{var}_{acc}_0": tensor for var, per_var in accumulators.items() for acc, tensor in per_var.items()}
    if masters:
        state["master_weights"] = dict(masters)
    state["LR_Scheduler"] = lr_state
    return state


def fresh_optimizer_entries(optimizer, present: dict) -> dict:
    """{accumulator variable name: its value at creation} for every AdamW accumulator that exists on this rank but
    is not in `present` (a set_state_dict argument): zeros for the moments, beta1/beta2 for their power accumulators.

    A checkpoint written before the first update (the divergence guard's step 0) holds no optimizer state; Paddle's
    `set_state_dict` asserts every existing accumulator is given, so a rewind to it passes these fresh values."""
    require_tested_paddle()
    import paddle

    out = {}
    for opt in optimizer_chain(optimizer):
        accs = opt.__dict__.get("_accumulators") or {}
        for kind, per_param in accs.items():
            for var in per_param.values():
                if var.name in present:
                    continue
                if kind == "beta1_pow_acc":
                    fill = float(opt._beta1)
                elif kind == "beta2_pow_acc":
                    fill = float(opt._beta2)
                elif kind in ("moment1", "moment2", "moment2_max"):
                    fill = 0.0
                else:
                    raise ValueError(f"fresh_optimizer_entries: unknown accumulator {kind!r} of {type(opt).__name__}")
                out[var.name] = paddle.full(var.shape, fill, dtype=var.dtype)
    return out
