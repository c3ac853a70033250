"""Communication-overlap knobs: `parallel.*` fields -> fleet.DistributedStrategy, checked before fleet sees them.

    python -m paddle.distributed.launch --nproc_per_node 8 llmtrain/pretrain.py +parallel=tp2pp2 parallel.dp=2 \
        parallel.mp_async_allreduce=true parallel.pp_overlap_p2p_comm=true

PaddleNLP turns its `tensor_parallel_config` / `pipeline_parallel_config` /
`sharding_parallel_config` words into the same fleet fields (paddlenlp 2.8.1,
trainer/training_args.py); `KNOBS` maps each of our fields to its fleet section and
attribute. `overlap_problems` refuses, with the numbers, every combination fleet 3.3.1
asserts against (read in meta_parallel/pipeline_parallel.py, meta_optimizers/
dygraph_optimizer/dygraph_sharding_optimizer.py and hybrid_parallel_optimizer.py,
fleet/optimizer.py) and those llmtrain cannot serve yet (named in each message).
`apply_overlap` sets the accepted knobs; on CPU the three that need CUDA kernels or streams
(`NOT_APPLIED_ON_CPU`) are logged, not applied. The fused-buffer knobs (`FUSED`) switch on
main-gradient training (`needs_main_grad`, `llmtrain.train.main_grad`) and fleet's fused
communication buffers, whose stage-1 optimizer state the checkpoint reads and writes by
canonical parameter name (V2's slices: `llmtrain.paddle_compat.sharding_v2`; V1's fused parameters under
`sharding_tensor_fusion`: `llmtrain.paddle_compat.sharding_fused`).
"""
from __future__ import annotations

KNOBS = {
    "mp_async_allreduce": ("mp_configs", "mp_async_allreduce"),
    "pp_overlap_p2p_comm": ("pp_configs", "overlap_p2p_comm"),
    "pp_enable_timer": ("pp_configs", "enable_timer"),
    "dp_comm_overlap": ("pp_configs", "dp_comm_overlap"),
    "pp_sharding_comm_overlap": ("pp_configs", "sharding_comm_overlap"),
    "sharding_comm_overlap": ("sharding_configs", "comm_overlap"),
    "sharding_tensor_fusion": ("sharding_configs", "tensor_fusion"),
    "sharding_split_param": ("sharding_configs", "split_param"),
}
"""Our `parallel.<field>` -> (`strategy.hybrid_configs[section]`, attribute)."""

FUSED = ("dp_comm_overlap", "pp_sharding_comm_overlap", "sharding_comm_overlap", "sharding_tensor_fusion",
         "sharding_split_param")
"""Knobs after which fleet keeps gradients in fused communication buffers filled by gradient hooks: fleet 3.3.1
serves them only with main-gradient training (`llmtrain.train.main_grad`): pipeline_parallel.py leaves 'support
dp_comm_overlap without use_main_grad training' a TODO, and its FusedCommBuffer refuses a gradient whose address
moved ('The address of the grad/main_grad ... has been changed'), which a plain `.grad` does on every
accumulation (measured on CPU: DygraphShardingOptimizerV2 without main_grad trains the third step wrong)."""

EP_FUSED = ("sharding_split_param", "sharding_comm_overlap")
"""The fused-buffer knobs served under ep > 1, with sharding_split_param on: stage-1 V2's per-parameter `color`
gives the routed experts buckets reduced over the expert-data-parallel group (`llmtrain.parallel.expert_states`),
with or without pp (sharding_comm_overlap itself needs pp = 1: fleet's assert)."""

