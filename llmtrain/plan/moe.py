"""The Mixture-of-Experts feed-forward for the planner: its kernels, its expert-parallel exchange, its saved bytes.

    python -m llmtrain.plan model=qwen-moe-a2.7b data.seq_len=4096 plan.devices=8 plan.device=h200 +parallel=dp8 parallel.ep=8
    moe_ffn(p, cfg, T, fused, MoEPlan(ep=8, link=(bw, alpha)), e)     # called by kernels._block for an MoE block

The kernels follow the agreed formulation of llmtrain's `Experts.forward` op for op, as the H200 twin runs it
(benchmarks/gpu_moe.py `MoEDecoder` with `experts_slots`), for T = b·s tokens of this rank:

- the router (`model.moe_router_dtype`): `fp32` (default), x cast to fp32 (a cast of [T, h] under AMP), the GEMM
  [T, h] x [h, E] and its input and weight gradients in fp32 with an fp32 weight: under AMP priced as the bf16
  table's GEMM with twice the reduction length (fp32 operands are twice the bytes, and on Ampere/Hopper Paddle runs
  fp32 GEMMs on TF32 tensor cores, half the bf16 rate at the datasheet peaks); `amp`, the GEMM in the activation
  dtype and its logits cast to fp32; `route()`: softmax [T, E], top-k, the chosen scores' gather (backward: zeros
  [T, E] and a scatter-add), the top-k renormalisation when `moe_norm_topk`; one_hot [T, k, E] and the counts;
  with a capacity factor, GShard's queue positions (slot-major copy, cumsum over the k·T choices, product, row
  sum) and the drop mask;
- the experts (`llmtrain/models/experts.py`'s final op sequence, MOE-FORMULATION a593f33): the slot-major
  choices, one_hot [k T, E] with dropped rows zeroed, the queue places (cumsum over the choices, product, row
  sum), C = ceil(factor T k / E) (capacity) or ceil(imbalance T k / E) (dropless: `MoEPlan.imbalance` or `expected_imbalance`, the
  largest expert's load over the mean, a stated factor; the host reads it, `int(counts.max())`: a `sync` kernel,
  where the host waits for the device); slot = idx C + pos; the inverse map `source` [E C] (a fill and a scatter
  of the k T token ids); the dispatch: x with a zero row appended [T + 1, h] (a copy), the buffer gathered
  through `source` [E C, h] (backward: zeros [T + 1, h] and one index_add of the E C rows, the empty ones on the
  zero row, `moe_index_add_inv`, and the concat's gradient split off: a copy); gate and up, bmm [E, C, h] x
  [E, h, f] each on the stacked weights (no concatenated copy; their input (nt) and weight (tn) gradients, the
  two input gradients added), silu(g) * u (`moe_swiglu_view`; GeLU experts: up alone, then gelu), bmm [E, C, f] x [E, f, h]; the combine in token-major order: the rows
  [T, k] gathered [T, k, h], times the weights [T, k, 1], summed over k (`moe_sum_mid`; backward: zeros + index_add
  into [E C, h], the weight product and its row sums). Every cumsum over axis 0 (route()'s and the experts') is
  Paddle's GPU kernel for an axis that is not the last: a transpose to [E, k T], a block scan along it, a
  transpose back (paddle/phi/kernels/gpu/cum_kernel.cu; `_scan`). On a GPU llmtrain's combine is Paddle's fused
  `moe_combine` when present; it is priced as the tensor ops it replaces (the CPU path and fallback, what the
  twin runs);
- the shared expert(s): a dense FFN of `moe_num_shared_experts` x the expert width (kernel_ops._mlp; split over tp
  like the dense MLP) and the add;
- the balancing terms (f = counts / T, P = the probabilities' mean, the z-loss's logsumexp [T, E]) and the
  statistics' adds, on the device; per micro-batch `balancing_loss_kernels` (aux, z and their coefficients).

Expert parallelism (ep > 1): the buffer [E, C, h] = [ep, E/ep, C, h] moves to the experts' ranks and back,
forward and backward (four exchanges per layer and micro-batch), as `comm` kernels in the device stream: the
experts wait for their tokens, so an exchange overlaps nothing on the device (its host dispatch overlaps the
queued kernels like any op). `alltoall` (NCCL): (ep - 1)/ep of the buffer's bytes each way per exchange;
`allgather` (gloo, which has no all-to-all): each rank receives the other ranks' whole buffers, (ep - 1) x its
bytes. The local experts then run as bmm over [E/ep, ep C, h].

Saved for backward (`moe_activation_bytes`): the router GEMM's input (an fp32 copy [T, h] with the fp32 router
under AMP, else in the activation dtype), the fp32 logits and probabilities,
the index tensors, the dispatch buffer [E C + 1, h], the gate and up outputs and silu(g) and the product [E/ep, ep C, f...], the gathered rows [k T, h].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from llmtrain.plan.kernel_ops import Kernel, _linear, _mlp, gemm, mem, part, view


@dataclass
class MoEPlan:
    """How this rank runs its MoE layers."""

    ep: int = 1
    """Expert-parallel degree: E / ep experts here, each serving ep x C rows."""
    dispatcher: str = "alltoall"
    """alltoall (NCCL) | allgather (gloo)."""
    imbalance: float | None = None
    """Dropless: the largest expert's load over the mean load T k / E (1.0: perfectly balanced); sets C. None:
    `expected_imbalance` of the rank's tokens (`plan.moe_imbalance` overrides it)."""
    link: tuple = (0.0, 0.0)
    """(bandwidth bytes/s, alpha s) of the ep group's links (estimate._link): the whole exchange at this rate when
    `local` is 0."""
    local: int = 0
    """Members of the ep group on this rank's node (0: not known, `link` prices everything). An all-to-all then sends
    (local - 1)/ep of the buffer over `nvlink` and (ep - local)/ep through this GPU's own network port (`net`),
    both at once: each GPU's off-node share leaves through its own port, whatever the group's size per node."""
    nvlink: tuple = (0.0, 0.0)
    """(bandwidth, alpha) inside a node, with `local`."""
    net: tuple = (0.0, 0.0)
    """(bandwidth, alpha) of one GPU's network port, with `local`."""


@lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals], by integrating x d(Phi(x)^n) on a grid (0 for n = 1)."""
    if n <= 1:
        return 0.0
    phi = lambda x: 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))  # noqa: E731
    steps, lo, hi = 1600, -8.0, 8.0
    dx = (hi - lo) / steps
    total, prev = 0.0, phi(lo) ** n
    for i in range(1, steps + 1):
        cur = phi(lo + i * dx) ** n
        total += (lo + (i - 0.5) * dx) * (cur - prev)
        prev = cur
    return total


def expected_imbalance(experts: int, top_k: int, tokens: int) -> float:
    """The busiest expert's expected load over the mean T k / E when each of `tokens` tokens picks `top_k` of
    `experts` experts with equal chance (a balanced router): each expert's load ~ Binomial(T, k / E), the busiest
    of E of them mu + sigma E[max of E normals]. A lower bound of real routing, whose choices correlate across
    tokens: the H100 twin's random-initialised routers put 2.6-5.2x the mean on their busiest expert where this
    gives 1.04-1.14 (benchmarks/README.md, "H100"); state the measured factor with `plan.moe_imbalance`."""
    p = top_k / experts
    mean = tokens * p
    if mean <= 0:
        return 1.0
    return 1.0 + math.sqrt(tokens * p * (1.0 - p)) * expected_max_normal(experts) / mean


def capacity(cfg, T: int, plan: MoEPlan) -> int:
    """Rows per expert of this rank's dispatch buffer: ceil(factor T k / E), or dropless ceil(imbalance T k / E)
    with the stated imbalance or, unstated, `expected_imbalance` of T."""
    E, k = cfg.moe_num_experts, cfg.moe_top_k
    if cfg.moe_capacity_factor > 0:
        f = cfg.moe_capacity_factor
    else:
        f = plan.imbalance if plan.imbalance is not None else expected_imbalance(E, k, T)
    return int(math.ceil(f * T * k / E))


def exchange_seconds(nbytes: float, plan: MoEPlan) -> float:
    """One exchange of this rank's [E, C, h] buffer (`nbytes`) over the ep group (module docstring)."""
    ep, (bw, alpha) = plan.ep, plan.link
    if ep <= 1:
        return 0.0
    if bw <= 0:
        raise ValueError("MoEPlan.link: the ep group's bandwidth is needed to price expert parallelism")
    if plan.dispatcher == "alltoall" and 0 < plan.local < ep:  # spans nodes: NVLink and the network port at once
        (nv_bw, nv_alpha), (net_bw, net_alpha) = plan.nvlink, plan.net
        inside = (plan.local - 1) / ep * nbytes / nv_bw + (plan.local - 1) * nv_alpha
        across = (ep - plan.local) / ep * nbytes / net_bw + (ep - plan.local) * net_alpha
        return max(inside, across)
    share = (ep - 1) / ep if plan.dispatcher == "alltoall" else ep - 1
    return share * nbytes / bw + (ep - 1) * alpha


