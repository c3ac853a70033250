"""Resolve and validate the parallel layout and the batch arithmetic, before any work.

    layout, problems = layout_problems(cfg.parallel, cfg.train, world_size)
    problems += model_fit_problems(cfg.parallel, cfg.model)
    layout = resolve_layout(cfg.parallel, cfg.train, world_size)   # the same rules, raising ConfigError
    check_model_fits(layout, cfg.model)

One source of truth for what a layout may be: each problem is a line naming the
config fields and their numbers (torchtitan's `ParallelDims._validate` idea);
`llmtrain.resolve` collects them with every other problem of the run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from llmtrain.errors import ConfigError
from llmtrain.parallel import groups
from llmtrain.parallel.config import ParallelConfig
from llmtrain.parallel.groups import AXES, StateSharding
from llmtrain.parallel.pp_split import split_fit_problems, split_problems

__all__ = ["AXES", "ConfigError", "Layout", "layout_problems", "resolve_layout", "model_fit_problems",
           "check_model_fits"]

PP_SCHEDULES = ("1f1b", "interleaved", "dualpipev")
"""`parallel.pp_schedule` values: fleet's 1F1B, interleaved virtual stages, DualPipeV (llmtrain/parallel/dualpipe.py)."""
CP_COMMS = ("ring", "allgather", "a2a")
"""`parallel.cp_comm` values (llmtrain/parallel/context.py)."""


class BatchSizes(Protocol):
    """The batch fields a layout is checked against (`llmtrain.train.config.TrainConfig` has them; the layout
    reads them without importing the trainer's package, which sits above this one)."""

    global_batch_size: Optional[int]
    micro_batch_size: Optional[int]
    grad_accum: Optional[int]


