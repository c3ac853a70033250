"""The price of each recompute mode and offload: bytes a block keeps, extra forward time, host-link time.

    python -m pytest tests/plan/test_recompute_price.py -q -s     # predicted vs measured bytes per block, each mode
    saved = part_savings(cfg, {"core_attn"}, s=2048, b=1, t=1, e=2, flash=True)   # bytes a block no longer keeps

A recomputed part keeps its inputs and drops what its own operators saved for the backward; the part runs its
forward a second time in the backward. Per part (written against `estimate.layer_activation_bytes`' terms,
checked on CPU against the host allocator in tests/plan/test_recompute_price.py):
- `core_attn`: flash attention drops its fp32 log-sum-exp (q, k, v are its inputs, kept); math attention drops
  the transposed q and nh-wide k, v, the pre-repeat k, v (grouped heads) and the probabilities, and keeps q, k, v;
- `attn` (`full_attn`, the attention layer as PaddleFormers' `full_attn` recomputes it; the norm before it is not
  inside): the column-input copies under tp, QK-norm's, RoPE's, all of the core's (flash attention: its q, k, v
  too, which `core_attn` keeps; the H100 twin's rows showed the 3 s·b·h per block the planner kept before) and the
  o_proj input; keeps the layer's input [s, b, h] (the norm output: the projections' input on one device);
- `mlp`: the FFN's inner tensors and its column-input copies under tp; keeps its input (the norm output);
- `norm`: each norm's own statistics and fp32 copies (its input is kept);
- `moe`: the whole MoE feed-forward's saved tensors (router, dispatch, experts, shared expert); keeps the top-k
  choice [T, k] int64 for the second run (`llmtrain.models.recompute`);
- `moe_act`: silu(gate) of the experts' unfused SwiGLU (fused SwiGLU and GeLU keep nothing more than their inputs);
- `shared_experts`: the shared expert's inner tensors;
- `block` (`full`): everything but the block's input (`estimate.recompute_kept_bytes`).
Time: full recompute runs every block's forward again (the operator-level kernels, `kernels.py`); a part costs
the full second forward times its share of the block's forward FLOPs (`part_flops_share`, from the kernels the
part re-runs in the planner's kernel list; the attention core at the profile's attention rate in
`estimate.compute_estimate`); norms are memory-bound and priced at zero FLOPs (their time is not counted: a stated
approximation).
Offload (`train.offload_activations`, `train.offload_optimizer`): bytes over the host link at the profile's
`host_bw` (PCIe, per direction, datasheet); activation offload moves each fully recomputed block's input out in
the forward and back in the backward, overlapped with compute (prefetched one block ahead): exposed only beyond
the step's compute; optimizer offload moves the state in and out around every optimizer step, not overlapped.
"""
from __future__ import annotations

from llmtrain.models.recompute import MODE_PARTS, Recompute, as_recompute, parse_mode

LEGACY = {"selective": "core_attn"}
"""The planner's older name: `selective` rows were the attention core alone."""


def plan_recompute(recompute) -> Recompute:
    """A `Recompute` from what the planner is given: a `Recompute`, a bool, or a mode name (`selective` = the core)."""
    if isinstance(recompute, Recompute):
        return recompute
    if recompute is True or recompute is False:
        return as_recompute(recompute)
    name = LEGACY.get(str(recompute), parse_mode(recompute))
    return Recompute(frozenset(MODE_PARTS[name])) if MODE_PARTS.get(name) else Recompute()


def mode_name(rc: Recompute) -> str:
    """A row's label: the mode, or the parts joined with '+' (`mlp+norm`)."""
    if not rc.on:
        return "none"
    named = {"block": "full", "attn": "full_attn"}
    label = "+".join(sorted(named.get(p, p) for p in rc.parts))
    return label if rc.blocks is None else f"{label}@{len(rc.blocks)}"


def _norm_own(cfg, sb: float, h: int, shard: int, fused_rms: bool) -> float:
    """Bytes one block norm saves beyond its input: fp32 statistics and (unfused RMSNorm) the fp32 copy."""
    if cfg.norm == "layernorm":
        return 2 * sb * 4 / shard
    if fused_rms:
        return sb * 4 / shard
    return (sb * h + sb) * 4 / shard


