"""The estimated parts of a plan: worst-rank memory breakdown and step time of one layout on one device profile.

    python -m llmtrain.plan model=llama-7b data.seq_len=4096 plan.devices=64 plan.device=a100-80g
    est = estimate(model_cfg, layout, seq_len, recompute, device, devices_per_node)   # -> dict (see `estimate`)

Memory (bytes, the worst rank): params/optimizer from `memory.predict_ranks` (exact); gradients in the
parameters' dtype (ZeRO-2/3: an estimate, see `memory._stage_ranks`); activations per transformer layer per micro-batch
after Korthikanti et al. 2022 (Table 2: s·b·h·(34 + 5·a·s/h) bytes for fp16 GPT without parallelism,
s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tensor parallelism and no sequence parallelism), written out for our
blocks and the fused paths the run takes (`layer_activation_bytes`: the norms' own tensors, the column
linears' inputs (one copy per projection under tp), q/k/v, the attention output, math attention's
probabilities or flash attention's log-sum-exp, the MLP's inner tensors); no dropout. With full recompute
a layer keeps only its input (s·b·h; with RoPE also the block's cached cos/sin tables, 2·s·d; both
measured on CPU through the host allocator) plus one layer's full set during its backward (beyond the head's peak
on the last stage: the two are alive at different times, `_beyond_head`). Selective recompute
(Korthikanti et al. 2022, section 4.2: only the attention core, softmax(q·kᵀ)·v, is recomputed) drops the
core's own saved tensors, the a·s²·b/t probabilities of math attention (Table 2's 5·a·s/h term; flash
attention: its log-sum-exp) and keeps everything else; it is a planner option only (`recompute`
"selective" rows are marked not runnable: llmtrain's Trainer recomputes whole blocks). In flight on the
first pipeline stage: 1F1B holds min(pp, m) micro-batches of its L/pp layers; interleaved holds
(pp - 1)·2 + (v - 1)·pp + 1 chunk-micro-batches of L/(pp·v) layers (fleet's warm-up count). other: logits,
their fp32 copy and the loss's softmax on the last stage (b·s·V/t·(e + 4 + 4), no copy in fp32: `head_bytes`)
and the framework margin (CUDA context, NCCL buffers,
fragmentation: outside the allocator's count, so `allocated` = total - margin is the figure to hold against
Paddle's max_memory_allocated).

Time: compute = the operator-level model (llmtrain/plan/kernels.py enumerates every kernel of a micro-batch's
forward and backward, full recompute's second forward included, and of the optimizer step; timeline.py times
them on the device profile's measured tables and overlaps host dispatch with device execution), for the
worst pipeline stage, every stage priced with its own blocks (the first holds the embedding, the last the head and
loss; a cost-balanced split gives the middle stages more blocks, so one of them is often the slowest); selective recompute (a
planner-only option) adds the attention core's forward FLOPs (4·L·h·s per token) at the profile's
attention rate. MFU keeps the model FLOPs 6N + 12·L·h·s (llmtrain/models/size.py) over the profile's peak; tp: the calls `llmtrain.plan.tp_comm` lists (checked against
a tp2 rank's): per block an all-reduce of b·s·h forward per row-parallel output (o, down) and one backward per
column-parallel input (q, k, v, gate, up; 2 with fused projections; MLA: q_b's, kv_b's and the rotary key's narrower
inputs; an MoE block without shared experts none for its feed-forward), ring: 2·(t-1)/t·bytes/bw + 2·(t-1)·alpha,
a recomputed piece repeating its forward ones (full: every block's; full_attn: the attention layer's; the
MLP, the shared experts), plus per micro-batch the embedding's and the head's [b, s, h] and the
parallel cross entropy's three [b, s]; not overlapped; under sequence parallelism an all-gather + reduce-scatter pair
per all-reduce (the same bytes, each half the ring's time);
pp: 2 sends of b·s·h per micro-batch per stage boundary (forward activation, backward grad; a calibrated
profile's own send/recv alpha-beta), not overlapped; dp/sharding, once per step: the gradient all-reduce over dp (ZeRO-2/3: of the 1/sharding
share; fp32 under main-gradient training) and, for sharding stage 1, a gradient reduce-scatter, overlapped with
the backward of the last micro-batch (gradient accumulation syncs once) only where the layout's options issue it
from the backward (llmtrain/plan/overlap.py: DataParallel's buckets always, dp under pp with dp_comm_overlap, V2
with sharding_comm_overlap / pp_sharding_comm_overlap), in buckets: exposed = max(comm/n, comm - backward·(n-1)/n),
else all of it; plus the all-gather of updated parameters after the optimizer step (not overlapped); ZeRO-2
reduces the gradients in every micro-batch's backward (Paddle's GroupShardedStage2 has no no_sync), one bucket per
gradient storage; ZeRO-3, every micro-batch: parameter all-gathers for forward and backward and a gradient
reduce-scatter (3 x (n-1)/n volume), one bucket per layer, behind the micro-batch's compute;
bubble = one micro-batch of every stage but the slowest (the fill and drain of 1F1B), /v when interleaved
(equal stages: (pp - 1)/(v·m) of the pipeline's compute; the last stage holding the LM head is the slowest);
DualPipeV: 1F1B's (v = 1) times `llmtrain.plan.dualpipe_bubble.dualpipe_bubble_factor` (DeepSeek's formula);
loop: the training loop's own small all-reduces a step (`loop_meetings_s`). A group spans the network if its ranks are more than
devices_per_node apart in fleet's order (dp, pp, sharding, tp: tp innermost); then its ring crosses between
nodes at (members per node) x net_bw, capped by NVLink (`_link`: one network port per GPU, one NCCL channel per
local member), and a pipeline pair at one port's net_bw.
"""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

from llmtrain.models.size import flops_parameters
from llmtrain.parallel.groups import first_group
from llmtrain.parallel.pp_split import stage_blocks
from llmtrain.plan.memory import (_LAYOUT_KEYS, _local_entries, _param_bytes, _spec_list, expert_state_owners, greedy_partition, local_shape, param_specs,
                                  stage_params, stage_worst_holdings)
from llmtrain.plan.kernels import MicroBatchSpec
from llmtrain.plan.moe import MoEPlan
from llmtrain.plan.overlap import MIB, SyncPlan, buckets, exposed, gradient_bytes_per_element, gradient_syncs
from llmtrain.plan.timeline import StepSpec, step_compute
from llmtrain.plan.tp_comm import tp_collectives

RECOMPUTE = ("none", "full", "full_attn", "core_attn")
"""The recompute modes the planner ranks (`train.recompute`; `selective`, the older planner name, is core_attn)."""


def recompute_mode(recompute) -> str:
    """`train.recompute` (bool: whole blocks), a mode name or a `Recompute` -> "none" | "full" | "selective" (the
    kernel model's classes: whole blocks re-run, or parts of them: `llmtrain.plan.recompute`)."""
    from llmtrain.plan.recompute import plan_recompute

    if recompute in ("none", "full", "selective"):
        return recompute
    rc = plan_recompute(recompute)
    if not rc.on:
        return "none"
    if rc.parts == {"block"} and rc.blocks is None:
        return "full"
    return "selective" if "core_attn" in rc.parts else "none"  # other parts: `_parts_compute`


def fused_paths(cfg, gpu: bool) -> dict:
    """{switch: on} for the `model.fuse_*` switches of a run on a GPU (`auto` on) or on CPU (`auto` off)."""
    from llmtrain.models.config import FUSE_SWITCHES

    return {k: cfg.fused(k, gpu) for k in FUSE_SWITCHES}


def column_inputs(cfg, gpu: bool) -> int:
    """Column-parallel inputs of one block under tp, each copied by fleet's c_identity and all-reduced in the
    backward: q, k, v and gate, up (GeLU: up), or one per fused projection (`fuse_qkv`, `fuse_ffn`)."""
    on = fused_paths(cfg, gpu)
    return (1 if on["fuse_qkv"] else 3) + (1 if on["fuse_ffn"] or cfg.activation != "swiglu" else 2)