@dataclass(frozen=True)
class Layout:
    """Degrees, their nesting and batch sizes after validation; identical on every rank. The one statement of the
    process groups: `group_ranks(kind)` lists every group of a kind (llmtrain/parallel/groups.py), which
    `Topology` creates; `state_sharding(expert)` says which group shards what under ZeRO."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sharding: int = 1
    sharding_stage: int = 1
    pp_schedule: str = "1f1b"
    virtual_pp: int = 1
    """Model chunks per pipeline stage: parallel.virtual_pp, or 2 under DualPipeV (its V holds two per stage)."""
    zero3_segment_size: int = 1048576
    zero2_buffer_size: int = 8388608
    ep: int = 1
    """Expert-parallel degree: ep consecutive data-parallel ranks (dp x sharding) share out the routed experts
    (llmtrain/parallel/experts.py)."""
    ep_dispatcher: str = "auto"
    order: tuple = AXES
    name: str = "single"
    global_batch: int = 1
    """Samples per optimizer step over all ranks."""
    micro_batch: int = 1
    """Samples per forward/backward on one rank."""
    grad_accum: int = 1
    """Micro-batches per step on one rank (= the pipeline's accumulate_steps)."""
    sequence_parallel: bool = False
    mp_async_allreduce: bool = False
    pp_overlap_p2p_comm: bool = False
    pp_enable_timer: bool = False
    dp_comm_overlap: bool = False
    pp_sharding_comm_overlap: bool = False
    sharding_comm_overlap: bool = False
    sharding_tensor_fusion: bool = False
    sharding_split_param: bool = False
    sharding_comm_buffer_mb: int = 256
    """Communication-overlap knobs accepted by `overlap_problems` (see ParallelConfig); the refused ones never get here."""
    cp: int = 1
    """Context-parallel degree (llmtrain/parallel/context.py): ranks that share one sequence, 2 chunks each."""
    cp_comm: str = "ring"
    """The key/value exchange under cp > 1: ring, allgather or a2a."""
    pp_layers: tuple = ()
    """Transformer blocks per pipeline chunk, in model order: pp x virtual_pp entries, chunk i on stage i % pp (as
    Paddle's interleaved PipelineLayer assigns chunks); () when pp == 1. `parallel.pp_layers`, or the cost-balanced
    default filled in by `llmtrain.plan.stage_cost.with_pipeline_split` (`llmtrain.parallel.pp_split`)."""

    @property
    def v_shape(self) -> bool:
        """DualPipeV's chunk placement: stage s runs chunks s and 2·pp - 1 - s (`llmtrain.parallel.pp_split`)."""
        return self.pp_schedule == "dualpipev"

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.sharding * self.cp

    @property
    def data_parallel(self) -> int:
        """Ranks reading different data: dp x sharding."""
        return self.dp * self.sharding

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the data-parallel ranks holding the same routed experts, dp x sharding / ep."""
        return self.data_parallel // self.ep

    @property
    def grid(self) -> tuple:
        """The process grid's axes, outermost first (`order`, with cp just outside tp when not listed)."""
        return groups.grid_order(self.order)

    def group_ranks(self, kind: str) -> list[list[int]]:
        """Every group of `kind` ("dp", "sharding", "pp", "cp", "tp", "data" = dp x sharding, "ep", "edp") as lists
        of global ranks, in the order of their smallest rank (pure arithmetic, llmtrain/parallel/groups.py)."""
        return groups.group_ranks(self, kind)

    def state_sharding(self, expert: bool) -> StateSharding:
        """The group and degree over which this layout's ZeRO stage shards dense parameters' (`expert=False`) or
        routed experts' (`expert=True`) optimizer states, gradients and values (`groups.state_sharding`)."""
        return groups.state_sharding(self, expert)


def _resolve_batch(train: BatchSizes, data_parallel: int, layout_desc: str, problems: list[str]):
    g, m, a = train.global_batch_size, train.micro_batch_size, train.grad_accum
    for fname, val in (("global_batch_size", g), ("micro_batch_size", m), ("grad_accum", a)):
        if val is not None and val < 1:
            problems.append(f"train.{fname}={val}: must be >= 1")
            return None
    d = data_parallel
    given = f"train.global_batch_size={g}, train.micro_batch_size={m}, train.grad_accum={a}, data-parallel ranks {layout_desc}={d}"
    if g is None and m is None and a is None:
        problems.append("train.global_batch_size, train.micro_batch_size and train.grad_accum are all null: give at least one")
        return None
    if g is None:
        m, a = m or 1, a or 1
        return m * a * d, m, a
    if m is not None and a is not None:
        if g != m * a * d:
            problems.append(f"{given}: global batch must equal micro x accum x data-parallel = {m} x {a} x {d} = {m * a * d}")
            return None
        return g, m, a
    if m is not None:
        if g % (m * d):
            problems.append(f"{given}: global batch {g} is not divisible by micro x data-parallel = {m} x {d} = {m * d}")
            return None
        return g, m, g // (m * d)
    a = a or 1
    if g % (a * d):
        problems.append(f"{given}: global batch {g} is not divisible by accum x data-parallel = {a} x {d} = {a * d}")
        return None
    return g, g // (a * d), a


def resolve_layout(parallel: Optional[ParallelConfig], train: BatchSizes, world_size: int) -> Layout:
    """Degrees from `parallel` (None = one device) checked against the world size, plus batch sizes."""
    layout, problems = layout_problems(parallel, train, world_size)
    if problems:
        raise ConfigError(problems)
    return layout


def layout_problems(parallel: Optional[ParallelConfig], train: BatchSizes,
                    world_size: int) -> tuple[Optional[Layout], list[str]]:
    """(the layout, []) or (None, every problem with its numbers)."""
    p = parallel or ParallelConfig(name="single")
    problems: list[str] = []
    for axis in ("dp", "tp", "pp", "sharding", "virtual_pp", "ep", "cp"):
        if getattr(p, axis) < 1:
            problems.append(f"parallel.{axis}={getattr(p, axis)}: must be >= 1")
    if problems:
        return None, problems
    degrees = f"parallel.dp={p.dp} x parallel.tp={p.tp} x parallel.pp={p.pp} x parallel.sharding={p.sharding}"
    if p.cp > 1:
        degrees += f" x parallel.cp={p.cp}"
    if p.world() != world_size:
        hint = "" if parallel is not None else f" (no +parallel= given means one process; add e.g. +parallel=dp{world_size})"
        problems.append(f"{degrees} = {p.world()} processes, but the job has {world_size}{hint}")
    if sorted(p.order) not in (sorted(AXES), sorted((*AXES, "cp"))):
        problems.append(f"parallel.order={list(p.order)}: must be a permutation of {list(AXES)} (optionally with 'cp')")
    problems += _cp_problems(p)
    if p.sharding_stage not in (1, 2, 3):
        problems.append(f"parallel.sharding_stage={p.sharding_stage}: must be 1, 2 or 3")
    if p.sharding_stage in (2, 3) and p.sharding == 1:
        problems.append(f"parallel.sharding_stage={p.sharding_stage} with parallel.sharding=1: ZeRO needs a sharding degree > 1")
    if p.sharding_stage in (2, 3) and p.pp > 1:
        problems.append(
            f"parallel.sharding_stage={p.sharding_stage} with parallel.pp={p.pp}: Paddle's pipeline runs sharding only "
            "through fleet's stage-1 sharding optimizer; use sharding_stage=1 with pipeline parallelism"
        )
    if p.sharding_stage == 3 and p.sharding > 1 and p.tp > 1:
        problems.append(
            f"parallel.sharding_stage=3 with parallel.tp={p.tp}: Paddle's stage-3 clip (GroupShardedClipGrad) "
            "all-reduces the gradient norm over the sharding group only, so tp-split gradients would be clipped "
            "by a wrong norm; use sharding_stage 1 or 2 with tensor parallelism"
        )
    if p.sequence_parallel and p.tp < 2:
        problems.append(f"parallel.sequence_parallel=true with parallel.tp={p.tp}: sequence parallelism splits the "
                        "sequence across the tensor-parallel ranks; needs tp > 1")
    if p.pp_schedule not in PP_SCHEDULES:
        problems.append(f"parallel.pp_schedule={p.pp_schedule!r}: expected one of {list(PP_SCHEDULES)}")
    if p.pp_schedule == "dualpipev":
        from llmtrain.parallel.dualpipe_checks import dualpipe_problems

        problems += dualpipe_problems(p)
    elif p.pp_schedule == "interleaved":
        if p.pp <= 2:
            problems.append(f"parallel.pp_schedule=interleaved with parallel.pp={p.pp}: Paddle's interleaved schedule needs pp > 2")
        if p.virtual_pp < 2:
            problems.append(f"parallel.pp_schedule=interleaved with parallel.virtual_pp={p.virtual_pp}: needs virtual_pp >= 2")
    elif p.virtual_pp != 1:
        problems.append(f"parallel.virtual_pp={p.virtual_pp} with parallel.pp_schedule={p.pp_schedule}: virtual stages need pp_schedule=interleaved")
    chunks_per_stage = 2 if p.pp_schedule == "dualpipev" else p.virtual_pp  # DualPipeV: two chunks per stage, the V
    problems += split_problems(p.pp, chunks_per_stage, p.pp_layers)
    if p.ep_dispatcher not in ("auto", "allgather", "alltoall"):
        problems.append(f"parallel.ep_dispatcher={p.ep_dispatcher!r}: expected 'auto', 'allgather' or 'alltoall'")
    problems += _expert_problems(p)
    batch = _resolve_batch(train, p.data_parallel(), f"(dp={p.dp} x sharding={p.sharding})", problems)
    if batch is not None and p.pp_schedule == "interleaved":
        problems += _interleaved_accum_problems(batch[2], p.pp)
    if batch is not None and p.pp_schedule == "dualpipev" and batch[2] < 2 * p.pp:
        problems.append(f"train.grad_accum={batch[2]} with parallel.pp={p.pp} (dualpipev): fleet's DualPipeV asserts "
                        f"accumulate_steps >= 2 x pp = {2 * p.pp} micro-batches; use train.grad_accum >= {2 * p.pp} "
                        "(or a smaller micro_batch_size)")
    if p.zero2_buffer_size < 1:
        problems.append(f"parallel.zero2_buffer_size={p.zero2_buffer_size}: must be >= 1 (elements)")
    from llmtrain.parallel.overlap import overlap_problems

    problems += overlap_problems(p, batch[2] if batch is not None else None)
    if problems:
        return None, problems
    g, m, a = batch
    return Layout(
        dp=p.dp, tp=p.tp, pp=p.pp, sharding=p.sharding, sharding_stage=p.sharding_stage if p.sharding > 1 else 1,
        pp_schedule=p.pp_schedule, virtual_pp=chunks_per_stage, pp_layers=tuple(p.pp_layers or ()), order=tuple(p.order),
        name=p.name,
        zero3_segment_size=p.zero3_segment_size, zero2_buffer_size=p.zero2_buffer_size,
        ep=p.ep, ep_dispatcher=p.ep_dispatcher, cp=p.cp, cp_comm=p.cp_comm,
        global_batch=g, micro_batch=m, grad_accum=a,
        sequence_parallel=p.sequence_parallel, mp_async_allreduce=p.mp_async_allreduce, pp_overlap_p2p_comm=p.pp_overlap_p2p_comm,
        pp_enable_timer=p.pp_enable_timer, dp_comm_overlap=p.dp_comm_overlap,
        pp_sharding_comm_overlap=p.pp_sharding_comm_overlap, sharding_comm_overlap=p.sharding_comm_overlap,
        sharding_tensor_fusion=p.sharding_tensor_fusion, sharding_split_param=p.sharding_split_param,
        sharding_comm_buffer_mb=p.sharding_comm_buffer_mb,
    ), []


def _expert_problems(p: ParallelConfig) -> list[str]:
    """Expert parallelism: ep divides the data-parallel ranks (dp x sharding) of each (pp, cp, tp) coordinate."""
    if p.ep <= 1:
        return []
    data = p.data_parallel()
    if data % p.ep:
        fits = [k for k in range(2, data + 1) if data % k == 0]
        hint = f"use parallel.ep in {fits}" if fits else "add data-parallel ranks (parallel.dp or parallel.sharding)"
        return [f"parallel.ep={p.ep} does not divide the data-parallel ranks parallel.dp={p.dp} x parallel.sharding="
                f"{p.sharding} = {data}: the routed experts are spread over ep of the data-parallel ranks of each "
                f"(pp, cp, tp) coordinate; {hint}"]
    return []


def _interleaved_accum_problems(accum: int, pp: int) -> list[str]:
    """fleet's interleaved schedules (Paddle 3.3.1, fleet/model.py): with at least 2 x pp micro-batches the
    interleaved 1F1B, any count; with pp to 2 x pp - 1 its forward-then-backward variant, a multiple of pp only;
    fewer than pp, none."""
    if accum >= 2 * pp or (accum >= pp and accum % pp == 0):
        return []
    return [f"train.grad_accum={accum} with parallel.pp={pp} (interleaved): fleet's interleaved schedule needs "
            f"{2 * pp} or more micro-batches, or a multiple of pp from {pp} (its forward-then-backward variant); "
            f"use train.grad_accum={pp} or >= {2 * pp}"]


def _cp_problems(p: ParallelConfig) -> list[str]:
    """Context parallelism: the exchange named, and the combinations not built yet refused with the reason.
    The sequence length and head counts are checked with the model (`llmtrain.parallel.context.context_problems`)."""
    problems = []
    if p.cp_comm not in CP_COMMS:
        problems.append(f"parallel.cp_comm={p.cp_comm!r}: expected one of {list(CP_COMMS)}")
    if p.cp > 1 and p.ep > 1:
        problems.append(f"parallel.cp={p.cp} with parallel.ep={p.ep}: expert parallelism under context parallelism "
                        "is not implemented. The process groups allow it (each cp rank would dispatch its own chunks' "
                        "tokens in its ep group, expert gradients summed over the expert-data-parallel ranks and cp), "
                        f"but Mixture-of-Experts layers are refused under cp: each of the {p.cp} cp ranks routes only "
                        f"1/{p.cp} of every sequence, so the experts' capacity, the balancing losses and the bias "
                        "counts would be computed over part of each micro-batch (summing the routing statistics over "
                        "the cp group inside the MoE layer is not built); use parallel.cp=1 with ep, or cp with a "
                        "dense model")
    return problems


def check_model_fits(layout: Layout, model) -> None:
    """`model_fit_problems`, raised as one ConfigError."""
    problems = model_fit_problems(layout, model)
    if problems:
        raise ConfigError(problems)


def model_fit_problems(degrees, model) -> list[str]:
    """Model widths divisible by tp, at least one block per pipeline chunk, an explicit split holding every block.

    `degrees`: anything with `tp`, `pp`, `virtual_pp` and `pp_layers` (a `Layout`, a `ParallelConfig`, or None for
    one device), so the check runs even when the layout itself has problems."""
    problems: list[str] = []
    tp, pp, vpp = (degrees.tp, degrees.pp, degrees.virtual_pp) if degrees is not None else (1, 1, 1)
    if getattr(degrees, "pp_schedule", "1f1b") == "dualpipev":
        vpp = 2  # DualPipeV's two chunks per stage (a ParallelConfig still says virtual_pp=1)
    ep = getattr(degrees, "ep", 1) if degrees is not None else 1
    e = getattr(model, "moe_num_experts", 0)
    if ep > 1 and e <= 0:
        problems.append(f"parallel.ep={ep} with model.moe_num_experts={e}: expert parallelism needs an MoE model; "
                        "use parallel.ep=1")
    elif ep > 1 and e % ep:
        data = getattr(degrees, "dp", 1) * getattr(degrees, "sharding", 1)
        fits = [k for k in range(1, data + 1) if data % k == 0 and e % k == 0]
        problems.append(f"model.moe_num_experts={e} is not divisible by parallel.ep={ep}: each ep rank holds "
                        f"num_experts / ep experts; use parallel.ep in {fits} (dividing both the experts and the "
                        f"{data} data-parallel ranks)")
    if e > 0 and pp > 1 and model.moe_aux_loss_scope != "layer":
        problems.append(f"model.moe_aux_loss_scope={model.moe_aux_loss_scope!r} with parallel.pp={pp}: under pipeline "
                        "parallelism each stage feeds its layers' balancing losses to the backward, and a loss pooled "
                        "over all layers is not a sum of per-stage terms; use moe_aux_loss_scope=layer")
    if e > 0 and 0 < model.moe_top_k > e:
        problems.append(f"model.moe_top_k={model.moe_top_k} > model.moe_num_experts={e}")
    if e > 0 and model.moe_top_k < 1:
        problems.append(f"model.moe_top_k={model.moe_top_k}: must be >= 1")
    for fname, allowed in (("moe_router", ("softmax", "sigmoid")), ("moe_router_dtype", ("fp32", "amp")),
                           ("moe_aux_loss_scope", ("layer", "model")), ("moe_aux_counts", ("chosen", "unbiased"))):
        if e > 0 and getattr(model, fname) not in allowed:
            problems.append(f"model.{fname}={getattr(model, fname)!r}: expected one of {list(allowed)}")
    if e > 0 and model.moe_layer_interval < 1:
        problems.append(f"model.moe_layer_interval={model.moe_layer_interval}: must be >= 1")
    elif e > 0 and model.num_layers > 0 and not any(model.is_moe_layer(i) for i in range(model.num_layers)):
        problems.append(f"model.moe_num_experts={e} but no block has experts (moe_first_dense_layers="
                        f"{model.moe_first_dense_layers}, moe_last_layer={model.moe_last_layer}, moe_layer_interval="
                        f"{model.moe_layer_interval}, num_layers={model.num_layers})")
    from llmtrain.models.field_checks import group_problems, mla_problems

    problems += group_problems(model) + mla_problems(model, bool(getattr(degrees, "sequence_parallel", False)))
    if model.num_heads <= 0 or model.num_layers <= 0:
        return problems  # reported by the value checks (llmtrain.config.config_problems)
    if model.head_dim is None and model.hidden_size % model.num_heads:  # a set head_dim needs no divisibility
        problems.append(f"model.hidden_size={model.hidden_size} is not divisible by model.num_heads={model.num_heads}")
    kv = model.num_kv_heads or model.num_heads
    if kv > 0 and model.num_heads % kv:
        problems.append(f"model.num_heads={model.num_heads} is not divisible by model.num_kv_heads={kv}")
    checks = [
        ("model.num_heads", model.num_heads),
        ("model.num_kv_heads", kv),
        ("model.ffn_hidden_size", model.ffn_hidden_size),
        ("model.vocab_size (padded)", model.vocab_size),
    ]
    for fname, val in checks:
        if val is not None and tp >= 1 and val % tp:
            problems.append(f"{fname}={val} is not divisible by parallel.tp={tp}")
    problems += split_fit_problems(pp, vpp, degrees.pp_layers if degrees is not None else None, model.num_layers)
    return problems
