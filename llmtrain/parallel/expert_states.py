"""The routed experts' gradients, optimizer states and updates over the expert-data-parallel (edp) group.

    python -m paddle.distributed.launch --nproc_per_node 4 llmtrain/pretrain.py model=moe-tiny +parallel=dp2 \
        parallel.sharding=2 parallel.ep=2 parallel.sharding_stage=2
    hooks = attach_expert_parallel(core, optimizer, clip, layout, topo)   # after the layout's wrappers

Under ep > 1 the ranks of one edp group (`Layout.group_ranks("edp")`: dp x sharding / ep ranks) hold the same
num_experts / ep experts. The dense parameters go through fleet's or Paddle's data-parallel / ZeRO machinery over
the dp and sharding groups; the experts are kept out of it and handled here, over edp:

- gradients: summed over edp and divided by the data-parallel degree dp x sharding (a holder's gradient already
  sums the losses of its ep group's ranks through the dispatcher's backward), giving one process's gradient;
- optimizer states, under ZeRO (`Layout.state_sharding(expert=True)`, degree edp when sharding > 1): each expert
  tensor has one owner in its edp group (`state_owners`: largest first, to the least-loaded rank, as fleet
  partitions). Its gradient is reduced to the owner and freed on the others; Paddle's optimizers step only
  parameters that have a gradient (and create their states lazily for those), so only the owner keeps the
  tensor's AdamW state and updates it, then broadcasts the new values over edp. Without ZeRO, or when edp = 1,
  every rank keeps its experts' states and the gradient is all-reduced;
- where that runs: under fleet's HybridParallelOptimizer (dp, tp, pp, ZeRO-1) right after its own gradient
  synchronisation, which skips the experts (`skip_in_dp_grad_sync`), with the broadcast after fleet's ZeRO-1
  parameter sync (`keep_local_in_zero1`); under Paddle's ZeRO-2/3 wrappers (which never see the experts,
  `llmtrain.parallel.zero`) as a step hook around the optimizer update;
- under stage-1 V2 (`parallel.sharding_split_param`, with or without `sharding_comm_overlap`) the experts go through
  fleet's own machinery instead: `color_experts` gives them V2 buckets of their own over edp (fleet's per-parameter
  `color`), so each bucket's gradient is reduce-scattered over edp (from the backward under the overlap), its
  optimizer state split by position over edp like a dense parameter's over sharding, and its values all-gathered
  over edp after the update; the buckets' reduced gradients are divided by ep besides fleet's 1/edp (one
  process's gradient is the edp sum / dp x sharding) and fleet's dp all-reduce skips the experts;
- fleet's pipeline buckets (`dp_comm_overlap`, V1's `pp_sharding_comm_overlap`) are built without the experts
  (`llmtrain.parallel.build`, `pipeline_buckets_without`): they would reduce them over the dp or sharding group;
- the clip counts every expert once (`configure_clip`): each expert tensor's squared gradient norm lives on one
  rank of the data group (its owner; without sharded states the ep group's ranks each hold their own), so the
  squares are summed over that group and handed to the clip's own sums in place of the local ones.
"""
from __future__ import annotations

import paddle
import paddle.distributed as dist

from llmtrain.contracts import tags
from llmtrain.contracts.steps import StepHook


def named_experts(named_params) -> list:
    """The (canonical name, parameter) pairs of the stacked routed-expert tensors among `named_params`."""
    return [(n, p) for n, p in named_params if tags.is_expert(p)]


def state_owners(named, degree: int) -> dict:
    """{canonical name: index in its edp group of the rank keeping the tensor's optimizer state}: largest first,
    each to the least-loaded index (ties: the lowest), the same on every rank of the group."""
    load, owner = [0] * degree, {}
    for name, p in sorted(named, key=lambda pair: (-int(pair[1].size), pair[0])):
        k = min(range(degree), key=lambda i: (load[i], i))
        owner[name] = k
        load[k] += int(p.size)
    return owner


class ExpertStates:
    """This rank's share of the expert work over its edp group (see the module docstring). `named_params`: the
    rank's (canonical name, parameter) pairs; the experts among them are handled."""

    def __init__(self, named_params, layout, topo):
        named = named_experts(named_params)
        self.params = [p for _, p in named]
        self.group = topo.group("edp")
        self.me = topo.rank
        self.scale = 1.0 / layout.data_parallel
        self.v2 = layout.sharding > 1 and layout.sharding_split_param  # fleet's V2 slices the states instead
        degree = 1 if self.v2 else layout.state_sharding(expert=True).degree
        members = topo.ranks("edp")
        by_name = state_owners(named, degree) if degree > 1 else {}
        # {parameter variable name: global rank keeping its state}; empty when every rank keeps its own
        self.owner = {p.name: members[by_name[n]] for n, p in named if n in by_name}

    def keeps_state(self, param) -> bool:
        """Whether this rank keeps (and updates) the optimizer state of expert tensor `param`."""
        return self.owner.get(param.name, self.me) == self.me

    def writes_state(self, param, topo) -> bool:
        """Whether this rank writes expert tensor `param`'s optimizer state into a checkpoint: its owner, or without
        sharded states the first rank of its edp group; tp rank 0 (experts are whole over tp)."""
        if self.v2:  # every edp rank keeps its own flat slice
            return topo.tp_rank == 0
        first = self.owner.get(param.name) is None and topo.rank_in("edp") == 0
        return topo.tp_rank == 0 and (first or self.owner.get(param.name) == self.me)

    @paddle.no_grad()
    def reduce(self) -> None:
        """After the last backward: gradients summed over edp (to the owner only, when states are sharded), divided
        by the data-parallel degree; the others' copies freed."""
        for p in self.params:
            main = getattr(p, "main_grad", None)  # main-gradient training: the fp32 gradient (llmtrain.train.main_grad)
            g = main if main is not None else p.grad
            if g is None:
                continue
            owner = self.owner.get(p.name)
            if self.group is None:
                g.scale_(self.scale)
            elif owner is None:
                dist.all_reduce(g, group=self.group)
                g.scale_(self.scale)
            else:
                dist.reduce(g, dst=owner, group=self.group)
                if owner == self.me:
                    g.scale_(self.scale)
                elif main is not None:
                    p.main_grad = None  # what MixPrecisionOptimizer steps on: none, so this rank does not update it
                else:
                    p.clear_gradient(False)

    @paddle.no_grad()
    def broadcast(self) -> None:
        """After the update: each expert tensor's new values from its owner to the rest of edp (sharded states)."""
        for p in self.params:
            owner = self.owner.get(p.name)
            if owner is not None:
                dist.broadcast(p, src=owner, group=self.group)


