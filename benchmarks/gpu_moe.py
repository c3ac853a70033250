"""PyTorch twin of llmtrain's Mixture-of-Experts feed-forward, the instrument of `benchmarks/gpu_tables.py`.

    python benchmarks/gpu_tables.py --out /tmp/h200 --only moe_steps      # where PyTorch and a CUDA GPU are present
    python benchmarks/gpu_tables.py --out /tmp/smoke --smoke              # tiny shapes, on CPU (logic check)

`MoEDecoder` is `gpu_model.Decoder` with every block's MLP replaced by the MoE feed-forward of
`llmtrain/models/moe.py` (router, `route()`, routed experts, shared expert, balancing losses), the routed
experts run three ways (`MoE.impl`):

- `slots`: llmtrain's `Experts.forward` as `llmtrain/models/experts.py` writes it (the team plan's formulation with
  the MOE-FORMULATION change of step 5), op for op: choices in slot-major order (idx = index.T.reshape([k T]));
  one_hot(idx) with dropped rows zeroed; pos = (cumsum(onehot, 0) * onehot).sum(-1) - 1; C = ceil(factor T k / E)
  (capacity) or int(counts.max()) (dropless: the one host read per layer, recorded in `CAPACITIES`);
  slot = idx C + pos, dropped -> E C; source = scatter(full([E C + 1], T), slot, tile(arange(T), k))[:E C] (the
  token of each buffer row, T if empty); buffer = gather(concat(x, zeros([1, h])), source) -> [E, C, h] (its
  backward one index_add of the buffer's gradient into [T + 1, h]); [E, C, h] bmm [E, h, f] for gate and for up
  (two bmm on the stacked weights, as `Experts.ffn`: no concatenation), silu(g) * u, bmm [E, f, h]; combine in token-major order: the rows
  at row = slot (dropped: row 0, weight 0) laid out [T, k], gathered [T, k, h], times the weights [T, k, 1],
  summed over k. Variants for the record (`MoE.dispatch` "index_add": the plan before that change, x[tok]
  index_added into the buffer at `slot`);
- `MoE.scan`: how `cumsum(onehot, 0)` runs. "paddle" (the default) writes out Paddle's GPU cumsum kernel for an
  axis that is not the last (paddle/phi/kernels/gpu/cum_kernel.cu: a transpose to [E, k T], a block scan along
  the contiguous axis, a transpose back); "torch" is PyTorch's own cumsum over axis 0 of [k T, E], a different
  algorithm that runs ~0.2-0.4 us per row on the H200 (2.7 ms at k T = 16384): not what llmtrain runs;
- `loop`: main's `Experts.forward` before that change: per expert `nonzero(index == j)` (a device-to-host sync
  each), gather, three matmuls, weight, `index_add` into [T, h];
- `grouped`: a grouped-GEMM reference (Megatron's/torchtitan's permute + grouped GEMM): choices stably sorted by
  expert, rows gathered, `torch._grouped_mm` over device-side int32 offsets (weights passed as transposed
  [E, out, in] views), weighted, `index_add` back; no host sync. Dropless only (its natural mode).

Gathers are `index_select` and scatters `index_add` (Paddle's gather / its gradient: an atomic add), not
advanced indexing (whose PyTorch backward sorts). The router mirrors `MoEFeedForward.routing` under Paddle's O2
(`MoE.router_dtype`, `model.moe_router_dtype`): "fp32" (llmtrain's default) x cast to fp32 and an fp32 GEMM
[T, h] x [h, E] with an fp32 weight, on TF32 tensor cores as Paddle runs fp32 GEMMs by default (the twin sets
`torch.backends.cuda.matmul.allow_tf32`; it has no other fp32 GEMM); "amp" a bf16 GEMM and its logits cast to fp32.
Routing statistics (counts, dropped) stay on the device. The balancing losses enter the loss
as `MoELMLoss` adds them: coef_aux * mean over layers of E sum_i f_i P_i + coef_z * mean of z (z computed always).
Where this differs from llmtrain on Paddle: attention is the twin's (no MLA for the DeepSeek shape: multi-head
attention of the same width), and PyTorch's kernels are not Paddle's.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from gpu_model import Arch, Decoder


@dataclass
class MoE:
    """One MoE feed-forward (every block of the twin), with the fields of moe_steps.json's `moe`."""

    experts: int
    top_k: int
    ffn: int  # inner width of one routed expert
    shared_ffn: int = 0  # width of the shared expert(s) as one FFN (0: none)
    capacity_factor: float = 0.0  # 0: dropless
    impl: str = "slots"  # slots | loop | grouped
    scan: str = "paddle"  # cumsum over axis 0 of [k T, E]: Paddle's GPU kernel written out (paddle) or PyTorch's (torch)
    dispatch: str = "gather"  # slots: gather through the inverse map (llmtrain) | index_add (the plan before a593f33)
    norm_topk: bool = True
    router_dtype: str = "fp32"  # fp32 (TF32 GEMM, fp32 weight) | amp (bf16 GEMM): model.moe_router_dtype
    aux_coef: float = 0.01
    z_coef: float = 0.0

    def as_dict(self):
        return asdict(self)

    def capacity(self, tokens: int) -> int:
        return int(math.ceil(self.capacity_factor * tokens * self.top_k / self.experts))