EP_UNSERVED = {
    "sharding_tensor_fusion": "fleet 3.3.1's V1 fuses every parameter a sharding rank owns into fused parameters and "
                              "reduce buckets over the sharding group, with no per-parameter group "
                              "(meta_optimizers/dygraph_optimizer/dygraph_sharding_optimizer.py, "
                              "DygraphShardingOptimizer._tensor_fusion, lines 238-262: fused_parameters(params, "
                              "comm_group=the sharding group))",
    "sharding_comm_overlap": "fleet 3.3.1's V1 comm overlap reduces through the buckets of its tensor fusion over the "
                             "sharding group, every owned parameter in them (dygraph_sharding_optimizer.py: the "
                             "constructor calls _tensor_fusion for comm_overlap alone too, lines 158-180; its buckets, "
                             "lines 244-258; V2's per-parameter `color` is read by "
                             "DygraphShardingOptimizerV2._build_comm_buffers only, lines 873-885)",
    "pp_sharding_comm_overlap": "with sharding_split_param, fleet 3.3.1's V2 takes its buckets from the pipeline's, "
                                "which hold every trainable parameter of each chunk over the sharding group "
                                "(meta_parallel/pipeline_parallel.py, fused_gradient, lines 953-1010; "
                                "DygraphShardingOptimizerV2._collect_comm_buffers, lines 1203-1222: no colour)",
}
"""Why a fused-buffer knob is refused under ep > 1, with the fleet 3.3.1 source it rests on: a bucket has one
communication group for all its parameters. The pipeline's buckets (dp_comm_overlap, V1's pp_sharding_comm_overlap)
take the parameters that are not stop_gradient (pipeline_parallel.py, fused_gradient, lines 971-973), so llmtrain
builds them with the experts flagged so (`llmtrain.parallel.build`, `llmtrain.parallel.expert_states`) and reduces
the experts over their own group; V2 under pp_sharding_comm_overlap keeps its state in those buckets, which then
cannot hold the experts."""

NOT_APPLIED_ON_CPU = ("mp_async_allreduce", "pp_overlap_p2p_comm", "pp_enable_timer")
"""Knobs that act through CUDA-only kernels or around the CPU pipeline channels: logged, not applied on CPU. The
fused-buffer knobs (`FUSED`) run on CPU over the stand-ins of `llmtrain.paddle_compat.cpu_backend.fused_comm`."""


def enabled(p) -> list[str]:
    """Names of the knobs switched on in `p` (a ParallelConfig or Layout)."""
    return [k for k in KNOBS if getattr(p, k, False)]