def layer_activation_bytes(cfg, s: int, b: int, t: int, e: int, flash: bool, selective: bool = False,
                           sp: bool = False, gpu: bool = False) -> float:
    """Bytes one transformer block saves for backward for one micro-batch [b, s] on a tp rank (no recompute, or
    `selective`: without the attention core's own saved tensors, Korthikanti et al. 2022 section 4.2).

    Korthikanti et al. 2022, Table 2 (s·b·h·(10 + 24/t + 5·a·s/(h·t)) for GPT in fp16 without sequence
    parallelism), written out tensor by tensor for our blocks (llmtrain/models/layers.py) with the
    `model.fuse_*` paths on for this run (`gpu`: how `auto` resolves, `ModelConfig.fused`), checked against
    `saved_tensors_hooks` on CPU (tests/plan/test_activations.py; under tp2, tests/parallel/sp_activations.py):
    - norms, of their own: LayerNorm its input (s·b·h) and fp32 mean/rstd (2·s·b); our RMSNorm an fp32 copy of
      its input (s·b·h fp32), the normalised tensor before the weight (s·b·h, compute dtype) and rsqrt (s·b
      fp32); fused RMSNorm (`fuse_rms_norm`, Paddle's rms_norm_grad takes x and inv_var) its input and s·b fp32;
    - the inputs of the column linears: one s·b·h per sub-block on one device (the norm output, shared by the
      projections); under tp each ColumnParallelLinear keeps its own copy (fleet's c_identity copies:
      phi CIdentityKernel), 3 for q/k/v and 2 for SwiGLU's gate/up, 1 per fused projection (`fuse_qkv`,
      `fuse_ffn`: its concatenated weight is not kept, `llmtrain/models/fused_linear.py`);
    - QK-norm (`qk_norm`): per head as our RMSNorm, on q and k: normalised s·b·(q + kv)/t (compute dtype), their
      fp32 copy and an fp32 rsqrt per head and position;
    - attention: the o_proj input (s·b·q/t; flash attention's output is the same storage); RoPE keeps q and k
      and their rotated halves (2·s·b·(q + kv)/t; fused RoPE nothing: its backward takes only cos/sin) and the
      cos/sin tables [s, d]; math attention keeps, with grouped-query heads, k and v before repeating
      (2·s·b·kv/t), the transposed q and nh-wide k, v (3·s·b·q/t) and the probabilities (a·s²·b/t, fp32, plus a
      copy in the compute dtype when that is not fp32); flash attention keeps q, k, v and an fp32 log-sum-exp
      (a·s·b/t);
    - MLP: GeLU keeps its input and output (2·s·b·f/t); SwiGLU gate, silu(gate), up and the product
      (4·s·b·f/t), fused (`fuse_swiglu`: swiglu_grad takes gate and up) 3·s·b·f/t.
    With sequence parallelism (`sp`, llmtrain/parallel/sequence.py) what the norms keep of their own is 1/t and
    the linear inputs are the all-gathered copies (one per projection, whole); checked against the bytes saved
    on 2 CPU processes for a Llama block, RMSNorm (tests/parallel/sp_activations.py); the LayerNorm case is
    written the same way, not measured. The GPU-only kernels (fused RMSNorm and RoPE, flash attention) are
    counted from their backward's inputs, not measured.
    """
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    d = cfg.attn_head_dim()
    q, kv, a = cfg.num_heads * d / t, cfg.kv_heads() * d / t, cfg.num_heads / t
    sb = s * b
    on = fused_paths(cfg, gpu)
    swiglu = cfg.activation == "swiglu"
    shard = t if sp else 1  # positions a norm sees on this rank: s / shard
    if cfg.norm == "layernorm" or on["fuse_rms_norm"]:  # two norms: input (compute dtype), fp32 statistics
        n, stats = 2 * sb * h / shard, (4 if cfg.norm == "layernorm" else 2) * sb / shard
    else:  # two norms: normalised tensor (compute dtype), fp32 input copy, fp32 rsqrt
        n, stats = 2 * sb * h / shard, (2 * sb * h + 2 * sb) / shard
    n += (2 if t == 1 and not sp else column_inputs(cfg, gpu)) * sb * h  # column linears' inputs
    n += sb * q  # o_proj input
    if cfg.qk_norm:  # layers.HeadNorm on q and k (unfused RMSNorm per head): normalised, fp32 input copy, fp32 rsqrt
        n += sb * (q + kv)
        stats += sb * (q + kv) + sb * (cfg.num_heads + cfg.kv_heads()) / t
    if cfg.position == "rope":
        n += 2 * s * d + (0 if on["fuse_rope"] else 2 * sb * (q + kv))  # cos/sin tables [s, d]; q, k, rotated
    n += (3 if on["fuse_swiglu"] else 4) * sb * f / t if swiglu else 2 * sb * f / t
    if flash:
        n += sb * (q + 2 * kv)
        return n * e + stats * 4 + (0 if selective else 4 * a * sb)
    n += 3 * sb * q + (2 * sb * kv if kv != q else 0)
    probs = 0 if selective else a * s * s * b * (4 + (e if e != 4 else 0))
    return n * e + stats * 4 + probs


def head_bytes(cfg, s: int, b: int, t: int, e: int) -> float:
    """Bytes the last stage holds beyond its blocks' at its loss's forward, the head's peak, for one micro-batch
    [b, s] on a tp rank: the logits [b, s, V/t] (compute dtype), their fp32 copy (none when the compute dtype is
    fp32: the cast returns its input) and the fp32 softmax Paddle's cross_entropy_with_softmax makes and keeps,
    all alive in its kernel; the loss's backward turns the softmax into the logits' gradient in place (then
    the cast back: 4 + e bytes, below the forward's). Measured on CPU for bf16 logits (forward peak 10 bytes per
    logit, backward 6, 4 held: tests/plan/test_activations.py); PyTorch's F.cross_entropy holds 12 bytes in its
    backward (three fp32 buffers), which the H100 twin's rows showed until the twin took Paddle's loss
    (benchmarks/data/h100/twin2; benchmarks/twin_memory.py). Not counted: what the final norm keeps and the LM head's input (about 2 s·b·h·e,
    1.7% of the twin's L4 peak)."""
    return s * b * cfg.vocab_size / t * (e + (4 if e != 4 else 0) + 4)


def recompute_kept_bytes(cfg, s: int, b: int, e: int) -> float:
    """Bytes a fully recomputed block keeps between its forward and backward: its input [b, s, h] (whole on
    every tp rank without sequence parallelism) and, with RoPE, the block's cached cos/sin tables [s, d]
    (measured on CPU: tests/plan/test_activations.py)."""
    return s * b * cfg.hidden_size * e + (2 * s * cfg.attn_head_dim() * e if cfg.position == "rope" else 0)


def memory_estimate(cfg, layout, seq_len: int, recompute, amp: str, device: str,
                    dtype_bytes: int, flash: bool, framework_bytes: float, moe_imbalance: float | None = None,
                    fp8: bool = False, fp8_cached_copies: int = 0) -> dict:
    """The worst rank's bytes by part (params, grads, optimizer, activations, other, total, allocated). Each pipeline
    stage is priced with its own blocks (`layout.pp_layers`; dense and MoE blocks each their own bytes) and its own
    micro-batches in flight: 1F1B min(pp - stage, m) (fleet's warm-up pp - stage - 1, plus one), interleaved
    min(2 (pp - stage - 1) + (v - 1) pp + 1, m v) chunk-micro-batches of 1/v of the stage's blocks, DualPipeV
    each of the stage's two chunks its own count, the peak read off fleet's schedule (`held_in_flight`,
    llmtrain/plan/dualpipe_memory.py: stage s holds 2 pp - s micro-batches of its down chunk beside s + 1 of its up
    chunk; the logits once, on stage 0). Gradients
    include the experts' that are held from the backward until reduced to their edp owners
    (`grad_transient_bytes`). `recompute`: a mode name, a bool or a `llmtrain.models.recompute.Recompute` (parts
    and blocks, priced by `llmtrain.plan.recompute`). `fp8` (`train.fp8` on): each block's FP8 weight copies, kept
    for its backward per micro-batch in flight (`fp8_weight_bytes`; under recompute only the re-running block's);
    with `fp8_cached_copies` > 0 (`train.fp8_weight_cache`, llmtrain/fp8/cache.py) instead that many copies of every
    weight of the stage for the whole step (made at first use, dropped after the optimizer step): 2 on the GPU path
    of the blockwise recipe (W and its transpose), 1 for tensorwise and for the CPU emulation (W)."""
    from llmtrain.plan.recompute import plan_recompute

    rc = plan_recompute(recompute)
    if rc.on and rc.parts != {"block"} or rc.blocks is not None:
        return _parts_memory_estimate(cfg, layout, seq_len, rc, amp, device, dtype_bytes, flash, framework_bytes,
                                      moe_imbalance, fp8, fp8_cached_copies)
    mode = "full" if rc.on else "none"
    w8 = fp8_weight_bytes(cfg, layout) if fp8 else None
    ranks = stage_worst(cfg, layout, amp, device)
    dualpipev = getattr(layout, "pp_schedule", "1f1b") == "dualpipev"
    head = 0 if dualpipev else layout.pp - 1  # the stage holding the logits (DualPipeV's V: stage 0)
    p, v, m = layout.pp, layout.virtual_pp, layout.grad_accum
    dense_layer, moe_layer, kept, logits = activation_parts(cfg, layout, seq_len, mode, dtype_bytes, flash, device,
                                                            moe_imbalance)
    worst = None
    stages = layout_stages(layout) if p > 1 else None
    for st in range(p):
        blocks = stages[st] if p > 1 else range(cfg.num_layers)
        count, total, most = _stage_sets(cfg, dense_layer, moe_layer, blocks if p > 1 else None)
        transient = most if mode == "full" else 0  # one block's full set during its backward
        transient = _beyond_head(transient, logits if st == head else 0)
        w8_flight = w8 is not None and not fp8_cached_copies and mode != "full"  # FP8 copies per micro-batch
        if dualpipev and p > 1 and layout.pp_layers:  # the V: each of its two chunks its own micro-batches in flight
            moe = moe_blocks(cfg)
            per = [kept if mode == "full" else moe_layer if moe[i] else dense_layer for i in blocks]
            per = [a + w8[i] for a, i in zip(per, blocks)] if w8_flight else per
            act = held_in_flight(per, layout, st, dualpipev) + transient
        else:
            flight = in_flight(p, v, m, st, dualpipev)
            act = flight * count * kept + transient if mode == "full" else flight * total
            act += flight * sum(w8[i] for i in blocks) if w8_flight else 0
        if w8 is not None and fp8_cached_copies:  # every weight's cached copies, the whole step
            act += fp8_cached_copies * sum(w8[i] for i in blocks)
        elif w8 is not None and mode == "full":  # the FP8 weight copies of the one block re-running
            act += max((w8[i] for i in blocks), default=0)
        worst = _worse(worst, ranks[st], act, transient, framework_bytes + (logits if st == head else 0))
    return _finish(worst, framework_bytes)