def cumsum0(onehot, moe: MoE):
    """cumsum over axis 0 of [n, E] as `moe.scan` says (module docstring): Paddle's kernel written out (transpose,
    scan along the contiguous axis, transpose back) or PyTorch's own."""
    if moe.scan == "paddle":
        return torch.cumsum(onehot.t().contiguous(), 1).t().contiguous()
    return torch.cumsum(onehot, 0)


def route(logits, moe: MoE):
    """llmtrain.models.router.route (softmax router): (index [T, k] (-1 dropped), weight [T, k] fp32, probs [T, E],
    counts [E] fp32, dropped [] fp32)."""
    T, E = logits.shape
    k = moe.top_k
    scores = F.softmax(logits, dim=-1)  # [T, E] fp32
    _, index = torch.topk(scores.detach(), k, dim=-1)  # [T, k]
    weight = torch.gather(scores, -1, index)  # take_along_axis
    if moe.norm_topk:
        weight = weight / weight.sum(-1, keepdim=True)
    with torch.no_grad():
        onehot = F.one_hot(index, E)  # [T, k, E] int64
        counts = onehot.sum((0, 1)).float()  # [E]
        dropped = torch.zeros((), device=logits.device)
        if moe.capacity_factor > 0:
            ordered = onehot.transpose(0, 1).reshape(k * T, E)  # slot-major
            place = (cumsum0(ordered, moe) * ordered).sum(-1)  # 1-based place in its expert's queue
            keep = (place <= moe.capacity(T)).reshape(k, T).t()  # [T, k]
            dropped = (~keep).float().sum()
            index = torch.where(keep, index, torch.full_like(index, -1))
    if moe.capacity_factor > 0:
        weight = weight * keep.to(weight.dtype)
    return index, weight, scores, counts, dropped


