"""Applying a layout: build this rank's part of the model, then wrap it (and its optimizer) for the layout.

    built = build_local_model(cfg.model, layout, topo, recompute)   # BuiltModel; tp roles at construction, pp cut
    ... initialise, build the optimizer, AMP-decorate (llmtrain.train.trainer) ...
    model, optimizer, scaler = parallelize(built, optimizer, scaler, layout, topo)

Paddle's manual hybrid mode fixes the order: tensor parallelism acts while the
model is constructed (the model asks `Roles` for its layers; under tp they are
fleet's parallel layers), the pipeline cuts the model's stage list into a
`PipelineLayer`, and only then are model and optimizer wrapped: fleet's
`distributed_model`/`distributed_optimizer` (dp, tp, pp, sharding stage 1) or
Paddle's group-sharded classes (ZeRO-2/3), which wrap model and optimizer in one
call — which is why `parallelize` takes both. Nothing here knows about the
training loop, AMP or clipping (`llmtrain.train` uses this module, not the reverse).
"""
from __future__ import annotations

from llmtrain.contracts import tags
from llmtrain.contracts.steps import BuiltModel
from llmtrain.models import build_model
from llmtrain.models.roles import Roles
from llmtrain.parallel.layout import Layout
from llmtrain.parallel.strategy import Topology


def make_roles(layout: Layout, topo: Topology, context=None) -> Roles:
    """The layer factory of this layout: fleet's tensor-parallel layers when tp > 1 (sequence-parallel ones with
    parallel.sequence_parallel), plain layers otherwise; under ep > 1 the routed experts are spread over the ep
    group (`llmtrain.parallel.experts`); under cp > 1 (`context`, a `ContextPlan`) every attention core is wrapped
    in the cp exchange."""
    roles = Roles()
    if layout.v_shape:  # DualPipeV (no tp): linears whose weight gradient the schedule may defer
        from llmtrain.parallel.dualpipe import SplitWeightGradRoles

        roles = SplitWeightGradRoles()
    if layout.tp > 1 and layout.sequence_parallel:
        from llmtrain.parallel.sequence import SequenceParallelRoles

        roles = SequenceParallelRoles(topo)
    elif layout.tp > 1:
        from llmtrain.parallel.tensor import TensorParallelRoles

        roles = TensorParallelRoles(topo)
    if layout.ep > 1:
        from llmtrain.parallel.experts import ExpertParallelRoles

        roles = ExpertParallelRoles(roles, topo, layout.ep, layout.ep_dispatcher)
    if context is not None:
        roles = context.roles(roles)
    return roles


def build_local_model(model_cfg, layout: Layout, topo: Topology, recompute=False, lora=None,
                      positions: bool = False) -> BuiltModel:
    """This rank's model — the whole model, or its pipeline stage(s) as a `PipelineLayer` — with its loss and the
    step hooks of the model and the plan (`llmtrain.contracts.steps.BuiltModel`).

    `loss_fn` is None under pipeline parallelism (the PipelineLayer owns the loss). `lora`
    (`finetune.lora`): adapters attached to this rank's matching linears, split like their base. `positions`: the
    batches carry position and document ids (`data.document_mask`), which a pipeline's stages pass along (always
    so under cp > 1)."""
    from llmtrain.models.lora import attach_lora

    context = None
    if layout.cp > 1:
        from llmtrain.parallel.context import ContextPlan

        context = ContextPlan(topo, layout.cp_comm)
    roles = make_roles(layout, topo, context)
    wrap_loss = context.loss if context is not None else (lambda loss_fn: loss_fn)
    if layout.pp > 1:
        from llmtrain.parallel.pipeline import build_pipeline

        core, hooks = build_pipeline(model_cfg, layout, roles, topo, recompute, wrap_loss=wrap_loss,
                                     carry=positions or context is not None)
        built = BuiltModel(core, None, pipeline=True, hooks=hooks)
    else:
        core = build_model(model_cfg, roles, recompute)
        built = BuiltModel(core, wrap_loss(core.loss_fn), pipeline=False, hooks=core.step_hooks())
    if context is not None:
        built.hooks.append(context)
        built.inputs, built.report = context.localize, context.report
    if lora is not None:
        attach_lora(core, lora, roles)
    if layout.tp > 1 and layout.sequence_parallel:
        from llmtrain.parallel.sequence import install_grad_allreduce

        install_grad_allreduce(core, layout.grad_accum)  # norm weights: all-reduce their gradients over tp
    return built