def _stage_sets(cfg, dense_layer: float, moe_layer: float, blocks) -> tuple:
    """(blocks, the sum of their saved bytes, the largest) of a stage holding `blocks` (None: every block), each
    dense block saving `dense_layer` and each MoE block `moe_layer` bytes; remembered per stage and sizes."""
    key = (id(cfg), dense_layer, moe_layer, blocks)
    hit = _SETS.get(key)
    if hit is None or hit[0] is not cfg:
        moe = moe_blocks(cfg)
        full = [moe_layer if moe[i] else dense_layer for i in (range(cfg.num_layers) if blocks is None else blocks)]
        hit = _SETS[key] = (cfg, (len(full), sum(full), max(full, default=0)))  # the model kept alive with its id
    return hit[1]


_SETS: dict = {}
_FP8_W: dict = {}


def fp8_weight_bytes(cfg, layout) -> list:
    """Per block, the bytes of the FP8 copies of its linears' weights on one rank (tp/ep-local shapes): one byte per
    element plus an fp32 scale per 128 x 128 block, as the blockwise recipe keeps for the backward (llmtrain/fp8;
    tensorwise's one scale is nothing). The router, norms and biases stay as they are."""
    key = (id(cfg), layout.tp, getattr(layout, "ep", 1))
    hit = _FP8_W.get(key)
    if hit is None or hit[0] is not cfg:
        out = [0.0] * cfg.num_layers
        for spec in param_specs(cfg, None):
            if not isinstance(spec.chunk, int) or ".router." in spec.name:
                continue
            if not (spec.expert or (spec.name.endswith(".weight") and len(spec.shape) == 2)):
                continue
            n = prod_(local_shape(spec, layout.tp, getattr(layout, "ep", 1)))
            out[spec.chunk] += n * (1 + 4 / (128 * 128))
        hit = _FP8_W[key] = (cfg, out)
    return hit[1]


def _beyond_head(transient: float, head: float) -> float:
    """The part of a recomputed block's transient (its whole saved set while it re-runs in the backward) above the
    head's peak (`head_bytes`, 0 off the last stage): the two are alive at different times (the loss's forward
    and backward end before the last block re-runs, and free the logits' buffers), so the step's peak holds the
    larger one. (The H100 twin: counting both priced full recompute 24% over its peak.)"""
    return max(0.0, transient - head)


def _worse(worst: dict | None, r: dict, act: float, transient: float, other: float) -> dict:
    """The stage entry (params, grads, optimizer, activations, other, total) of holdings `r` if it holds more than
    `worst`, else `worst`."""
    params, grads, opt = r["param_bytes"], r["grad_bytes"] + r.get("grad_transient_bytes", 0), r["optimizer_bytes"]
    a, o = int(act), int(other)
    total = params + grads + opt + a + o  # in the entry's order, as sum() adds them
    if worst is not None and not total > worst["total"]:
        return worst
    return {"params": params, "grads": grads, "optimizer": opt, "activations": a, "other": o, "total": total,
            "recompute_transient": int(transient)}  # in `activations`: one block during its backward, beyond the head


def _finish(worst: dict, framework_bytes: float) -> dict:
    worst["allocated"] = worst["total"] - int(framework_bytes)  # what the allocator counts (max_memory_allocated)
    return {k: int(v) for k, v in worst.items()}


_MOE_BLOCKS: dict = {}


def moe_blocks(cfg) -> tuple:
    """Per block, whether it is an MoE block (`ModelConfig.is_moe_layer`), remembered per model."""
    hit = _MOE_BLOCKS.get(id(cfg))
    if hit is None or hit[0] is not cfg:
        hit = _MOE_BLOCKS[id(cfg)] = (cfg, tuple(cfg.is_moe_layer(i) for i in range(cfg.num_layers)))
    return hit[1]


def stage_blocks_of(pp_layers, pp: int, stage: int, v_shape: bool = False) -> tuple:
    """`llmtrain.parallel.pp_split.stage_blocks` as a tuple, remembered per (split, pp, stage, V shape): a ranking
    asks for the same stages of the same splits many times."""
    return _stage_blocks_of(tuple(pp_layers), pp, stage, v_shape)


def layout_stages(layout) -> tuple:
    """`stage_blocks_of` of every pipeline stage of `layout` (pp > 1, its split filled), remembered per Layout object
    (frozen: every row of one split layout reads the same tuples)."""
    hit = _STAGES_OF.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    v_shape = getattr(layout, "pp_schedule", "1f1b") == "dualpipev"
    out = tuple(stage_blocks_of(layout.pp_layers, layout.pp, st, v_shape) for st in range(layout.pp))
    if getattr(getattr(type(layout), "__dataclass_params__", None), "frozen", False):
        _STAGES_OF[id(layout)] = (layout, out)  # the layout kept alive with its id
    return out


_STAGES_OF: dict = {}


@lru_cache(maxsize=65536)
def _stage_blocks_of(pp_layers: tuple, pp: int, stage: int, v_shape: bool) -> tuple:
    return tuple(stage_blocks(pp_layers, pp, stage, v_shape))


def held_in_flight(per_block: list, layout, stage: int, dualpipev: bool) -> float:
    """Bytes stage `stage` keeps for backward at its peak: `in_flight` micro-batches of its blocks' `per_block`
    bytes (in the order `stage_blocks_of` lists them), or under DualPipeV the peak of its down chunk's and up chunk's
    micro-batches in flight read off fleet's schedule (`llmtrain.plan.dualpipe_memory`)."""
    p = layout.pp
    if dualpipev and p > 1 and layout.pp_layers:
        from llmtrain.plan.dualpipe_memory import v_held

        down = layout.pp_layers[stage]  # stage_blocks lists the down chunk's blocks first
        return v_held(sum(per_block[:down]), sum(per_block[down:]), pp=p, micro_batches=layout.grad_accum,
                      stage=stage)
    return in_flight(p, layout.virtual_pp, layout.grad_accum, stage, dualpipev) * sum(per_block)


def in_flight(p: int, v: int, m: int, stage: int, dualpipev: bool = False) -> float:
    """Micro-batches of pipeline stage `stage`'s blocks in flight (`memory_estimate`): 1F1B min(pp - stage, m),
    interleaved min(2 (pp - stage - 1) + (v - 1) pp + 1, m v) chunk-micro-batches of 1/v of its blocks, DualPipeV
    (`dualpipev`, v = 2) min(2 pp + 1, m v) chunk-micro-batches on every stage (DualPipe's table); 1 without pp."""
    if p == 1:
        return 1.0
    if dualpipev:
        return min(2 * p + 1, m * v) / v
    if v == 1:
        return float(min(p - stage, m))
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v) / v


def activation_parts(cfg, layout, seq_len: int, mode: str, dtype_bytes: int, flash: bool, device: str,
                     moe_imbalance: float | None = None) -> tuple[float, float, float, float]:
    """(bytes a dense block saves for backward, an MoE block's, a fully recomputed block's kept input, the last
    stage's head peak `head_bytes`) for one micro-batch of `layout` on one rank (remembered per model and the
    layout fields they read)."""
    cp = getattr(layout, "cp", 1)
    s, b, t = seq_len // cp, layout.micro_batch, layout.tp
    sp = getattr(layout, "sequence_parallel", False)
    key = (id(cfg), s, b, t, sp, getattr(layout, "ep", 1), mode, dtype_bytes, flash, device, moe_imbalance)
    hit = _ACT_PARTS.get(key)
    if hit is None or hit[0] is not cfg:
        hit = _ACT_PARTS[key] = (cfg, _activation_parts(cfg, layout, s, b, t, sp, mode, dtype_bytes, flash, device,
                                                        moe_imbalance))  # the model kept alive with its id
    return hit[1]


_ACT_PARTS: dict = {}


def shared_expert_cfg(cfg):
    """`cfg` as a dense block whose FFN is the shared experts' (an MoE block's dense part), remembered per model."""
    hit = _SHARED_CFG.get(id(cfg))
    if hit is None or hit[0] is not cfg:
        hit = _SHARED_CFG[id(cfg)] = (cfg, dataclasses.replace(
            cfg, ffn_hidden_size=cfg.moe_num_shared_experts * cfg.expert_ffn_size()))
    return hit[1]


_SHARED_CFG: dict = {}


