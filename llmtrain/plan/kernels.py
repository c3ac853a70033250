"""The kernels of one micro-batch's forward and backward, as llmtrain runs them, for the operator-level cost model.

    python -m llmtrain.plan model=tinyllama-1.1b data.seq_len=2048 plan.devices=1 plan.device=h200 +parallel=single
    ks = micro_batch_kernels(MicroBatchSpec(model_cfg, b=4, s=2048, t=1, gpu=True, flash=True, recompute="none"))

Each `Kernel` is one eager op: one host dispatch and one device kernel. The list follows
`llmtrain/models/decoder.py` and `layers.py` block by block with the `model.fuse_*` paths this run
takes (`ModelConfig.fused`, `auto` = on for GPU), shapes after tensor-parallel splitting (column
linears hold out/tp features, row linears in/tp):

- GEMMs (`gemm`, C[m, n] = A[m, k] @ B[k, n]): a linear layer x [T, K] @ W [K, N] (T = b·s tokens) is
  the forward (T, N, K), the input gradient (T, K, N) and the weight gradient (K, N, T); fused
  projections (`fuse_qkv`, `fuse_ffn`) are one GEMM of the concatenated width plus the weight concat
  (a copy in the forward; in the backward the weights concatenated again, as the concatenation is not kept
  (`llmtrain/models/fused_linear.py`), and the gradient's split: priced as one copy of twice the bytes, one host
  dispatch, because the h200 host fit counts the dispatches of the twin, which still concatenates through
  autograd); the LM head (untied: [h, V/tp]; tied: x @ tableᵀ) likewise;
- the attention core (`attn`): flash attention by (batch·heads, seq, head dim, causal), forward and
  backward; the math path (CPU, `attention=math`) as its batched GEMMs (q·kᵀ, probs·v and their
  gradients) plus the transposes, the fp32 cast, the causal mask add, the softmax and its backward; or, when
  the profile measured it (`math_core`, CPU profiles from `--calibrate`), as one composite kernel `attn_* math`
  (from the reshapes of q, k, v to o_proj's input: on a CPU its matmuls read strided views and cost 3-4x a
  contiguous GEMM of the same shape);
- memory-bound ops (`mem`) by their size (elements of one input, the index of the profile's measured rows),
  per op class (norms, QK-norm's per-head RMSNorm on q and k, RoPE, activations,
  residual adds, casts, the embedding gather and its scatter-add gradient, the logits' fp32 cast,
  softmax cross entropy and its gradient); the models have no dropout;
- `view` ops (reshape, split, chunk views): host time only.

Under full recompute every block's forward runs a second time inside the backward. The optimizer step
(`optimizer_kernels`) is counted apart: gradient accumulation adds for micro-batches after the first (on a GPU
for every micro-batch: the gradients are zeroed, not freed, between steps),
the global-norm clip (one squared-norm kernel per tensor, a sum, one scale per tensor) and multi-precision
AdamW (one kernel per tensor reading the gradient, the fp32 master, both moments and writing them and
the low-precision copy).

A block's kernel lists are built once per distinct block (model, shape, degrees, MoE plan) and shared by every
micro-batch that holds it (`micro_batch_kernels`): the same list objects, so the timeline's maps of them
(llmtrain/plan/timeline.py, cached per list) are computed once per ranking. Read them; never change them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmtrain.models.recompute import Recompute, as_recompute
from llmtrain.plan.kernel_ops import Kernel, _linear, _mlp, _Pass, _seq_edge, attention_flops, gemm, mem, part, view  # noqa: F401 (re-exported)
from llmtrain.plan.moe import MoEPlan, moe_ffn


def _norm(p: _Pass, cfg, T, h, e, fused_rms: bool):
    if cfg.norm == "layernorm":
        p.op([mem("layernorm", T * h)], [mem("layernorm_bwd", T * h)])
    elif fused_rms:
        p.op([mem("rmsnorm", T * h)], [mem("rmsnorm_bwd", T * h)])
    else:
        _rms_unfused(p, T, h, e)


def _rms_unfused(p: _Pass, T, h, e):
    """x.astype(fp32); pow; mean; +eps, rsqrt; x32 * r; astype; * weight (layers.rms_norm) over T rows of h."""
    n = T * h
    cast = [mem("cast", n)] if e != 4 else []
    p.op(cast, cast)
    p.op([mem("mul", n)], [mem("mul", n), mem("mul", n)])
    p.op([mem("reduce", n)], [mem("copy", n)])
    p.op([mem("add", T), Kernel("mem", "mul", numel=float(T), of="rmsnorm")],
         [mem("mul", T), Kernel("mem", "mul", numel=float(T), of="rmsnorm")])
    p.op([mem("mul", n)], [mem("mul", n), mem("mul", n), mem("reduce", n)])
    p.op(cast, cast)
    p.op([mem("mul", n)], [mem("mul", n), mem("mul", n), mem("reduce", n)])


def _residual(p: _Pass, T, h, gpu: bool):
    """x + branch(x): the add's own gradient passes through to both inputs (no kernel); x's two gradients (through
    the identity and through the branch) are summed by autograd: one add in the backward (seen on the H200 as
    one `add_` of [b, s, h] per residual). Counted on the GPU path; the CPU leg keeps its calibrated count."""
    p.op([mem("add", T * h)], [mem("add", T * h, "launch")] if gpu else [])


def _rope(p: _Pass, T, width, fused: bool):
    """Rotary embedding of q ([T, q]) and k ([T, kv]); `width` = (q, kv) widths."""
    q, kv = width
    if fused:  # one kernel for q and k
        p.op([mem("rope", T * (q + kv))], [mem("rope_bwd", T * (q + kv))])
        return
    for w in (q, kv):  # layers.Rotary.apply: chunk, -x2, concat, x*cos, rotated*sin, add: one composite row
        host = [view("chunk")] + [part("rope-part")] * 4
        p.op([mem("rope", T * w)] + host, [mem("rope_bwd", T * w)] + host)


def _mla_projections(p: _Pass, cfg, T, t, e, fused: dict) -> tuple[int, int, int]:
    """Multi-head latent attention's projections and rotary part (`llmtrain/models/mla.py`) on one tp rank: q_a
    (replicated) + its norm + q_b (column), or one q_proj; kv_a (replicated), its norm, kv_b (column); the rotary
    q and the one shared rotary key; q and k assembled [T, nh/tp, d_qk]. Returns (heads, d_qk, o_proj's input
    width) on this rank. (The tp all-reduce of the shared key's gradient, [T, d_r], is not counted.)"""
    h, nh = cfg.hidden_size, cfg.num_heads // t
    nope, rope, dv, r, rq = (cfg.mla_qk_nope_head_dim, cfg.mla_qk_rope_head_dim, cfg.mla_v_head_dim,
                             cfg.mla_kv_lora_rank, cfg.mla_q_lora_rank)
    qk = nope + rope
    if rq:
        _linear(p, T, h, rq, cfg.bias, "q_a")
        _norm(p, cfg, T, rq, e, fused["fuse_rms_norm"])
        _linear(p, T, rq, nh * qk, False, "q_b")
    else:
        _linear(p, T, h, nh * qk, False, "q")
    _linear(p, T, h, r + rope, cfg.bias, "kv_a")
    p.op([view("split")], [mem("copy", T * (r + rope))])  # c_kv | k_pe; the backward concatenates their grads
    _norm(p, cfg, T, r, e, fused["fuse_rms_norm"])
    _linear(p, T, r, nh * (nope + dv), False, "kv_b")
    p.op([], [mem("add", T * h)])  # the block norm's output feeds two projections: its gradients summed
    p.op([view("reshape"), view("split"), view("reshape"), view("split")], [mem("copy", T * nh * qk)] * 2)
    _rope(p, T, (nh * rope, rope), fused["fuse_rope"])
    p.op([mem("copy", T * nh * qk)], [mem("copy", T * nh * qk)])  # q = [q_nope, q_rope]
    p.op([mem("copy", T * nh * qk)], [mem("copy", T * nh * qk), mem("reduce", T * nh * rope)])  # k, k_pe to heads
    return nh, qk, nh * dv


def _ring_math_core(p: _Pass, *, bh: int, s: int, d: int, dv: int, cp: int):
    """The context-parallel ring's attention core on CPU (`parallel.cp_comm=ring`, `context_exchange._Ring`, math
    blocks of `context_attention.py`) on the first cp rank, s = its 2c positions: step 0 its own keys (both query
    chunks over both key chunks, 2c x 2c), each of the cp - 1 later steps a later rank's keys (its late query chunk
    over both of their chunks, c x 2c; other ranks hold an earlier rank's, 2c x c: the same work). A block's forward:
    scores q·kᵀ, the masked softmax with its log-sum-exp, p·v, the merge into the running output; its backward (the
    ring's own, a PyLayer): the scores again, dv = pᵀ·do, dp = do·vᵀ, dq = ds·k, dk = dsᵀ·q."""
    c = s // 2
    for rows, keys in [(s, s)] + [(c, s)] * (cp - 1):
        n = bh * rows * keys
        p.op([gemm(rows, keys, d, bh, "ring.qk"), mem("softmax", n), gemm(rows, dv, keys, bh, "ring.pv"),
              mem("add", bh * rows * dv)],
             [gemm(rows, keys, d, bh, "ring.qk_again"), mem("softmax_bwd", n), gemm(keys, dv, rows, bh, "ring.dv"),
              gemm(rows, keys, dv, bh, "ring.dp"), gemm(rows, d, keys, bh, "ring.dq"),
              gemm(keys, d, rows, bh, "ring.dk")])


def _ring_flash_core(p: _Pass, *, b: int, nh: int, nkv: int, s: int, d: int, dv: int, cp: int, causal: bool = True):
    """The context-parallel ring's attention core on a GPU (`context_exchange._Ring` through
    `paddle_compat/flash_blocks.py`) on the first cp rank, s = its 2c positions: one `flash_attn` call per ring step
    on the block `ring_block` chooses - step 0 its own keys, a square causal block 2c x 2c; each of the cp - 1 later
    steps a later rank's keys, its late query chunk over both of their chunks, c x 2c unmasked (other ranks hold an
    earlier rank's, 2c x c: the same work) - and, from step 1, the merge of the block's output into the running one
    by their log-sum-exps (two products and their sum over the block's [b, rows, nh, dv]); the backward one
    `flash_attn_grad` per step and the block's q, k, v gradients added into the fp32 accumulators. The attention
    kernels' shape is (b·nh, keys, d, causal, nkv, query rows). Unmasked (`causal` off): every step 2c x 2c."""
    c, bh = s // 2, b * nh
    blocks = [(s, s, True)] + [(c, s, False)] * (cp - 1) if causal else [(s, s, False)] * cp
    for step, (rows, keys, causal) in enumerate(blocks):
        shape, fl = (bh, keys, d, causal, nkv, rows), 4.0 * bh * rows * keys * d * (0.5 if causal else 1.0)
        n = bh * rows * dv
        merge = [mem("mul", n), mem("mul", n), mem("add", n)] if step else []
        grads = [mem("add", bh * rows * d), mem("add", b * nkv * keys * d), mem("add", b * nkv * keys * dv)]
        p.op([Kernel("attn_fwd", "flash", shape, flops=fl)] + merge,
             [Kernel("attn_bwd", "flash", shape, flops=2.5 * fl)] + grads)


def _block(p: _Pass, cfg, b, s, t, e, gpu, flash, sp: bool = False, math_core: bool = False, moe=None,
           cp: int = 1):
    """One block on one tp rank (`moe`: a callable adding the MoE feed-forward's kernels, moe.py); `sp` (sequence parallelism, tp > 1): the norms, residual adds and row linears'
    biases work on this rank's T/tp positions, the column linears on the all-gathered T; `math_core`: the math
    attention core as one composite kernel (a profile that measured it, `attention_math`)."""
    h, T = cfg.hidden_size, b * s
    Ts = T // t if sp and t > 1 else T  # positions of the residual stream on this rank
    sp = sp and t > 1
    f = cfg.ffn_hidden_size // t
    fused = {k: cfg.fused(k, gpu) for k in ("fuse_rms_norm", "fuse_rope", "fuse_swiglu", "fuse_qkv", "fuse_ffn")}
    with p.part("norm"):
        _norm(p, cfg, Ts, h, e, fused["fuse_rms_norm"])
    with p.part("attn"):  # the attention layer (`train.recompute=full_attn`): its input is the norm's output
        _attention(p, cfg, b=b, s=s, t=t, e=e, flash=flash, sp=sp, math_core=math_core, fused=fused, cp=cp)
    _residual(p, Ts, h, gpu)
    with p.part("norm"):
        _norm(p, cfg, Ts, h, e, fused["fuse_rms_norm"])
    if moe is not None:  # the MoE feed-forward (llmtrain/plan/moe.py) in place of the dense one
        with p.part("moe"):
            moe(p, Ts, fused)  # routed over this rank's positions (sequence parallelism: its shard)
    else:
        with p.part("mlp"):
            _mlp(p, cfg, T, Ts, f, fused, sp, cfg.bias)
    _residual(p, Ts, h, gpu)


def _attention(p: _Pass, cfg, *, b, s, t, e, flash, sp: bool, math_core: bool, fused: dict, cp: int):
    """The attention layer on one tp rank: projections, QK-norm, RoPE, the core (part `core_attn`), o_proj."""
    h, d = cfg.hidden_size, cfg.attn_head_dim()
    T = b * s
    Ts = T // t if sp else T
    q, kv = cfg.num_heads * d // t, cfg.kv_heads() * d // t
    nh, nkv = cfg.num_heads // t, cfg.kv_heads() // t
    causal = cfg.family == "decoder"
    o_in = q
    if cfg.is_mla():  # its own projections; the core below on nh/tp heads of d_qk (flash: v padded to d_qk)
        nh, d, o_in = _mla_projections(p, cfg, T, t, e, fused)
        nkv, q = nh, nh * d
    elif fused["fuse_qkv"]:  # one GEMM of the weights concatenated at forward and again in backward (not kept)
        p.op([mem("copy", h * (q + 2 * kv))], [mem("copy", 2 * h * (q + 2 * kv))])  # (module docstring)
        _linear(p, T, h, q + 2 * kv, cfg.bias, "qkv")
        _seq_edge(p, T, q + 2 * kv, sp)
        p.op([view("split")], [mem("copy", T * (q + 2 * kv))])  # the backward concatenates q, k, v grads
    else:
        for name, width in (("q", q), ("k", kv), ("v", kv)):
            _linear(p, T, h, width, cfg.bias, name)
            _seq_edge(p, T, width, sp)
        p.op([], [mem("add", Ts * h), mem("add", Ts * h)])  # the norm output's three gradients summed
    if (not math_core or flash) and not cfg.is_mla():
        p.op([view("reshape")] * 3, [view("reshape")] * 3)
    if cfg.qk_norm:  # layers.HeadNorm on q and k: the unfused RMSNorm over rows of head_dim (weights [d], whole)
        for heads in (nh, nkv):
            _rms_unfused(p, T * heads, d, e)
    if cfg.position == "rope" and not cfg.is_mla():
        _rope(p, T, (q, kv), fused["fuse_rope"])
    with p.part("core_attn"):  # layers.math_attention / flash: what `core_attn` re-runs
        if flash and cp > 1:  # the cp ring's flash calls (s = this rank's 2c positions)
            _ring_flash_core(p, b=b, nh=nh, nkv=nkv, s=s, d=d, dv=o_in // nh, cp=cp, causal=causal)
        elif flash:
            shape = (b * nh, s, d, causal, nkv)
            fl = attention_flops(b * nh, s, d, causal)
            p.op([Kernel("attn_fwd", "flash", shape, flops=fl)], [Kernel("attn_bwd", "flash", shape, flops=2.5 * fl)])
        elif cp > 1:  # the cp ring's math blocks (parallel/context_exchange.py; s = this rank's 2c positions): not
            # layers.math_attention, so a profile's measured math core does not price them
            _ring_math_core(p, bh=b * nh, s=s, d=d, dv=o_in // nh, cp=cp)
        elif math_core:  # the profile's measured composite: layers.math_attention from the reshapes of q, k, v to o's input
            if nkv != nh:  # repeat_interleave of k and v; their gradients summed back
                p.op([mem("copy", T * q)] * 2, [mem("reduce", T * q)] * 2)
            shape = (b * nh, s, d, causal, nh)
            fl = attention_flops(b * nh, s, d, False)  # the math core computes the whole s x s square
            p.op([Kernel("attn_fwd", "math", shape, flops=fl)], [Kernel("attn_bwd", "math", shape, flops=2 * fl)])
        else:  # layers.math_attention
            if nkv != nh:  # repeat_interleave of k and v; their gradients summed back
                p.op([mem("copy", T * q)] * 2, [mem("reduce", T * q)] * 2)
            p.op([mem("copy", T * q)] * 3, [mem("copy", T * q)] * 3)  # transposes to [b, nh, s, d]
            bh, ss = b * nh, b * nh * s * s
            p.op([gemm(s, s, d, bh, "qk")], [gemm(s, d, s, bh, "qk.dgrad_q"), gemm(s, d, s, bh, "qk.dgrad_k")])
            p.op([mem("cast", ss)] if e != 4 else [], [mem("cast", ss)] if e != 4 else [])
            p.op([mem("mul", ss)], [mem("mul", ss)])  # / sqrt(d)
            if causal:  # full, triu, add
                p.op([mem("copy", s * s), mem("copy", s * s), mem("add", ss)], [])
            p.op([mem("softmax", ss)], [mem("softmax_bwd", ss)])
            p.op([mem("cast", ss)] if e != 4 else [], [mem("cast", ss)] if e != 4 else [])
            dv = o_in // nh  # the value head width (MLA's v_head_dim: the math core does not pad v to d)
            p.op([gemm(s, dv, s, bh, "pv")], [gemm(s, s, dv, bh, "pv.dgrad_p"), gemm(dv, s, s, bh, "pv.dgrad_v")])
            p.op([mem("copy", T * q)], [mem("copy", T * q)])  # back to [b, s, nh, d]
    if not math_core or flash:
        p.op([view("reshape")], [view("reshape")])
    _seq_edge(p, T, o_in, sp)
    _linear(p, T, o_in, h, cfg.bias, "o", Ts)


def replayed_flops_share(cfg, parts, s: int) -> float:
    """FLOPs of the forward kernels a recompute of `parts` re-runs over the block's forward FLOPs, for one sequence
    [1, s] on one device with flash attention (an MoE model's MoE block; `block`: 1)."""
    parts = set(parts)
    p = _Pass()
    moe = (lambda q, T, fused: moe_ffn(q, cfg, T, fused, MoEPlan(), 2)) if cfg.moe_num_experts > 0 else None
    _block(p, cfg, 1, s, 1, 2, True, True, moe=moe)
    return sum(k.flops for k in p.replayed(parts)) / sum(k.flops for k in p.fwd)


def block_kernels(cfg, b, s, t, e, gpu, flash, sp: bool = False, math_core: bool = False) -> tuple[list[Kernel], list[Kernel]]:
    """(forward, backward) kernels of one transformer block for a micro-batch [b, s] on one tp rank (`sp`:
    under sequence parallelism; `math_core`: the math attention core as one composite kernel, for a profile that
    measured it, `attention_math`)."""
    p = _Pass()
    _block(p, cfg, b, s, t, e, gpu, flash, sp, math_core)
    return p.fwd, p.backward()


def embedding_kernels(cfg, b, s, t, e) -> tuple[list[Kernel], list[Kernel]]:
    """The word (and learned position) embedding: gather forward; zeroed table gradient + scatter-add backward."""
    h, T = cfg.hidden_size, b * s
    p = _Pass()
    v = cfg.vocab_size // t
    # backward: the table's gradient, zero-filled and scattered into (indexed by the table's elements)
    p.op([mem("embedding", T * h)], [mem("embedding_bwd", v * h)])
    if t > 1:  # VocabParallelEmbedding: mask the ids outside this rank's rows, zero their outputs
        p.op([mem("mul", T)] * 3 + [mem("mul", T * h)], [mem("mul", T * h)])
    if cfg.position == "learned":
        p.op([mem("embedding", s * h)], [mem("embedding_bwd", cfg.max_position_embeddings * h)])
        p.op([mem("add", T * h)], [mem("reduce", T * h)])
    if cfg.family == "encoder":  # ERNIE 3.0: + token-type embedding, then the embedding's norm (encoder.py)
        if cfg.type_vocab_size:
            p.op([mem("embedding", T * h), mem("add", T * h)], [mem("embedding_bwd", cfg.type_vocab_size * h)])
        _norm(p, cfg, T, h, e, False)
    return p.fwd, p.backward()


def head_kernels(cfg, b, s, t, e, gpu, sp: bool = False, ce_core: bool = False) -> tuple[list[Kernel], list[Kernel]]:
    """Final norm (on T/tp positions under sequence parallelism, gathered after it), LM head GEMM (tied:
    x @ tableᵀ), cross entropy over fp32 logits (the cast and the loss: one composite row of the profile,
    `cross_entropy`, over T·V elements; under tp on a CPU the stand-in's ops, `_vocab_parallel_ce`), the
    masked mean."""
    h, T, V = cfg.hidden_size, b * s, cfg.vocab_size // t
    p = _Pass()
    if cfg.family == "encoder":  # the MLM head: norm(gelu(dense(x))) (encoder.MLMTransform), the tied head + bias
        _linear(p, T, h, h, True, "mlm_transform")
        p.op([mem("gelu", T * h)], [mem("gelu_bwd", T * h)])
        _norm(p, cfg, T, h, e, False)
    else:
        _norm(p, cfg, T // t if sp and t > 1 else T, h, e, cfg.fused("fuse_rms_norm", gpu))
    _linear(p, T, h, V, False, "lm_head", tied=cfg.tie_embeddings)
    if cfg.family == "encoder":  # encoder.MLMBias: [T, V/tp] + [V/tp]
        p.op([mem("add", T * V)], [mem("reduce", T * V)])
    cast = [part("cast")] if e != 4 else []
    if t > 1 and not gpu:  # llmtrain's CPU stand-in for fleet's fused c_softmax_with_cross_entropy
        _vocab_parallel_ce(p, T, V, ce_core)
    else:
        p.op([mem("cross_entropy", T * V)] + cast, [mem("cross_entropy_bwd", T * V)] + cast)
    p.op([view("squeeze"), mem("cast", T), mem("mul", T), mem("reduce", T), mem("reduce", T), mem("add", 1),
          mem("mul", 1)], [mem("mul", 1), mem("mul", T), mem("copy", T)])
    return p.fwd, p.backward()


def _vocab_parallel_ce(p: _Pass, T, V, measured: bool = False):
    """Cross entropy over vocabulary-split logits [T, V/tp] as the CPU stand-in computes it
    (llmtrain/paddle_compat/cpu_backend/mp_ops.py `vocab_ce_forward` / `vocab_ce_backward`; on a GPU fleet's
    kernel is fused). `measured` (a profile from `--calibrate`, which times those two functions: the classes
    `vocab_parallel_ce` and its `_bwd`): one composite kernel each way. Otherwise op by op: forward row max,
    x - max, exp, row sum, exp / sum over [T, V] plus [T]-sized label work (its three all-reduces are tp
    communication); backward one_hot, its cast and mask, softmax - one_hot, * dloss, zeros_like and where."""
    n = T * V
    if measured:
        p.op([mem("vocab_parallel_ce", n)], [mem("vocab_parallel_ce_bwd", n)])
        return
    p.op([mem("reduce", n), mem("add", n), mem("mul", n), mem("reduce", n), mem("mul", n)] + [mem("mul", T)] * 6,
         [mem("copy", n), mem("copy", n), mem("mul", n), mem("add", n), mem("mul", n), mem("copy", n), mem("add", n)])


@dataclass
class MicroBatch:
    """Kernels of one micro-batch on one rank of a stage holding `layers` blocks (and the embedding and/or head),
    as segments [(kernels, times repeated)] in execution order."""

    forward_segments: list
    backward_segments: list
    """Including recompute's second forward of each block under full recompute: that segment is
    (kernels, n, forward_prefix), its first `forward_prefix` kernels being the forward run again (dispatched
    at the forward's host cost)."""

    @property
    def forward(self) -> list:
        return [k for ks, n, *_ in self.forward_segments for _ in range(n) for k in ks]

    @property
    def backward(self) -> list:
        return [k for ks, n, *_ in self.backward_segments for _ in range(n) for k in ks]


@dataclass
class MicroBatchSpec:
    """One micro-batch [b, s] on one rank, as `micro_batch_kernels` enumerates it."""

    cfg: object
    """The model (ModelConfig)."""
    b: int
    """Micro-batch size (sequences)."""
    s: int
    """Sequence length (the whole sequence; a cp rank holds s / cp of it)."""
    t: int = 1
    """Tensor-parallel degree."""
    e: int | None = 2
    """Bytes per element of the compute dtype (None: the profile's, in timeline.step_compute)."""
    gpu: bool = True
    """How `model.fuse_* = auto` resolves (on for a GPU)."""
    flash: bool = True
    """Flash attention (else the math core)."""
    recompute: object = "none"
    """none | full (every block's forward again in the backward) | a `llmtrain.models.recompute.Recompute` (of a
    mode name: `llmtrain.plan.recompute.plan_recompute`): the recomputed parts' forward kernels again in the
    backward of the blocks that recompute them."""
    layers: float | None = None
    """Blocks on this rank (None: all)."""
    first: bool = True
    """This rank holds the embedding (the first pipeline stage)."""
    last: bool = True
    """This rank holds the head and the loss (the last pipeline stage)."""
    sp: bool = False
    """Sequence parallelism (tp > 1)."""
    math_core: bool | None = False
    """The math attention core as one composite kernel (a profile that measured it, `attention_math`; None: as
    the profile does, in timeline.step_compute)."""
    ce_core: bool | None = False
    """The CPU stand-in's vocabulary-parallel cross entropy as one composite kernel (`vocab_parallel_ce`; None:
    as the profile does)."""
    first_layer: int = 0
    """Index of this rank's first block (which blocks are MoE: `ModelConfig.is_moe_layer`)."""
    block_ids: tuple | None = None
    """This rank's blocks when they are not `layers` consecutive ones from `first_layer` (DualPipeV's V: a stage's
    down and up chunks, e.g. stage 0 holds the first and the last blocks); None: consecutive."""
    cp: int = 1
    """Context-parallel degree: this rank's blocks see s / cp positions; its attention does 1/cp of the causal
    work (balanced chunks) as the ring's cp blocks (flash: one call per block, `_ring_flash_core`; the math path:
    the ring's blocks, `_ring_math_core`, priced per GEMM even where the profile measured `layers.math_attention`)."""
    moe: object = None
    """llmtrain.plan.moe.MoEPlan (expert parallelism, dropless imbalance); None: its defaults."""


def micro_batch_kernels(spec: MicroBatchSpec) -> MicroBatch:
    """All kernels of one micro-batch's forward and backward on one rank (see MicroBatchSpec); the blocks of an
    MoE model run llmtrain/plan/moe.py's feed-forward from `moe_first_dense_layers` on."""
    cfg, b, t, e, gpu = spec.cfg, spec.b, spec.t, spec.e, spec.gpu
    s = spec.s // max(1, spec.cp)
    L = cfg.num_layers if spec.layers is None else spec.layers
    n = int(round(L))
    plan = spec.moe or MoEPlan()

    rc = spec.recompute if isinstance(spec.recompute, Recompute) else as_recompute(spec.recompute == "full")

    def blocks(moe: bool, parts: frozenset):  # (forward, backward, the forward kernels re-run in the backward)
        # the same lists for the same block and recomputed parts (module docstring)
        key = ("block", id(cfg), b, s, t, e, gpu, spec.flash, spec.sp, spec.math_core, spec.cp, moe,
               tuple(getattr(plan, f.name) for f in dataclasses.fields(plan)) if moe else None)

        def build():
            p = _Pass()
            hook = (lambda q, T, fused: moe_ffn(q, cfg, T, fused, plan, e, t, spec.sp and t > 1)) if moe else None
            _block(p, cfg, b, s, t, e, gpu, spec.flash, spec.sp, spec.math_core, hook, spec.cp)
            return p, {}

        p, lists = _shared(key, cfg, build)
        if parts not in lists:
            lists[parts] = (p.fwd, p.backward(), p.replayed(parts))
        return lists[parts]

    counts = {}  # (MoE block, recomputed parts) -> blocks of that kind on this rank, dense ones first
    ids = spec.block_ids if spec.block_ids is not None else range(spec.first_layer, spec.first_layer + n)
    for i in sorted(ids, key=cfg.is_moe_layer):
        key = (cfg.is_moe_layer(i), rc.at(i))
        counts[key] = counts.get(key, 0) + 1
    kinds = [(blocks(moe, parts), k) for (moe, parts), k in counts.items()]
    fwd, bwd = [], []
    if spec.first:
        ef, eb = _shared(("embedding", id(cfg), b, s, t, e), cfg, lambda: embedding_kernels(cfg, b, s, t, e))
        fwd.append((ef, 1))
    fwd += [(bf, k) for (bf, _, _), k in kinds]
    if spec.last:
        def head():
            hf, hb = head_kernels(cfg, b, s, t, e, gpu, spec.sp, spec.ce_core)
            if cfg.moe_num_experts > 0:  # the balancing losses over the model's MoE layers, added to the loss
                from llmtrain.plan.moe import balancing_loss_kernels

                lf, lb = balancing_loss_kernels(cfg)
                hf, hb = hf + lf, lb + hb
            return hf, hb

        hf, hb = _shared(("head", id(cfg), b, s, t, e, gpu, spec.sp, spec.ce_core), cfg, head)
        fwd.append((hf, 1))
        bwd.append((hb, 1))
    for (_, bb, again), k in reversed(kinds):  # a recomputed part's forward runs again before its backward
        bwd.append((_joined(again, bb), k, len(again)) if again else (bb, k))
    if spec.first:
        bwd.append((eb, 1))
    return MicroBatch(fwd, bwd)


_BLOCKS: dict = {}


def _shared(key: tuple, cfg, build):
    """`build()`'s lists of a piece of the model (forward, backward; a block's pass), one per key (module
    docstring)."""
    hit = _BLOCKS.get(key)
    if hit is None or hit[0] is not cfg:
        hit = _BLOCKS[key] = (cfg, build())  # the model kept alive with its id
    return hit[1]


def _joined(forward: list, backward: list) -> list:
    """forward + backward (a block's backward after its recomputed forward), one list per pair of lists."""
    hit = _JOINED.get((id(forward), id(backward)))
    if hit is None or hit[0] is not forward or hit[1] is not backward:
        hit = _JOINED[(id(forward), id(backward))] = (forward, backward, forward + backward)  # the lists kept alive
    return hit[2]


_JOINED: dict = {}


def optimizer_kernels(grads: list[tuple[int, int]], owned: list[tuple[int, int]], micro_batches: int,
                      clip: bool = True, accumulate_first: bool = False) -> list[Kernel]:
    """Memory-bound kernels of the step after the micro-batches: gradient accumulation over the rank's gradients
    `grads` [(elements, bytes/elem)] for every micro-batch after the first (`accumulate_first`: for every
    micro-batch, the first too: gradients cleared to zero, as Paddle's `clear_grad()` and the H200 twin leave
    them, are added into by each backward; the profiled H200 step shows one `add_` per parameter), and the
    global-norm clip over the tensors it updates (`owned`): a squared norm per tensor, their sum, a scale per
    tensor. (AdamW itself is the profile's fitted `optimizer_seconds`.)"""
    ks = []
    for n, _ in grads:
        acc = mem("add", n, "launch" if accumulate_first else "")  # grad += this micro-batch's grad
        ks += [acc] * max(0, micro_batches - (0 if accumulate_first else 1))
    if clip:
        for n, _ in owned:
            ks.append(mem("reduce", n))  # squared L2 norm of the gradient
        ks += [mem("add", len(owned)), mem("add", 1)]  # add_n of the squares, sqrt, scale
        for n, _ in owned:
            ks.append(mem("mul", n))  # grad *= scale
    return ks
