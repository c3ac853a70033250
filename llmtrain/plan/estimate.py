"""The estimated parts of a plan: worst-rank memory breakdown and step time of one layout on one device profile.

    python -m llmtrain.plan model=llama-7b data.seq_len=4096 plan.devices=64 plan.device=a100-80g
    est = estimate(model_cfg, layout, seq_len, recompute, device, devices_per_node)   # -> dict (see `estimate`)

Memory (bytes, the worst rank): params/optimizer from `memory.predict_ranks` (exact); gradients in the
parameters' dtype (ZeRO-2/3: an estimate, see `memory._stage_ranks`); activations per transformer layer per micro-batch
after Korthikanti et al. 2022 (Table 2: s·b·h·(34 + 5·a·s/h) bytes for fp16 GPT without parallelism,
s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tensor parallelism and no sequence parallelism), written out for our
blocks: saved inputs of the two norms and of q/k/v (replicated, 3·s·b·h), q/k/v outputs (s·b·(q + 2kv)/t),
the attention output (s·b·q/t), math attention's scores and softmax (2·a·s²·b/t; flash attention keeps
only a fp32 log-sum-exp of a·s·b/t), the MLP input (s·b·h), and the MLP's inner tensors (GeLU: 2·s·b·f/t;
SwiGLU: gate, up, silu(gate), product: 4·s·b·f/t), in the compute dtype; no dropout. With full recompute
a layer keeps only its input (s·b·h; with RoPE also the block's cached cos/sin tables, 2·s·d; both
measured on CPU through the host allocator) plus one layer's full set during its backward. Selective recompute
(Korthikanti et al. 2022, section 4.2: only the attention core, softmax(q·kᵀ)·v, is recomputed) drops the
core's own saved tensors, the a·s²·b/t probabilities of math attention (Table 2's 5·a·s/h term; flash
attention: its log-sum-exp) and keeps everything else; it is a planner option only (`recompute`
"selective" rows are marked not runnable: llmtrain's Trainer recomputes whole blocks). In flight on the
first pipeline stage: 1F1B holds min(pp, m) micro-batches of its L/pp layers; interleaved holds
(pp - 1)·2 + (v - 1)·pp + 1 chunk-micro-batches of L/(pp·v) layers (fleet's warm-up count). other: logits
and their fp32 loss copy and gradient on the last stage (b·s·V/t·(e + 8)) and the framework margin.

Time: compute = FLOPs per token (6N + 12·L·h·s, as llmtrain/models/size.py; full recompute adds one more
forward, 2N + 4·L·h·s, selective recompute the attention core's forward, 4·L·h·s) x tokens per device per
step / (peak x efficiency); tp: 4 all-reduces of b·s·h per layer per micro-batch (2 forward, 2 backward;
ring: 2·(t-1)/t·bytes/bw + 2·(t-1)·alpha; full recompute repeats the 2 forward ones), not overlapped;
pp: 2 sends of b·s·h per micro-batch per stage boundary (forward activation, backward grad; a calibrated
profile's own send/recv alpha-beta), not overlapped; dp/sharding, once per step: the gradient all-reduce over dp (ZeRO-2/3: of the 1/sharding
share) and, for sharding stage 1/2, a gradient reduce-scatter, overlapped with the backward of the last
micro-batch only (gradient accumulation syncs once), exposed = max(0, comm - 0.8·that backward), plus the
all-gather of updated parameters after the optimizer step (not overlapped); ZeRO-3, every micro-batch:
parameter all-gathers for forward and backward and a gradient reduce-scatter (3 x (n-1)/n volume),
exposed = max(0, comm - 0.8·the micro-batch's compute);
bubble = (pp - 1)/(v·m) of the pipeline's compute. A group spans the network if its ranks are more than
devices_per_node apart in fleet's order (dp, pp, sharding, tp: tp innermost).
"""
from __future__ import annotations

from llmtrain.models.size import flops_parameters
from llmtrain.plan.memory import predict_stage_ranks

OVERLAP = 0.8
RECOMPUTE = ("none", "full", "selective")


def recompute_mode(recompute) -> str:
    """`train.recompute` (bool: whole blocks) or a mode name -> "none" | "full" | "selective"."""
    if recompute is True or recompute is False:
        return "full" if recompute else "none"
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: expected one of {RECOMPUTE}")
    return recompute