def _activation_parts(cfg, layout, s: int, b: int, t: int, sp: bool, mode: str, dtype_bytes: int, flash: bool,
                      device: str, moe_imbalance: float | None) -> tuple[float, float, float, float]:
    """`activation_parts`, computed."""
    dense_layer = layer_activation_bytes(cfg, s, b, t, dtype_bytes, flash, selective=mode == "selective", sp=sp,
                                         gpu=device == "gpu")
    moe_layer = dense_layer
    if cfg.moe_num_experts > 0:  # an MoE block: the dense block with the shared expert's FFN, plus the dispatch's
        from llmtrain.plan.moe import moe_activation_bytes

        shared = shared_expert_cfg(cfg)
        plan = MoEPlan(ep=getattr(layout, "ep", 1), imbalance=moe_imbalance)
        moe_layer = layer_activation_bytes(shared, s, b, t, dtype_bytes, flash, selective=mode == "selective", sp=sp,
                                           gpu=device == "gpu") + moe_activation_bytes(cfg, b * s // t if sp else b * s, dtype_bytes, plan)  # sp: a rank routes its T/tp
    return dense_layer, moe_layer, recompute_kept_bytes(cfg, s, b, dtype_bytes), head_bytes(cfg, s, b, t, dtype_bytes)


_WORST: dict = {}
_HELD: dict = {}


def stage_worst(cfg, layout, amp: str, device: str) -> list[dict]:
    """Per pipeline stage, the holdings (`memory.predict_stage_ranks`) of its rank with the most bytes of parameters,
    gradients (transient expert ones included) and optimizer states; cached per (model, degrees, split)."""
    mine = _WORST_OF.get((id(layout), id(cfg), amp, device))  # the same layout object again (another mode)
    if mine is not None and mine[0] is layout and mine[1] is cfg:
        return mine[2]
    key = (id(cfg), amp, device, *layout_key(layout))
    hit = _WORST.get(key)
    if hit is None or hit[0] is not cfg:
        # the entries `predict_stage_ranks` lists for each stage, read in place (its first rank of the most bytes)
        per = stage_worst_holdings(cfg, layout, amp, device)
        hit = _WORST[key] = (cfg, per)  # the model kept alive with its id
    if getattr(getattr(type(layout), "__dataclass_params__", None), "frozen", False):  # a Layout cannot change
        _WORST_OF[(id(layout), id(cfg), amp, device)] = (layout, cfg, hit[1])  # both kept alive with their ids
    return hit[1]


_WORST_OF: dict = {}


def layout_key(layout) -> tuple:
    """The values of the layout fields the holdings depend on (`memory._LAYOUT_KEYS`), hashable."""
    return tuple(tuple(x) if isinstance(x, list) else x for x in (getattr(layout, k, None) for k in _LAYOUT_KEYS))


def _parts_memory_estimate(cfg, layout, seq_len: int, rc, amp: str, device: str, dtype_bytes: int, flash: bool,
                           framework_bytes: float, moe_imbalance: float | None, fp8: bool = False,
                           fp8_cached_copies: int = 0) -> dict:
    """`memory_estimate` under recompute of parts of blocks or of some blocks (`llmtrain.plan.recompute`): each
    block priced by what it recomputes, each pipeline stage with its own blocks and micro-batches in flight."""
    from llmtrain.plan.recompute import kept_routing_bytes, part_savings

    cp = getattr(layout, "cp", 1)
    s, b, t, p, v, m = seq_len // cp, layout.micro_batch, layout.tp, layout.pp, layout.virtual_pp, layout.grad_accum
    sp = getattr(layout, "sequence_parallel", False)
    gpu = device == "gpu"
    plan = MoEPlan(ep=getattr(layout, "ep", 1), imbalance=moe_imbalance)
    # each block's whole set without recompute (dense; MoE: the shared expert's block plus the dispatch's)
    dense, moe_full = activation_parts(cfg, layout, seq_len, "none", dtype_bytes, flash, device, moe_imbalance)[:2]

    def block(moe: bool, parts) -> tuple:  # (bytes a block keeps for one micro-batch, bytes without recompute)
        full = moe_full if moe else dense
        if "block" in parts:
            return recompute_kept_bytes(cfg, s, b, dtype_bytes) + (kept_routing_bytes(cfg, s, b) if moe else 0), full
        return full - part_savings(cfg, parts, s=s, b=b, t=t, e=dtype_bytes, flash=flash, sp=sp, gpu=gpu,
                                   moe_plan=plan, moe_layer=moe), full

    # per block (bytes kept, bytes without recompute), whether any block is wholly recomputed, and per stage's
    # blocks (their kept bytes, one re-run block's full set): remembered per model, recompute and activation sizes
    hkey = (id(cfg), rc, s, b, t, sp, device, flash, dtype_bytes, plan.ep, moe_imbalance)
    hit = _HELD.get(hkey)
    if hit is None or hit[0] is not cfg:
        kinds: dict = {}  # (MoE block, its parts): a model has a few kinds of block
        held = []
        for i, moe in enumerate(moe_blocks(cfg)):
            key = (moe, frozenset(rc.at(i)))
            if key not in kinds:
                kinds[key] = block(moe, key[1])
            held.append(kinds[key])
        any_block = any("block" in rc.at(i) for i in range(cfg.num_layers))
        hit = _HELD[hkey] = (cfg, held, any_block, {})  # the model kept alive with its id
    _, held, any_block, per_stage = hit
    ranks = stage_worst(cfg, layout, amp, device)
    dualpipev = getattr(layout, "pp_schedule", "1f1b") == "dualpipev"
    head = 0 if dualpipev else layout.pp - 1  # the stage holding the logits (DualPipeV's V: stage 0)
    logits = head_bytes(cfg, s, b, t, dtype_bytes)
    worst = None
    stages = layout_stages(layout) if p > 1 else None
    for st in range(p):
        blocks = stages[st] if p > 1 else range(cfg.num_layers)
        sums = per_stage.get(blocks if p > 1 else None)
        if sums is None:
            sums = per_stage[blocks if p > 1 else None] = (
                sum(held[i][0] for i in blocks),
                max((held[i][1] for i in blocks if held[i][0] < held[i][1]), default=0) if any_block else 0)
        transient = _beyond_head(sums[1], logits if st == head else 0)
        w8 = fp8_weight_bytes(cfg, layout) if fp8 and not fp8_cached_copies else None  # per micro-batch in flight,
        # a wholly recomputed block's only while it re-runs
        if dualpipev and p > 1 and layout.pp_layers:  # the V: each of its two chunks its own micro-batches in flight
            per = [held[i][0] + (w8[i] if w8 is not None and "block" not in rc.at(i) else 0) for i in blocks]
            act = held_in_flight(per, layout, st, dualpipev) + transient  # + one re-run block
        else:
            act = in_flight(p, v, m, st, dualpipev) * sums[0] + transient  # + one re-run block
            if w8 is not None:
                act += in_flight(p, v, m, st, dualpipev) * sum(w8[i] for i in blocks if "block" not in rc.at(i))
        if fp8 and fp8_cached_copies:  # cached FP8 weight copies: every block's, the whole step
            act += fp8_cached_copies * sum(fp8_weight_bytes(cfg, layout)[i] for i in blocks)
        elif w8 is not None:
            act += max((w8[i] for i in blocks if "block" in rc.at(i)), default=0)
        worst = _worse(worst, ranks[st], act, transient, framework_bytes + (logits if st == head else 0))
    return _finish(worst, framework_bytes)




def _ring(bytes_: float, n: int, bw: float, alpha: float, factor: float = 2.0) -> float:
    """Ring all-reduce (factor 2) or reduce-scatter / all-gather (factor 1) of `bytes_` over n ranks."""
    if n <= 1:
        return 0.0
    return factor * (n - 1) / n * bytes_ / bw + factor * (n - 1) * alpha


def _link(span: int, dev, devices_per_node: int, stride: int | None = None):
    """(bandwidth, alpha) of a collective over a group whose members are `stride` ranks apart (`span` = stride x
    size). Within a node: NVLink. Across nodes a ring enters and leaves every node through the network; each GPU
    has its own network port (`net_bw` is one GPU's share of the node's adapters) and NCCL spreads a collective
    over one channel per local member, so a group with g members per node crosses the node boundary at
    g x net_bw, capped by NVLink: g = devices_per_node / stride (1 when stride >= devices_per_node, e.g. one tp
    group per node). `stride=None`: a point-to-point pair (one port each)."""
    if span <= devices_per_node:
        return dev.nvlink_bw, dev.nvlink_alpha
    local = max(1, devices_per_node // stride) if stride else 1
    return min(dev.nvlink_bw, local * dev.net_bw), dev.net_alpha


_STAGE_SPECS: dict = {}


def loop_meetings_s(layout, dev, devices_per_node: int, stride: dict) -> float:
    """The training loop's own collectives a step (trainer.py) on a job of more than one rank: the divergence
    guard's verdict and the stop agreement over the whole job, and the metrics' sums over each data-parallel
    group (dp, then sharding; `Topology.data_group`). A few bytes each, right after the ranks met: latency
    only, 2·ceil(log2 n) alphas (recursive doubling or a tree for tiny messages; a ring's 2(n - 1) at n = 2).
    Measured on this CPU: 3 all-reduces, 5-8 ms a step in a 2-process dp2/zero2 run
    (benchmarks/collective_trace.py); microseconds on a GPU."""
    if layout.world <= 1:
        return 0.0
    groups = [(layout.world, 1)] * 2 + [(n, stride[axis]) for axis, n in (("dp", layout.dp),
                                                                             ("sharding", layout.sharding)) if n > 1]
    return sum(2 * math.ceil(math.log2(n)) * _link(st * n, dev, devices_per_node, st)[1] for n, st in groups)


def v2_experts(layout) -> bool:
    """Stage-1 V2 under ep > 1: the routed experts in V2 buckets of their own over edp
    (`llmtrain.parallel.expert_states.color_experts`): reduce-scattered in buckets of `parallel.sharding_comm_buffer_mb`
    (from the backward with `parallel.sharding_comm_overlap`), all-gathered after the update."""
    return (getattr(layout, "ep", 1) > 1 and layout.sharding > 1 and layout.sharding_stage == 1
            and getattr(layout, "sharding_split_param", False))


def _v2_gather(layout, nbytes: float, dev, devices_per_node: int) -> float:
    """Seconds of the experts' parameter all-gather over edp after a V2 update (`v2_experts`; 0 when edp = 1)."""
    edp = layout.data_parallel // layout.ep
    if edp <= 1:
        return 0.0
    local, nodes = group_spread(layout, "edp", devices_per_node)
    bw, alpha = (dev.nvlink_bw, dev.nvlink_alpha) if nodes == 1 else (min(dev.nvlink_bw, local * dev.net_bw), dev.net_alpha)
    return _ring(nbytes, edp, bw, alpha, factor=1.0)


def expert_sync_s(layout, nbytes: float, dev, devices_per_node: int) -> float:
    """Seconds a step spends synchronising this rank's routed experts (`nbytes` of them) over their expert-data-
    parallel group (llmtrain/parallel/expert_states.py), after the last backward and outside any overlap: with
    sharded states (sharding > 1) each tensor reduced to its owner and, after the update, broadcast back (B/bw each,
    a reduce or broadcast per tensor carrying its buffer over each link of the group's ring); otherwise one ring
    all-reduce. The group's link is read off its ranks (`group_spread`)."""
    edp = layout.data_parallel // layout.ep
    if edp <= 1:
        return 0.0
    local, nodes = group_spread(layout, "edp", devices_per_node)
    bw, alpha = (dev.nvlink_bw, dev.nvlink_alpha) if nodes == 1 else (min(dev.nvlink_bw, local * dev.net_bw), dev.net_alpha)
    if v2_experts(layout):  # their own V2 buckets over edp: the gradients' reduce-scatter (the all-gather: `_v2_gather`)
        return _ring(nbytes, edp, bw, alpha, factor=1.0)
    if layout.sharding > 1:
        return 2 * (nbytes / bw + (edp - 1) * alpha)
    return _ring(nbytes, edp, bw, alpha)


def rank_tensors(cfg, layout, amp: str, pp_rank: int) -> tuple[list, list]:
    """([(elements, bytes/elem)] of the gradients pipeline stage `pp_rank`'s ranks accumulate, the share
    the busiest sharding rank updates: ZeRO-1/2 own whole tensors, partitioned as fleet does (memory.py's
    `greedy_partition`; the owner with the most elements, whom the others wait for at the parameters' broadcast),
    ZeRO-3 each tensor's 1/sharding slice. Under ep > 1 the rank's E/ep experts stay out of that partition: with
    sharding and edp > 1 it updates the expert tensors it owns in its edp group (`memory.expert_state_owners`, the
    busiest owner), otherwise all of them. Cached per (model, degrees, split, stage)."""
    mine = _TENSORS_OF.get((id(layout), id(cfg), amp, pp_rank))  # the same layout object again (another row)
    if mine is not None and mine[0] is layout and mine[1] is cfg:
        return mine[2]
    ep = getattr(layout, "ep", 1)
    key = (id(cfg), amp, pp_rank, *layout_key(layout))
    hit = _TENSORS.get(key)
    if hit is None or hit[0] is not cfg:
        hit = _TENSORS[key] = _rank_tensors_by_kinds(cfg, layout, amp, pp_rank, ep)
    if getattr(getattr(type(layout), "__dataclass_params__", None), "frozen", False):  # a Layout cannot change
        _TENSORS_OF[(id(layout), id(cfg), amp, pp_rank)] = (layout, cfg, hit[1])  # both kept alive with their ids
    return hit[1]


_TENSORS_OF: dict = {}


def _rank_tensors_by_kinds(cfg, layout, amp: str, pp_rank: int, ep: int) -> tuple:
    """(the model, `rank_tensors`' lists) shared by the stages of equal block kinds, ends and degrees."""
    # the lists depend on the sequence of the stage's block kinds (equal shapes within a kind), the ends it holds
    # and the degrees, not on which blocks they are: stages of other splits with the same kinds share them
    v_shape = getattr(layout, "pp_schedule", "1f1b") == "dualpipev"
    moe = moe_blocks(cfg)
    blocks = stage_blocks_of(layout.pp_layers, layout.pp, pp_rank, v_shape) if layout.pp > 1 else ()
    kinds_key = (id(cfg), amp, tuple(moe[i] for i in blocks), pp_rank == 0,
                 pp_rank == (0 if v_shape else layout.pp - 1), layout.pp == 1, layout.tp, ep, layout.sharding,
                 layout.sharding_stage, layout.dp * layout.sharding // ep if ep > 1 else 1)
    hit = _TENSORS_BY_KINDS.get(kinds_key)
    if hit is None or hit[0] is not cfg:
        hit = _TENSORS_BY_KINDS[kinds_key] = (cfg, _rank_tensors(cfg, layout, amp, pp_rank))  # the model kept alive
    return hit


_TENSORS_BY_KINDS: dict = {}


def _rank_tensors(cfg, layout, amp: str, pp_rank: int) -> tuple[list, list]:
    """`rank_tensors`, computed."""
    ep = getattr(layout, "ep", 1)
    specs = _stage_specs(cfg, layout, pp_rank)
    sized = _sized(cfg, layout.tp, ep, amp)
    grads = [sized.get(id(x)) or (int(prod_(local_shape(x, layout.tp, ep))), _param_bytes(x, amp)) for x in specs]
    expert = [i for i, x in enumerate(specs) if ep > 1 and x.expert]
    dense = [i for i in range(len(specs)) if not (ep > 1 and specs[i].expert)]
    sh = layout.sharding
    edp = layout.dp * sh // ep if ep > 1 else 1
    if expert and sh > 1 and edp > 1:
        owner = expert_state_owners([(specs[i].name, grads[i][0]) for i in expert], edp)
        load = [0] * edp  # elements of the expert tensors each edp index keeps
        for i in expert:
            load[owner[specs[i].name]] += grads[i][0]
        mine = max(range(edp), key=load.__getitem__)
        experts_owned = [grads[i] for i in expert if owner[specs[i].name] == mine]
    else:
        experts_owned = [grads[i] for i in expert]
    if sh <= 1:
        out = grads, grads
    elif layout.sharding_stage == 3:
        sliced = [(-(-grads[i][0] // sh), grads[i][1]) for i in dense]
        out = sliced + [grads[i] for i in expert], sliced + experts_owned
    else:
        d = [grads[i] for i in dense]
        owners = greedy_partition([n for n, _ in d], sh, sort=layout.sharding_stage == 1)
        busiest = max(owners, key=lambda owned: sum(d[i][0] for i in owned))
        out = grads, [d[i] for i in sorted(busiest)] + experts_owned
    return out


_TENSORS: dict = {}


def _sized(cfg, tp: int, ep: int, amp: str) -> dict:
    """{id(spec): (elements on a rank of tp/ep, bytes per element)} for the model's parameter list
    (`memory._local_entries`)."""
    specs = _spec_list(cfg, None)
    key = (id(specs), tp, ep, amp)
    hit = _SIZED.get(key)
    if hit is None or hit[0] is not specs:
        hit = _SIZED[key] = (specs, {id(x): (int(n), b) for x, n, b in _local_entries(specs, tp, ep, amp)[0]})
    return hit[1]


_SIZED: dict = {}


def _stage_specs(cfg, layout, pp_rank: int) -> list:
    """The trained, unfrozen parameters of pipeline stage `pp_rank` (cached per model and split)."""
    key = (id(cfg), layout.pp, tuple(layout.pp_layers), getattr(layout, "pp_schedule", "1f1b") == "dualpipev",
           pp_rank)
    hit = _STAGE_SPECS.get(key)
    if hit is None or hit[0] is not cfg:
        hit = _STAGE_SPECS[key] = (cfg, [x for x in stage_params(param_specs(cfg), layout, pp_rank, cfg.tie_embeddings)
                                         if x.trainable and not x.frozen])  # the model kept alive with its id
    return hit[1]


def synced_gradient_elements(cfg, layout) -> tuple[int, int]:
    """(other, expert) gradient elements one rank of the busiest pipeline stage synchronises each step: every
    trainable tensor it holds, input tables and every expert included (Paddle syncs each trainable gradient, not
    the 6N of the FLOPs), tp-local; the experts E/ep of them (`local_shape`)."""
    ep = getattr(layout, "ep", 1)
    key = (id(cfg), layout.pp, tuple(layout.pp_layers), getattr(layout, "pp_schedule", "1f1b") == "dualpipev",
           layout.tp, ep)
    hit = _SYNCED.get(key)
    if hit is not None and hit[0] is cfg:
        return hit[1]
    best = (0, 0)
    for rank in range(layout.pp):
        specs = _stage_specs(cfg, layout, rank)
        other = sum(prod_(local_shape(x, layout.tp)) for x in specs if not x.expert)
        expert = sum(prod_(local_shape(x, layout.tp, ep)) for x in specs if x.expert)
        best = max(best, (other, expert), key=sum)
    _SYNCED[key] = (cfg, best)
    return best


_SYNCED: dict = {}


def prod_(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def moe_plan(layout, dev, devices_per_node: int, imbalance: float | None = None) -> MoEPlan:
    """How a rank of `layout` runs its MoE layers: ep and its dispatcher from the layout, the ep group's links read
    off its ranks (`Layout.group_ranks("ep")`: consecutive data indices, so within the sharding group first, then
    across dp), the stated dropless imbalance (None: expected)."""
    ep = getattr(layout, "ep", 1)
    chosen = getattr(layout, "ep_dispatcher", "auto")  # auto: all-to-all on a GPU (llmtrain/parallel/experts.py)
    plan = MoEPlan(ep=ep, dispatcher=("alltoall" if chosen == "auto" else chosen) if dev.async_launch else "allgather",
                   imbalance=imbalance)
    if ep <= 1:
        return plan
    local, nodes = group_spread(layout, "ep", devices_per_node)
    ring = (dev.nvlink_bw, dev.nvlink_alpha) if nodes == 1 else (min(dev.nvlink_bw, local * dev.net_bw), dev.net_alpha)
    return dataclasses.replace(plan, link=ring, local=local, nvlink=(dev.nvlink_bw, dev.nvlink_alpha),
                               net=(dev.net_bw, dev.net_alpha))


_SPREAD: dict = {}


def group_spread(layout, kind: str, devices_per_node: int) -> tuple[int, int]:
    """(fewest members of one `kind` group on one node, nodes it spans) for the group holding rank 0, read off the
    group algebra (`Layout.group_ranks`): how many of its members talk over NVLink and how many nodes its traffic
    crosses."""
    key = (kind, devices_per_node, *(repr(getattr(layout, k, None)) for k in ("dp", "tp", "pp", "sharding", "cp", "ep",
                                                                              "order")))
    if key not in _SPREAD:
        ranks = first_group(layout, kind)  # group_ranks(kind)[0], the others not listed
        per: dict = {}
        for r in ranks:
            per[r // devices_per_node] = per.get(r // devices_per_node, 0) + 1
        _SPREAD[key] = (min(per.values()), len(per))
    return _SPREAD[key]


def compute_estimate(cfg, layout, seq_len: int, mode: str, dev, flash: bool, amp: str, local_ranks: float = 1,
                     moe: MoEPlan | None = None) -> dict:
    """The compute part of a step on the slowest pipeline stage (timeline.step_compute), selective recompute's
    extra attention forward added; `local_ranks` processes of the job on one host (a CPU profile's
    `shared_host` slowdown); `moe`: how the MoE layers run (expert parallelism, dropless imbalance)."""
    s, b, t, p, m = seq_len, layout.micro_batch, layout.tp, layout.pp, layout.grad_accum
    gpu = dev.async_launch
    cp = getattr(layout, "cp", 1)
    v_shape = getattr(layout, "pp_schedule", "1f1b") == "dualpipev"  # DualPipeV: the head on stage 0

    moe_of = moe_blocks(cfg)
    extra = _selective_extra(cfg, b, s, t, dev, flash) if mode == "selective" else 0.0

    def stage_key(stage) -> tuple:
        # what a stage's compute depends on: its blocks' kinds (dense or MoE, each V chunk apart), whether it holds
        # the embedding and the head, and the tensors it updates (`rank_tensors`, shared by equal kinds)
        blocks = stage_blocks_of(layout.pp_layers, p, stage, v_shape) if p > 1 else tuple(range(cfg.num_layers))
        down = layout.pp_layers[stage] if v_shape and p > 1 and layout.pp_layers else len(blocks)
        grads, owned = rank_tensors(cfg, layout, amp, stage)
        kinds = (sum(moe_of[i] for i in blocks[:down]), down, sum(moe_of[i] for i in blocks[down:]), len(blocks) - down)
        return (kinds, stage == 0, stage == (0 if v_shape else p - 1), id(grads), id(owned)), blocks, grads, owned

    sp = bool(getattr(layout, "sequence_parallel", False))
    moe_key = None if moe is None else (moe.ep, moe.dispatcher, moe.imbalance, moe.link, moe.local, moe.nvlink, moe.net)

    def stage_compute(key, blocks, grads, owned, ranks):
        # the kernels depend on the blocks' kinds, not on which blocks: a stage of the same kinds seen before (any
        # split) stands for it, so the kernel lists and their maps are shared (`timeline.cached_micro_batch`)
        rk = (id(cfg), v_shape and p > 1, key[0])
        rep = _REP_BLOCKS.get(rk)
        if rep is None or rep[0] is not cfg:
            rep = _REP_BLOCKS[rk] = (cfg, blocks)  # the model kept alive with its id
        blocks = rep[1]
        recompute = "full" if mode == "full" else "none"
        # the step's compute is remembered per everything its StepSpec reads (other rows of the same stage: the
        # recompute modes priced alike, layouts of the same tensors); kept alive: the profile, model and lists
        sk = (id(dev), *rk, recompute, b, s, t, flash, key[1], key[2], sp, cp, moe_key, m, id(grads), id(owned), ranks)
        hit = _STEP.get(sk)
        if hit is not None and hit[0] is dev and hit[1] is cfg and hit[2] is grads and hit[3] is owned:
            out = hit[4]
        else:
            micro = MicroBatchSpec(cfg, b, s, t, dev.dtype_bytes, gpu, flash, recompute, len(blocks), key[1], key[2],
                                   sp, math_core=dev.math_attn is not None, ce_core="vocab_parallel_ce" in dev.mem_curves,
                                   first_layer=blocks[0], cp=cp, moe=moe,
                                   block_ids=tuple(blocks) if v_shape and p > 1 else None)  # the V: two chunks
            out = step_compute(dev, StepSpec(micro, m, grads, owned, ranks))
            _STEP[sk] = (dev, cfg, grads, owned, out)  # read, never changed (the rows copy what they keep)
        if extra:  # selective recompute: each block's attention core forward again, every micro-batch
            out = dict(out, compute_s=out["compute_s"] + m * len(blocks) * extra)
        return out

    # every stage priced, each distinct one once: the bottleneck is the costliest, the pipeline's fill and drain
    # run every other stage's share once (for the bubble)
    seen: dict = {}  # stage key -> (blocks, grads, owned, its stages)
    for st in range(max(1, p)):
        key, blocks, grads, owned = stage_key(st)
        seen.setdefault(key, [blocks, grads, owned, 0])[3] += 1
    priced = {k: stage_compute(k, bl, g, o, local_ranks) for k, (bl, g, o, _) in seen.items()}
    top = max(priced, key=lambda k: priced[k]["compute_s"])
    worst = priced[top]
    fill = sum(priced[k]["compute_s"] * n for k, (_, _, _, n) in seen.items()) - worst["compute_s"]
    if p > 1 and local_ranks > 1 and dev.shared_host_slowdown(local_ranks):
        # pipeline stages on one host compute at once only part of the time: the bottleneck stage shares the host
        # with the others for their busy fraction (their mean compute over its own), so it sees that share of the
        # measured slowdown (`local_ranks` - 1 other processes, each busy that fraction)
        alone = {k: stage_compute(k, bl, g, o, 1)["compute_s"] for k, (bl, g, o, _) in seen.items()}
        top = max(alone, key=alone.get)
        others = sum(alone[k] * n for k, (_, _, _, n) in seen.items()) - alone[top]
        busy = min(1.0, others / (p - 1) / alone[top])
        bl, g, o, _ = seen[top]
        worst = stage_compute(top, bl, g, o, 1 + busy * (local_ranks - 1))
    return dict(worst, other_stages_s=fill)


_REP_BLOCKS: dict = {}
_STEP: dict = {}


def _selective_extra(cfg, b: int, s: int, t: int, dev, flash: bool) -> float:
    """Seconds of one block's attention core forward for one micro-batch (what selective recompute runs again)."""
    from llmtrain.plan.kernels import attention_flops

    nh, d = cfg.num_heads // t, cfg.attn_head_dim()
    fl = attention_flops(b * nh, s, d, cfg.family == "decoder")
    if flash:
        return dev.attention_seconds(b * nh, s, d, cfg.family == "decoder", fl, False)
    if dev.math_attn is not None:  # the measured math core (CPU profiles)
        return dev.math_attention_seconds(b * nh, s, d, attention_flops(b * nh, s, d, False), False)
    return 2 * dev.gemm_seconds(s, s, d, b * nh)


def _parts_compute(cfg, layout, seq_len: int, recompute, dev, flash: bool, amp: str, local_ranks, moe, comp) -> dict:
    """`comp` with the second forward of recomputed parts other than the attention core (priced in
    `compute_estimate`) and of whole blocks recomputed in only some blocks: their FLOP share
    (`plan.recompute.part_flops_share`) of full recompute's extra compute, over the share of blocks recomputing."""
    from llmtrain.plan.recompute import part_flops_share, plan_recompute

    rc = plan_recompute(recompute)
    if not rc.on or (rc.parts == {"block"} and rc.blocks is None) or rc.parts == {"core_attn"} and rc.blocks is None:
        return comp
    parts = rc.parts - {"core_attn"}
    share = part_flops_share(cfg, parts, seq_len) if parts else 0.0
    frac = 1.0 if rc.blocks is None else len(rc.blocks) / cfg.num_layers
    if rc.blocks is not None and "core_attn" in rc.parts:  # the core's extra was priced for every block
        core = comp["compute_s"] - compute_estimate(cfg, layout, seq_len, "none", dev, flash, amp, local_ranks,
                                                    moe)["compute_s"]
        comp = dict(comp, compute_s=comp["compute_s"] - (1 - frac) * core)
    if not share:
        return comp
    none = compute_estimate(cfg, layout, seq_len, "none", dev, flash, amp, local_ranks, moe)
    full = compute_estimate(cfg, layout, seq_len, "full", dev, flash, amp, local_ranks, moe)
    extra = share * frac * (full["compute_s"] - none["compute_s"])
    fill = share * frac * (full["other_stages_s"] - none["other_stages_s"])
    return dict(comp, compute_s=comp["compute_s"] + extra, other_stages_s=comp["other_stages_s"] + fill)


def cp_comm_s(cfg, layout, seq_len: int, mode: str, dev, devices_per_node: int, stride: dict, *,
              flash: bool = True) -> float:
    """Exposed seconds a step spends in context parallelism's key/value exchanges (`parallel.cp_comm`), on this
    rank's L/pp blocks, every micro-batch (again in the backward's second forward under full recompute):
    - ring: each layer's forward runs cp - 1 steps, each sending this rank's k and v chunk (2·b·(s/cp)·kv/tp
      elements) to the next rank while attending over the block in hand (an s/cp x s/cp block at the flash
      rate of an s/cp call): exposed max(0, transfer - that block's attention) per step; the backward runs the
      ring in reverse with k, v and dk, dv (twice the bytes) against the block's backward;
    - allgather: k and v all-gathered once per layer forward (cp·chunk bytes, ring all-gather), dk and dv
      reduce-scattered in the backward; not overlapped (attention waits for the whole sequence's keys);
    - a2a (Ulysses): forward all-to-alls of q, k, v (sequence- to head-split) and of the output back, the
      backward the same four; (cp - 1)/cp of each tensor's bytes; not overlapped.
    A pair of ring neighbours or the group talks over `_link` (cp ranks `tp` apart). `flash`: the attention core the
    run uses; the ring's blocks are then flash blocks, else math blocks (`attention_math` rows, none assumed without them); on a device that
    does not launch asynchronously (CPU: gloo's send/recv block) nothing of the ring overlaps."""
    from llmtrain.plan.kernels import attention_flops

    cp, t, b, m = layout.cp, layout.tp, layout.micro_batch, layout.grad_accum
    e, d = dev.dtype_bytes, cfg.attn_head_dim()
    sl = seq_len // cp
    nh, kv = cfg.num_heads // t, cfg.kv_heads() * d / t
    chunk = 2 * b * sl * kv * e  # this rank's k and v
    bw, alpha = _link(stride["cp"] * cp, dev, devices_per_node, stride["cp"])
    forwards = 2 if mode == "full" else 1
    kind = getattr(layout, "cp_comm", "ring")
    if kind == "ring":
        fl = attention_flops(b * nh, sl, d, False)
        if not dev.async_launch:
            fwd_block = bwd_block = 0.0
        elif flash:
            fwd_block = dev.attention_seconds(b * nh, sl, d, True, fl, False)
            bwd_block = dev.attention_seconds(b * nh, sl, d, True, 2.5 * fl, True)
        elif dev.math_attn:
            fwd_block = dev.math_attention_seconds(b * nh, sl, d, fl, False)
            bwd_block = dev.math_attention_seconds(b * nh, sl, d, 2.5 * fl, True)
        else:  # a math core costed op by op: no block time to hide behind is assumed
            fwd_block = bwd_block = 0.0
        bw_p2p, a_p2p = _link(stride["cp"] * 2, dev, devices_per_node)
        step_f, step_b = chunk / bw_p2p + a_p2p, 2 * chunk / bw_p2p + a_p2p
        layer = (cp - 1) * (forwards * max(0.0, step_f - fwd_block) + max(0.0, step_b - bwd_block))
    elif kind == "allgather":
        layer = (forwards + 1) * _ring(chunk * cp, cp, bw, alpha, factor=1.0)
    else:  # a2a: q, k, v in and the output out, each (cp - 1)/cp of its bytes
        nbytes = b * sl * (2 * nh * d + 2 * kv) * e
        layer = (forwards + 1) * ((cp - 1) / cp * nbytes / bw + 4 * (cp - 1) * alpha)
    return m * cfg.num_layers / layout.pp * layer


def _flops_parameters(cfg) -> int:
    """`llmtrain.models.size.flops_parameters`, remembered per model."""
    hit = _FLOPS_N.get(id(cfg))
    if hit is None or hit[0] is not cfg:
        hit = _FLOPS_N[id(cfg)] = (cfg, flops_parameters(cfg))  # the model kept alive with its id
    return hit[1]


_FLOPS_N: dict = {}


def time_estimate(cfg, layout, seq_len: int, recompute, dev, devices_per_node: int, flash: bool | None = None,
                  amp: str = "bf16", moe_imbalance: float | None = None) -> dict:
    """Step time of `layout` on `dev` and its parts; a pipeline layout without its split gets the default one, as a
    run on `dev` resolves it (`llmtrain.plan.stage_cost.with_pipeline_split`)."""
    from llmtrain.plan.stage_cost import with_pipeline_split

    mode = recompute_mode(recompute)
    moe = moe_plan(layout, dev, devices_per_node, moe_imbalance)
    layout = with_pipeline_split(layout, cfg, dev, seq_len=seq_len, recompute=mode, moe=moe)
    e = dev.dtype_bytes
    s, b, t, p, v, m = seq_len, layout.micro_batch, layout.tp, layout.pp, layout.virtual_pp, layout.grad_accum
    n_flops = _flops_parameters(cfg)
    per_token = 6 * n_flops + 12 * cfg.num_layers * cfg.hidden_size * s
    if flash is None:
        flash = cfg.attention == "flash" or (cfg.attention == "auto" and dev.async_launch)
    comp = compute_estimate(cfg, layout, seq_len, mode, dev, flash, amp, min(layout.world, devices_per_node), moe)
    comp = _parts_compute(cfg, layout, seq_len, recompute, dev, flash, amp, min(layout.world, devices_per_node), moe,
                          comp)
    compute = comp["compute_s"]
    # fleet's order dp, pp, sharding, tp (tp innermost): the stride of each axis in ranks
    cp = getattr(layout, "cp", 1)  # context parallelism sits just outside tp (Megatron's tp-cp nesting)
    stride = {"tp": 1, "cp": t, "sharding": t * cp, "pp": t * cp * layout.sharding, "dp": t * cp * layout.sharding * p}
    bw_tp, a_tp = _link(t, dev, devices_per_node, 1)
    # the tp group's calls (`llmtrain.plan.tp_comm`, checked against a tp2 rank's): every block's (a recomputed
    # piece's forward ones again), and per micro-batch the embedding's, the head's and the parallel cross entropy's
    sp = getattr(layout, "sequence_parallel", False)
    blocks = tp_collectives(cfg, b, s, t, e, sp=sp, gpu=dev.async_launch, replay=recompute, first=False,
                            last=False)
    ends = tp_collectives(cfg, b, s, t, e, sp=sp, gpu=dev.async_launch, layers=[])
    # a collective also waits for the slower rank, longer the more each computed since the last meeting (CPU
    # profiles measure that wait against the gap: `alpha_by_gap`; others keep the link's alpha); an all-gather or a
    # reduce-scatter counts as half an all-reduce
    n_ar = sum(1.0 if c.name == "all_reduce" else 0.5 for c in blocks) / cfg.num_layers  # per block
    a_tp = dev.alpha_at(compute / max(1.0, m * ((cfg.num_layers / p) * n_ar + len(ends))), a_tp)

    def priced(calls):
        return sum(_ring(c.nbytes, t, bw_tp, a_tp, 2.0 if c.name == "all_reduce" else 1.0) for c in calls)

    tp_comm = m * (priced(blocks) / p + priced(ends)) if t > 1 else 0.0
    bw_pp, a_pp = _link(stride["pp"] * 2, dev, devices_per_node)
    bw_pp, a_pp = dev.p2p_bw or bw_pp, dev.p2p_alpha or a_pp  # measured send/recv figures when calibrated
    pp_comm = (m * v * 2 * (b * s * cfg.hidden_size / t * e / bw_pp + a_pp)) if p > 1 else 0.0
    other_elems, expert_elems = synced_gradient_elements(cfg, layout)
    ep = getattr(layout, "ep", 1)
    # under ep > 1 the experts are synchronised apart, over their edp group (`expert_sync_s`); otherwise with the rest
    local_param_bytes = (other_elems + (expert_elems if ep <= 1 else 0)) * e
    g_e = gradient_bytes_per_element(layout, e)  # fp32 under main-gradient training (the fused-buffer knobs)
    local_grad_bytes = (other_elems + (expert_elems if ep <= 1 else 0)) * g_e
    syncs = gradient_syncs(layout, dev.async_launch, g_e)
    micro = comp["micro_batch_s"]  # one micro-batch's forward + backward
    after_update = max(0.0, compute - m * micro)  # the optimizer's share of the step: the gap before its gathers
    grads = {}  # once per step, by axis: gradient sync (its overlap decided by the layout's options, plan/overlap.py)
    params_after = 0.0  # once per step: parameter all-gather / broadcast after the update (never overlapped)
    zero3 = 0.0  # every micro-batch: ZeRO-3 all-gathers the parameters for forward and backward, reduce-scatters grads
    zero2 = 0.0  # every micro-batch: ZeRO-2 reduces the gradients
    for axis, n in (("dp", layout.dp * cp), ("sharding", layout.sharding)):  # gradients reduce over dp x cp
        if n <= 1:
            continue
        lane = "cp" if axis == "dp" and layout.dp == 1 else axis  # dp x cp: the cp ranks when dp is 1
        bw, al_link = _link(stride[lane] * n, dev, devices_per_node, stride[lane])
        # the ranks meet once a step for the gradients (ZeRO-3: three collectives a micro-batch)
        al = dev.alpha_at(compute / (3 * m) if axis == "sharding" and layout.sharding_stage == 3 else compute, al_link)
        if axis == "dp":  # all-reduce of this replica's (sharded, under ZeRO-2/3) gradients
            share = layout.sharding if layout.sharding_stage >= 2 else 1
            grads["dp"] = _ring(local_grad_bytes / share, n, bw, al)
        elif layout.sharding_stage == 3:
            zero3 += 3 * _ring(local_param_bytes, n, bw, al, factor=1.0)
        elif layout.sharding_stage == 2:
            # Paddle's GroupShardedStage2 re-arms its gradient hooks in every forward and has no no_sync: each
            # micro-batch's backward reduces the gradients to their owners (group_sharded_stage2.py
            # `_clear_counters`), one reduce per owner's gradient storage (n of B/n bytes: a reduce carries its
            # whole buffer over each link, B/bw together; gloo's reduce of a buffer took as long as its
            # all-reduce). The ranks meet there once a micro-batch, after its forward and backward: the wait at
            # that gap. Then each owner broadcasts its updated parameters (B/bw together), right after the update
            zero2 += local_param_bytes / bw + 2 * (n - 1) * dev.alpha_at(micro, al_link)
            params_after += local_param_bytes / bw + (n - 1) * dev.alpha_at(after_update, al_link)
        else:  # stage 1: reduce-scatter of gradients, all-gather of the updated parameters
            grads["sharding"] = _ring(local_grad_bytes, n, bw, al, factor=1.0)
            params_after += _ring(local_param_bytes, n, bw, al, factor=1.0)
            if layout.sharding_stage == 1 and not dev.async_launch and not layout.sharding_split_param:
                # fleet's stage-1 optimizer (V1, no tensor fusion) reduces every gradient to its owner and broadcasts
                # every updated parameter, tensor by tensor: a call's latency per tensor each way, back to back
                # (measured so by `--calibrate`: `reduce_call_s`, `broadcast_call_s`; else the quiet alpha,
                # `burst_alpha`). CPU profiles only for now: the GPU points the planner is checked against run
                # bucketed optimizers (Megatron's distributed optimizer), whose pinned predictions this term would
                # move (-33% on Megatron 7.1B over 48 ranks). V2 (split_param) moves buckets, not tensors
                tensors = len(rank_tensors(cfg, layout, amp, 0)[0])
                burst = dev.burst_alpha if dev.burst_alpha is not None else al
                grads["sharding"] += max(0, tensors - 1) * (n - 1) * (dev.reduce_call_s or burst)
                params_after += max(0, tensors - 1) * (n - 1) * (dev.broadcast_call_s or burst)
    loop_comm = loop_meetings_s(layout, dev, devices_per_node, stride)
    # the step's gradient sync can hide behind the last micro-batch's backward only (earlier ones accumulate
    # without sync), and only where the layout's options issue it from the backward (plan/overlap.py); ZeRO-2/3
    # behind every micro-batch's; on a CPU (ops in the dispatching thread, gloo collectives in the training
    # thread) nothing overlaps
    backward = micro * 2 / 3
    comm_syncs = {}
    for axis, comm in grads.items():
        sync = syncs[axis]
        nb = buckets(local_grad_bytes / (layout.sharding if axis == "dp" and layout.sharding_stage >= 2 else 1), sync,
                     len(rank_tensors(cfg, layout, amp, 0)[0]) if sync.bucket_bytes <= 0 else 1)
        comm_syncs[axis] = {"kind": sync.kind, "comm_s": comm, "buckets": nb, "bucket_bytes": sync.bucket_bytes,
                            "overlapped": sync.overlapped, "option": sync.option, "window_s": backward,
                            "exposed_s": exposed(comm, backward, sync, nb)}
    exposed_s = sum(c["exposed_s"] for c in comm_syncs.values()) + params_after
    if ep > 1 and v2_experts(layout):  # the experts' own V2 buckets over edp: reduce-scatter, overlapped as asked
        sync = SyncPlan("reduce-scatter", dev.async_launch and layout.sharding_comm_overlap,
                        getattr(layout, "sharding_comm_buffer_mb", 256) * MIB, "sharding_comm_overlap")
        comm = expert_sync_s(layout, expert_elems * g_e, dev, devices_per_node)
        nb = buckets(expert_elems * g_e, sync)
        comm_syncs["edp"] = {"kind": sync.kind, "comm_s": comm, "buckets": nb, "bucket_bytes": sync.bucket_bytes,
                             "overlapped": sync.overlapped, "option": sync.option, "window_s": backward,
                             "exposed_s": exposed(comm, backward, sync, nb)}
        exposed_s += comm_syncs["edp"]["exposed_s"] + _v2_gather(layout, expert_elems * e, dev, devices_per_node)
    elif ep > 1:  # the experts' gradients over their edp group, after the backward (`expert_sync_s`), exposed
        comm_syncs["edp"] = {"kind": "expert", "comm_s": expert_sync_s(layout, expert_elems * g_e, dev, devices_per_node),
                             "buckets": 1, "bucket_bytes": 0, "overlapped": False, "option": "", "window_s": 0.0}
        comm_syncs["edp"]["exposed_s"] = comm_syncs["edp"]["comm_s"]
        exposed_s += comm_syncs["edp"]["exposed_s"]
    if zero2 or zero3:
        sync = syncs["sharding"]
        nb = buckets(local_param_bytes, sync, max(1, round(cfg.num_layers / p)))
        each = exposed(zero2, backward, sync, nb) if zero2 else exposed(zero3, micro, sync, nb)
        comm_syncs["sharding"] = {"kind": sync.kind, "comm_s": m * (zero2 or zero3), "buckets": nb,
                                  "bucket_bytes": sync.bucket_bytes, "overlapped": sync.overlapped, "option": "",
                                  "window_s": backward if zero2 else micro, "exposed_s": m * each}
        exposed_s += m * each
    # 1F1B: the slowest stage's m micro-batches plus the fill and drain through the other p - 1 stages, one
    # micro-batch each (1/v of it when interleaved); equal stages give the textbook (p - 1)/(v·m) of the step
    bubble = (comp["other_stages_s"] + (p - 1) * tp_comm) / (v * m) if p > 1 else 0.0
    if p > 1 and getattr(layout, "pp_schedule", "1f1b") == "dualpipev":  # its V and deferred weight gradients
        from llmtrain.plan.dualpipe_bubble import dualpipe_bubble_factor

        bubble = (comp["other_stages_s"] + (p - 1) * tp_comm) / m * dualpipe_bubble_factor(cfg, s)
    cp_comm = cp_comm_s(cfg, layout, seq_len, mode, dev, devices_per_node, stride, flash=flash) if cp > 1 else 0.0
    step = compute + tp_comm + pp_comm + exposed_s + bubble + loop_comm + cp_comm
    tokens = layout.global_batch * s
    world = layout.world
    return {"compute_s": compute, "host_s": comp["host_s"], "device_s": comp["device_s"],
            "ep_comm_s": comp["by_kind_s"].get("comm", 0.0),
            "kernels_per_step": comp["kernels_per_step"], "dp_sharding_comm_s": exposed_s, "comm_syncs": comm_syncs, "tp_comm_s": tp_comm, "pp_p2p_s": pp_comm,
            "bubble_s": bubble, "loop_comm_s": loop_comm, "cp_comm_s": cp_comm, "step_time_s": step, "tokens_per_sec_per_device": tokens / step / world,
            "mfu": tokens * per_token / step / world / dev.peak_flops}