def experts_slots(moe: MoE, x, index, weight, counts, w_gate, w_up, w_down):
    """llmtrain's formulation (module docstring). x [T, h]; index/weight [T, k]; w_gate/w_up [E, h, f],
    w_down [E, f, h] -> [T, h]. Dropless reads int(counts.max()) once (the layer's one host sync)."""
    T, h = x.shape
    E, k = moe.experts, moe.top_k
    idx = index.t().reshape(-1)  # [k T] slot-major
    keep = idx >= 0
    onehot = F.one_hot(idx.clamp(min=0), E) * keep[:, None]  # [k T, E], dropped rows zero
    pos = (cumsum0(onehot, moe) * onehot).sum(-1) - 1  # [k T] place in its expert's queue
    C = moe.capacity(T) if moe.capacity_factor > 0 else int(counts.max())  # dropless: the host read
    CAPACITIES.append(C)
    slot = torch.where(keep, idx * C + pos, torch.full_like(idx, E * C))  # [k T]; dropped -> trash row E C
    tok = torch.arange(T, device=x.device).repeat(k)  # [k T] token of each choice
    if moe.dispatch == "index_add":  # the plan before a593f33: x[tok] index_added at `slot`
        buf = torch.zeros(E * C + 1, h, device=x.device, dtype=x.dtype)
        xe = buf.index_add(0, slot, x.index_select(0, tok))[: E * C].view(E, C, h)
    else:  # the inverse map: the token of each buffer row (T: empty), gathered from x with a zero row appended
        source = torch.full((E * C + 1,), T, device=x.device, dtype=torch.int64).scatter_(0, slot, tok)[: E * C]
        padded = torch.cat([x, x.new_zeros(1, h)])  # [T + 1, h]
        xe = padded.index_select(0, source).view(E, C, h)  # [E, C, h] expert-major; backward: index_add into [T+1, h]
    g, u = torch.bmm(xe, w_gate), torch.bmm(xe, w_up)  # [E, C, f] each: two bmm on the stacked weights (Experts.ffn)
    ye = torch.bmm(F.silu(g) * u, w_down).view(E * C, h)  # [E C, h]
    row = torch.where(keep, slot, torch.zeros_like(slot)).view(k, T).t().reshape(-1)  # [T k] token-major; dropped 0
    rows = ye.index_select(0, row).view(T, k, h)  # [T, k, h]
    return (rows * weight.to(x.dtype)[:, :, None]).sum(1)  # combine: [T, h]


def experts_loop(moe: MoE, x, index, weight, counts, w_gate, w_up, w_down):
    """main's Experts.forward: per expert nonzero + gather + matmuls + index_add (a host sync per expert)."""
    T, k = index.shape
    flat_index, flat_weight = index.reshape(-1), weight.reshape(-1)  # [T k] token-major
    token = torch.arange(T, device=x.device).repeat_interleave(k)
    out = torch.zeros_like(x)
    for j in range(moe.experts):
        pos = torch.nonzero(flat_index == j).flatten()
        if pos.shape[0] == 0:
            continue
        rows = token.index_select(0, pos)
        xe = x.index_select(0, rows)  # [n, h]
        inner = F.silu(xe @ w_gate[j]) * (xe @ w_up[j])
        ye = (inner @ w_down[j]) * flat_weight.index_select(0, pos).to(x.dtype)[:, None]
        out = out.index_add(0, rows, ye)
    return out


def experts_grouped(moe: MoE, x, index, weight, counts, w_gate, w_up, w_down):
    """Grouped-GEMM reference (dropless): sort choices by expert, torch._grouped_mm over device offsets; the
    weights are stored transposed ([E, f, h], [E, f, h], [E, h, f]: `MoEDecoder` for impl grouped) and passed as
    column-major views, no copy but the gate|up concatenation (`slots` and `loop` run gate and up apart)."""
    T, k = index.shape
    flat = index.reshape(-1)  # [T k]
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=moe.experts), 0).to(torch.int32)  # [E]
    token = torch.arange(T, device=x.device).repeat_interleave(k).index_select(0, order)
    xs = x.index_select(0, token)  # [T k, h] sorted by expert
    wgu = torch.cat([w_gate, w_up], dim=1).transpose(-2, -1)  # stored [E, 2f, h]: a column-major [E, h, 2f] view
    g, u = torch._grouped_mm(xs, wgu, offs=offs).chunk(2, dim=-1)  # [T k, f] each
    ys = torch._grouped_mm(F.silu(g) * u, w_down.transpose(-2, -1), offs=offs)  # w_down stored [E, h, f]
    ys = ys * weight.reshape(-1).index_select(0, order).to(x.dtype)[:, None]
    return torch.zeros_like(x).index_add(0, token, ys)