def part_savings(cfg, parts, *, s: int, b: int, t: int, e: int, flash: bool, sp: bool = False, gpu: bool = False,
                 moe_plan=None, moe_layer: bool = False) -> float:
    """Bytes one block (of one micro-batch [b, s] on a tp rank) no longer keeps when `parts` are recomputed
    (`block` excluded: see `estimate.recompute_kept_bytes`). `moe_layer`: an MoE block, whose feed-forward runs
    under `moe_plan` (`plan.moe.MoEPlan`: expert parallelism, the dropless capacity's imbalance)."""
    from llmtrain.models.config import FUSE_SWITCHES

    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    d = cfg.attn_head_dim()
    q, kv, a = cfg.num_heads * d / t, cfg.kv_heads() * d / t, cfg.num_heads / t
    sb = s * b
    on = {k: cfg.fused(k, gpu) for k in FUSE_SWITCHES}  # as `estimate.fused_paths`
    shard = t if sp else 1
    one = t == 1 and not sp  # one device: one copy of each sub-block's input for its projections
    # column-parallel inputs under tp, each its own copy (`estimate.column_inputs`): q, k, v (or one fused); gate, up
    qkv_cols = 1 if one else (1 if on["fuse_qkv"] else 3)
    mlp_cols = 1 if one else (1 if on["fuse_ffn"] or cfg.activation != "swiglu" else 2)
    swiglu = cfg.activation == "swiglu"
    inner = ((3 if on["fuse_swiglu"] else 4) if swiglu else 2) * sb * f / t * e
    if flash:  # the log-sum-exp; q, k, v are its inputs: kept by core_attn, dropped with the attention layer
        core = 4 * a * sb
        full_core = core + sb * (q + 2 * kv) * e
    else:  # transposed q and nh-wide k, v, pre-repeat k, v (grouped heads), probabilities (fp32 + compute dtype)
        full_core = (3 * sb * q + (2 * sb * kv if kv != q else 0)) * e + a * s * s * b * (4 + (e if e != 4 else 0))
        core = full_core - sb * (q + 2 * kv) * e  # core_attn keeps its inputs q, k, v
    rope = 0 if cfg.position != "rope" or on["fuse_rope"] else 2 * sb * (q + kv) * e
    qk = (sb * (q + kv) * e + (sb * (q + kv) + sb * (cfg.num_heads + cfg.kv_heads()) / t) * 4) if cfg.qk_norm else 0
    norm = _norm_own(cfg, sb, h, shard, on["fuse_rms_norm"])
    saved = 0.0
    parts = set(parts)
    if "attn" in parts:  # the attention layer (its input kept: the norm output, or x under post-norm)
        saved += qkv_cols * sb * h * e - sb * h / shard * e + qk + rope + full_core + sb * q * e
    elif "core_attn" in parts:
        saved += core
    if "norm" in parts:
        saved += 2 * norm
    if moe_layer:
        from llmtrain.plan.moe import MoEPlan, capacity, moe_activation_bytes

        plan = moe_plan or MoEPlan()
        if "moe" in parts:
            saved += moe_activation_bytes(cfg, s * b, e, plan) - kept_routing_bytes(cfg, s, b)
            if cfg.moe_router_dtype != "fp32" or e == 4:  # the router's input is the layer's input: kept
                saved -= s * b * h * e
            if cfg.moe_num_shared_experts > 0:
                saved += _shared_inner(cfg, sb, t, e, on, swiglu)
        else:
            if "moe_act" in parts and swiglu and not on["fuse_swiglu"]:  # silu(gate) [E_l, ep·C, f]
                saved += capacity(cfg, s * b, plan) * cfg.moe_num_experts * cfg.expert_ffn_size() * e
            if "shared_experts" in parts and cfg.moe_num_shared_experts > 0:
                saved += _shared_inner(cfg, sb, t, e, on, swiglu)
    elif "mlp" in parts:
        saved += inner + (mlp_cols - 1) * sb * h * e
    return saved


def _shared_inner(cfg, sb, t, e, on, swiglu) -> float:
    fs = cfg.moe_num_shared_experts * cfg.expert_ffn_size()
    return ((3 if on["fuse_swiglu"] else 4) if swiglu else 2) * sb * fs / t * e


