"""The kernels of one micro-batch's forward and backward, as llmtrain runs them, for the operator-level cost model.

    python -m llmtrain.plan model=llama-1b data.seq_len=2048 plan.devices=1 plan.device=h200 +parallel=single
    ks = micro_batch_kernels(model_cfg, b=4, s=2048, tp=1, gpu=True, flash=True, recompute="none")

Each `Kernel` is one eager op: one host dispatch and one device kernel. The list follows
`llmtrain/models/decoder.py` and `layers.py` block by block with the `model.fuse_*` paths this run
takes (`ModelConfig.fused`, `auto` = on for GPU), shapes after tensor-parallel splitting (column
linears hold out/tp features, row linears in/tp):

- GEMMs (`gemm`, C[m, n] = A[m, k] @ B[k, n]): a linear layer x [T, K] @ W [K, N] (T = b·s tokens) is
  the forward (T, N, K), the input gradient (T, K, N) and the weight gradient (K, N, T); fused
  projections (`fuse_qkv`, `fuse_ffn`) are one GEMM of the concatenated width plus the weight concat
  (a copy, forward and backward); the LM head (untied: [h, V/tp]; tied: x @ tableᵀ) likewise;
- the attention core (`attn`): flash attention by (batch·heads, seq, head dim, causal), forward and
  backward; the math path (CPU, `attention=math`) as its batched GEMMs (q·kᵀ, probs·v and their
  gradients) plus the transposes, the fp32 cast, the causal mask add, the softmax and its backward;
- memory-bound ops (`mem`) by the bytes they read and write, per op class (norms, RoPE, activations,
  residual adds, casts, the embedding gather and its scatter-add gradient, the logits' fp32 cast,
  softmax cross entropy and its gradient); the models have no dropout;
- `view` ops (reshape, split, chunk views): host time only.

Under full recompute every block's forward runs a second time inside the backward. The optimizer step
(`optimizer_kernels`) is counted apart: gradient accumulation adds for micro-batches after the first,
the global-norm clip (one squared-norm kernel per tensor, a sum, one scale per tensor) and multi-precision
AdamW (one kernel per tensor reading the gradient, the fp32 master, both moments and writing them and
the low-precision copy).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    kind: str
    """gemm | attn_fwd | attn_bwd | mem | view"""
    op: str
    """Op class of a memory-bound kernel (a row class of the profile's memory_bound table) or a name."""
    shape: tuple = ()
    """gemm: (m, n, k, batch); attn: (batch·heads, seq, head_dim, causal)."""
    bytes: float = 0.0
    """Bytes read + written (memory-bound kernels)."""
    flops: float = 0.0


def gemm(m, n, k, batch=1, op="gemm") -> Kernel:
    return Kernel("gemm", op, (int(m), int(n), int(k), int(batch)), flops=2.0 * m * n * k * batch)


def mem(op: str, nbytes: float) -> Kernel:
    return Kernel("mem", op, bytes=float(nbytes))


def view(op: str = "view") -> Kernel:
    return Kernel("view", op)


def attention_flops(bh: int, s: int, d: int, causal: bool) -> float:
    """Forward FLOPs of softmax(q kᵀ) v for bh heads: 4·s²·d per head, halved when causal (flash skips the
    masked half); the backward is 2.5x (five GEMM-sized products instead of two)."""
    return 4.0 * bh * s * s * d * (0.5 if causal else 1.0)


class _Pass:
    """Forward kernels in order and the backward kernels each op adds (replayed in reverse)."""

    def __init__(self):
        self.fwd: list[Kernel] = []
        self.bwd: list[list[Kernel]] = []

    def op(self, fwd: list[Kernel], bwd: list[Kernel] = ()):
        self.fwd += fwd
        self.bwd.append(list(bwd))

    def backward(self) -> list[Kernel]:
        return [k for group in reversed(self.bwd) for k in group]


def _linear(p: _Pass, T, K, N, bias: bool, e: int, name: str):
    """x [T, K] @ W [K, N] (+ b)."""
    fwd = [gemm(T, N, K, op=f"{name}.fwd")] + ([mem("add", (2 * T * N + N) * e)] if bias else [])
    bwd = [gemm(T, K, N, op=f"{name}.dgrad"), gemm(K, N, T, op=f"{name}.wgrad")]
    if bias:
        bwd.append(mem("reduce", T * N * e + N * e))  # bias gradient: sum over tokens
    p.op(fwd, bwd)


def _norm(p: _Pass, cfg, T, h, e, fused_rms: bool):
    if cfg.norm == "layernorm":
        p.op([mem("layernorm", 2 * T * h * e + 8 * T)], [mem("layernorm_bwd", 3 * T * h * e + 8 * T)])
    elif fused_rms:
        p.op([mem("rmsnorm", 2 * T * h * e + 4 * T)], [mem("rmsnorm_bwd", 3 * T * h * e + 4 * T)])
    else:  # x.astype(fp32); pow; mean; +eps, rsqrt; x32 * r; astype; * weight (layers.RMSNorm)
        f = 4
        p.op([mem("cast", T * h * (e + f))], [mem("cast", T * h * (e + f))] if e != f else [])
        p.op([mem("mul", 2 * T * h * f)], [mem("mul", 3 * T * h * f)])
        p.op([mem("reduce", T * h * f + T * f)], [mem("add", T * h * f + T * f)])
        p.op([mem("add", 2 * T * f)], [mem("add", 2 * T * f)])
        p.op([mem("mul", 2 * T * f)], [mem("mul", 3 * T * f)])
        p.op([mem("mul", 2 * T * h * f + T * f)], [mem("mul", 3 * T * h * f), mem("reduce", 2 * T * h * f)])
        p.op([mem("cast", T * h * (e + f))], [mem("cast", T * h * (e + f))] if e != f else [])
        p.op([mem("mul", 2 * T * h * e + h * e)], [mem("mul", 3 * T * h * e), mem("reduce", 2 * T * h * e)])


def _residual(p: _Pass, T, h, e):
    p.op([mem("add", 3 * T * h * e)], [])  # the gradient passes through both inputs (no kernel)


def _block(p: _Pass, cfg, b, s, t, e, gpu, flash):
    h, d = cfg.hidden_size, cfg.head_dim()
    T = b * s
    q, kv = cfg.num_heads * d // t, cfg.kv_heads() * d // t
    nh, nkv = cfg.num_heads // t, cfg.kv_heads() // t
    f = cfg.ffn_hidden_size // t
    fused = {k: cfg.fused(k, gpu) for k in ("fuse_rms_norm", "fuse_rope", "fuse_swiglu", "fuse_qkv", "fuse_ffn")}
    swiglu = cfg.activation == "swiglu"
    causal = cfg.family == "decoder"
    _norm(p, cfg, T, h, e, fused["fuse_rms_norm"])
    # q, k, v projections
    if fused["fuse_qkv"]:
        w = h * (q + 2 * kv)
        p.op([mem("copy", 2 * w * e)], [mem("copy", 2 * w * e)])  # concat of the weights; split of their grad
        _linear(p, T, h, q + 2 * kv, cfg.bias, e, "qkv")
        p.op([view("split")] * 1, [mem("copy", 2 * T * (q + 2 * kv) * e)])  # backward concatenates the grads
    else:
        for name, width in (("q", q), ("k", kv), ("v", kv)):
            _linear(p, T, h, width, cfg.bias, e, name)
        p.op([], [mem("add", 3 * T * h * e), mem("add", 3 * T * h * e)])  # the norm output's three grads summed
    p.op([view("reshape")] * 3, [view("reshape")] * 3)
    if cfg.position == "rope":
        if fused["fuse_rope"]:
            p.op([mem("rope", 2 * T * (q + kv) * e + 2 * s * d * e)], [mem("rope_bwd", 2 * T * (q + kv) * e + 2 * s * d * e)])
        else:  # per tensor: chunk, -x2, concat, x*cos, rotated*sin, add (layers.Rotary.apply)
            for width in (q, kv):
                n = T * width * e
                p.op([view("chunk"), mem("mul", n), mem("copy", 2 * n), mem("mul", 2 * n), mem("mul", 2 * n),
                      mem("add", 3 * n)],
                     [mem("add", 3 * n), mem("mul", 2 * n), mem("mul", 2 * n), mem("copy", 2 * n), mem("mul", n),
                      mem("copy", 2 * n), mem("add", 3 * n)])
    if flash:
        shape = (b * nh, s, d, causal, nkv)
        fl = attention_flops(b * nh, s, d, causal)
        p.op([Kernel("attn_fwd", "flash", shape, flops=fl)], [Kernel("attn_bwd", "flash", shape, flops=2.5 * fl)])
    else:  # layers.math_attention
        if nkv != nh:
            p.op([mem("copy", 2 * T * (kv + q) * e)] * 2, [mem("reduce", T * (q + kv) * e)] * 2)
        p.op([mem("copy", 2 * T * q * e)] * 3, [mem("copy", 2 * T * q * e)] * 3)  # transposes to [b, nh, s, d]
        bh = b * nh
        p.op([gemm(s, s, d, bh, "qk")], [gemm(s, d, s, bh, "qk.dgrad_q"), gemm(s, d, s, bh, "qk.dgrad_k")])
        ss = bh * s * s
        p.op([mem("cast", ss * (e + 4))] if e != 4 else [], [mem("cast", ss * (e + 4))] if e != 4 else [])
        p.op([mem("mul", 2 * ss * 4)], [mem("mul", 2 * ss * 4)])  # / sqrt(d)
        if causal:
            p.op([mem("copy", s * s * 4), mem("copy", 2 * s * s * 4), mem("add", 2 * ss * 4 + s * s * 4)], [])
        p.op([mem("softmax", 2 * ss * 4)], [mem("softmax_bwd", 3 * ss * 4)])
        p.op([mem("cast", ss * (e + 4))] if e != 4 else [], [mem("cast", ss * (e + 4))] if e != 4 else [])
        p.op([gemm(s, d, s, bh, "pv")], [gemm(s, s, d, bh, "pv.dgrad_p"), gemm(s, d, s, bh, "pv.dgrad_v")])
        p.op([mem("copy", 2 * T * q * e)], [mem("copy", 2 * T * q * e)])  # back to [b, s, nh, d]
    p.op([view("reshape")], [view("reshape")])
    _linear(p, T, q, h, cfg.bias, e, "o")
    _residual(p, T, h, e)
    _norm(p, cfg, T, h, e, fused["fuse_rms_norm"])
    if swiglu:
        if fused["fuse_ffn"]:
            w = h * 2 * f
            p.op([mem("copy", 2 * w * e)], [mem("copy", 2 * w * e)])
            _linear(p, T, h, 2 * f, cfg.bias, e, "gate_up")
            p.op([view("split")], [mem("copy", 4 * T * f * e)])
        else:
            _linear(p, T, h, f, cfg.bias, e, "gate")
            _linear(p, T, h, f, cfg.bias, e, "up")
            p.op([], [mem("add", 3 * T * h * e)])
        if fused["fuse_swiglu"]:
            p.op([mem("swiglu", 3 * T * f * e)], [mem("swiglu_bwd", 5 * T * f * e)])
        else:  # silu(gate) * up
            p.op([mem("silu", 2 * T * f * e)], [mem("silu_bwd", 3 * T * f * e)])
            p.op([mem("mul", 3 * T * f * e)], [mem("mul", 3 * T * f * e), mem("mul", 3 * T * f * e)])
    else:
        _linear(p, T, h, f, cfg.bias, e, "up")
        p.op([mem("gelu", 2 * T * f * e)], [mem("gelu_bwd", 3 * T * f * e)])
    _linear(p, T, f, h, cfg.bias, e, "down")
    _residual(p, T, h, e)


def block_kernels(cfg, b, s, t, e, gpu, flash) -> tuple[list[Kernel], list[Kernel]]:
    """(forward, backward) kernels of one transformer block for a micro-batch [b, s] on one tp rank."""
    p = _Pass()
    _block(p, cfg, b, s, t, e, gpu, flash)
    return p.fwd, p.backward()


def embedding_kernels(cfg, b, s, t, e) -> tuple[list[Kernel], list[Kernel]]:
    """The word (and learned position) embedding: gather forward; zeroed table gradient + scatter-add backward."""
    h, T = cfg.hidden_size, b * s
    p = _Pass()
    v = cfg.vocab_size // t
    p.op([mem("embedding", T * h * e + T * 8)], [mem("copy", v * h * e), mem("embedding_bwd", 2 * T * h * e + T * 8)])
    if t > 1:  # VocabParallelEmbedding: mask the ids outside this rank's rows, zero their outputs
        p.op([mem("mul", 3 * T * 8)] * 3 + [mem("mul", 3 * T * h * e)], [mem("mul", 3 * T * h * e)])
    if cfg.position == "learned":
        p.op([mem("embedding", s * h * e + s * 8)],
             [mem("copy", cfg.max_position_embeddings * h * e), mem("embedding_bwd", 2 * s * h * e)])
        p.op([mem("add", (2 * T * h + s * h) * e)], [mem("reduce", T * h * e + s * h * e)])
    return p.fwd, p.backward()


def head_kernels(cfg, b, s, t, e, gpu) -> tuple[list[Kernel], list[Kernel]]:
    """Final norm, LM head GEMM (tied: x @ tableᵀ), the logits' fp32 cast and softmax cross entropy, the masked mean."""
    h, T, V = cfg.hidden_size, b * s, cfg.vocab_size // t
    p = _Pass()
    _norm(p, cfg, T, h, e, cfg.fused("fuse_rms_norm", gpu))
    _linear(p, T, h, V, False, e, "lm_head")
    if e != 4:
        p.op([mem("cast", T * V * (e + 4))], [mem("cast", T * V * (e + 4))])
    # softmax_with_cross_entropy keeps the fp32 softmax; its gradient reads it and writes the logits' gradient
    p.op([mem("cross_entropy", 2 * T * V * 4 + T * 12)], [mem("cross_entropy_bwd", 2 * T * V * 4 + T * 12)])
    p.op([view("squeeze"), mem("cast", 8 * T), mem("mul", 12 * T), mem("reduce", 4 * T), mem("reduce", 4 * T),
          mem("add", 8), mem("mul", 12)], [mem("mul", 12), mem("mul", 12 * T), mem("copy", 8 * T)])
    return p.fwd, p.backward()


@dataclass
class MicroBatch:
    """Kernels of one micro-batch on one rank of a stage holding `layers` blocks (and the embedding and/or head)."""

    forward: list
    backward: list
    """Including recompute's second forward of each block under full recompute."""


def micro_batch_kernels(cfg, b: int, s: int, t: int, e: int, gpu: bool, flash: bool, recompute: str = "none",
                        layers: float | None = None, first: bool = True, last: bool = True) -> MicroBatch:
    """All kernels of one micro-batch's forward and backward on one rank (`layers` blocks; default all)."""
    L = cfg.num_layers if layers is None else layers
    bf, bb = block_kernels(cfg, b, s, t, e, gpu, flash)
    fwd, bwd = [], []
    if first:
        ef, eb = embedding_kernels(cfg, b, s, t, e)
        fwd += ef
    n = int(round(L))
    fwd += bf * n
    if last:
        hf, hb = head_kernels(cfg, b, s, t, e, gpu)
        fwd += hf
        bwd += hb
    per_block = (bf + bb) if recompute == "full" else bb  # recompute: the block's forward again, then its backward
    bwd += per_block * n
    if first:
        bwd += eb
    return MicroBatch(fwd, bwd)


def optimizer_kernels(grads: list[tuple[int, int]], owned: list[tuple[int, int]], micro_batches: int,
                      clip: bool = True) -> list[Kernel]:
    """Memory-bound kernels of the step after the micro-batches: gradient accumulation over the rank's gradients
    `grads` [(elements, bytes/elem)] for every micro-batch after the first, and the global-norm clip over the
    tensors it updates (`owned`): a squared norm per tensor, their sum, a scale per tensor. (AdamW itself is
    the profile's fitted `optimizer_seconds`.)"""
    ks = []
    for n, pb in grads:
        ks += [mem("add", 3 * n * pb)] * max(0, micro_batches - 1)  # grad += this micro-batch's grad
    if clip:
        for n, pb in owned:
            ks.append(mem("reduce", n * pb + 4))  # squared L2 norm of the gradient
        ks += [mem("add", 8 * len(owned)), mem("add", 8)]  # add_n of the squares, sqrt, scale
        for n, pb in owned:
            ks.append(mem("mul", 2 * n * pb + 4))  # grad *= scale
    return ks
