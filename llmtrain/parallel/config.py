"""Parallel layout: the `parallel` config group (`conf/parallel/*.yaml`).

    python -m paddle.distributed.launch --nproc_per_node 4 llmtrain/pretrain.py +parallel=dp2tp2

`parallel` is deliberately absent from the defaults list: `+parallel=NAME`
appends it, and no `+parallel=` means one device. Any field can be overridden
after the file is chosen (`+parallel=tp2 parallel.pp=2`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ParallelConfig:
    name: str = "custom"
    """Label of the layout (used in run names); the option files set it to their file name."""

    dp: int = 1
    """Data-parallel degree: replicas that each see a different share of the global batch."""

    tp: int = 1
    """Tensor (model) parallel degree, Megatron style: heads, FFN width and vocabulary split across ranks."""

    pp: int = 1
    """Pipeline-parallel degree: the layer stack cut into this many stages."""

    sharding: int = 1
    """Sharding (ZeRO) degree: data-parallel ranks that also split optimizer state (and more, by stage)."""

    sharding_stage: int = 1
    """ZeRO stage when sharding > 1: 1 optimizer states, 2 + gradients, 3 + parameters."""

    zero3_segment_size: int = 1048576
    """ZeRO-3 only: parameters with fewer elements than this stay whole on every rank (Paddle's `segment_size`)."""

    zero2_buffer_size: int = 8388608
    """ZeRO-2 only: elements of the one gradient storage per owning rank (Paddle's `buffer_max_size`, 2**23).
    Parameters that do not fit have their own gradients, freed on the other ranks as soon as they are reduced
    to their owner; the storages live through the whole backward. Gradient sharding shows at the backward's
    peak only for parameters outside the storages (`llmtrain.plan.memory.zero2_grad_bytes`)."""

    pp_schedule: str = "1f1b"
    """Pipeline schedule: `1f1b`, `interleaved` (virtual stages; needs pp > 2 and virtual_pp > 1) or `dualpipev`
    (fleet's DualPipeV: 2 chunks per stage laid out as a V, weight gradients deferred to fill bubbles; pp >= 2,
    grad_accum >= 2 x pp, pp alone for now; llmtrain/parallel/dualpipe.py, docs/layouts.md#dualpipev)."""

    virtual_pp: int = 1
    """Model chunks per pipeline rank for the interleaved schedule (1 = plain 1F1B). DualPipeV always runs 2 (its V;
    leave 1 or write 2)."""

    pp_layers: Optional[list] = None
    """Transformer blocks per pipeline chunk, in model order: `[3,2]` puts blocks 0-2 on stage 0 and 3-4 on stage 1.
    One entry per chunk (pp x virtual_pp of them; chunk i runs on stage i % pp, as fleet's interleaved schedule
    assigns chunks), each >= 1, summing to model.num_layers; the embedding joins the first chunk, the final norm,
    head and loss the last (PaddleFormers' explicit segments, Megatron's `--decoder-first/last-pipeline-num-layers`
    generalised). null: balanced by the planner's per-layer cost, embedding and head counted
    (`llmtrain.plan.stage_cost`), so the last stage usually holds fewer blocks. Checkpoints are layout-free: a run
    resumes under another split. docs/layouts.md#uneven-pipeline-stages."""

    ep: int = 1
    """Expert-parallel degree (Mixture-of-Experts models): any divisor of the data-parallel ranks dp x sharding (adds
    no processes). Each group of ep consecutive data ranks spreads the routed experts over its members, num_experts
    / ep each; the dp x sharding / ep ranks holding the same experts (the expert-data-parallel group) sum their
    gradients and, under ZeRO (sharding > 1, any stage), shard their optimizer states, while dense parameters
    shard over `sharding` as without experts (docs/layouts.md, "Process groups")."""

    ep_dispatcher: str = "auto"
    """How the expert-major token buffer moves between the ep ranks under ep > 1: `alltoall` (one all-to-all; NCCL
    only, GPU), `allgather` (all-gather of every rank's buffer, ep x the bytes; gloo and NCCL) or `auto` (alltoall
    on a GPU, allgather on CPU)."""

    order: list = field(default_factory=lambda: ["dp", "pp", "sharding", "tp"])
    """Nesting of the process grid from outermost to innermost (fleet's `hybrid_configs.order`; `tp` = fleet's `mp`).
    Innermost ranks are adjacent, so put the most communication-heavy axis (tp) last. `cp` may be listed too
    (fleet's `sep`); when it is not, it sits just outside tp (Megatron's tp-cp nesting)."""

    # Context parallelism (llmtrain/parallel/context.py)
    cp: int = 1
    """Context-parallel degree: each sequence is cut into 2·cp chunks and rank r of a cp group holds chunks r and
    2·cp-1-r (causal load balancing), so activations per rank shrink by 1/cp; attention exchanges keys/values over
    the group (`cp_comm`). Adds processes: world = dp x tp x pp x sharding x cp; cp ranks read the same samples
    (data ranks are dp x sharding), losses and token counts are summed over cp, gradients over dp x cp. Built on
    fleet's `sep` axis. data.seq_len must be divisible by 2·cp. Composes with dp, tp (+ sequence_parallel), pp and
    ZeRO-1/2/3; Mixture-of-Experts models (so ep too) and encoders are refused (docs/long-context.md)."""

    cp_comm: str = "ring"
    """How attention sees the other chunks under cp > 1: `ring` (keys/values travel around the cp ring, one block
    at a time, partial outputs merged by their log-sum-exp; the backward sends the key/value gradients back
    around), `allgather` (keys/values of the whole sequence gathered once per layer: simplest, cheapest with few
    kv heads, holds the whole sequence's k/v), or `a2a` (Ulysses all-to-all: the sequence is regathered per head
    group, each rank attends over the whole sequence for heads/cp heads; needs the heads and kv heads on a tp rank
    divisible by cp)."""

    sequence_parallel: bool = False
    """tp > 1, decoder: Megatron-style sequence parallelism (llmtrain/parallel/sequence.py): between the
    tensor-parallel blocks each tp rank keeps 1/tp of the positions, so norms and their saved activations shrink
    by 1/tp; all-gather before and reduce-scatter after each tp block replace the all-reduce. data.seq_len must be
    divisible by tp; use it with model.fuse_qkv/fuse_ffn (one all-gather per block instead of one per projection)."""

    # Communication overlap (fleet.DistributedStrategy fields, as PaddleNLP sets them; checked by
    # llmtrain/parallel/overlap.py before fleet sees them; mp_async_allreduce, pp_overlap_p2p_comm and
    # pp_enable_timer are logged and not applied on CPU; the fused-buffer ones run on CPU too)
    mp_async_allreduce: bool = False
    """tp > 1, GPU: ColumnParallelLinear's backward all-reduces d(input) asynchronously while it computes d(weight)
    (fleet `mp_configs.mp_async_allreduce`; export CUDA_DEVICE_MAX_CONNECTIONS=1 so the all-reduce is not queued
    behind the matmul). Same numbers; safe whenever tp > 1. Projections fused by model.fuse_qkv/fuse_ffn do their
    own single all-reduce and do not use it."""

    pp_overlap_p2p_comm: bool = False
    """pp > 1, GPU: the 1F1B/interleaved schedule posts its stage-to-stage send/recv asynchronously and overlaps
    them with the next micro-batch's compute (fleet `pp_configs.overlap_p2p_comm`; turns batched p2p off). Same
    numbers; safe whenever pp > 1."""

    pp_enable_timer: bool = False
    """pp > 1, GPU: fleet's pipeline timers (forward/backward/send/recv per step, logged by fleet;
    `pp_configs.enable_timer`). Costs device synchronisations: for profiling runs, not production."""

    dp_comm_overlap: bool = False
    """pp > 1 and dp > 1: fuse the data-parallel gradient all-reduce into buckets issued during the pipeline's
    last backward (fleet `pp_configs.dp_comm_overlap`). Switches on main-gradient training (train.main_grad).
    Without pp, DataParallel already overlaps its bucketed all-reduce with the backward on GPU."""

    pp_sharding_comm_overlap: bool = False
    """pp > 1 and sharding > 1 (stage 1): the same as dp_comm_overlap for the sharding group's gradient reduce
    (fleet `pp_configs.sharding_comm_overlap`). Switches on train.main_grad; not with sharding_comm_overlap."""

    sharding_comm_overlap: bool = False
    """sharding > 1, stage 1, pp = 1, with sharding_split_param: each bucket's gradient reduce-scatter is issued from
    the backward as soon as the bucket's gradients are complete (fleet `sharding_configs.comm_overlap`, with
    accumulate_steps = train.grad_accum). Switches on train.main_grad."""

    sharding_tensor_fusion: bool = False
    """sharding > 1, stage 1: fleet's V1 optimizer with parameters and gradients fused into large buffers
    (`sharding_configs.tensor_fusion`): its optimizer state lives on fused parameters, which the checkpoint reads and
    writes under the canonical names; under pp a tied table's later copy is counted once by the clip. Not with ep,
    cp or sharding_split_param. Switches on train.main_grad."""

    sharding_split_param: bool = False
    """sharding > 1, stage 1: fleet's DygraphShardingOptimizerV2: parameters and gradients laid end to end in
    buckets (sharding_configs.comm_buffer_size_MB, 256 MiB), each rank owning a contiguous 1/sharding of every
    bucket, gradients reduce-scattered and updated parameters all-gathered (`sharding_configs.split_param`; not
    with tensor_fusion). Under ep (pp = 1) the routed experts get buckets of their own over the expert-data-parallel
    group; under cp (pp = 1) the slices are summed over dp x cp after the reduce-scatter. Switches on
    train.main_grad; checkpoints store the state under canonical names."""

    sharding_comm_buffer_mb: int = 256
    """sharding_split_param: MiB of parameters per V2 bucket (fleet `sharding_configs.comm_buffer_size_MB`): one
    reduce-scatter and one all-gather per bucket; smaller buckets start overlapping earlier in the backward."""

    def world(self) -> int:
        """Processes this layout needs: dp x tp x pp x sharding x cp."""
        return self.dp * self.tp * self.pp * self.sharding * self.cp

    def data_parallel(self) -> int:
        """Ranks that read different data: dp x sharding."""
        return self.dp * self.sharding


def layout_tag(parallel) -> str:
    """The layout's real degrees as a name: `dp2`, `tp2pp2`, `dp2tp2pp2`, `sharding2` (ZeRO-1), `sharding2s3`
    (stage 2/3), `pp4v2` (virtual stages), `pp2L3-2` (an explicit split, parallel.pp_layers=[3,2]), `dp2ep2`, `tp2sp`
    (sequence parallel), `dp2cp2` / `tp2cp2sp` (context parallel; the exchange `cp_comm` is not in the name: a run
    may resume under another), `pp2dpv` (DualPipeV), `single` for one device, `auto` for the planner's choice. `parallel`: a
    ParallelConfig, its DictConfig node, or None. The default run name (`run.name`) ends in it, so `+parallel=tp2
    parallel.pp=2` never writes into a tp2 run's directory, nor a run split [3,2] into one split [2,3]."""
    if parallel is None:
        return "single"

    def get(name, default):
        value = parallel.get(name, default) if hasattr(parallel, "get") else getattr(parallel, name, default)
        return default if value is None else value

    if get("name", "") == "auto":
        return "auto"
    tag = "".join(f"{axis}{get(axis, 1)}" for axis in ("dp", "tp", "pp", "cp") if get(axis, 1) > 1)
    sharding, stage = get("sharding", 1), get("sharding_stage", 1)
    if sharding > 1:
        tag += f"sharding{sharding}" + (f"s{stage}" if stage != 1 else "")
    if get("pp_schedule", "1f1b") == "dualpipev" and get("pp", 1) > 1:
        tag += "dpv"  # DualPipeV: its two chunks per stage are implied
    elif get("virtual_pp", 1) > 1:
        tag += f"v{get('virtual_pp', 1)}"
    if get("pp_layers", None) and get("pp", 1) > 1:
        from llmtrain.parallel.pp_split import split_tag

        tag += split_tag(list(get("pp_layers", None)))
    if get("ep", 1) > 1:
        tag += f"ep{get('ep', 1)}"
    if get("sequence_parallel", False):
        tag += "sp"
    return tag or "single"