def overlap_problems(p, grad_accum: int | None = None) -> list[str]:
    """One line per refused knob or combination, naming the fields and their values."""
    on = set(enabled(p))
    problems = []
    deg = f"parallel.dp={p.dp}, parallel.tp={p.tp}, parallel.pp={p.pp}, parallel.sharding={p.sharding}"
    if "mp_async_allreduce" in on and p.tp == 1:
        problems.append(f"parallel.mp_async_allreduce=true with parallel.tp={p.tp}: it overlaps the tensor-parallel "
                        "all-reduce of d(input) in ColumnParallelLinear's backward; there is none without tp > 1")
    for knob in ("pp_overlap_p2p_comm", "pp_enable_timer"):
        if knob in on and p.pp == 1:
            problems.append(f"parallel.{knob}=true with parallel.pp={p.pp}: a pipeline schedule option; needs pp > 1")
    if "dp_comm_overlap" in on:
        if p.pp == 1 or p.dp == 1:
            problems.append(f"parallel.dp_comm_overlap=true with {deg}: fleet asserts dp > 1 and pp > 1 (it is a "
                            "pipeline option; without pp, DataParallel already overlaps its bucketed all-reduce "
                            "with the backward on GPU)")
        if "pp_sharding_comm_overlap" in on:
            problems.append("parallel.dp_comm_overlap=true with parallel.pp_sharding_comm_overlap=true: fleet refuses "
                            "both at once ('Cannot use dp pp overlap and sharding pp overlap at the same time')")
    if "pp_sharding_comm_overlap" in on:
        if p.pp == 1 or p.sharding == 1:
            problems.append(f"parallel.pp_sharding_comm_overlap=true with {deg}: fleet asserts sharding > 1 and pp > 1")
        if on & {"sharding_comm_overlap", "sharding_tensor_fusion"}:
            problems.append("parallel.pp_sharding_comm_overlap=true with parallel.sharding_comm_overlap or "
                            "sharding_tensor_fusion: fleet refuses both ('Can not enable pp's sharding_comm_overlap "
                            "and sharding's tensor_fusion at the same time')")
    stage_1 = p.sharding > 1 and p.sharding_stage == 1
    for knob in ("sharding_comm_overlap", "sharding_tensor_fusion", "sharding_split_param"):
        if knob in on and not stage_1:
            problems.append(f"parallel.{knob}=true with parallel.sharding={p.sharding}, parallel.sharding_stage="
                            f"{p.sharding_stage}: an option of fleet's stage-1 sharding optimizer; needs sharding > 1 "
                            "and sharding_stage=1 (ZeRO-2/3 run through group_sharded_parallel, which ignores it)")
    if "sharding_comm_overlap" in on and p.pp > 1:
        problems.append(f"parallel.sharding_comm_overlap=true with parallel.pp={p.pp}: fleet asserts 'You should not "
                        "use pipeline parallel and comm_overlap at the same time' (PaddleNLP ignores it under pp)")
    if getattr(p, "sharding_comm_buffer_mb", 256) < 1:
        problems.append(f"parallel.sharding_comm_buffer_mb={p.sharding_comm_buffer_mb}: must be >= 1 (MiB, an integer "
                        "in fleet's strategy)")
    if "sharding_comm_overlap" in on and grad_accum is not None and grad_accum < 1:
        problems.append(f"parallel.sharding_comm_overlap=true with train.grad_accum={grad_accum}: needs >= 1")
    if "sharding_split_param" in on and "sharding_tensor_fusion" in on:
        problems.append("parallel.sharding_split_param=true with parallel.sharding_tensor_fusion=true: split_param "
                        "selects DygraphShardingOptimizerV2, which asserts tensor_fusion off ('not supported yet'); "
                        "V2 fuses its gradients and parameters into buckets without it")
    fused = [k for k in FUSED if k in on]
    served = {"dp_comm_overlap"} | (set(EP_FUSED) if "sharding_split_param" in on else {"pp_sharding_comm_overlap"})
    off_v2 = [k for k in fused if k not in served]  # under ep: fleet's buckets that can leave the experts out
    if off_v2 and p.ep > 1:
        problems.append(f"parallel.{off_v2[0]}=true with parallel.ep={p.ep}: {EP_UNSERVED[off_v2[0]]}, so the routed "
                        "experts, whose gradients are summed over the expert-data-parallel group, would be summed over "
                        "the data group with other ranks' experts; under ep use parallel.sharding_split_param=true "
                        "(stage-1 V2: the experts get V2 buckets of their own over that group, pp > 1 included), with "
                        "parallel.sharding_comm_overlap=true for the overlap (pp = 1); under pp "
                        "parallel.dp_comm_overlap and V1's parallel.pp_sharding_comm_overlap are served")
    if "pp_sharding_comm_overlap" in on and p.cp > 1:
        problems.append(f"parallel.pp_sharding_comm_overlap=true with parallel.cp={p.cp}: fleet 3.3.1 asserts 'sep "
                        "parallel can not coexist with sharding_comm_overlap' (fleet/optimizer.py, "
                        "_dygraph_distributed_optimizer, line 82); under cp and pp use parallel.sharding_split_param=true "
                        "without it")
    return problems


def needs_main_grad(layout) -> bool:
    """True when a switched-on knob makes fleet keep gradients in fused buffers (`FUSED`): main-gradient training."""
    return any(getattr(layout, k, False) for k in FUSED)


def apply_overlap(strategy, layout, on_cpu: bool) -> list[str]:
    """Set every knob of `KNOBS` on `strategy` to the layout's value (after `hybrid_configs` is assigned); returns
    the switched-on ones NOT applied.

    On CPU the knobs of `NOT_APPLIED_ON_CPU` stay off: mp_async_allreduce calls the c_identity CUDA kernel directly,
    overlap_p2p_comm and the pipeline timers go around the CPU pipeline channels. The fused-buffer knobs are applied
    on CPU and GPU alike (the CPU's stand-ins: `llmtrain.paddle_compat.cpu_backend.fused_comm`). Knobs that are off
    are written off, so a strategy reused by a later run of the same process (`init_distributed`) carries only that
    run's knobs."""
    on = enabled(layout)
    skipped = [k for k in on if on_cpu and k in NOT_APPLIED_ON_CPU]
    for knob, (section, attr) in KNOBS.items():
        setattr(strategy.hybrid_configs[section], attr, knob in on and knob not in skipped)  # GPU-ONLY(overlap-knobs) for NOT_APPLIED_ON_CPU
    strategy.hybrid_configs["sharding_configs"].comm_buffer_size_MB = int(getattr(layout, "sharding_comm_buffer_mb", 256))
    if "sharding_comm_overlap" in on:  # as PaddleNLP: the sharding optimizer's overlap needs the accumulation count
        strategy.hybrid_configs["sharding_configs"].accumulate_steps = layout.grad_accum
    return skipped
