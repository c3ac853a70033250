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
`apply_overlap` sets the accepted knobs on GPU; on CPU none is applied (each depends
on CUDA streams, NCCL or kernels the gloo stand-ins do not provide) and the run says so.
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

_NO_MAIN_GRAD = ("fleet 3.3.1 fuses these gradients into communication buffers only for main_grad training "
                 "(PaddleNLP's amp_master_grad / MixPrecisionLayer; pipeline_parallel.py: 'support dp_comm_overlap "
                 "without use_main_grad training' is a TODO, the in-place reshape_ of _split_tensors fails), "
                 "which llmtrain does not use")
_FUSED_STATE = ("the sharding optimizer then keeps its optimizer state on fused buffers (fleet's _tensor_fusion / "
                "DygraphShardingOptimizerV2 slices), which llmtrain's checkpoints (state by canonical parameter name), "
                "gradient-norm record and memory.json do not read yet")


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
        problems.append(f"parallel.dp_comm_overlap=true: not supported here: {_NO_MAIN_GRAD}")
    if "pp_sharding_comm_overlap" in on:
        if p.pp == 1 or p.sharding == 1:
            problems.append(f"parallel.pp_sharding_comm_overlap=true with {deg}: fleet asserts sharding > 1 and pp > 1")
        if on & {"sharding_comm_overlap", "sharding_tensor_fusion"}:
            problems.append("parallel.pp_sharding_comm_overlap=true with parallel.sharding_comm_overlap or "
                            "sharding_tensor_fusion: fleet refuses both ('Can not enable pp's sharding_comm_overlap "
                            "and sharding's tensor_fusion at the same time')")
        problems.append(f"parallel.pp_sharding_comm_overlap=true: not supported here: {_NO_MAIN_GRAD}")
    stage_1 = p.sharding > 1 and p.sharding_stage == 1
    for knob in ("sharding_comm_overlap", "sharding_tensor_fusion", "sharding_split_param"):
        if knob in on and not stage_1:
            problems.append(f"parallel.{knob}=true with parallel.sharding={p.sharding}, parallel.sharding_stage="
                            f"{p.sharding_stage}: an option of fleet's stage-1 sharding optimizer; needs sharding > 1 "
                            "and sharding_stage=1 (ZeRO-2/3 run through group_sharded_parallel, which ignores it)")
    if "sharding_comm_overlap" in on and p.pp > 1:
        problems.append(f"parallel.sharding_comm_overlap=true with parallel.pp={p.pp}: fleet asserts 'You should not "
                        "use pipeline parallel and comm_overlap at the same time' (PaddleNLP ignores it under pp)")
    if "sharding_comm_overlap" in on and grad_accum is not None and grad_accum < 1:
        problems.append(f"parallel.sharding_comm_overlap=true with train.grad_accum={grad_accum}: needs >= 1")
    if "sharding_split_param" in on and "sharding_tensor_fusion" in on:
        problems.append("parallel.sharding_split_param=true with parallel.sharding_tensor_fusion=true: split_param "
                        "selects DygraphShardingOptimizerV2, which asserts tensor_fusion off ('not supported yet')")
    for knob in ("sharding_comm_overlap", "sharding_tensor_fusion", "sharding_split_param"):
        if knob in on:
            problems.append(f"parallel.{knob}=true: not supported here yet: {_FUSED_STATE}")
    return problems


def apply_overlap(strategy, layout, on_cpu: bool) -> list[str]:
    """Set the layout's knobs on `strategy` (after `hybrid_configs` is assigned); returns those NOT applied.

    On CPU nothing is applied: mp_async_allreduce calls the c_identity CUDA kernel directly, overlap_p2p_comm
    and the pipeline timers go around the CPU pipeline channels, and the sharding/dp overlaps need NCCL streams."""
    on = enabled(layout)
    if on_cpu:
        return on
    for knob in on:
        section, attr = KNOBS[knob]
        setattr(strategy.hybrid_configs[section], attr, True)  # GPU-ONLY(overlap-knobs)
        if knob == "sharding_comm_overlap":  # as PaddleNLP: the sharding optimizer's overlap needs the accumulation count
            strategy.hybrid_configs["sharding_configs"].accumulate_steps = layout.grad_accum
    return []