def layer_activation_bytes(cfg, s: int, b: int, t: int, e: int, flash: bool, selective: bool = False,
                           sp: bool = False) -> float:
    """Bytes one transformer block saves for backward for one micro-batch [b, s] on a tp rank (no recompute, or
    `selective`: without the attention core's own saved tensors, Korthikanti et al. 2022 section 4.2).

    Korthikanti et al. 2022, Table 2 (s·b·h·(10 + 24/t + 5·a·s/(h·t)) for GPT in fp16 without sequence
    parallelism), written out tensor by tensor for our blocks (llmtrain/models/layers.py) and checked
    against `saved_tensors_hooks` on CPU (tests/plan/test_activations.py):
    - norms: LayerNorm keeps its input and output (2·s·b·h each, + fp32 mean/var 2·s·b); our RMSNorm keeps
      its fp32 input copy and the fp32 normalised tensor (2·s·b·h in fp32 whatever the compute dtype), its
      output (s·b·h) and rsqrt (s·b, fp32);
    - attention: the o_proj input (s·b·q/t); RoPE keeps q and k and their rotated halves (2·s·b·(q + kv)/t)
      and, with grouped-query heads, k and v before repeating (2·s·b·kv/t); math attention keeps the
      transposed q and nh-wide k, v (3·s·b·q/t) and the probabilities (a·s²·b/t, fp32, plus a copy in the
      compute dtype when that is not fp32); flash attention keeps q, k, v, its output and an fp32
      log-sum-exp (a·s·b/t);
    - MLP: GeLU keeps its input and output (2·s·b·f/t), SwiGLU gate, silu(gate), up and the product (4·s·b·f/t).
    With sequence parallelism (`sp`, llmtrain/parallel/sequence.py) what the norms keep of their own is 1/t (the
    norm outputs are replaced by the all-gathered linear inputs, still whole); checked against the bytes saved
    on 2 CPU processes for a Llama block, RMSNorm (tests/parallel/sp_activations.py); the LayerNorm case is
    written the same way, not measured. Fused kernels (model.fuse_*) are not modelled.
    """
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    d = cfg.head_dim()
    q, kv, a = cfg.num_heads * d / t, cfg.kv_heads() * d / t, cfg.num_heads / t
    sb = s * b
    shard = t if sp else 1  # positions a norm sees on this rank: s / shard
    if cfg.norm == "layernorm":  # two norms: input (1/shard) and output (whole: the next linear's input)
        n, stats = 2 * sb * h / shard + 2 * sb * h, 4 * sb / shard
    else:  # two norms: output in the compute dtype, fp32 input copy and normalised tensor (counted as stats)
        n, stats = 2 * sb * h, (4 * sb * h + 2 * sb) / shard
    n += sb * q  # o_proj input
    if cfg.position == "rope":
        n += 2 * sb * (q + kv) + 2 * s * d  # + the cos/sin tables [s, d]
        if kv != q:
            n += 2 * sb * kv
    n += (4 if cfg.activation == "swiglu" else 2) * sb * f / t
    if flash:
        n += sb * (q + 2 * kv) + sb * q
        return n * e + stats * 4 + (0 if selective else 4 * a * sb)
    n += 3 * sb * q
    probs = 0 if selective else a * s * s * b * (4 + (e if e != 4 else 0))
    return n * e + stats * 4 + probs


def recompute_kept_bytes(cfg, s: int, b: int, e: int) -> float:
    """Bytes a fully recomputed block keeps between its forward and backward: its input [b, s, h] (whole on
    every tp rank without sequence parallelism) and, with RoPE, the block's cached cos/sin tables [s, d]
    (measured on CPU: tests/plan/test_activations.py)."""
    return s * b * cfg.hidden_size * e + (2 * s * cfg.head_dim() * e if cfg.position == "rope" else 0)


def memory_estimate(cfg, layout, seq_len: int, recompute, amp: str, device: str,
                    dtype_bytes: int, flash: bool, framework_bytes: float) -> dict:
    mode = recompute_mode(recompute)
    ranks = predict_stage_ranks(cfg, layout, amp, device)
    worst = None
    s, b, t, p, v, m = seq_len, layout.micro_batch, layout.tp, layout.pp, layout.virtual_pp, layout.grad_accum
    per_layer = layer_activation_bytes(cfg, s, b, t, dtype_bytes, flash, selective=mode == "selective",
                                       sp=getattr(layout, "sequence_parallel", False))
    layers_here = cfg.num_layers / p
    if p == 1:
        in_flight_layers = layers_here
    elif v == 1:
        in_flight_layers = min(p, m) * layers_here
    else:
        in_flight_layers = min((p - 1) * 2 + (v - 1) * p + 1, m * v) * cfg.num_layers / (p * v)
    if mode == "full":
        act = in_flight_layers * recompute_kept_bytes(cfg, s, b, dtype_bytes) + per_layer
    else:
        act = in_flight_layers * per_layer
    logits = b * s * cfg.vocab_size / t * (dtype_bytes + 8)
    for (pp_rank, _), r in ranks.items():
        last = pp_rank == p - 1
        other = framework_bytes + (logits if last else 0)
        entry = {"params": r["param_bytes"], "grads": r["grad_bytes"], "optimizer": r["optimizer_bytes"],
                 "activations": act, "other": other}
        entry["total"] = sum(entry.values())
        if worst is None or entry["total"] > worst["total"]:
            worst = entry
    return {k: int(v) for k, v in worst.items()}


