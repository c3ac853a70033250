"""Apply the parallel plan: build this rank's part of the model and wrap model and optimizer.

    built = build_for_layout(cfg, layout, topo, amp)   # -> Built(model, loss_fn, optimizer, ...)

Order matters and follows Paddle's manual hybrid mode: roles (TP layers) at
construction -> pipeline cut -> layout-independent init (or a PaddleNLP
checkpoint) -> optimizer -> AMP O2 decorate -> fleet wrappers -> ZeRO-2/3 ->
swap in the norm-recording clip.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from llmtrain.models import build_model
from llmtrain.models.decoder import canonical_parameters
from llmtrain.models.init import init_parameters
from llmtrain.models.roles import Roles
from llmtrain.parallel.layout import Layout
from llmtrain.parallel.slicing import TensorSlices
from llmtrain.parallel.strategy import Topology
from llmtrain.train.amp import AmpPlan
from llmtrain.train.clip import install_recording_clip
from llmtrain.train.optim import build_optimizer


@dataclass
class Built:
    model: Any
    """What the step runner calls: the plain model, or fleet's DataParallel/TensorParallel/PipelineParallel wrapper."""
    core: Any
    """The unwrapped model (or PipelineLayer) whose parameters are ours."""
    loss_fn: Optional[Any]
    """Loss for flat models; None under pipeline parallelism (the PipelineLayer owns it)."""
    optimizer: Any
    scheduler: Any
    clip: Any
    scaler: Optional[Any]
    named_params: list
    """(canonical name, parameter) of this rank's parameters."""
    pipeline: bool


def make_roles(layout: Layout, topo: Topology) -> Roles:
    if layout.tp > 1:
        from llmtrain.parallel.tensor import TensorParallelRoles

        return TensorParallelRoles(topo.hcg)
    return Roles()


def build_for_layout(cfg, layout: Layout, topo: Topology, amp: AmpPlan, initial_state=None) -> Built:
    """This rank's model and optimizer under `layout`.

    `initial_state`: optional {canonical name: full numpy tensor} (a PaddleNLP
    import) used instead of random initialisation.
    """
    roles = make_roles(layout, topo)
    recompute = cfg.train.recompute
    if layout.pp > 1:
        from llmtrain.parallel.pipeline import build_pipeline

        core = build_pipeline(cfg.model, layout, roles, topo, recompute)
        loss_fn = None
    else:
        core = build_model(cfg.model, roles, recompute)
        loss_fn = core.loss_fn
    named = canonical_parameters(core)
    if len(named) != len(core.parameters()):
        raise RuntimeError(f"{len(core.parameters()) - len(named)} parameters have no canonical name")
    slices = TensorSlices(topo.tp_rank, layout.tp)
    if initial_state is not None:
        from llmtrain.models.init import load_full_state

        load_full_state(named, initial_state, slices, source=cfg.model.init_from or "initial state")
    else:
        init_parameters(named, cfg.model, cfg.seed, slices)

    optimizer, scheduler = build_optimizer(named, cfg.optim, cfg.train.max_steps, multi_precision=amp.enabled)
    core, optimizer = amp.decorate(core, optimizer)
    scaler = amp.scaler()
    model = core
    if layout.distributed:
        from paddle.distributed import fleet

        if layout.sharding_stage in (2, 3):
            from llmtrain.parallel.zero import wrap_zero

            model, optimizer, scaler = wrap_zero(core, optimizer, scaler, layout, topo)
        else:
            model = fleet.distributed_model(core)
            optimizer = fleet.distributed_optimizer(optimizer)
            if scaler is not None:
                scaler = fleet.distributed_scaler(scaler)
    clip = install_recording_clip(optimizer)
    return Built(model, core, loss_fn, optimizer, scheduler, clip, scaler, named, layout.pp > 1)