class ExpertUpdates(StepHook):
    """ZeRO-2/3: the expert gradients reduced before the optimizer update, the updated experts broadcast after it
    and their gradients cleared, fp32 main gradients included (Paddle's wrappers clear only the parameters they
    manage)."""

    def __init__(self, states: ExpertStates):
        self.states = states

    def before_update(self, check) -> None:
        self.states.reduce()

    def after_step(self, record) -> None:
        self.states.broadcast()
        for p in self.states.params:
            main = getattr(p, "main_grad", None)  # main-gradient training: the wrappers' clear never reaches it
            if main is not None:
                main.zero_()  # as MixPrecisionOptimizer.clear_grad (kept, zeroed; measured without: step 2 2.4e-5 off)
            p.clear_gradient(False)


def configure_clip(clip, layout, topo) -> None:
    """Make the recording clip count each expert once (see the module docstring): the experts' squares summed over
    the ep group (no sharding: each holder has its experts' whole gradients) or the data group (sharding: each
    expert's gradient on its owner), then shared out over the sharding ranks whose sums fleet adds next (1/sharding
    each). Nothing to do when the data group is the sharding group (dp = 1) under ZeRO-1/2: fleet's own sum over
    the sharding group already counts every expert once. ZeRO-3's recording clip takes the data group and clips
    itself."""
    if layout.sharding == 1:
        clip.expert_group = topo.group("ep")
    elif layout.sharding_stage == 3:
        clip.expert_group = topo.group("data")
    elif layout.dp > 1:
        clip.expert_group, clip.expert_share = topo.group("data"), 1.0 / layout.sharding


EXPERT_COLOR = "routed_experts"
"""The V2 bucket colour of the routed experts (`color_experts`)."""


def color_experts(core, topo) -> None:
    """Stage-1 V2 under ep > 1, before fleet wraps the optimizer: the routed experts of `core` in V2 buckets of their
    own, reduced and gathered over this rank's edp group (see the module docstring)."""
    from llmtrain.paddle_compat.sharding_v2 import color_params

    group = topo.process_group("edp")
    if group is None:
        raise RuntimeError("stage-1 V2 under ep > 1 needs the edp process group, one-member ones included "
                           "(llmtrain.parallel.strategy.single_member_kinds)")
    color_params([p for p in core.parameters() if tags.is_expert(p)], EXPERT_COLOR, group)


def attach_expert_parallel(core, optimizer, clip, layout, topo, model=None) -> list:
    """Under ep > 1, after the layout's wrappers: the expert gradient reduction and update over edp wired into the
    optimizer (fleet) or returned as step hooks (ZeRO-2/3), and the clip made to count each expert once. `model`:
    fleet's wrapper of `core` (its pipeline builds the buckets of pp_sharding_comm_overlap here, without the
    experts)."""
    if layout.ep <= 1:
        return []
    from llmtrain.models.stages import canonical_parameters
    from llmtrain.paddle_compat.optim import keep_local_in_zero1, skip_in_dp_grad_sync

    states = ExpertStates(canonical_parameters(core), layout, topo)
    configure_clip(clip, layout, topo)
    if layout.sharding_stage in (2, 3):
        return [ExpertUpdates(states)]
    if states.v2:  # fleet's V2 reduces the experts' buckets over edp (`color_experts`); one process's scale
        from llmtrain.paddle_compat.sharding_v2 import colored_buffers, rescale_after_reduce

        buffers = colored_buffers(optimizer, EXPERT_COLOR)
        if not buffers:
            raise RuntimeError("stage-1 V2 under ep > 1: no V2 bucket of the routed experts (color_experts not run)")
        rescale_after_reduce(buffers, 1.0 / layout.ep)
        skip_in_dp_grad_sync(optimizer, tags.is_expert)  # fleet's dp all-reduce: the edp reduce-scatter did it
        return []

    skip_in_dp_grad_sync(optimizer, tags.is_expert, after=states.reduce)
    if layout.sharding > 1:
        keep_local_in_zero1(optimizer, tags.is_expert, keep=states.keeps_state, after_sync=states.broadcast)
    if layout.pp_sharding_comm_overlap:  # V1's owners are now the dense partition's: the pipeline's buckets from them,
        # the experts left out (fleet would put them in its sharding reduce buckets at the first step, each rank's
        # experts to another owner: measured, MoE under sharding2 x pp2 x ep2 stalls and gloo times out)
        from llmtrain.paddle_compat.sharding_v2 import pipeline_buckets_without

        if not pipeline_buckets_without(model, optimizer, states.params):
            raise RuntimeError("parallel.pp_sharding_comm_overlap under ep: fleet's pipeline built no buckets")
    return []
