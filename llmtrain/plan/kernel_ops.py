"""The building blocks of the kernel lists: one eager op's `Kernel`, the GEMM / memory-bound / view constructors,
a pass's forward and backward lists, and the linear and feed-forward layers that both the dense blocks
(`llmtrain/plan/kernels.py`) and the MoE feed-forward (`llmtrain/plan/moe.py`) are made of.

    from llmtrain.plan.kernel_ops import Kernel, gemm, mem
    gemm(4096, 11008, 4096)          # Kernel("gemm", "gemm", (4096, 11008, 4096, 1), flops=2·m·n·k)
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    kind: str
    """gemm | attn_fwd | attn_bwd | mem | view (a view: host only, no device kernel; the profile's
    `host.view_op_s`) | part (a dispatched op whose device time is inside the composite memory-bound row listed
    before it: the pass's per-op host time, no device time of its own)"""
    op: str
    """Op class of a memory-bound kernel (a class of the profile's memory_bound table) or a name."""
    shape: tuple = ()
    """gemm: (m, n, k, batch); attn: (batch·heads, seq, head_dim, causal, kv_heads[, query rows: a cp ring block's,
    when they are not seq; priced at its key length seq]); mem: () or (a second op
    class, w): priced (1 - w) x its own class + w x the second (between two measured conditions)."""
    numel: float = 0.0
    """Memory-bound kernels: elements of one input, the table's index (fp32 statistics and the like are
    folded into the op's measured time)."""
    flops: float = 0.0
    layout: str = "nn"
    """gemm: which operand is read transposed, as Paddle's matmul is called: "nn" (A[m, k] @ B[k, n]), "nt"
    (B stored [n, k]: a linear's input gradient dY @ Wᵀ, the tied head's logits x @ tableᵀ) or "tn" (A stored
    [k, m]: a weight gradient Xᵀ @ dY). A profile with per-layout GEMM tables prices each by its own."""
    host: str = ""
    """"" (the pass's per-op host time) or "launch": a kernel the autograd engine launches from C++ without a node
    of its own (summing a tensor's gradients, adding into a parameter's gradient buffer): the bare launch cost
    (the profile's `host.launch_op_s`)."""
    of: str = ""
    """The model op a generic kernel stands for, where its class does not say it (the unfused RMSNorm's rsqrt step:
    "rmsnorm"); not used in pricing (checked against a trace: tests/plan/test_op_sequence.py)."""


def gemm(m, n, k, batch=1, op="gemm", layout="nn") -> Kernel:
    return Kernel("gemm", op, (int(m), int(n), int(k), int(batch)), flops=2.0 * m * n * k * batch, layout=layout)


def mem(op: str, numel: float, host: str = "") -> Kernel:
    return Kernel("mem", op, numel=float(numel), host=host)


def view(op: str = "view") -> Kernel:
    return Kernel("view", op)


def part(op: str) -> Kernel:
    return Kernel("part", op)


def attention_flops(bh: int, s: int, d: int, causal: bool) -> float:
    """Forward FLOPs of softmax(q kᵀ) v for bh heads: 4·s²·d per head, halved when causal (flash skips the
    masked half); the backward is 2.5x (five GEMM-sized products instead of two)."""
    return 4.0 * bh * s * s * d * (0.5 if causal else 1.0)


class _Pass:
    """Forward kernels in order and the backward kernels each op adds (replayed in reverse); each forward kernel
    carries the names of the block parts it is inside (`part`: the recompute parts of `llmtrain.models.recompute`),
    so that a recompute of some parts re-runs exactly their kernels (`replayed`)."""

    def __init__(self):
        self.fwd: list[Kernel] = []
        self.bwd: list[list[Kernel]] = []
        self.tags: list[tuple] = []  # per forward kernel: the parts it is inside
        self._within: tuple = ()

    def op(self, fwd: list[Kernel], bwd: list[Kernel] = ()):
        self.fwd += fwd
        self.bwd.append(list(bwd))
        self.tags += [self._within] * len(fwd)

    @contextmanager
    def part(self, name: str):
        """The ops added inside are part `name` of the block (nested parts keep the outer names)."""
        outer = self._within
        self._within = outer + (name,)
        try:
            yield
        finally:
            self._within = outer

    def replayed(self, parts) -> list[Kernel]:
        """The forward kernels a recompute of `parts` runs again in the backward, in forward order (not those inside
        part `once`: the MoE router's top-k, which a recomputed forward takes from its first run)."""
        parts = set(parts)
        return [k for k, within in zip(self.fwd, self.tags)
                if ("block" in parts or parts.intersection(within)) and "once" not in within]

    def backward(self) -> list[Kernel]:
        return [k for group in reversed(self.bwd) for k in group]


def _linear(p: _Pass, T, K, N, bias: bool, name: str, bias_T=None, tied: bool = False):
    """x [T, K] @ W [K, N] (+ b); `bias_T`: the rows the bias is added to when fewer than T (a row-parallel
    linear under sequence parallelism adds it after the reduce-scatter, to T/tp rows). Layouts as Paddle's
    matmul_grad runs them: dX = dY @ Wᵀ ("nt"), dW = Xᵀ @ dY ("tn"). `tied`: the weight is the word table
    [N, K] (x @ tableᵀ, "nt"): dX = dY @ table ("nn"), d(table) [N, K] = dYᵀ @ X ("tn")."""
    bt = T if bias_T is None else bias_T
    if tied:
        fwd = [gemm(T, N, K, op=f"{name}.fwd", layout="nt")]
        bwd = [gemm(T, K, N, op=f"{name}.dgrad"), gemm(N, K, T, op=f"{name}.wgrad", layout="tn")]
    else:
        fwd = [gemm(T, N, K, op=f"{name}.fwd")] + ([mem("add", bt * N)] if bias else [])
        bwd = [gemm(T, K, N, op=f"{name}.dgrad", layout="nt"), gemm(K, N, T, op=f"{name}.wgrad", layout="tn")]
    if bias:
        bwd.append(mem("reduce", bt * N))  # bias gradient: sum over tokens
    p.op(fwd, bwd)


def _seq_edge(p: _Pass, T, width, sp: bool):
    """Sequence parallelism's transpose between fleet's [s, b, ...] and the model's [b, s, ...] (a copy forward and
    backward) at a column linear's output or a row linear's input of `width` columns (llmtrain/parallel/sequence.py)."""
    if sp:
        p.op([mem("copy", T * width)], [mem("copy", T * width)])


def _mlp(p: _Pass, cfg, T, Ts, f, fused: dict, sp: bool, bias: bool):
    """The feed-forward x [T, h] -> [T, h] of inner width f (on this tp rank): gate|up (or up), the activation,
    down; `Ts`: the rows the down projection's bias is added to (sequence parallelism)."""
    h = cfg.hidden_size
    if cfg.activation == "swiglu":
        if fused["fuse_ffn"]:  # concatenated at forward and again in backward, not kept (kernels.py's docstring)
            p.op([mem("copy", h * 2 * f)], [mem("copy", 2 * h * 2 * f)])
            _linear(p, T, h, 2 * f, bias, "gate_up")
            _seq_edge(p, T, 2 * f, sp)
            p.op([view("split")], [mem("copy", 2 * T * f)])
        else:
            for name in ("gate", "up"):
                _linear(p, T, h, f, bias, name)
                _seq_edge(p, T, f, sp)
            p.op([], [mem("add", Ts * h)])
        # silu(gate) * up: one kernel fused (`fuse_swiglu`), two unfused (the profile's row is the pair)
        host = [] if fused["fuse_swiglu"] else [part("mul")]
        p.op([mem("swiglu", T * f)] + host, [mem("swiglu_bwd", T * f)] + host + host)
    else:
        _linear(p, T, h, f, bias, "up")
        _seq_edge(p, T, f, sp)
        p.op([mem("gelu", T * f)], [mem("gelu_bwd", T * f)])
    _seq_edge(p, T, f, sp)
    _linear(p, T, f, h, bias, "down", Ts)