def _exchange(nbytes: float, plan: MoEPlan) -> Kernel:
    return Kernel("comm", f"ep_{plan.dispatcher}", (round(exchange_seconds(nbytes, plan), 12),), numel=nbytes)


def _tiny(n: float, count: int = 1) -> list:
    """`count` small elementwise kernels over n elements (index arithmetic, casts of [T, k], scalars)."""
    return [mem("add", n)] * count


def _scan(n: float) -> list:
    """The queue places (cumsum(onehot, 0) * onehot).sum(-1) over a one-hot [k T, E] of n elements: Paddle's GPU
    cumsum over axis 0 (a transpose to [E, k T], the block scan along it, a transpose back), the product, the row
    sum."""
    return [mem("moe_t_copy_i64", n), mem("moe_cumsum_emajor", n), mem("moe_t_copy_i64", n), mem("moe_mul_i64", n),
            mem("moe_rowsum_i64", n)]


def inverse_index_add(n_rows: int, kept: int, h: int) -> Kernel:
    """The dispatch gather's backward: `n_rows` buffer rows of width h index_added into [T + 1, h], the rows past
    the `kept` choices on the zero row; priced between the tables measured with 20% and 60% of the rows empty."""
    empty = min(0.6, max(0.2, 1.0 - kept / max(1, n_rows)))
    return Kernel("mem", "moe_index_add_inv", ("moe_index_add_inv60", (empty - 0.2) / 0.4), numel=n_rows * h)