def kept_routing_bytes(cfg, s: int, b: int) -> float:
    """The top-k choice [b·s, k] int64 a fully recomputed MoE block keeps for its second run."""
    return 8.0 * b * s * cfg.moe_top_k


def part_flops_share(cfg, parts, s: int) -> float:
    """The recomputed parts' share of one block's forward FLOPs (an MoE model's MoE block), read from the block's
    kernel list (`llmtrain.plan.kernels`, one sequence [1, s] on one device with flash attention: causal work
    halved; the MoE experts at their buffer's rows, the router's GEMM with them): the FLOPs of the kernels the parts
    re-run (`_Pass.replayed`, checked against the model's recompute in tests/plan/test_op_sequence.py) over the
    block's; norms and other memory-bound kernels count as none. What a recompute of `parts` adds, as a fraction of
    full recompute's."""
    from llmtrain.plan.kernels import replayed_flops_share

    return replayed_flops_share(cfg, parts, s)


def offload_seconds(nbytes: float, dev) -> float:
    """Seconds to move `nbytes` one way over the host link (`host_bw`; 0 on a host-only device)."""
    bw = getattr(dev, "host_bw", None)
    return 0.0 if not bw else nbytes / bw


def with_offload(cfg, layout, seq_len: int, dev, mem: dict, times: dict, *, optimizer: bool,
                 activations: bool, kept: float = 0.0) -> tuple[dict, dict]:
    """(memory, time) of a row with the optimizer state and/or each fully recomputed block's kept input offloaded
    to the host (a GPU profile's `host_bw`; on a host-only profile nothing changes):
    - optimizer: off the device during forward and backward, back for the update (peak: the larger of the two
      phases); 2 x its bytes over the link per step, not overlapped;
    - activations (full recompute): the in-flight blocks' kept inputs leave the device; one block's is on its way
      back while another's block re-runs (two kept inputs on the device); each crosses the link twice per
      micro-batch, overlapped with the step's compute (exposed only beyond it); `kept`: the bytes a fully
      recomputed block keeps (`estimate.recompute_kept_bytes`)."""

    bw = getattr(dev, "host_bw", None)
    if not bw or not (optimizer or activations):
        return mem, times
    mem, times = dict(mem), dict(times)
    p, m = layout.pp, layout.grad_accum
    extra = 0.0
    if activations:
        v = layout.virtual_pp
        if p == 1:
            in_flight = cfg.num_layers
        elif v == 1:
            in_flight = min(p, m) * cfg.num_layers / p
        elif getattr(layout, "pp_schedule", "1f1b") == "dualpipev":  # 2 pp + 1 chunk-micro-batches at its peak
            in_flight = min(2 * p + 1, m * v) * cfg.num_layers / (p * v)  # (llmtrain/plan/dualpipe_memory.py)
        else:
            in_flight = min((p - 1) * 2 + (v - 1) * p + 1, m * v) * cfg.num_layers / (p * v)
        on_host = max(0.0, (in_flight - 2) * kept)  # all kept inputs but the re-running block's and the prefetched
        mem["activations"] -= int(on_host)
        link = 2 * m * cfg.num_layers / p * kept / bw
        extra += max(0.0, link - times["compute_s"])
    if optimizer:
        opt = mem["optimizer"]
        mem["optimizer"] = 0
        mem["optimizer_host"] = opt
        step_peak = mem["params"] + mem["grads"] + opt + mem["other"]
        mem["total"] = max(sum(mem[k] for k in ("params", "grads", "activations", "other")), step_peak)
        extra += 2 * opt / bw
    else:
        mem["total"] = sum(mem[k] for k in ("params", "grads", "optimizer", "activations", "other"))
    mem["allocated"] = int(mem["total"] - dev.framework_bytes)
    mem = {k: int(v) for k, v in mem.items()}
    times["offload_s"] = extra
    step = times["step_time_s"] + extra
    scale = times["step_time_s"] / step
    times["step_time_s"] = step
    times["tokens_per_sec_per_device"] *= scale
    if "mfu" in times:
        times["mfu"] *= scale
    return mem, times