def _ring(bytes_: float, n: int, bw: float, alpha: float, factor: float = 2.0) -> float:
    """Ring all-reduce (factor 2) or reduce-scatter / all-gather (factor 1) of `bytes_` over n ranks."""
    if n <= 1:
        return 0.0
    return factor * (n - 1) / n * bytes_ / bw + factor * (n - 1) * alpha


def _link(span: int, dev, devices_per_node: int):
    """(bandwidth, alpha) of a group whose members are `span` ranks apart times its size."""
    return (dev.nvlink_bw, dev.nvlink_alpha) if span <= devices_per_node else (dev.net_bw, dev.net_alpha)


def time_estimate(cfg, layout, seq_len: int, recompute, dev, devices_per_node: int) -> dict:
    mode = recompute_mode(recompute)
    e = dev.dtype_bytes
    s, b, t, p, v, m = seq_len, layout.micro_batch, layout.tp, layout.pp, layout.virtual_pp, layout.grad_accum
    n_flops = flops_parameters(cfg)
    per_token = 6 * n_flops + 12 * cfg.num_layers * cfg.hidden_size * s
    core = 4 * cfg.num_layers * cfg.hidden_size * s  # the attention core's forward: q·kᵀ and probs·v
    extra = {"none": 0, "full": 2 * n_flops + core, "selective": core}[mode]
    tokens_per_rank = m * b * s  # per data-parallel replica; split over tp x pp devices
    compute = tokens_per_rank * (per_token + extra) / (t * p) / (dev.peak_flops * dev.efficiency)
    # fleet's order dp, pp, sharding, tp (tp innermost): the stride of each axis in ranks
    stride = {"tp": 1, "sharding": t, "pp": t * layout.sharding, "dp": t * layout.sharding * p}
    bw_tp, a_tp = _link(t, dev, devices_per_node)
    n_ar = 6 if mode == "full" else 4  # full recompute repeats the forward's two all-reduces
    tp_comm = m * (cfg.num_layers / p) * n_ar * _ring(b * s * cfg.hidden_size * e, t, bw_tp, a_tp) if t > 1 else 0.0
    bw_pp, a_pp = _link(stride["pp"] * 2, dev, devices_per_node)
    bw_pp, a_pp = dev.p2p_bw or bw_pp, dev.p2p_alpha or a_pp  # measured send/recv figures when calibrated
    pp_comm = (m * v * 2 * (b * s * cfg.hidden_size / t * e / bw_pp + a_pp)) if p > 1 else 0.0
    local_param_bytes = n_flops / (t * p) * e
    grads, params_after = 0.0, 0.0  # once per step: gradient sync; parameter all-gather after the update
    zero3 = 0.0  # every micro-batch: ZeRO-3 all-gathers the parameters for forward and backward, reduce-scatters grads
    for axis, n in (("dp", layout.dp), ("sharding", layout.sharding)):
        if n <= 1:
            continue
        bw, al = _link(stride[axis] * n, dev, devices_per_node)
        if axis == "dp":  # all-reduce of this replica's (sharded, under ZeRO-2/3) gradients
            share = layout.sharding if layout.sharding_stage >= 2 else 1
            grads += _ring(local_param_bytes / share, n, bw, al)
        elif layout.sharding_stage == 3:
            zero3 += 3 * _ring(local_param_bytes, n, bw, al, factor=1.0)
        else:  # stage 1/2: reduce-scatter of gradients, all-gather of the updated parameters
            grads += _ring(local_param_bytes, n, bw, al, factor=1.0)
            params_after += _ring(local_param_bytes, n, bw, al, factor=1.0)
    micro = compute / m  # one micro-batch's forward + backward
    # the step's gradient sync overlaps the last micro-batch's backward only (earlier ones accumulate without sync)
    exposed = max(0.0, grads - OVERLAP * micro * 2 / 3) + params_after
    exposed += m * max(0.0, zero3 - OVERLAP * micro)
    bubble = (p - 1) / (v * m) * (compute + tp_comm) if p > 1 else 0.0
    step = compute + tp_comm + pp_comm + exposed + bubble
    tokens = layout.global_batch * s
    world = layout.world
    return {"compute_s": compute, "dp_sharding_comm_s": exposed, "tp_comm_s": tp_comm, "pp_p2p_s": pp_comm,
            "bubble_s": bubble, "step_time_s": step, "tokens_per_sec_per_device": tokens / step / world,
            "mfu": tokens * per_token / step / world / dev.peak_flops}