def moe_ffn(p, cfg, T: int, fused: dict, plan: MoEPlan, e: int, t: int = 1, sp: bool = False) -> None:
    """Add the kernels of one MoE feed-forward over this rank's T tokens to the pass `p` (module docstring); `t`:
    the tensor-parallel degree (the shared experts are column and row linears split over it; the router and the
    routed experts are replicated over the tp ranks, llmtrain/parallel/experts.py); `sp` (sequence parallelism,
    t > 1): T is the rank's sequence shard, which it routes alone, while the shared experts' column linears work on
    the gathered t·T positions (their transposes: `kernel_ops._seq_edge`)."""
    h, E, k, f = cfg.hidden_size, cfg.moe_num_experts, cfg.moe_top_k, cfg.expert_ffn_size()
    kT, TE, kTE = k * T, T * E, k * T * E
    C = capacity(cfg, T, plan)
    EC = E * C
    El, rows = E // max(1, plan.ep), max(1, plan.ep) * C  # local experts, rows each serves
    cap = cfg.moe_capacity_factor > 0
    # router (MoEFeedForward.routing)
    p.op([view("reshape")], [view("reshape")])
    if cfg.moe_router_dtype == "fp32":
        if e < 4:  # under AMP: x.astype(fp32); the fp32 (TF32) GEMM at twice the bf16 GEMM's work
            p.op([mem("cast", T * h)], [mem("cast", T * h)])
            p.op([gemm(T, E, 2 * h, op="router.fwd")], [gemm(T, h, 2 * E, op="router.dgrad", layout="nt"),
                                                         gemm(h, E, 2 * T, op="router.wgrad", layout="tn")])
        else:
            _linear(p, T, h, E, False, "router")
    else:  # moe_router_dtype=amp: the GEMM in the activation dtype, the logits cast to fp32
        _linear(p, T, h, E, False, "router")
        p.op([mem("cast", TE)], [mem("cast", TE)])
    # route(): softmax, top-k, the chosen scores, renormalisation; counts and capacity under no_grad
    p.op([mem("moe_softmax", TE)], [mem("moe_softmax_bwd", TE)])  # (a sigmoid router's scores: the same row)
    if cfg.moe_n_group > 1:  # group-limited routing (router.limit_to_groups), no gradient: each group's score (its
        # top-2 summed, or its max), the best groups' top-k over [T, G] (a tiny top-k: the top-2 row), their
        # one_hot [T, keep, G] summed, the mask expanded over [T, E], and the selection's where and -inf fill
        G, keep = cfg.moe_n_group, cfg.moe_topk_group
        score = [mem("moe_topk2", TE), mem("reduce", T * G * 2)] if cfg.moe_group_score == "top2" else [mem("reduce", TE)]
        p.op([view("reshape")] + score + [mem("moe_topk2", T * G), mem("moe_one_hot", T * keep * G),
                                          mem("reduce", T * keep * G)] + _tiny(T * G) + [view("expand"), view("reshape"),
                                                                                         mem("add", TE), mem("add", TE)])
    with p.part("once"):  # a recomputed forward routes with the first run's choice (`MoEFeedForward.replay`)
        p.op([mem(f"moe_topk{k}", TE)])
    p.op(_tiny(T * k), [mem("moe_fill", TE)] + _tiny(T * k))  # take_along_axis; backward zeros + scatter-add
    if cfg.moe_norm_topk:
        p.op(_tiny(T * k, 2), _tiny(T * k, 3))
    p.op([mem("moe_one_hot", kTE), mem("moe_colsum_i64", kTE)] + _tiny(E, 2))  # one_hot [T, k, E]; counts
    if cap:  # queue positions in slot-major order, the drop mask, index = where(keep, index, -1)
        p.op([mem("moe_mul_i64", kTE)] + _scan(kTE) + [view("reshape"), view("t")] + _tiny(kT, 6))
        p.op(_tiny(T * k, 2), _tiny(T * k))  # weight * keep
    # Experts.forward: slot-major choices, queue places, slots, the inverse map
    p.op(_tiny(kT, 3))  # index.T.reshape, >= 0, clamp
    p.op([mem("moe_one_hot", kTE), mem("moe_mul_i64", kTE)] + _scan(kTE) + _tiny(kT))
    if not cap:  # dropless: C = int(counts.max()), the one host read of the layer
        p.op(_tiny(E) + [Kernel("sync", "host_read")])
    p.op(_tiny(kT, 6))  # idx * C + pos, the trash row, where; arange(T), its k-fold tile
    p.op(_tiny(EC) + [mem("moe_scatter_i64", kT), view("slice")])  # source = scatter(full([E C + 1], T), slot, tok)
    # dispatch: buffer [E C, h] = gather(concat(x, zeros([1, h])), source)
    p.op(_tiny(h) + [mem("copy", (T + 1) * h)], [mem("copy", T * h)])
    p.op([mem("moe_gather_rows", EC * h), view("view")],
         [mem("moe_fill", (T + 1) * h), inverse_index_add(EC, kT, h)])
    if plan.ep > 1:  # to the experts' ranks (and the gradient back)
        p.op([_exchange(EC * h * e, plan)], [_exchange(EC * h * e, plan)])
    # experts: bmm over [E/ep, ep C, h]
    swiglu = cfg.activation == "swiglu"
    for name in ("expert.gate", "expert.up") if swiglu else ("expert.up",):  # bmm on the stacked weights themselves
        p.op([gemm(rows, f, h, El, name)], [gemm(rows, h, f, El, f"{name}.dgrad", "nt"),
                                           gemm(h, f, rows, El, f"{name}.wgrad", "tn")])
    if swiglu:
        p.op([], [mem("add", El * rows * h)])  # the buffer's two gradients summed
    with p.part("moe_act"):  # silu(g) * u, or gelu(u) (`train.recompute_modules=[moe_act]` re-runs it)
        if swiglu:
            p.op([mem("moe_swiglu_view", El * rows * f), part("mul")],
                 [mem("moe_swiglu_view_bwd", El * rows * f)] + [part("mul")] * 2)
        else:
            p.op([mem("gelu", El * rows * f)], [mem("gelu_bwd", El * rows * f)])
    p.op([gemm(rows, h, f, El, "expert.down")],
         [gemm(rows, f, h, El, "expert.down.dgrad", "nt"), gemm(f, h, rows, El, "expert.down.wgrad", "tn")])
    p.op([view("view")], [view("view")])
    if plan.ep > 1:  # back to the tokens' ranks
        p.op([_exchange(EC * h * e, plan)], [_exchange(EC * h * e, plan)])
    # combine, token-major: rows [T, k] of the expert output gathered, times the weights [T, k, 1], summed over k
    p.op(_tiny(kT, 3))  # row = where(keep, slot, 0), laid out [T, k]
    p.op(_tiny(kT), _tiny(kT))  # weight.astype(bf16)
    p.op([mem("moe_gather_rows", kT * h), view("view")], [mem("moe_fill", EC * h), mem("moe_index_add_rows", kT * h)])
    p.op([mem("moe_mul_rows", kT * h)], [mem("moe_mul_rows", kT * h), mem("mul", kT * h), mem("moe_rowsum_bf16", kT * h)])
    p.op([mem("moe_sum_mid", kT * h)], [view("expand")])
    if cfg.moe_routed_scale != 1.0:
        p.op([mem("mul", T * h)], [mem("mul", T * h)])
    if cfg.moe_num_shared_experts > 0:
        with p.part("shared_experts"):
            _mlp(p, cfg, T * t if sp else T, T, cfg.moe_num_shared_experts * f // t, fused, sp, cfg.bias)
        p.op([mem("add", T * h)])
    # balancing terms (counts / T, the probabilities' mean, z = logsumexp^2 mean) and the statistics' adds
    p.op(_tiny(E) + [mem("add", TE), mem("moe_logsumexp", TE)] + _tiny(T) + _tiny(1),
         _tiny(1) + _tiny(T) + [mem("moe_logsumexp_bwd", TE), mem("add", TE)])
    p.op(_tiny(E) + _tiny(1))
    p.op([view("view")], [view("view")])


def balancing_loss_kernels(cfg) -> tuple[list, list]:
    """(forward, backward) kernels of the balancing losses over the model's MoE layers, once per micro-batch:
    E sum_i f_i P_i per layer, the stacks and means, the coefficients, the add to the LM loss."""
    n = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    fwd = _tiny(cfg.moe_num_experts, 3 * n) + _tiny(n, 4) + _tiny(1, 4)
    bwd = _tiny(1, 4) + _tiny(n, 4) + _tiny(cfg.moe_num_experts, 3 * n)
    return fwd, bwd


def moe_activation_bytes(cfg, T: int, e: int, plan: MoEPlan) -> float:
    """Bytes one MoE feed-forward saves for backward for this rank's T tokens, beyond what the dense block
    without its FFN saves (the shared expert: as a dense FFN of its width; see the module docstring)."""
    h, E, k, f = cfg.hidden_size, cfg.moe_num_experts, cfg.moe_top_k, cfg.expert_ffn_size()
    C = capacity(cfg, T, plan)
    El, rows = E // max(1, plan.ep), max(1, plan.ep) * C
    kT = k * T
    router_input = T * h * (4 if cfg.moe_router_dtype == "fp32" else e)  # the router GEMM's input (module docstring)
    n = E * C * h  # the dispatch buffer (bmm's input)
    # gate and up outputs (silu's and the product's inputs), silu(g), the product; GeLU experts: up and gelu(up)
    n += El * rows * (4 * f if cfg.activation == "swiglu" else 2 * f)
    n += kT * h + kT  # the gathered rows and slot-major weights (the weight product's inputs)
    fp32 = 3 * T * E  # logits, probabilities (softmax output), the logsumexp's input and output
    ints = E * C + 2 * kT + T * k  # source (the gather's index), slot, row (the combine's); the top-k index
    if plan.ep > 1:
        n += El * rows * h  # the received buffer
    return n * e + router_input + 4 * fp32 + 8 * ints