def parallelize(built: BuiltModel, optimizer, scaler, layout: Layout, topo: Topology):
    """(model, optimizer, scaler) wrapped for `layout`; unchanged on one process. A wrapper's step hooks (ZeRO-3's)
    join `built.hooks`.

    dp/tp/pp/sharding stage 1: fleet's `distributed_model` (DataParallel, TensorParallel
    or PipelineParallel), `distributed_optimizer` (HybridParallelOptimizer, with the
    stage-1 sharding optimizer) and `distributed_scaler`. Sharding stage 2/3: Paddle's
    `group_sharded_parallel` over fleet's sharding group (`llmtrain.parallel.zero`)."""
    core = built.core
    if not layout.distributed:
        return core, optimizer, scaler
    if layout.sharding_stage in (2, 3):
        from llmtrain.parallel.zero import wrap_zero

        model, optimizer, scaler, hooks = wrap_zero(core, optimizer, scaler, layout, topo)
        built.hooks.extend(hooks)
        return model, optimizer, scaler
    from paddle.distributed import fleet

    # dp_comm_overlap under ep: fleet's pipeline builds its dp buckets (every trainable parameter, one group) while
    # wrapping; the routed experts are kept out of them (flagged stop_gradient meanwhile, fleet's own filter) and
    # reduced over their expert-data-parallel group by llmtrain.parallel.expert_states, as without the overlap
    # (measured with them in: MoE under dp2 x pp2 x ep2, step-1 grad_norm 0.54342 for one process's 0.54357)
    experts = [p for p in core.parameters() if tags.is_expert(p) and not p.stop_gradient] \
        if layout.dp_comm_overlap and layout.ep > 1 else []
    for p in experts:
        p.stop_gradient = True
    try:
        if layout.v_shape:  # fleet's DualPipeVParallel, keeping the step loss and with an evaluation pass
            from llmtrain.paddle_compat.dualpipe import dualpipev_model

            model = dualpipev_model(core)
        else:
            model = fleet.distributed_model(core)
    finally:
        for p in experts:
            p.stop_gradient = False
    if layout.dp_comm_overlap and layout.cp > 1:
        # fleet fuses the dp x sep all-reduce into the pipeline's buckets (pipeline_parallel.py: dp_group becomes the
        # dp x sep group) and divides by dp x cp; the cp ranks' gradients are parts of one sum (llmtrain.parallel.
        # context): x cp gives 1/dp (measured without: dp2 x pp2 x cp2, step-1 grad_norm 0.2715 for one process's 0.5431)
        from llmtrain.paddle_compat.sharding_v2 import pipeline_buffers, rescale_after_reduce

        buffers = pipeline_buffers(model)
        if not buffers:
            raise RuntimeError("parallel.dp_comm_overlap under cp: fleet's pipeline built no dp buckets")
        rescale_after_reduce(buffers, float(layout.cp))
    if layout.sharding_split_param and layout.ep > 1:  # stage-1 V2: the routed experts in buckets of their own
        from llmtrain.parallel.expert_states import color_experts

        color_experts(core, topo)
    optimizer = fleet.distributed_optimizer(optimizer)
    if layout.sharding_split_param:  # stage-1 V2: its slice parameters keep the tied table's pipeline mark
        from llmtrain.contracts.tags import EXPERT_AXIS_ATTR
        from llmtrain.paddle_compat.sharding_v2 import carry_marks, slices_before_dp_sync

        carry_marks(optimizer, ("is_firstly_shared", EXPERT_AXIS_ATTR))  # and the experts' tag (the clip reads it)
        slices_before_dp_sync(optimizer)  # dp > 1 or cp > 1: the first step's slices summed too
    elif layout.sharding_comm_overlap and not layout.sharding_tensor_fusion:  # V1: fleet drops its weight decay
        from llmtrain.paddle_compat.sharding_fused import restore_v1_overlap_decay

        restore_v1_overlap_decay(optimizer)
    if scaler is not None:
        scaler = fleet.distributed_scaler(scaler)
    return model, optimizer, scaler