CAPACITIES: list = []
"""Every C the slot formulation used since the list was last cleared (the dropless host reads, recorded)."""

IMPLS = {"slots": experts_slots, "loop": experts_loop, "grouped": experts_grouped}


class MoEDecoder(Decoder):
    """gpu_model.Decoder with the MoE feed-forward in every block; `a.ffn` is the shared expert's width (its
    weights are the dense MLP's), or, without a shared expert, the dense MLP weights are dropped."""

    def __init__(self, a: Arch, moe: MoE, device, dtype=torch.bfloat16, recompute: bool = False, generator=None):
        super().__init__(a, device, dtype, recompute, generator)
        if moe.impl == "grouped" and moe.capacity_factor > 0:
            raise ValueError("the grouped-GEMM reference is dropless (capacity_factor 0)")
        self.moe = moe
        kw = dict(device=device, dtype=dtype, generator=generator)
        E, h, f = moe.experts, a.hidden, moe.ffn
        for b in self.blocks:
            if not moe.shared_ffn:
                del b.wup, b.wgate, b.wdown
            router_kw = dict(kw, dtype=torch.float32) if moe.router_dtype == "fp32" else kw
            b.w_router = torch.nn.Parameter(torch.randn(h, E, **router_kw) * 0.02)  # [h, E]
            # drawn in one layout for every impl (the same weights for the same generator state); the grouped
            # reference stores them transposed
            store = (lambda w: w.transpose(1, 2).contiguous()) if moe.impl == "grouped" else (lambda w: w)
            b.w_gate = torch.nn.Parameter(store(torch.randn(E, h, f, **kw) * 0.02))
            b.w_up = torch.nn.Parameter(store(torch.randn(E, h, f, **kw) * 0.02))
            b.w_down = torch.nn.Parameter(store(torch.randn(E, f, h, **kw) * (0.02 / math.sqrt(2 * a.layers))))
        self.terms: list = []
        self.stat_counts = self.stat_dropped = None  # routing statistics, on the device
        if moe.router_dtype == "fp32":
            torch.backends.cuda.matmul.allow_tf32 = True  # Paddle's cuBLAS default for fp32 GEMMs

    def mlp(self, blk, x):  # x [b, s, h] -> [b, s, h]
        moe, shape = self.moe, x.shape
        flat = x.reshape(-1, shape[-1])  # [T, h]
        if moe.router_dtype == "fp32":
            logits = flat.float() @ blk.w_router  # [T, E]: fp32 operands, TF32 GEMM
        else:
            logits = (flat @ blk.w_router).float()  # [T, E]: bf16 GEMM, logits cast
        index, weight, probs, counts, dropped = route(logits, moe)
        y = IMPLS[moe.impl](moe, flat, index, weight, counts, blk.w_gate, blk.w_up, blk.w_down)
        if moe.shared_ffn:
            y = y + super().mlp(blk, flat)
        self.terms.append((counts / flat.shape[0], probs.mean(0), torch.logsumexp(logits, -1).pow(2).mean()))
        with torch.no_grad():
            self.stat_counts = counts if self.stat_counts is None else self.stat_counts + counts
            self.stat_dropped = dropped if self.stat_dropped is None else self.stat_dropped + dropped
        return y.view(shape)

    def forward(self, ids, target, mask):
        self.terms = []
        loss = super().forward(ids, target, mask)
        E = self.moe.experts
        aux = torch.stack([E * (f * p).sum() for f, p, _ in self.terms]).mean()
        z = torch.stack([z for _, _, z in self.terms]).mean()
        return loss + self.moe.aux_coef * aux + self.moe.z_coef * z

    def load_imbalance(self) -> float:
        """max over experts of the accumulated choices / their mean (1.0: perfectly balanced), read on the host."""
        c = self.stat_counts
        return float(c.max() / c.mean()) if c is not None else float("nan")
