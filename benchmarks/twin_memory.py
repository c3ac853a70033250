"""What is alive at the peak of one twin training step, per recompute mode: live bytes op by op, on CPU.

    /work/torchvenv/bin/python benchmarks/twin_memory.py [--saved llmtrain|torch] [--layers 2] [--out FILE]

The H100 rows (benchmarks/data/h100/twin*/recompute_steps.json) give one number per step (the allocator's peak);
this instrument says what makes it. The twin (benchmarks/gpu_model.py, gpu_h100.RecomputeDecoder) runs one
forward + loss + backward on CPU in bf16 at small shapes (h 256, 4 heads, f 688, seq 256, vocab 8192; CPU SDPA is
flash attention, which saves what cuDNN's does: q, k, v, the output and the log-sum-exp) under a
`TorchDispatchMode` that follows every storage an aten op returns (a weak reference on the storage: it leaves the
count when its last tensor, view or autograd saved variable dies), so after every op the bytes alive that the
step made are known, with the op that made each. Per mode it prints:
- held: bytes alive after forward + loss (what the step keeps for its backward), and per block (L vs L-1 blocks);
- peak: the largest count, the op running then, forward or backward, and the tensors alive at it grouped by the
  op that made them and their shape, in units of s·b·h (`sbh`, a [b, s, h] tensor) and s·b·V (`sbV`).
Parameters, their gradients and the optimizer state exist before the step and are not counted (the H100 rows'
`static_gib`); a weight gradient's transient (the GEMM's result before it is added to `.grad`) is.
`--saved torch`: the twin2 rows' twin (autograd's own saved tensors, the norm inside the recomputed parts).
On CPU `F.rms_norm` is a composite of ops that keep fp32 copies; CUDA's (the H100 rows) is one fused kernel that
keeps its input and the fp32 rstd: `FusedRMSNorm` stands in for it here (the same saved tensors).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu_h100  # noqa: E402
from gpu_model import llama, make_batch  # noqa: E402

MODES = ("none", "full", "full_attn", "core_attn", "mlp")


class FusedRMSNorm(torch.autograd.Function):
    """x [.., h] -> x rstd w, saving x, w and rstd [.., 1] fp32 (CUDA's fused rms_norm; CPU's composite keeps more)."""

    @staticmethod
    def forward(ctx, x, w, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)  # [.., 1] fp32
        ctx.save_for_backward(x, w, rstd)
        return (x.float() * rstd).to(x.dtype) * w

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        xf, g = x.float(), dy.float() * w.float()
        xhat = xf * rstd
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        dw = (dy.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(w.dtype), None


def fused_rms_norm(x, shape, w, eps):
    return FusedRMSNorm.apply(x, w, eps)


class Live(TorchDispatchMode):
    """Bytes of the storages made since entry that are still alive, after every aten op (`timeline`)."""

    def __init__(self, static=()):
        super().__init__()
        self.static = {t.untyped_storage().data_ptr() for t in static}  # made before the step: not counted
        self.live: dict = {}  # id(storage) -> (bytes, op, shape, dtype, phase)
        self.timeline: list = []  # (bytes alive, op, phase)
        self.phase = "fwd"
        self.peak, self.at_peak = 0, None

    def _track(self, t, op):
        if not isinstance(t, torch.Tensor):
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self.live or st.nbytes() == 0 or st.data_ptr() in self.static:
            return
        self.live[key] = (st.nbytes(), op, tuple(t.shape), str(t.dtype).replace("torch.", ""), self.phase)
        weakref.finalize(st, self.live.pop, key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = func.__name__
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            self._track(t, op)
        now = sum(v[0] for v in self.live.values())
        self.timeline.append((now, op, self.phase))
        if now > self.peak:
            self.peak, self.at_peak = now, (op, self.phase, list(self.live.values()))
        return out


def one_step(layers: int, mode: str, saved: str, *, seq: int, hidden: int, heads: int, ffn: int, vocab: int,
             mb: int) -> dict:
    """held / peak bytes of one step of `mode` and the tensors alive at its peak."""
    torch.manual_seed(0)
    torch.nn.functional.rms_norm = fused_rms_norm  # CUDA's saved tensors (module docstring)
    a = llama(layers, hidden, heads, heads, ffn, seq, vocab=vocab)
    model = gpu_h100.RecomputeDecoder(a, "cpu", torch.bfloat16, mode)
    model.saved = saved
    batch = make_batch(a, mb, "cpu")
    model(*batch).backward()  # the gradients exist before the measured step, as in the H100 rows
    static = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None] + [
        t for t in vars(model).values() if isinstance(t, torch.Tensor)]
    with Live(static) as live:
        loss = model(*batch)
        held = sum(v[0] for v in live.live.values())
        live.phase = "bwd"
        loss.backward()
        del loss
    sbh, sbv = seq * mb * hidden * 2, seq * mb * vocab * 2  # bytes of a bf16 [b, s, h] / [b, s, V]
    groups: dict = defaultdict(float)
    op, phase, alive = live.at_peak
    for nbytes, made_by, shape, dtype, ph in alive:
        groups[f"{made_by} {list(shape)} {dtype} ({ph})"] += nbytes
    top = sorted(groups.items(), key=lambda kv: -kv[1])
    return {"layers": layers, "mode": mode, "saved": saved, "held": held, "peak": live.peak, "peak_op": op,
            "peak_phase": phase, "sbh_bytes": sbh, "sbv_bytes": sbv,
            "at_peak": [(k, v, round(v / sbh, 3)) for k, v in top]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saved", default="llmtrain", choices=("llmtrain", "torch"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    shape = dict(seq=256, hidden=256, heads=4, ffn=688, vocab=args.vocab, mb=1)
    rows = []
    for mode in args.modes.split(","):
        r = one_step(args.layers, mode, args.saved, **shape)
        r1 = one_step(args.layers - 1, mode, args.saved, **shape)
        sbh = r["sbh_bytes"]
        r["held_per_block_sbh"] = (r["held"] - r1["held"]) / sbh
        r["peak_minus_prev_sbh"] = (r["peak"] - r1["peak"]) / sbh
        rows.append(r)
        print(f"{args.saved} L{args.layers} {mode}: held {r['held'] / sbh:.2f} sbh ({r['held_per_block_sbh']:.2f} "
              f"per block), peak {r['peak'] / sbh:.2f} sbh = held + {(r['peak'] - r['held']) / r['sbv_bytes']:.2f} "
              f"sbV, at {r['peak_op']} ({r['peak_phase']})")
        for k, v, units in r["at_peak"][:12]:
            print(f"    {units:8.3f} sbh  {k}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"shape": shape, "layers": args.layers, "saved": args.saved, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
