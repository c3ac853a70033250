"""The cost of each piece a pipeline cuts (embedding, every block, the head with its loss), and the default split.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py model=llama-tiny model.num_layers=5 +parallel=pp2
    costs = layer_costs(model_cfg, dev, micro_batch=2, seq_len=4096, tp=1)    # seconds: [embedding, blocks..., head]
    layout = with_pipeline_split(layout, model_cfg, dev, seq_len=4096, recompute="none")

A piece's cost is the device seconds of its forward and backward kernels for one micro-batch on one rank, as the
planner's kernel inventory (`llmtrain.plan.kernels.micro_batch_kernels`) lists them and the device profile
(`llmtrain.plan.timeline.kernel_seconds`) prices them: the same model the planner ranks layouts with, so dense
and MoE blocks, the embedding's gather and scatter, and the LM head's GEMM with its cross entropy (and an MoE
model's balancing losses) are weighed as the step runs them. Under full recompute a block's forward counts twice.
`with_pipeline_split` fills `Layout.pp_layers` with `llmtrain.parallel.pp_split.balanced_split` of these costs
(under DualPipeV `llmtrain.parallel.v_split.v_balanced_split`: each stage's pair of chunks) when `parallel.pp_layers`
is not given.
"""
from __future__ import annotations

import dataclasses

from llmtrain.parallel.pp_split import balanced_split
from llmtrain.parallel.v_split import v_balanced_split
from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels
from llmtrain.plan.profile import Profile, load_profile
from llmtrain.plan.timeline import kernel_seconds

_COSTS: dict = {}


def split_profile(on_gpu: bool, plan_device: str) -> Profile:
    """The profile a run's default split is priced on: the packaged `plan.device` on a GPU, `cpu-here` on a CPU
    (packaged files only, so every rank and every machine computes the same split)."""
    return load_profile(plan_device if on_gpu else "cpu-here")


def layer_costs(model_cfg, dev: Profile, *, micro_batch: int, seq_len: int, tp: int = 1,
                sequence_parallel: bool = False, cp: int = 1, recompute: str = "none", moe=None) -> list[float]:
    """[embedding, block 0, ..., block L-1, head with its loss]: forward + backward device seconds of one micro-batch
    [micro_batch, seq_len] on one rank of tensor-parallel degree `tp` (`recompute`: none | full | selective, full
    runs each block's forward again; `moe`: a `llmtrain.plan.moe.MoEPlan`, how MoE blocks dispatch)."""
    gpu = dev.async_launch
    recompute = "full" if recompute == "full" else "none"  # the kernel model's classes: selective prices as none
    moe_key = None if moe is None else (moe.ep, moe.dispatcher, moe.imbalance, moe.link, moe.local, moe.nvlink, moe.net)
    key = (id(model_cfg), id(dev), micro_batch, seq_len, tp, sequence_parallel, cp, recompute, moe_key)
    hit = _COSTS.get(key)
    if hit is not None and hit[0] is dev and hit[1] is model_cfg:
        return list(hit[2])
    flash = model_cfg.attention == "flash" or (model_cfg.attention == "auto" and gpu)
    base = MicroBatchSpec(model_cfg, micro_batch, seq_len, tp, dev.dtype_bytes, gpu, flash, recompute, layers=0, first=False, last=False,
                          sp=sequence_parallel and tp > 1, math_core=dev.math_attn is not None,
                          ce_core="vocab_parallel_ce" in dev.mem_curves, cp=cp, moe=moe)

    memo = dev.__dict__.setdefault("_kernel_memo", {})  # a kernel's device time, per profile (as timeline.Stream)
    by_id = dev.__dict__.setdefault("_kernel_memo_ids", {})  # the same per kernel object: the lists are shared

    def priced(k) -> float:
        hit = by_id.get(id(k))
        if hit is not None and hit[0] is k:
            return hit[1]
        d = memo.get(k)
        if d is None:
            d = memo[k] = kernel_seconds(dev, k)
        by_id[id(k)] = (k, d)  # the kernel kept alive with its id
        return d

    def seconds(**piece) -> float:
        mb = micro_batch_kernels(dataclasses.replace(base, **piece))
        return sum(priced(k) for k in mb.forward + mb.backward)

    # the pieces that do not run the MoE feed-forward (embedding, head, a dense block) do not read `moe`: priced
    # once for every MoE plan
    plain = (id(model_cfg), id(dev), micro_batch, seq_len, tp, sequence_parallel, cp, recompute)

    def piece(kind, **where) -> float:
        k = (*plain, kind, moe_key if kind == "moe" else None)
        hit = _PIECES.get(k)
        if hit is None or hit[0] is not dev or hit[1] is not model_cfg:
            hit = _PIECES[k] = (dev, model_cfg, seconds(**where))
        return hit[2]

    kinds: dict = {}  # a dense and an MoE block are each priced once
    blocks = []
    for i in range(model_cfg.num_layers):
        kind = model_cfg.is_moe_layer(i)
        if kind not in kinds:
            kinds[kind] = piece("moe" if kind else ("dense", i), layers=1, first_layer=i)
        blocks.append(kinds[kind])
    costs = [piece("embedding", first=True), *blocks, piece("head", last=True)]
    _COSTS[key] = (dev, model_cfg, tuple(costs))  # the profile and the model kept alive with their ids
    return costs


_PIECES: dict = {}


def with_pipeline_split(layout, model_cfg, dev: Profile, *, seq_len: int, recompute: str = "none", moe=None):
    """`layout` with `pp_layers` filled: unchanged when pp == 1 or the split was given (`parallel.pp_layers`),
    otherwise balanced by `layer_costs` on `dev` (`moe`: the layout's `llmtrain.plan.estimate.moe_plan`; each chunk
    at least one block; the caller has checked `model.num_layers` >= pp x virtual_pp,
    `llmtrain.parallel.layout.model_fit_problems`): chunk by chunk along the chain (`balanced_split`), or under
    DualPipeV each stage's pair of chunks (`llmtrain.parallel.v_split.v_balanced_split`). The run
    (`llmtrain.resolve`) and the planner, which prices every distinct stage, take their split from here."""
    if layout.pp <= 1 or layout.pp_layers:
        return layout
    costs = layer_costs(model_cfg, dev, micro_batch=layout.micro_batch, seq_len=seq_len, tp=layout.tp,
                        sequence_parallel=layout.sequence_parallel, cp=layout.cp, recompute=recompute, moe=moe)
    if getattr(layout, "v_shape", False):  # DualPipeV: each stage's pair of chunks balanced (its V)
        split = v_balanced_split(costs, layout.pp)
    else:
        split = balanced_split(costs, layout.pp * layout.virtual_pp)
    hit = _SPLIT_LAYOUTS.get((id(layout), split))  # the ranking asks again per recompute mode of one layout
    if hit is None or hit[0] is not layout:
        hit = _SPLIT_LAYOUTS[(id(layout), split)] = (layout, dataclasses.replace(layout, pp_layers=split))
    return hit[1]


_SPLIT_LAYOUTS: dict = {}
